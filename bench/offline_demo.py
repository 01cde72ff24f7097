"""Caption latency and batch throughput without HTTP: fovea's engine vs transformers' generate.

    python bench/offline_demo.py [--model DIR] [--requests 40] [--batch 8] [--device cuda]

Same scenes, same greedy decoding, same process, so the two columns differ only in the
generation loop. Together with bench/http_load.py it shows what the HTTP layer costs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import FinishEvent
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat

QUESTION = [{"type": "image"}, {"type": "text", "text": "Describe the image."}]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for both columns")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    loaded = load_model(args.model, args.device, args.dtype)
    torch.set_num_threads(args.threads)
    images = [scenes.render(scenes.SceneSampler().sample(random.Random(90_000 + i))) for i in range(args.requests)]
    text = render_chat(loaded, [{"role": "user", "content": QUESTION}])

    def encode(image):
        return encode_prompt(loaded, text, [image])

    # transformers: processor + generate, one request at a time, then static batches.
    hf_single = []
    for image in images:
        started = time.perf_counter()
        p = encode(image)
        ids = torch.tensor([p.input_ids], device=loaded.device)
        extra = loaded.adapter.reference_inputs(p, loaded.device, loaded.image_token_id)
        with torch.no_grad():
            loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                                  max_new_tokens=48, do_sample=False)
        hf_single.append(time.perf_counter() - started)
    processor = loaded.processor
    processor.tokenizer.padding_side = "left"
    started = time.perf_counter()
    hf_tokens = 0
    for i in range(0, len(images), args.batch):
        chunk = images[i:i + args.batch]
        enc = processor(text=[text] * len(chunk), images=chunk, return_tensors="pt", padding=True).to(loaded.device)
        enc["pixel_values"] = enc["pixel_values"].to(loaded.dtype)
        with torch.no_grad():
            out = loaded.model.generate(**enc, max_new_tokens=48, do_sample=False)
        new = out[:, enc["input_ids"].shape[1]:]
        hf_tokens += int((new != processor.tokenizer.pad_token_id).sum())
    hf_batch_s = time.perf_counter() - started

    # fovea: the serving engine; the same static batches as generate; then closed-loop clients.
    def make(kind: str, batch: int):
        return PagedEngine(loaded, PagedEngineConfig(max_num_seqs=batch, cpu_threads=args.threads))

    async def fovea_static(kind: str) -> tuple[float, int]:
        engine = make(kind, args.batch)
        engine.start()
        tokens = 0

        async def one(prompt) -> int:
            async for event in engine.generate(prompt, SamplingParams(max_tokens=48, temperature=0)):
                if isinstance(event, FinishEvent):
                    return event.completion_tokens
            return 0

        t = time.perf_counter()
        for i in range(0, len(images), args.batch):
            prompts = [encode(image) for image in images[i:i + args.batch]]
            tokens += sum(await asyncio.gather(*(one(p) for p in prompts)))
        wall = time.perf_counter() - t
        engine.stop()
        return wall, tokens

    async def fovea_run(kind: str, concurrency: int) -> tuple[list[float], float, int]:
        engine = make(kind, concurrency)
        engine.start()
        latencies: list[float] = []
        tokens = 0
        queue = list(images)

        async def worker() -> None:
            nonlocal tokens
            while queue:
                image = queue.pop()
                t0 = time.perf_counter()
                prompt = await asyncio.to_thread(encode, image)
                async for event in engine.generate(prompt, SamplingParams(max_tokens=48, temperature=0)):
                    if isinstance(event, FinishEvent):
                        tokens += event.completion_tokens
                latencies.append(time.perf_counter() - t0)

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t
        engine.stop()
        return latencies, wall, tokens

    cols = {}
    for kind in ("paged",):  # the one engine
        single, _, _ = asyncio.run(fovea_run(kind, 1))
        static_s, static_tokens = asyncio.run(fovea_static(kind))
        _, wall, tokens = asyncio.run(fovea_run(kind, args.batch))
        cols[kind] = (single, static_s, static_tokens, wall, tokens)

    where = f"cpu, {args.threads} thread(s)" if args.device == "cpu" else f"{args.device}, {args.dtype}"
    print(f"{loaded.name} on {where}, {args.requests} caption requests, greedy")
    print(f"{'':<34}{'transformers':>14}{'fovea':>14}")
    row = lambda name, hf, f: print(f"{name:<34}{hf:>14}" + "".join(f"{f(c):>14.1f}" for c in cols.values()))
    row("single p50 ms", f"{1000 * statistics.median(hf_single):.1f}", lambda c: 1000 * statistics.median(c[0]))
    row("single p95 ms", f"{1000 * pct(hf_single, 0.95):.1f}", lambda c: 1000 * pct(c[0], 0.95))
    row(f"static batches of {args.batch}, req/s", f"{args.requests / hf_batch_s:.1f}", lambda c: args.requests / c[1])
    row(f"static batches of {args.batch}, tok/s", f"{hf_tokens / hf_batch_s:.1f}", lambda c: c[2] / c[1])
    row(f"{args.batch} closed-loop clients, req/s", "-", lambda c: args.requests / c[3])
    row(f"{args.batch} closed-loop clients, tok/s", "-", lambda c: c[4] / c[3])


if __name__ == "__main__":
    main()
