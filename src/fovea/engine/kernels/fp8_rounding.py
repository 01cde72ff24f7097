"""The dynamic FP8 (e4m3) quantisation step as Triton helpers: one value, divided by its scale,
rounded to e4m3 exactly as torch's cast rounds (``fp8_quantize``'s docstring says why the rounding
is done in float32 before the cast). ``fp8_quantize``'s kernel calls it from both its paths, and a
kernel that quantises its own inputs can call it too.

This module imports triton at the top, so it is only imported from inside a lazy ``_kernels()``
builder; a module-level ``@triton.jit`` helper is one the CPU interpreter can call.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize_e4m3(x, scale):
    """float32 x / scale, clamped to ±448 and rounded to the nearest e4m3 value (ties to even), as
    float32; its cast to float8_e4m3fn is then exact."""
    y = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
    # Normals keep 3 of float32's 23 mantissa bits, ties to even (the integer add carries into the
    # exponent as it should); subnormals (|y| < 2^-6) are multiples of 2^-9, rounded by adding
    # 1.5 * 2^14 (float32's spacing there is 2^-9) and taking it off again; the sign (of a zero
    # too) is kept.
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    sub = ((a + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def token_scale(amax, min_scale):
    """The per-token (or per-group) scale of an absolute maximum: max(amax / 448, min_scale)."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), min_scale)


@triton.jit
def store_fp8_groups(y, cols, ok, Q, S, row, stride_q, stride_s, n_cols, min_scale, first_group,
                     BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Whole groups of a row held by its program (float32 y [BLOCK] at columns ``cols``, zeros where
    not ``ok``; the first is the row's group ``first_group``) quantised as ``fp8_quantize``
    quantises them: a scale per GROUP consecutive columns (GROUP = BLOCK: the whole row, one scale),
    e4m3 codes into Q's row and the scales into S's. A producer that holds its output's rows (RMSNorm,
    SiLU * up) thus hands a product its FP8 input without a quantiser's launch."""
    if GROUP == BLOCK:  # one scale: the row stays 1-D (a [1, BLOCK] reshape costs a re-layout
        # through shared memory: SiLU * up's 32768 lanes took 14 us on an H100, 2026-12-07)
        scale = token_scale(tl.max(tl.abs(y), axis=0), min_scale)
        tl.store(Q + row * stride_q + cols, quantize_e4m3(y, scale).to(Q.dtype.element_ty), mask=ok)
        tl.store(S + row * stride_s + first_group, scale)
    else:
        groups = tl.reshape(y, [BLOCK // GROUP, GROUP])
        scale = token_scale(tl.max(tl.abs(groups), axis=1), min_scale)
        q = quantize_e4m3(groups, tl.broadcast_to(scale[:, None], [BLOCK // GROUP, GROUP]))
        q_cols = tl.reshape(cols, [BLOCK // GROUP, GROUP])
        q_ok = tl.reshape(ok, [BLOCK // GROUP, GROUP])
        tl.store(Q + row * stride_q + q_cols, q.to(Q.dtype.element_ty), mask=q_ok)
        g = first_group + tl.arange(0, BLOCK // GROUP)
        tl.store(S + row * stride_s + g, scale, mask=g * GROUP < n_cols)
