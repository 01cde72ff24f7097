"""The residual add + RMSNorm kernel, plain and quantising its row to FP8 (``triton_ops``'s
``add_rms_norm_kernel``, QUANT off and on), compiled for sm_90 by this machine's triton and ptxas:
its SASS instructions, counted without a GPU, and the registers a thread.

    python3 bench/norm_fp8_sass.py [--cols 3584] [--arch 90]

At one row (batch-1 decode) one SM runs the whole row, so the instructions a value are its time:
this is the count to read when the e4m3 quantisation step (``fp8_rounding``) changes. A static
count (every instruction of the kernel once, branches' both sides), not a timing. At 3584
columns, 2026-12-07: 1,376 with the row quantised by an IEEE division a value (with its range check
and slow-path call) and the rounding in float32 arithmetic; 792 with the quotient from the scale's
reciprocal, the zero's sign taken from x, and the GPU's own rounding cast; 344 without the
quantising. Exit status 2 where triton's compiler or its NVIDIA tools are missing (``kernel_sass``).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SIGNATURE = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "OUT": "*bf16", "Q": "*fp8e4nv", "S": "*fp32",
             "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_q": "i32", "stride_s": "i32",
             "n_cols": "i32", "eps": "fp32", "min_scale": "fp32", "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr",
             "QUANT": "constexpr", "GROUP": "constexpr"}


def norm_cubin(cols: int, arch: int, quant: bool) -> bytes:
    """The kernel for a row of ``cols``, plain or quantising, compiled as ``triton_ops._add_rms_norm``
    launches it. Raises ImportError or FileNotFoundError where triton or its NVIDIA tools are missing."""
    from kernel_sass import compile_kernel

    from fovea.engine.kernels import triton_ops
    from fovea.engine.kernels.triton_util import next_pow2

    block = next_pow2(cols)
    constants = {"HAS_RESIDUAL": True, "BLOCK": block, "QUANT": quant, "GROUP": block if quant else 1}
    return compile_kernel(triton_ops._kernels()[0], SIGNATURE, constants, triton_ops.norm_warps(cols),
                          arch).asm["cubin"]


def norm_counts(cols: int, arch: int) -> dict[bool, tuple[int, int, collections.Counter]]:
    """{QUANT: (SASS instructions, registers a thread, opcodes counted)} for a row of ``cols``
    (``norm_cubin``)."""
    from kernel_sass import disassemble, opcodes, resources

    counts = {}
    for quant in (False, True):
        cubin = norm_cubin(cols, arch, quant)
        ops = opcodes(disassemble(cubin).splitlines())
        counts[quant] = (len(ops), resources(cubin)["regs"], collections.Counter(ops))
    return counts


# y | (x & 0x80000000): ``fp8_rounding.with_sign_of``, one a value (LOP3's truth table 0xf8 is a | (b & c))
SIGN_MERGE = re.compile(r"LOP3\.LUT \S+, \S+, 0x80000000, \S+, 0xf8,")


def sign_merges(cols: int, arch: int) -> tuple[int, int]:
    """(sign merges, e4m3 values cast) in the quantising kernel's SASS for a row of ``cols``: each
    value's sign must come from x's bits before its cast (``fp8_rounding.with_sign_of``), so the
    first is at least the second. Each F2FP.SATFINITE.E4M3 casts two values."""
    from kernel_sass import disassemble

    sass = disassemble(norm_cubin(cols, arch, True))
    return len(SIGN_MERGE.findall(sass)), 2 * sass.count("F2FP.SATFINITE.E4M3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", type=int, default=3584, help="the row's width (the 7B hidden size)")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    try:
        counts = norm_counts(args.cols, args.arch)
    except (ImportError, FileNotFoundError) as exc:
        print(f"cannot compile here: {exc}", file=sys.stderr)
        return 2
    from fovea.engine.kernels.triton_ops import norm_warps

    print(f"add_rms_norm_kernel, a row of {args.cols} bf16 ({norm_warps(args.cols)} warps), sm_{args.arch}")
    for quant, (count, regs, ops) in counts.items():
        label = "normed row, then FP8 codes and scale" if quant else "normed row"
        print(f"  {label:38} {count:5d} instructions  {regs:3d} registers  "
              + ", ".join(f"{op}:{n}" for op, n in ops.most_common(8)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
