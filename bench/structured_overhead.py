"""Structured outputs' cost to a batch: decode tokens/s with 0, 1 and all rows structured.

    python3 bench/structured_overhead.py [--device cpu|cuda] [--model tiny|demo|DIR ...] [--batch 8] [--tokens 64]

``tiny``: a random tiny Qwen2.5-VL with a byte-level tokenizer (fovea.testing.byte_level_model);
``demo``: the shipped fovea-shapes; a directory: any served model (on a GPU, a real-size random
one: ``python -m fovea.testing.random_qwen2_5_vl --arch qwen2.5-vl-7b --out /tmp/q7 --device cuda``).
Every row decodes exactly ``--tokens`` tokens (min_tokens = max_tokens); a structured row follows
the grammar ``[a-z]+`` (a regex every vocabulary can follow), so the cost measured is masking,
not a different answer length. Prompts are encoded beforehand; only the engine is timed.

Columns: all rows' tokens/s; the free-text rows' and the structured rows' tokens/s each (per
row); host milliseconds per step spent filling and applying masks, and on CUDA the device
milliseconds of what that queues (events, read after the run: nothing synchronises in a step);
steps whose sampling waited for the step before them because a structured row's mask needed its
in-flight token (only with overlap_steps: the forward is queued first, so the wait hides behind it).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
from PIL import Image

from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import ErrorEvent, FinishEvent
from fovea.engine.sampling.params import SamplingParams
from fovea.engine.structured import bitmask
from fovea.engine.structured.compiler import GrammarCompiler
from fovea.engine.structured.spec import GrammarSpec
from fovea.loading.loader import load_model


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_dir(name: str, tmp: Path) -> Path | None:
    if name == "demo":
        return None  # the shipped model
    if name == "tiny":
        from fovea.testing.byte_level_model import write_model_dir
        return write_model_dir(tmp / "tiny")
    return Path(name)


class MaskTimer:
    """Host seconds inside apply_grammar_masks_ (the sampler imports it from the module per call),
    and on CUDA the device time of the work it queues, from events read after the run. Nothing
    here synchronises inside a step: a first version called torch.cuda.synchronize after each
    mask, which waited for the step in flight and so removed the overlap it meant to measure
    (its GPU figures are kept in docs/logs/gpu-structured-overhead-2026-12-01.log, as flawed)."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._real = 0.0, 0, bitmask.apply_grammar_masks_
        self.events: list = []

    def __enter__(self) -> MaskTimer:  # noqa: PYI034
        def timed(logits, seqs):
            on_cuda = logits.device.type == "cuda"
            if on_cuda:
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
            t0 = time.perf_counter()
            self._real(logits, seqs)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            if on_cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events.append((begin, end))
        bitmask.apply_grammar_masks_ = timed
        return self

    def __exit__(self, *exc) -> None:
        bitmask.apply_grammar_masks_ = self._real

    def device_ms_per_call(self) -> float:
        if not self.events:
            return float("nan")
        self.events[-1][1].synchronize()
        return sum(b.elapsed_time(e) for b, e in self.events) / len(self.events)


async def timed_request(engine, prompt, params) -> tuple[int, float]:
    started = time.perf_counter()
    async for event in engine.generate(prompt, params):
        if isinstance(event, FinishEvent):
            # A structured row that did not follow its grammar means the masks were not applied.
            if params.grammar is not None and not re.fullmatch(r"[a-z]+", event.text.replace(" ", "")):
                raise AssertionError(f"a structured answer does not match [a-z]+: {event.text[:80]!r}")
            return event.completion_tokens, time.perf_counter() - started
        if isinstance(event, ErrorEvent):
            raise event.error
    raise AssertionError("no finish event")


def run_case(engine, prompt, grammar, batch: int, structured: int, tokens: int) -> dict:
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0,
                              grammar=grammar if i < structured else None)

    async def together():
        return await asyncio.gather(*(timed_request(engine, prompt, params(i)) for i in range(batch)))

    waits = engine.structured_waits
    with MaskTimer() as masks:
        started = time.perf_counter()
        results = asyncio.run(together())
        wall = time.perf_counter() - started
    free = [n / s for n, s in results[structured:]]
    done = [n / s for n, s in results[:structured]]
    return {"rows": f"{structured}/{batch}", "tok_s": sum(n for n, _ in results) / wall,
            "free_row_tok_s": sum(free) / len(free) if free else float("nan"),
            "structured_row_tok_s": sum(done) / len(done) if done else float("nan"),
            "mask_ms_per_step": 1e3 * masks.seconds / max(1, masks.calls),
            "mask_device_ms_per_step": masks.device_ms_per_call(),
            "waited": engine.structured_waits - waits}


def probe_7b_vocab() -> None:
    """Host cost at Qwen2.5-VL-7B's vocabulary (152,064 rows, the random directories' word-level
    tokenizer): TokenizerInfo, one compile, and one row's fill + accept per token."""
    import xgrammar as xgr

    from fovea.testing import random_qwen2_5_vl as qwen
    tokenizer = qwen.build_tokenizer(qwen.ARCHITECTURES["qwen2.5-vl-7b"])
    t0 = time.perf_counter()
    grammars = GrammarCompiler(tokenizer, qwen.EMBEDDING_ROWS, [qwen.SPECIAL_IDS["<|im_end|>"]])
    t1 = time.perf_counter()
    grammar = grammars.get_now(GrammarSpec("regex", "[a-z]+", "probe"))
    t2 = time.perf_counter()
    matcher, mask = xgr.GrammarMatcher(grammar.compiled), xgr.allocate_token_bitmask(1, qwen.EMBEDDING_ROWS)
    words = [tokenizer.convert_tokens_to_ids(w) for w in qwen.vocabulary(qwen.FIRST_SPECIAL)[8:108]]
    t3 = time.perf_counter()
    for token in words:
        matcher.fill_next_token_bitmask(mask)
        assert matcher.accept_token(token)
    t4 = time.perf_counter()
    print(f"152,064-row vocabulary: TokenizerInfo {t1 - t0:.2f} s, compile [a-z]+ {1e3 * (t2 - t1):.1f} ms, "
          f"fill + accept {1e3 * (t4 - t3) / len(words):.3f} ms per row per token")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", nargs="+", default=["tiny", "demo"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--overlap", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                        help="overlap_steps (auto: the engine's default, on for CUDA models of real size)")
    parser.add_argument("--repeats", type=int, default=3, help="each case this many times; the best is shown")
    parser.add_argument("--probe-7b-vocab", action="store_true", help="only the host-cost probe at 152k tokens")
    args = parser.parse_args()
    if args.probe_7b_vocab:
        probe_7b_vocab()
        return 0
    rows = []
    loaded, loaded_name = None, None
    with tempfile.TemporaryDirectory() as tmp:
        for name, overlap in [(m, o) for m in args.model for o in args.overlap]:
            if loaded_name != name:  # each model loaded once, for all its overlap settings
                loaded, loaded_name = None, name
                free_device_memory()
                loaded = load_model(model_dir(name, Path(tmp)), device=args.device, dtype=args.dtype)
            engine = PagedEngine(loaded, PagedEngineConfig(overlap_steps={"auto": None, "on": True,
                                                                          "off": False}[overlap]))
            engine.start()
            try:
                grammars = GrammarCompiler(loaded.tokenizer, int(engine.runner.llama.lm_head.shape[0]),
                                           sorted(loaded.eos_token_ids))
                t0 = time.perf_counter()
                grammar = grammars.get_now(GrammarSpec("regex", "[a-z]+", "bench"))
                compile_ms = 1e3 * (time.perf_counter() - t0)
                text = loaded.codec.render([{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": "describe"}]}])
                prompt = loaded.codec.encode(text, [Image.new("RGB", (224, 224), (200, 40, 40))])
                run_case(engine, prompt, grammar, args.batch, 1, 8)  # warm-up
                for structured in (0, 1, args.batch):
                    best = max((run_case(engine, prompt, grammar, args.batch, structured, args.tokens)
                                for _ in range(args.repeats)), key=lambda r: r["tok_s"])
                    rows.append({"model": name, "overlap": engine.config.overlap_steps,
                                 "compile_ms": compile_ms, **best})
            finally:
                engine.stop()
                engine = None
                free_device_memory()  # each engine plans most of the GPU: the last one's must be gone
    head = ("model", "overlap", "rows", "tok_s", "free_row_tok_s", "structured_row_tok_s", "mask_ms_per_step",
            "mask_device_ms_per_step", "waited", "compile_ms")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        cells = [f"{row[h]:.1f}" if isinstance(row[h], float) else str(row[h]) for h in head]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
