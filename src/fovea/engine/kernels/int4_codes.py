"""The matrix-vector int4 kernel's arithmetic on packed codes, as Triton helpers: two codes of every
packed int32 as float32 with one shift and no conversion instruction (or exactly less the zero
point, for float32 activations), and a group's x for one row of x with the sums' start.

This module imports triton at the top, so it is only imported from inside a lazy ``_kernels()``
builder (as ``fp8_rounding`` and ``epilogue``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int4_pair(p, b: tl.constexpr, low_mask, high_mask):
    """Codes 2b and 2b+1 (bits 8b..8b+7) of every packed int32 in p, as the float32 256 + q and
    16 + q: one shift brings their byte to bits 15..22, and one LOP3 each keeps a code (the masks
    ``quant_gemv.LOW_CODE_MASK`` and ``HIGH_CODE_MASK``) under 256's or 16's exponent, where a unit
    of the code is one. Both floats have at most 9 significant bits, so their products with bf16
    or fp16 x are exact in float32 (``int4_start`` takes the offsets off)."""
    if b == 0:
        t = p << 15
    elif b == 1:
        t = p << 7
    elif b == 2:
        t = p >> 1
    else:
        t = p >> 9  # arithmetic: the sign bits it brings in lie above the masks
    low = ((t & low_mask) | 0x43800000).to(tl.float32, bitcast=True)
    high = ((t & high_mask) | 0x41800000).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def int4_exact_pair(p, b: tl.constexpr, z):
    """Codes 2b and 2b+1 (bits 8b..8b+7) of every packed int32 in p less the zero point, exactly, as
    float32: (2^23 + q) - (2^23 + z), for float32 activations, whose products with 256 + q would round."""
    zz = (z + 8388608.0)[None, :]
    low = (((p >> (8 * b)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zz
    high = (((p >> (8 * b + 4)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zz
    return low, high


@triton.jit
def int4_start(x_ptrs, z, FOLD: tl.constexpr):
    """(the group's 8 x of each packed row ([BLOCK_P] each, as float32) for one row of x, where the
    sums of their products start ([BLOCK_P, BLOCK_N])). Under FOLD the sums start from minus the
    codes' offsets, sum_j x_j (z + 256) for even j and x_j (z + 16) for odd, so the first product's
    multiply-add takes them off (made from two sums of x a packed row: one multiply-add an element,
    as a fold after the products would cost). The float32 sums then carry terms at most 271 times
    the exact ones', a relative 2^-24 * 271 < 2^-15, far below bf16's and fp16's output rounding."""
    x = (tl.load(x_ptrs).to(tl.float32), tl.load(x_ptrs + 1).to(tl.float32),
         tl.load(x_ptrs + 2).to(tl.float32), tl.load(x_ptrs + 3).to(tl.float32),
         tl.load(x_ptrs + 4).to(tl.float32), tl.load(x_ptrs + 5).to(tl.float32),
         tl.load(x_ptrs + 6).to(tl.float32), tl.load(x_ptrs + 7).to(tl.float32))
    if FOLD:
        even = (x[0] + x[2]) + (x[4] + x[6])
        odd = (x[1] + x[3]) + (x[5] + x[7])
        start = -((even + odd)[:, None] * z[None, :] + (256.0 * even + 16.0 * odd)[:, None])
    else:
        start = tl.zeros([x_ptrs.shape[0], z.shape[0]], tl.float32)
    return x, start
