"""What preparing one request's image and text costs, and how it scales in threads and in processes.

    python bench/preprocess_probe.py --model DIR [--requests 256]

Per request (a distinct photo-like 336 px JPEG and 64 words, as bench/gpu_serve.py sends):
decoding, the model's image processor, the whole prompt (processor + tokenizer + hash); then
the throughput of fovea's Preprocessor over ``--requests`` requests at once in this process's
threads (workers=0) and in 2/4/8 worker processes, and how much the event loop is held up
meanwhile (the lag of a 1 ms timer): the number that decides --preprocess-workers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import serve_load as load  # noqa: E402

from fovea.loading.contract import check_contract  # noqa: E402
from fovea.loading.loader import load_model  # noqa: E402
from fovea.loading.prompt import encode_prompt, render_chat  # noqa: E402
from fovea.media import MediaConfig, decode_image_bytes  # noqa: E402
from fovea.serve.preprocess import Preprocessor  # noqa: E402
from fovea.testing.random_llava import prompt_words  # noqa: E402


def ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


async def loop_lag(stop: asyncio.Event) -> list[float]:
    lags = []
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)
    return lags


async def throughput(pre: Preprocessor, texts: list[str], images: list[bytes]) -> tuple[float, float]:
    stop = asyncio.Event()
    lag_task = asyncio.create_task(loop_lag(stop))
    started = time.perf_counter()
    await asyncio.gather(*(pre.prompts(t, [(b, "image")]) for t, b in zip(texts, images)))
    wall = time.perf_counter() - started
    stop.set()
    lags = await lag_task
    return len(texts) / wall, 1e3 * max(lags, default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--workers", default="0,2,4,8")
    args = parser.parse_args()
    loaded = load_model(args.model, "cpu", "bfloat16")
    contract = check_contract(loaded)
    media = MediaConfig()
    reduce_to = loaded.codec.target_short_side()
    jpegs = [load.photo_jpeg(seed) for seed in range(args.requests)]
    messages = lambda i: [{"role": "user", "content": [{"type": "image"},  # noqa: E731
                                                     {"type": "text", "text": prompt_words(64, i)}]}]
    texts = [render_chat(loaded, messages(i)) for i in range(args.requests)]
    image = decode_image_bytes(jpegs[0], media, reduce_to)
    rows = [
        ("decode JPEG", ms(lambda: decode_image_bytes(jpegs[1], media, reduce_to), 30)),
        (f"image processor ({type(loaded.processor.image_processor).__name__})",
         ms(lambda: loaded.processor.image_processor(image, return_tensors="pt"), 30)),
        ("chat template", ms(lambda: render_chat(loaded, messages(3)), 30)),
        ("encode_prompt (processor + tokenizer + hash)", ms(lambda: encode_prompt(loaded, texts[0], [image]), 30)),
    ]
    for name, value in rows:
        print(f"{name:<52} {value:8.2f} ms")
    for workers in (int(w) for w in args.workers.split(",")):
        started = time.perf_counter()
        pre = Preprocessor(loaded, media, workers, contract.recipe_fingerprint)
        ready = time.perf_counter() - started
        try:
            started = time.perf_counter()
            asyncio.run(throughput(pre, texts[:16], jpegs[:16]))  # the first requests of fresh workers
            first = time.perf_counter() - started
            rate, lag = asyncio.run(throughput(pre, texts, jpegs))
        finally:
            pre.close()
        print(f"{'workers=' + str(workers):<52} {rate:8.0f} requests/s, event loop held up to {lag:.1f} ms; "
              f"start {ready:.1f} s, first 16 requests {first:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
