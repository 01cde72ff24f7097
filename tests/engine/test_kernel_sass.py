"""The matrix-vector kernels' sm_90 code, compiled on this machine (no GPU) by triton and ptxas and
counted by ``bench/kernel_sass.py``: the properties their speed rests on, which a timing on a GPU
would show only as a slowdown with no cause attached.

- nothing goes through shared memory inside the main loop (the first version re-laid its 3-D tile
  out through shared memory on every step: STS/LDS/BAR.SYNC in the loop);
- the weight streams in 16-byte loads (LDG.E.128);
- no register spills;
- at most 6 loop instructions a weight: above that the 1-row int4 kernel is issue-bound on an H200
  (6.5e9 weights a 7B decode step x 6 / 3.3e13 thread instructions a second = 1.2 ms, against its
  0.83 ms bandwidth floor). The first version took 7.6 (FP8) and 9.3 (int4); this one 4.0 and 4.3
  (4.4 and 4.2 with the next step's weights prefetched).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernel_sass.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("kernel_sass", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_sass"] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module


tool = load_tool()
needs_tools = pytest.mark.skipif(tool.tools_missing() is not None, reason=f"{tool.tools_missing()}")

SHARED_MEMORY_OPS = ("STS", "LDS", "LDSM", "BAR")


@needs_tools
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("kind", ["fp8", "fp8-block", "int4"])
def test_the_one_row_loops_stream_the_weight_through_registers_only(kind, prefetch):
    from fovea.engine.kernels import quant_gemv

    configs = {"fp8": quant_gemv.fp8_gemv_candidates(1), "fp8-block": quant_gemv.fp8_block_gemv_candidates(1, (128, 128)),
               "int4": quant_gemv.int4_gemv_candidates(1, 128)}[kind]
    a = tool.analyse(kind, 1, next(c for c in configs if c.prefetch == prefetch))
    in_loop = sorted(op for op in a.loop if op.startswith(SHARED_MEMORY_OPS))
    assert in_loop == [], f"shared memory inside the {kind} loop: {in_loop}"
    assert any(op.startswith("LDG") and op.endswith(".128") for op in a.loop), sorted(a.loop)
    assert a.spilled == 0
    assert a.per_weight <= 6.0, (a.per_weight, a.loop.most_common(8))


@needs_tools
def test_the_tool_counts_a_relayout_when_there_is_one():
    """The check above can fail: a [rows, N, K] 3-D tile (as the first version had) shows its
    shared-memory traffic in the loop."""
    import triton
    import triton.language as tl

    @triton.jit
    def relayout(X, W, C, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([2, BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(W + offs_n[:, None] * K + (k0 + offs_k)[None, :]).to(tl.float32)
            x = tl.load(X + tl.arange(0, 2)[:, None] * K + (k0 + offs_k)[None, :]).to(tl.float32)
            acc += w[None, :, :] * x[:, None, :]
        tl.store(C + tl.arange(0, 2)[:, None] * BLOCK_N + offs_n[None, :], tl.sum(acc, axis=2))

    kernel = tool.compile_kernel(relayout, {"X": "*bf16", "W": "*fp8e4nv", "C": "*fp32", "K": "i32",
                                            "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                                 {"BLOCK_N": 16, "BLOCK_K": 256}, 4, 90)
    loop = tool.longest_loop(tool.disassemble(kernel.asm["cubin"]))
    assert any(op.startswith(SHARED_MEMORY_OPS) for op in loop), sorted(set(loop))


def norm_tool():
    """bench/norm_fp8_sass.py as a module."""
    spec = importlib.util.spec_from_file_location("norm_fp8_sass", SCRIPT.parent / "norm_fp8_sass.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_tools
def test_the_norm_quantises_its_row_with_no_division_a_value():
    """RMSNorm handing its row on in FP8 (``fp8_rounding``): each value's quotient comes from the
    scale's reciprocal (two FMAs and the sign of x), its rounding from the GPU's cast. One IEEE
    division a value (a check and a slow-path call each) and the rounding in float32 arithmetic made
    the kernel 1,376 sm_90 instructions at 3584 columns, against 792 now and the plain norm's 344:
    at one row one SM runs the whole row, so these are its time. The divisions left are made once a
    row: the scale and its reciprocal."""
    counts = norm_tool().norm_counts(3584, 90)
    plain, quant = counts[False][0], counts[True][0]
    ops = counts[True][2]
    assert ops["FCHK"] <= 2, ops  # a division's range check: one for each division in the SASS
    assert quant < 2.5 * plain, (quant, plain)


@needs_tools
def test_every_fp8_code_takes_its_sign_from_x_before_the_cast():
    """The CPU interpreter keeps -0 / scale = -0 whatever the kernel does, but on an H200 the
    compiled quotient gave +0 (torch: -0), so each value's sign bit is ORed in from x
    (``fp8_rounding.with_sign_of``) and this counts those merges in the SASS: at least one a value
    cast to e4m3. Without them the count is 0 against 32."""
    merges, cast = norm_tool().sign_merges(3584, 90)
    assert cast > 0 and merges >= cast, (merges, cast)
