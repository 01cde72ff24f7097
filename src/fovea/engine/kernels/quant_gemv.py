"""Matrix-vector kernels for quantised weights: one to four activation rows (batch-1 to batch-4
decode), no matrix instructions.

``quant_matmul``'s GEMM kernels run a decode step's product on the tensor cores with the rows
padded to 16: the unpacked weight tile must then be moved into the matrix instruction's operand
layout, and on the H200 the int4 kernel read its weights at a quarter of the copy bandwidth
(bench/quant_matmul.py, 2026-12-03). Here each weight is unpacked in the registers that loaded it
and multiplied there (fused multiply-adds in float32), so the only cost beside the bytes is the
unpacking: int4 codes by the magic-number trick (``(q | 0x4B000000)`` read as float32 is 2^23 + q
exactly, and 2^23 + q - (2^23 + z) = q - z exactly: a shift, one logic operation and a subtraction
per weight, no conversion instruction), FP8 by the hardware's conversion.

The products are exact in float32 (a bf16 activation times a difference of two 4-bit codes; two
e4m3 values), and the sums are float32, as the reference's: only their order differs.

Launch shapes are ``quant_matmul``'s business (``GemmConfig(gemv=True)`` candidates, the K split,
the partial sums' reduction); this module only defines the kernels. Each program takes BLOCK_N
output columns of every row (ROWS, a power of two >= the rows) over one K split.
"""

from __future__ import annotations

import functools

GEMV_MAX_ROWS = 4  # above this the per-row multiply-adds cost more than the tensor cores' padding


@functools.cache
def gemv_kernels():
    """(fp8_gemv_kernel, int4_gemv_kernel); triton imported on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_gemv_kernel(A, AS, B, BS, C, BIAS, M, N, K, k_split,
                        stride_am, stride_as, stride_bn, stride_bsn, stride_cs, stride_cm, group_n, group_k,
                        BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # C[m, n] = sum_k A[m, k] B[n, k] * scales; A, B fp8 (K-contiguous). BLOCK_SCALED: BLOCK_K
        # divides group_k, so each K tile has one activation scale per row and one weight scale per column.
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_m = tl.arange(0, ROWS)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k_start = split * k_split
        k_end = tl.minimum(k_start + k_split, K)
        a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + (k_start + offs_k)[None, :]
        b_ptrs = B + offs_n.to(tl.int64)[:, None] * stride_bn + (k_start + offs_k)[None, :]
        acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = (k0 + offs_k) < k_end
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            if BLOCK_SCALED:
                kb = k0 // group_k
                a_s = tl.load(AS + offs_m * stride_as + kb, mask=m_ok, other=0.0)
                b_s = tl.load(BS + (offs_n // group_n) * stride_bsn + kb, mask=n_ok, other=0.0)
                acc += a[:, None, :] * b[None, :, :] * (a_s[:, None] * b_s[None, :])[:, :, None]
            else:
                acc += a[:, None, :] * b[None, :, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        out = tl.sum(acc, axis=2)
        if not BLOCK_SCALED:
            a_s = tl.load(AS + offs_m * stride_as, mask=m_ok, other=0.0)
            b_s = tl.load(BS + offs_n, mask=n_ok, other=0.0)
            out = out * a_s[:, None] * b_s[None, :]
        c_ptrs = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_ok = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            tl.store(C + split.to(tl.int64) * stride_cs + c_ptrs, out, mask=c_ok)
        else:
            if HAS_BIAS:
                out += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(C + c_ptrs, out.to(C.dtype.element_ty), mask=c_ok)

    @triton.jit
    def int4_gemv_kernel(A, P, S, Z, C, BIAS, M, N, K, k_split,
                         stride_am, stride_pk, stride_sk, stride_zk, stride_cs, stride_cm,
                         GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        # C[m, n] = sum_k A[m, k] (q[k, n] - z[g, n]) s[g, n], g = k // GROUP, the layout of
        # ``quant_matmul``'s int4 weights (P int32 [K / 8, N]); GROUP % BLOCK_K == 0 and the K split
        # is a multiple of GROUP, so every K tile lies in one group. The packed rows [BLOCK_K / 8,
        # BLOCK_N] are loaded once; nibble j of row i is weight 8i + j, multiplied by the activations'
        # columns 8i + j (a strided load of BLOCK_K / 8 values per row, from L1). Each tile's sums
        # stay per packed row until the group's scale is applied; the rows are summed once at the end.
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_m = tl.arange(0, ROWS)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_p = tl.arange(0, BLOCK_K // 8)
        m_ok = offs_m < M
        n_ok = offs_n < N
        k_start = split * k_split
        k_end = tl.minimum(k_start + k_split, K)
        a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + (k_start + 8 * offs_p)[None, :]
        p_ptrs = P + (k_start // 8 + offs_p).to(tl.int64)[:, None] * stride_pk + offs_n[None, :]
        acc = tl.zeros([ROWS, BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            p = tl.load(p_ptrs, mask=n_ok[None, :], other=0, eviction_policy="evict_first")
            g = k0 // GROUP
            s = tl.load(S + g * stride_sk + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zm = tl.load(Z + g * stride_zk + offs_n, mask=n_ok, other=0.0).to(tl.float32) + 8388608.0
            else:
                zm = tl.full([BLOCK_N], 8388616.0, tl.float32)  # 2^23 + the symmetric zero 8
            part = tl.zeros([ROWS, BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(8):
                a = tl.load(a_ptrs + j, mask=m_ok[:, None], other=0.0).to(tl.float32)
                w = (((p >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zm[None, :]
                part += a[:, :, None] * w[None, :, :]
            acc += part * s[None, None, :]
            a_ptrs += BLOCK_K
            p_ptrs += (BLOCK_K // 8) * stride_pk
        out = tl.sum(acc, axis=1)
        c_ptrs = offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_ok = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            tl.store(C + split.to(tl.int64) * stride_cs + c_ptrs, out, mask=c_ok)
        else:
            if HAS_BIAS:
                out += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(C + c_ptrs, out.to(C.dtype.element_ty), mask=c_ok)

    return fp8_gemv_kernel, int4_gemv_kernel
