"""What the Triton kernel tests share: when they can run, and on which device."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# A kernel runs on a CUDA GPU, or on the CPU through triton's interpreter (TRITON_INTERPRET=1).
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
