"""The dynamic FP8 (e4m3) quantisation step as Triton helpers: one value, divided by its scale,
rounded to e4m3 exactly as torch's cast rounds (in float32 arithmetic first in the CPU
interpreter, whose cast rounds otherwise: ``ROUND_IN_FLOAT32``). ``fp8_quantize``'s kernel calls it
from both its paths, and a kernel that quantises its own inputs can call it too.

This module imports triton at the top, so it is only imported from inside a lazy ``_kernels()``
builder; a module-level ``@triton.jit`` helper is one the CPU interpreter can call.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# On the GPU the caller's cast to float8_e4m3fn rounds by itself: triton lowers it to
# cvt.rn.satfinite.e4m3x2.f32 (sm_89+), ties to even, which is torch's cast. Only the CPU
# interpreter's own conversion rounds ties away and drops the carry into the exponent, so there the
# value is rounded in float32 arithmetic first (the cast is then exact). With the quotient made from
# the scale's reciprocal (correctly_rounded_quotient, the same in both), the RMSNorm + quantise
# kernel of a 3584-wide row is 792 sm_90 SASS instructions against 1,376 with div_rn and the float32
# rounding (the plain norm: 344; ``bench/norm_fp8_sass.py``): at one row its whole row runs on one
# SM, where the instructions a value are its time.
ROUND_IN_FLOAT32: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def quantize_e4m3(x, scale):
    """float32 x / scale, clamped to ±448, as float32 whose cast to float8_e4m3fn gives the nearest
    e4m3 value (ties to even): the quotient torch's ``x / scale`` makes, bit for bit."""
    return quantize_e4m3_by(x, scale, tl.math.div_rn(1.0, scale))


@triton.jit
def quantize_e4m3_by(x, scale, rcp):
    """``quantize_e4m3`` given the scale's reciprocal too (1 / scale rounded to nearest), for a scale
    broadcast over a tile: its reciprocal is then made once a group, not once a value."""
    y = with_sign_of(tl.clamp(correctly_rounded_quotient(x, scale, rcp), -448.0, 448.0), x)
    if ROUND_IN_FLOAT32:
        return _round_e4m3(y)
    return y


@triton.jit
def correctly_rounded_quotient(x, d, rcp):
    """x / d rounded to nearest float32, from rcp = 1 / d rounded to nearest: the product's
    residual is exact in an FMA, and one correction step then rounds correctly (Markstein's
    theorem; it assumes no overflow or underflow, and quotients that small become e4m3 zeros
    either way). Three instructions a value against div_rn's ~8 and its branch to a slow path:
    where the divisor is one scale a row or group, its reciprocal is made once. An infinite divisor
    (a scale made from an infinite input) gives NaN where torch gives zeros. The sign of a zero
    quotient is the compiler's (``with_sign_of`` sets it)."""
    q = x * rcp
    return tl.fma(-tl.fma(q, d, -x), rcp, q)


@triton.jit
def with_sign_of(y, x):
    """y with x's sign bit too: for a positive divisor a quotient's sign is x's, and a zero's sign
    is not left to the arithmetic. On an H200 the kernel's -0 / 1 came out +0 where torch gives -0
    (2026-12-07; the interpreter keeps -0), so the float's sign cannot be trusted to survive the
    compiler's FMA rewrites or the clamp's lowering (a nonzero y already has x's sign: one LOP3)."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (y.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(y):
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
        q = quantize_e4m3_by(groups, tl.broadcast_to(scale[:, None], [BLOCK // GROUP, GROUP]),
                             tl.broadcast_to(tl.math.div_rn(1.0, scale)[:, None], [BLOCK // GROUP, GROUP]))
        q_cols = tl.reshape(cols, [BLOCK // GROUP, GROUP])
        q_ok = tl.reshape(ok, [BLOCK // GROUP, GROUP])
        tl.store(Q + row * stride_q + q_cols, q.to(Q.dtype.element_ty), mask=q_ok)
        g = first_group + tl.arange(0, BLOCK // GROUP)
        tl.store(S + row * stride_s + g, scale, mask=g * GROUP < n_cols)
