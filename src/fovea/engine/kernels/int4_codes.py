"""The matrix-vector int4 kernel's arithmetic on packed codes, as Triton helpers: one code of every
packed int32 as a float32 without a conversion instruction, its products with x summed, and a
group's zero point and scale folded into the running sums.

This module imports triton at the top, so it is only imported from inside a lazy ``_kernels()``
builder (as ``fp8_rounding`` and ``epilogue``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int4_code(p, j: tl.constexpr, FOLD: tl.constexpr, z, code_mask):
    """Code j (bits 4j..4j+3) of every packed int32 in p, as float32. FOLD: 128 + q, the code put
    in mantissa bits 16..19 under 128's exponent (bf16 and fp16 activations: the product with x is
    exact and the zero point is taken off once, by ``int4_fold``); else q - z exactly, as
    (2^23 + q) - (2^23 + z) (float32 activations, whose products with 128 + q would round).
    ``code_mask`` is 0xF0000, passed in as a value (``quant_gemv.CODE_MASK`` says why)."""
    if FOLD:
        if j < 4:
            bits = (p << (16 - 4 * j)) & code_mask
        else:
            bits = (p >> (4 * j - 16)) & code_mask
        return (bits | 0x43000000).to(tl.float32, bitcast=True)
    else:
        w = (((p >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        return w - (z + 8388608.0)[None, :]


@triton.jit
def int4_products(w, x_ptrs, part, x_sum, FIRST: tl.constexpr):
    """(part + w * x, x_sum + x) for the x at x_ptrs (one a packed row: [BLOCK_P]) and the codes w
    [BLOCK_P, BLOCK_N] as float32; FIRST starts both from x itself (part and x_sum unused): a zero
    start would be laid out apart from x and re-laid out every group."""
    x = tl.load(x_ptrs).to(tl.float32)
    if FIRST:
        return w * x[:, None], x
    else:
        return part + w * x[:, None], x_sum + x


@triton.jit
def int4_fold(acc, part, x_sum, z, s, FOLD: tl.constexpr):
    """acc + s * (the group's sums less, under FOLD, (128 + z) times the sum of the x they multiplied):
    part [BLOCK_P, BLOCK_N] holds a thread's sums of x * (128 + q) (or x * (q - z)) for its packed
    rows, x_sum [BLOCK_P] the x of each packed row summed. The float32 sums carry terms at most
    143 times the exact ones', a relative 2^-24 * 143 < 2^-16, below bf16's and fp16's rounding."""
    if FOLD:
        part -= x_sum[:, None] * (z + 128.0)[None, :]
    return acc + part * s[None, :]
