"""Paged-attention decode as a Triton kernel (CUDA), split over context partitions.

Grid (batch, kv_head, partition): each program loads the query heads that share one KV
head, walks its partition's blocks through the block table with an online softmax and
writes a partial (max, sum, accumulator). A second kernel merges the partitions. Long
contexts at small batch so still fill the GPU, and the grid depends only on the block
table's width, so a CUDA graph can capture it.

triton is imported lazily: this module imports on machines without it, and
``available()`` says whether the kernel can run. Check it against the torch reference:

    python -m fovea.engine.paged.triton_decode --check
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

PARTITION_TOKENS = 512  # context tokens per program; one partition up to this length


def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(Q, K, V, BT, CL, ACC, M, L, scale,
                       stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                       stride_vb, stride_vt, stride_vh, stride_btb,
                       stride_ab, stride_ah, stride_ap, stride_mb, stride_mh,
                       GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS_PER_PART: tl.constexpr,
                       USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        ctx = tl.load(CL + b)
        num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
        first = part * BLOCKS_PER_PART
        last = tl.minimum(first + BLOCKS_PER_PART, num_blocks)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = tl.arange(0, BLOCK_SIZE)
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if not USE_DOT:
            q = q.to(tl.float32) * scale

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for i in range(first, last):
            block = tl.load(BT + b * stride_btb + i).to(tl.int64)
            tok = i * BLOCK_SIZE + offs_t
            t_ok = tok < ctx
            kv_ok = t_ok[:, None] & d_ok[None, :]
            k = tl.load(K + block * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=kv_ok, other=0.0)  # [BLOCK_SIZE, BLOCK_D]
            if USE_DOT:  # tensor cores; the query heads are padded to 16 rows
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            else:
                s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_G, BLOCK_SIZE]
            s = tl.where(t_ok[None, :], s, float("-inf"))
            # Every visited block holds at least one valid token, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + block * stride_vb + offs_t[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                        mask=kv_ok, other=0.0)
            if USE_DOT:
                pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        # An empty partition (past the context) stores max -inf, sum 0: the merge weighs it 0.
        tl.store(ACC + b * stride_ab + heads[:, None] * stride_ah + part * stride_ap + offs_d[None, :],
                 acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(M + b * stride_mb + heads * stride_mh + part, m_i, mask=g_ok)
        tl.store(L + b * stride_mb + heads * stride_mh + part, l_i, mask=g_ok)

    @triton.jit
    def merge_kernel(ACC, M, L, O, stride_ab, stride_ah, stride_ap, stride_mb, stride_mh,
                     stride_ob, stride_oh, num_parts, BLOCK_P: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_D)
        p_ok = offs_p < num_parts
        d_ok = offs_d < HEAD_DIM
        m = tl.load(M + b * stride_mb + h * stride_mh + offs_p, mask=p_ok, other=float("-inf"))
        l = tl.load(L + b * stride_mb + h * stride_mh + offs_p, mask=p_ok, other=0.0)
        m_max = tl.max(m, axis=0)  # partition 0 always holds a token: finite
        w = tl.exp(m - m_max)
        denom = tl.sum(w * l, axis=0)
        acc = tl.load(ACC + b * stride_ab + h * stride_ah + offs_p[:, None] * stride_ap + offs_d[None, :],
                      mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / denom
        tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)

    return partial_kernel, merge_kernel


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, partition_tokens: int = PARTITION_TOKENS) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [B, W] int32;
    context_lens [B] int32 (each >= 1). Returns [B, H, D] in q's dtype."""
    partial_kernel, merge_kernel = _kernels()
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    q = q.contiguous()
    group = heads // kv_heads
    blocks_per_part = max(1, partition_tokens // block_size)
    num_parts = max(1, -(-block_tables.shape[1] // blocks_per_part))
    acc = torch.empty((batch, heads, num_parts, dim), dtype=torch.float32, device=q.device)
    m = torch.empty((batch, heads, num_parts), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty_like(q)
    block_d = _next_pow2(dim)
    # tl.dot needs every dimension >= 16: query heads are padded up to 16 rows (decode is
    # bound by reading K/V, so the idle rows cost little); small blocks use a plain reduction.
    use_dot = block_size >= 16 and block_d >= 16
    block_g = max(16, _next_pow2(group)) if use_dot else _next_pow2(group)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only matters for fp32 inputs
    partial_kernel[(batch, kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, context_lens, acc, m, l, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCKS_PER_PART=blocks_per_part, USE_DOT=use_dot, PRECISION=precision, num_warps=4)
    merge_kernel[(batch, heads)](
        acc, m, l, out, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1), num_parts, BLOCK_P=_next_pow2(num_parts),
        HEAD_DIM=dim, BLOCK_D=block_d, num_warps=4)
    return out


# ---- self-test ----------------------------------------------------------------------------
def random_case(batch: int, heads: int, kv_heads: int, dim: int, block_size: int, max_ctx: int,
                dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random caches, shuffled block tables and context lengths 1..max_ctx (max_ctx included)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = -(-max_ctx // block_size)
    num_blocks = batch * width + 3
    k_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen).to(device, dtype)
    v_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen).to(device, dtype)
    q = torch.randn((batch, heads, dim), generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * width].view(batch, width)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen)
    lens[0] = max_ctx
    return q, k_cache, v_cache, tables.to(device, torch.int32), lens.to(device, torch.int32)


def check(device: torch.device | None = None) -> float:
    """Compare against the torch reference (in float32) over a grid of shapes; returns the
    worst error and prints one line per case."""
    from fovea.engine.paged.attention import paged_decode_torch

    device = device or torch.device("cuda")
    worst = 0.0
    cases = [  # batch, heads, kv_heads, head_dim, block_size, max_ctx
        (1, 4, 4, 64, 16, 1), (3, 8, 2, 64, 16, 40), (5, 32, 8, 128, 16, 1100),
        (2, 32, 32, 128, 16, 2000), (7, 12, 4, 80, 8, 300), (64, 32, 8, 128, 16, 700)]
    dtypes = [torch.float32] if device.type == "cpu" else [torch.float16, torch.bfloat16, torch.float32]
    for dtype in dtypes:
        for i, (b, h, kvh, d, bs, ctx) in enumerate(cases):
            q, kc, vc, bt, cl = random_case(b, h, kvh, d, bs, ctx, dtype, device, seed=i)
            scale = d ** -0.5
            got = paged_decode(q, kc, vc, bt, cl, scale).float()
            ref = paged_decode_torch(q.float(), kc.float(), vc.float(), bt, cl, scale)
            err = (got - ref).abs().max().item()
            tol = 2e-2 if dtype != torch.float32 else 2e-4
            worst = max(worst, err / tol)
            print(f"{dtype!s:15s} B={b:3d} H={h:2d} KVH={kvh:2d} D={d:3d} bs={bs:2d} ctx<={ctx:5d} "
                  f"max abs err {err:.2e} (tol {tol:.0e}) {'ok' if err <= tol else 'FAIL'}")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the torch reference")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not available():
        print(f"FAIL: triton or CUDA missing (torch {torch.__version__}, cuda available: "
              f"{torch.cuda.is_available()})")
        return 1
    worst = check(device)
    print("PASS" if worst <= 1.0 else "FAIL", f"(worst error / tolerance = {worst:.3f})")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
