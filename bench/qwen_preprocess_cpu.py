"""What a Qwen-VL image costs the API process: the whole processor against the resize alone.

    python bench/qwen_preprocess_cpu.py [--model DIR] [--size 1280x720] [--reps 15] [--threads 1]

Per photo-like JPEG (bench/serve_load.py's), median of ``--reps`` runs after two warm-ups:

- before: decode (fovea.media) + transformers' image processor (resize, rescale, normalise,
  temporal repeat, patchify) + the cast to the model dtype and the content hash, as the codec
  did it (``QwenCodec._preprocess`` and ``_sliced``);
- after: decode + the processor's resize alone (``QwenCodec._resized``: uint8 [H, W, 3] and its
  hash); the rest runs in the engine core, on the device;
- on a CUDA server (``QwenCodec.resize_on_device``): decode + hash alone, the image sent at its
  decoded size for the vision stage to resize (``fovea.models.pil_resize``) on the GPU;
- for reference, that device step here on the CPU (``PatchRecipe.patches``), which a GPU does
  in microseconds.

Without ``--model``, Qwen2.5-VL-7B's processor and tokenizer files are written without weights
(``fovea.testing.random_qwen2_5_vl``: min_pixels 3136, max_pixels 12845056, 14 px patches,
merge 2); the model dtype is ``--dtype`` (bfloat16, as on the GPU). ``--threads``: torch's CPU threads (the API process's
preprocessing threads each run one image).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import torch
from serve_load import photo_jpeg

from fovea.loading.loader import DTYPES, load_codec
from fovea.media import MediaConfig, decode_image_bytes
from fovea.models.base import pixel_hash
from fovea.models.qwen_pixels import PatchRecipe


def median_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def seven_b_codec(dtype: torch.dtype):
    """Qwen2.5-VL-7B's processor and tokenizer files (fovea.testing's architecture, no weights)."""
    from fovea.testing.random_qwen2_5_vl import write_model_dir

    path = write_model_dir(Path(tempfile.mkdtemp()) / "qwen2.5-vl-7b", arch="qwen2.5-vl-7b", weights=False)
    return load_codec(path, dtype, load_format="dummy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Qwen2.5-VL or Qwen3-VL directory (default: 7B's processor)")
    parser.add_argument("--size", default="1280x720", help="the JPEG's width x height")
    parser.add_argument("--reps", type=int, default=15, help="timed runs per path (the median is shown)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    codec = load_codec(args.model, dtype) if args.model else seven_b_codec(dtype)
    width, height = (int(v) for v in args.size.lower().split("x"))
    data = photo_jpeg(7, (width, height))
    media, reduce_to = MediaConfig(), codec.target_short_side()

    def decode():
        return decode_image_bytes(data, media, reduce_to)

    def before():
        return codec._sliced(*codec._preprocess([decode()]))[0]

    def after():
        return codec._resized([decode()])[0]

    def deferred():
        codec.resize_on_device = True
        try:
            return codec._resized([decode()])[0]
        finally:
            codec.resize_on_device = False

    old, new, unresized = before(), after(), deferred()
    recipe = PatchRecipe.of(codec.image_processor)
    assert torch.equal(recipe.patches(new.pixels, dtype), old.pixels), "the two paths disagree"
    assert unresized.pixels.shape[:2] == (height, width), "the CUDA server's path resized on the host"
    assert torch.equal(recipe.patches(unresized.pixels, dtype, unresized.grid), old.pixels), "the deferred resize disagrees"
    decode_ms = median_ms(decode, args.reps)
    before_ms = median_ms(before, args.reps)
    after_ms = median_ms(after, args.reps)
    deferred_ms = median_ms(deferred, args.reps)
    device_ms = median_ms(lambda: recipe.patches(new.pixels, dtype), args.reps)
    hash_ms = median_ms(lambda: pixel_hash(unresized.pixels, unresized.grid), args.reps)
    mib = 2 ** 20
    print(f"{width}x{height} JPEG ({len(data) / 1024:.0f} KiB) -> grid {new.grid}, {old.pixels.shape[0]} patches; "
          f"torch threads {args.threads}; median of {args.reps}")
    print(f"  decode alone                                   {decode_ms:7.1f} ms")
    print(f"  before: decode + processor + cast + hash       {before_ms:7.1f} ms   sends {old.pixels.nbytes / mib:5.1f} "
          f"MiB ({str(old.pixels.dtype).removeprefix('torch.')} patches)")
    print(f"  after:  decode + resize + hash                 {after_ms:7.1f} ms   sends {new.pixels.nbytes / mib:5.1f} "
          "MiB (uint8 image)")
    print(f"  on a CUDA server: decode + hash                {deferred_ms:7.1f} ms   sends "
          f"{unresized.pixels.nbytes / mib:5.1f} MiB (uint8 image at its decoded size)")
    print(f"    of which the content hash (pixel_hash)       {hash_ms:7.2f} ms")
    print(f"  the moved step on this CPU (the GPU's job now) {device_ms:7.1f} ms")


if __name__ == "__main__":
    main()
