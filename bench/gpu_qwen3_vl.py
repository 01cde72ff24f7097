"""Qwen3-VL-8B at real resolutions on one GPU: the offline engine and `fovea serve` under a 720p
burst and Poisson loads, the vision stage, a check.

    python3 bench/gpu_qwen3_vl.py --out $OUT [--sections offline,serve,vision,check] [--topologies agg,e_pd]
        [--loads 0.5,0.8,1.0] [--sustain-seconds 30]

A random-weight directory of Qwen3-VL-8B-Instruct's shape (its config, processor files, special
tokens and vocabulary size; ``fovea.testing.random_qwen3_vl``) is written to /tmp and measured
by the harness both Qwen families share (``bench/qwen_harness.py``, whose docstring lists the
sections and their figures).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from qwen_harness import FamilyBench, main

from fovea.testing import random_qwen3_vl

if __name__ == "__main__":
    sys.exit(main(FamilyBench("gpu_qwen3_vl", random_qwen3_vl, "qwen3-vl-8b"), __doc__))
