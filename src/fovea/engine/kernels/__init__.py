"""Every Triton kernel of the engine, with its launch: paged decode and prefill attention
(``triton_decode``, ``triton_prefill``), the fused Llama ops (``triton_ops``), the fused vision
stages' elementwise steps (``vision_kernels``, ``qwen_vision_kernels``), the E->PD handoff's
checksum (``checksum_kernel``), the shared helpers (``triton_util``) and the case builders and
torch references the checks use (``cases``).

A kernel module imports no engine object: only torch, triton (lazily) and its neighbours here.
"""

import os

# The kernels are written for fused multiply-adds: the matrix-vector kernels' instruction counts
# (bench/kernel_sass.py) assume FFMA, and unfused they would issue a multiply and an add for each
# weight. Triton 3.9 fuses by default but warns that 3.10 will not; this keeps fusion on (a user's
# own TRITON_DEFAULT_FP_FUSION still wins). No kernel's correctness depends on it.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
