"""Exact-match accuracy of a model on held-out shape scenes, through fovea's serving path.

    fovea eval-demo --scenes 600            # the shipped model, all tasks
    python -m fovea.demo.evaluate --model DIR --scenes 600 --min-accuracy 0.97

Each scene is drawn as a PIL image (JPEG round trip and non-square canvas included), and
every question goes through the chat template, the model's processor and fovea's engine
with greedy decoding, exactly as an HTTP request would. The scene seed differs from the
training and training-time held-out seeds, so none of these scenes was seen in training.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from fovea.config import ServerSettings, engine_config
from fovea.demo import scenes
from fovea.engine import PagedEngine
from fovea.engine.core.request import FinishEvent
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import LoadedModel, load_model
from fovea.loading.prompt import encode_prompt, render_chat
from fovea.progress import progress

EVAL_SEED = 3


@dataclass
class Case:
    scene: scenes.Scene
    qa: scenes.QA
    answer: str = ""

    @property
    def correct(self) -> bool:
        return self.answer.strip() == self.qa.answer


def make_cases(n_scenes: int, seed: int = EVAL_SEED) -> list[tuple[scenes.Scene, list[scenes.QA]]]:
    sampler = scenes.SceneSampler()
    out = []
    for i in range(n_scenes):
        rng = random.Random(seed * 7_919 + i)
        scene = sampler.sample(rng)
        out.append((scene, scenes.questions_for(scene, rng)))
    return out


async def answer_all(loaded: LoadedModel, cases: list[Case], batch_size: int = 64) -> None:
    # The server's default engine, so the accuracy is the served accuracy.
    engine = PagedEngine(loaded, engine_config(ServerSettings(max_batch_size=batch_size, max_queue=len(cases) + 1)))
    engine.start()
    try:
        images: dict[int, object] = {}

        async def run(case: Case) -> None:
            key = id(case.scene)
            if key not in images:
                images[key] = scenes.render(case.scene)
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": case.qa.question}]}]
            prompt = encode_prompt(loaded, render_chat(loaded, messages), [images[key]])
            async for event in engine.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0)):
                if isinstance(event, FinishEvent):
                    case.answer = event.text

        bar = progress(total=len(cases), desc="eval-demo", unit="question")

        async def counted(case: Case) -> None:
            await run(case)
            bar.update()

        try:
            await asyncio.gather(*(counted(c) for c in cases))
        finally:
            bar.close()
    finally:
        engine.stop()


def summarise(cases: list[Case]) -> dict[str, dict[str, float]]:
    groups: dict[str, list[bool]] = defaultdict(list)
    for case in cases:
        groups[f"task:{case.qa.task}"].append(case.correct)
        groups["jpeg" if case.scene.jpeg_quality is not None else "png"].append(case.correct)
        square = case.scene.width == case.scene.height
        groups["square" if square else "non_square"].append(case.correct)
        groups["all"].append(case.correct)
    return {k: {"accuracy": sum(v) / len(v), "n": len(v)} for k, v in sorted(groups.items())}


def evaluate(loaded: LoadedModel, n_scenes: int, seed: int = EVAL_SEED) -> tuple[dict, list[Case]]:
    cases = [Case(scene, qa) for scene, qas in make_cases(n_scenes, seed) for qa in qas]
    asyncio.run(answer_all(loaded, cases))
    return summarise(cases), cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the shipped demo model)")
    parser.add_argument("--scenes", type=int, default=600)
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--min-accuracy", type=float, default=0.97,
                        help="exit non-zero if any task scores below this")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--show-errors", type=int, default=5)
    args = parser.parse_args(argv)

    loaded = load_model(args.model, args.device, args.dtype)
    started = time.perf_counter()
    summary, cases = evaluate(loaded, args.scenes, args.seed)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({"model": str(loaded.path), "scenes": args.scenes, "seconds": elapsed, "summary": summary}))
    else:
        print(f"{loaded.name}: {args.scenes} held-out scenes, {len(cases)} questions, {elapsed:.1f} s "
              f"on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')})")
        print(f"{'group':<16}{'accuracy':>10}{'n':>7}")
        for group, row in summary.items():
            print(f"{group:<16}{row['accuracy'] * 100:>9.2f}%{row['n']:>7}")
        wrong = [c for c in cases if not c.correct][: args.show_errors]
        for c in wrong:
            print(f"  wrong [{c.qa.task}] {c.qa.question!r}: expected {c.qa.answer!r}, got {c.answer!r} "
                  f"({c.scene.width}x{c.scene.height}, jpeg={c.scene.jpeg_quality})")
    worst = min(row["accuracy"] for group, row in summary.items() if group.startswith("task:"))
    return 0 if worst >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
