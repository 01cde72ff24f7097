"""Fused Triton kernels for the Llama forward on CUDA: what a step spends outside the big
matrix products, collapsed into one launch each.

- ``add_rms_norm``: residual add + RMSNorm (one read of each row, two writes);
- ``rope_write_kv``: rotary embedding of q and k in the fused qkv buffer, K and V stored
  at their cache slots;
- ``silu_mul``: SiLU(gate) * up over the fused gate_up buffer;
- ``add_rms_norm_fp8`` and ``silu_mul_fp8``: the same, their rows handed on quantised to FP8 for
  an FP8 product (``fp8_activation``: the quantiser's codes bit for bit, without its launch);
- ``gemv``: x @ W^T for a few rows (decode at small batch), streaming W once at close to
  copy bandwidth where cuBLAS's matrix-vector path stays below it.

Every kernel rounds where transformers' eager ops round (each elementwise op's result in
the model dtype), so a step differs from the torch path only by summation order.

triton is imported lazily, as in ``triton_decode``. Check against the torch ops and time:

    python3 bench/kernels_check.py --kernel ops --check [--bench]

(the engine's start-up check of these kernels is ``kernel_selfcheck.ops_problem``).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from fovea.engine.kernels.fp8_activation import Fp8Activation, kernel_group
from fovea.engine.kernels.fp8_quantize import FP8_DTYPE, MIN_SCALE
from fovea.engine.kernels.triton_util import launch_time, next_pow2

log = logging.getLogger("fovea.engine.paged")

GEMV_MAX_ROWS = 4  # above this many rows cuBLAS's matrix products win (see --bench)
MAX_FP8_ROW = 32768  # the widest row a producer quantises to FP8 in its own launch (RMSNorm holds it whole)
SILU_FP8_BLOCK = 1024  # columns a program of silu_mul_fp8 takes, as silu_mul's

# bound by _kernels() (fp8_rounding): module globals, where the interpreter looks
store_fp8_groups = quantize_e4m3 = token_scale = None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    from fovea.engine.kernels import fp8_rounding

    global store_fp8_groups, quantize_e4m3, token_scale
    store_fp8_groups, quantize_e4m3, token_scale = (fp8_rounding.store_fp8_groups, fp8_rounding.quantize_e4m3,
                                                    fp8_rounding.token_scale)

    @triton.jit
    def add_rms_norm_kernel(X, R, W, OUT, Q, S, stride_x, stride_r, stride_o, stride_q, stride_s, n_cols, eps,
                            min_scale, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                            GROUP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:  # R <- R + X, rounded to the model dtype as torch's add
            x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
            x = x.to(R.dtype.element_ty)
            tl.store(R + row * stride_r + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * rstd).to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        out = (y * w).to(OUT.dtype.element_ty)
        if QUANT:  # the normed row in the model dtype, quantised to FP8 for the product that reads it
            store_fp8_groups(out.to(tl.float32), cols, ok, Q, S, row, stride_q, stride_s, n_cols, min_scale, 0,
                             BLOCK, GROUP)
        else:
            tl.store(OUT + row * stride_o + cols, out, mask=ok)

    @triton.jit
    def rope_write_kv_kernel(QKV, POS, COS, SIN, KC, VC, SLOTS, stride_t, stride_pos,
                             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KV: tl.constexpr):
        # One program per token, all its heads: q and k heads rotated as one [heads, D/2] tile
        # pair (the cos/sin row is loaded once), v heads copied.
        t = tl.program_id(0).to(tl.int64)
        dt = QKV.dtype.element_ty
        rows = tl.arange(0, BLOCK_R)  # q heads, then k heads
        offs = tl.arange(0, HALF)
        row_ok = (rows < NUM_HEADS + NUM_KV_HEADS)[:, None]
        base = QKV + t * stride_t + rows[:, None] * HEAD_DIM + offs[None, :]
        x1 = tl.load(base, mask=row_ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=row_ok, other=0.0).to(tl.float32)
        pos = tl.load(POS + t).to(tl.int64)
        c1 = tl.load(COS + pos * stride_pos + offs).to(tl.float32)[None, :]
        c2 = tl.load(COS + pos * stride_pos + HALF + offs).to(tl.float32)[None, :]
        s1 = tl.load(SIN + pos * stride_pos + offs).to(tl.float32)[None, :]
        s2 = tl.load(SIN + pos * stride_pos + HALF + offs).to(tl.float32)[None, :]
        # torch: (x * cos) + (rotate_half(x) * sin), each product rounded to the dtype.
        y1 = ((x1 * c1).to(dt).to(tl.float32) + (-(x2 * s1)).to(dt).to(tl.float32)).to(dt)
        y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        tl.store(base, y1, mask=row_ok)
        tl.store(base + HALF, y2, mask=row_ok)
        slot = tl.load(SLOTS + t).to(tl.int64)
        is_k = (rows >= NUM_HEADS)[:, None] & row_ok
        dst = KC + (slot * NUM_KV_HEADS + rows[:, None] - NUM_HEADS) * HEAD_DIM + offs[None, :]
        tl.store(dst, y1, mask=is_k)
        tl.store(dst + HALF, y2, mask=is_k)
        kv = tl.arange(0, BLOCK_KV)
        dims = tl.arange(0, 2 * HALF)
        kv_ok = (kv < NUM_KV_HEADS)[:, None]
        v = tl.load(QKV + t * stride_t + (NUM_HEADS + NUM_KV_HEADS + kv[:, None]) * HEAD_DIM + dims[None, :],
                    mask=kv_ok, other=0.0)
        tl.store(VC + (slot * NUM_KV_HEADS + kv[:, None]) * HEAD_DIM + dims[None, :], v, mask=kv_ok)

    @triton.jit
    def silu_mul_kernel(GU, OUT, stride_g, stride_o, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        dt = OUT.dtype.element_ty
        g = tl.load(GU + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_g + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (act * u).to(dt), mask=ok)

    @triton.jit
    def silu_mul_fp8_kernel(GU, OUT, AMAX, Q, S, stride_g, stride_o, stride_a, stride_q, stride_s, n_cols,
                            min_scale, BLOCK: tl.constexpr, GROUP: tl.constexpr, PER_ROW: tl.constexpr):
        # silu_mul_kernel's block of a row (rounded to the model dtype, as the unfused pair rounds
        # it) on its way to FP8. Groups of GROUP columns (whole groups a block): their codes and
        # scales here. One scale a row (PER_ROW): the values in the model dtype and the block's
        # largest magnitude, which quantise_row_blocks_kernel's programs then combine.
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        dt = GU.dtype.element_ty
        g = tl.load(GU + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_g + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (act * u).to(dt)
        if PER_ROW:
            tl.store(OUT + row * stride_o + cols, y, mask=ok)
            tl.store(AMAX + row * stride_a + block, tl.max(tl.abs(y.to(tl.float32)), axis=0))
        else:
            store_fp8_groups(y.to(tl.float32), cols, ok, Q, S, row, stride_q, stride_s, n_cols, min_scale,
                             block * (BLOCK // GROUP), BLOCK, GROUP)

    @triton.jit
    def quantise_row_blocks_kernel(Y, AMAX, Q, S, stride_y, stride_a, stride_q, stride_s, n_cols, n_blocks,
                                   min_scale, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
        # A block of a row quantised with the row's one scale, made from the largest magnitudes of
        # all its blocks (AMAX [rows, n_blocks]): the quantiser's codes, by as many programs as the
        # row has blocks instead of one (the quantiser's one program a row averaged 5.1 us a launch
        # at one row on an H100, this 2.4 on the 18944-column row).
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        parts = tl.arange(0, BLOCKS)
        amax = tl.max(tl.load(AMAX + row * stride_a + parts, mask=parts < n_blocks, other=0.0), axis=0)
        scale = token_scale(amax, min_scale)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        y = tl.load(Y + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_q + cols, quantize_e4m3(y, scale).to(Q.dtype.element_ty), mask=ok)
        if block == 0:
            tl.store(S + row * stride_s, scale)

    @triton.jit
    def gemv_plain(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        m_ok = offs_m < M
        w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                k_ok = (k + offs_k) < K
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    return (add_rms_norm_kernel, rope_write_kv_kernel, silu_mul_kernel, gemv_plain, silu_mul_fp8_kernel,
            quantise_row_blocks_kernel)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` ([T, C]); with ``residual``, first ``residual += x`` in place and the
    norm is of the sum. Returns the normed rows."""
    out = torch.empty_like(x) if out is None else out
    _add_rms_norm(x, weight, eps, residual, out, None, None, 0)
    return out


def add_rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                     residual: torch.Tensor | None = None) -> Fp8Activation:
    """``add_rms_norm``, its normed rows handed on quantised to FP8 (``fp8_activation``): the codes
    and a scale per ``group`` columns of a row (>= C: one a row) that ``quantize_per_token_group``
    makes from ``add_rms_norm``'s output, bit for bit. ValueError where ``fp8_row_fits`` says no."""
    rows, cols = x.shape
    lanes = _fp8_lanes(group, cols)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, -(-cols // group)), dtype=torch.float32, device=x.device)
    _add_rms_norm(x, weight, eps, residual, x, q, scale, lanes)
    return Fp8Activation(q, scale, group, x.dtype)


def fp8_row_fits(cols: int, group: int) -> bool:
    """A producer's launch can quantise rows of ``cols`` columns by ``group`` (``kernel_group``)."""
    return cols <= MAX_FP8_ROW and kernel_group(group, cols) is not None


def _fp8_lanes(group: int, cols: int) -> int:
    if not fp8_row_fits(cols, group):
        raise ValueError(f"rows of {cols} columns cannot be quantised by groups of {group} in their producer's "
                         f"launch (a power-of-2 group, or one a row, up to {MAX_FP8_ROW} columns)")
    return kernel_group(group, cols)


def _add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                  out: torch.Tensor, q: torch.Tensor | None, scale: torch.Tensor | None, group_lanes: int) -> None:
    """The launch: the normed rows into ``out`` (its dtype), or quantised into ``q`` and ``scale``
    by groups of ``group_lanes`` lanes (``q`` given)."""
    kernel = _kernels()[0]
    rows, cols = x.shape
    r = residual if residual is not None else x
    quant = q is not None
    kernel[(rows,)](x, r, weight, out, q if quant else out, scale if quant else out, x.stride(0), r.stride(0),
                    out.stride(0), q.stride(0) if quant else 0, scale.stride(0) if quant else 0, cols, eps, MIN_SCALE,
                    HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(cols), QUANT=quant,
                    GROUP=group_lanes if quant else 1, num_warps=norm_warps(cols))


def norm_warps(cols: int) -> int:
    """Warps of the RMSNorm launch for rows of ``cols`` columns (one program a row)."""
    return 8 if cols >= 4096 else 4


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Rotate q and k in ``qkv`` ([T, (H + 2 KVH) * D], in place) and store k and v at
    ``slots`` of the caches ([blocks, block_size, KVH, D], contiguous)."""
    kernel = _kernels()[1]
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    kernel[(tokens,)](
        qkv, positions, cos, sin, k_cache, v_cache, slots, qkv.stride(0), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        BLOCK_R=next_pow2(num_heads + num_kv_heads), BLOCK_KV=next_pow2(num_kv_heads),
        num_warps=4 if (num_heads + num_kv_heads) * head_dim >= 4096 else 2)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> [T, I] SiLU(gate) * up."""
    kernel = _kernels()[2]
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    kernel[(rows, -(-inter // block))](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
                                       num_warps=4)
    return out


def silu_mul_fp8(gate_up: torch.Tensor, group: int) -> Fp8Activation:
    """``silu_mul``, its rows handed on quantised to FP8 as ``add_rms_norm_fp8`` hands its rows on.
    Rows are taken ``SILU_FP8_BLOCK`` columns a program, as ``silu_mul`` takes them: groups that
    fit a block are quantised there (one launch); one scale a row takes a second launch whose
    programs each quantise a block with the scale of the blocks' largest magnitudes."""
    rows, width = gate_up.shape
    inter = width // 2
    lanes = _fp8_lanes(group, inter)
    q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty((rows, -(-inter // group)), dtype=torch.float32, device=gate_up.device)
    per_row = group >= inter
    block = max(lanes, SILU_FP8_BLOCK) if not per_row else SILU_FP8_BLOCK  # (whole groups a block)
    blocks = -(-inter // block)
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device) if per_row else q
    amax = torch.empty((rows, blocks), dtype=torch.float32, device=gate_up.device) if per_row else scale
    kernels = _kernels()
    kernels[4][(rows, blocks)](gate_up, out, amax, q, scale, gate_up.stride(0), out.stride(0), amax.stride(0),
                               q.stride(0), scale.stride(0), inter, MIN_SCALE, BLOCK=block,
                               GROUP=block if per_row else lanes, PER_ROW=per_row, num_warps=4)
    if per_row:
        kernels[5][(rows, blocks)](out, amax, q, scale, out.stride(0), amax.stride(0), q.stride(0), scale.stride(0),
                                   inter, blocks, MIN_SCALE, BLOCK=block, BLOCKS=max(2, next_pow2(blocks)),
                                   num_warps=4)
    return Fp8Activation(q, scale, group, gate_up.dtype)


# The launch configurations the matrix-vector kernel is timed in: (BLOCK_N, BLOCK_K, num_warps).
GEMV_CONFIGS = ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 512, 4), (16, 512, 8), (16, 1024, 8),
                (32, 256, 4), (4, 2048, 8), (2, 2048, 4))
GEMV_STAGES = 3  # triton.Config's default, which these configurations were chosen under
# Choices made on first use of a shape, by timing (start-up makes them all: memory.planner);
# ``tuning_cache`` keeps them between starts. Keys: (rows, N, K, dtype name).
_GEMV_CONFIG: dict[tuple, tuple[int, int, int]] = {}  # -> the fastest of GEMV_CONFIGS
_GEMV_CHOICE: dict[tuple, bool] = {}  # -> the Triton kernel beat cuBLAS


def gemv_key(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    return (x.shape[0], weight.shape[0], weight.shape[1], str(x.dtype).removeprefix("torch."))


def _cannot_time() -> bool:
    """Under the CPU interpreter or inside a graph capture nothing can be timed: a shape met there
    gets a default that is not kept (nor written to the tuning cache), so a later use times it."""
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_current_stream_capturing()


def _fastest_gemv_config(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    """Time every configuration on this shape; the fastest."""
    times = [launch_time(lambda c=c: gemv_launch(x, weight, *c, GEMV_STAGES)) for c in GEMV_CONFIGS]
    return GEMV_CONFIGS[min(range(len(times)), key=times.__getitem__)]


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T for M <= GEMV_MAX_ROWS (both K-contiguous), in the launch
    configuration timed fastest on this shape."""
    key = gemv_key(x, weight)
    config = _GEMV_CONFIG.get(key)
    if config is None:
        if _cannot_time():
            config = GEMV_CONFIGS[0]
        else:
            config = _GEMV_CONFIG[key] = _fastest_gemv_config(x, weight)
    return gemv_launch(x, weight, *config, GEMV_STAGES)


def gemv_launch(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, num_warps: int,
                num_stages: int) -> torch.Tensor:
    """``gemv`` with an explicit launch configuration instead of the autotuner's choice."""
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _kernels()[3][(-(-n // block_n),)](x, weight, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
                                       BLOCK_M=max(1, next_pow2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
                                       EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    return y


def _triton_gemv_is_faster(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Time both on this shape once (weights streamed from memory, as in a decode step)."""
    t_triton = launch_time(lambda: gemv(x, weight))
    t_cublas = launch_time(lambda: F.linear(x, weight))
    log.debug("matrix-vector %sx%s rows=%d: triton %.1f us, cuBLAS %.1f us", weight.shape[0], weight.shape[1],
              x.shape[0], 1e3 * t_triton, 1e3 * t_cublas)
    return t_triton < 0.97 * t_cublas


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or the Triton matrix-vector kernel for a few bias-free rows where it
    measured faster than cuBLAS on this shape (decided on first use, per shape)."""
    if (bias is None and x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS and x.stride(-1) == 1
            and weight.is_contiguous()):
        key = gemv_key(x, weight)
        use = _GEMV_CHOICE.get(key)
        if use is None:  # (inside a graph capture the warm-up before it decided; else cuBLAS, not kept)
            use = False if _cannot_time() else _GEMV_CHOICE.setdefault(key, _triton_gemv_is_faster(x, weight))
        if use:
            return gemv(x, weight)
    return F.linear(x, weight, bias)
