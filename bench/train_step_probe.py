"""Median training-step time of the demo model under different compile modes (one GPU).

    python bench/train_step_probe.py [--steps 600] [--modes none,default,reduce-overhead]

Each mode trains from the same seed on a small pool for --steps steps with the real
training loop (fovea.demo.train) and reports its median ms/step over the last 75% of steps.
"""

from __future__ import annotations

import argparse
import json
import time

from fovea.demo.train import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--modes", default="none,default,reduce-overhead")
    parser.add_argument("--out", default="/tmp/probe")
    args = parser.parse_args()
    rows = []
    for mode in args.modes.split(","):
        cfg = TrainConfig(out=f"{args.out}/{mode}", steps=args.steps, train_scenes=20_000, heldout_scenes=500,
                          eval_every=args.steps, compile=mode != "none",
                          compile_mode=mode if mode != "none" else "default")
        started = time.time()
        try:
            report = train(cfg)
        except Exception as exc:  # noqa: BLE001 - one mode failing must not hide the others
            print(f"mode {mode} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append((mode, float("nan"), time.time() - started, float("nan")))
            continue
        rows.append((mode, report["median_step_ms_sampled"], time.time() - started,
                     min(report["best_heldout"][t] for t in ("describe", "count", "color", "where", "exists"))))
    print(f"\n{'mode':<18}{'ms/step':>10}{'run s':>10}{'min task acc':>14}")
    for mode, ms, wall, acc in rows:
        print(f"{mode:<18}{ms:>10.2f}{wall:>10.1f}{acc:>14.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
