"""Case builders and torch references for checking fovea's Triton kernels.

Used by the kernels' tests, by ``bench/kernels_check.py`` (``--check``, ``--bench``) and by the
engine's start-up self-check (``fovea.engine.runner.kernel_selfcheck``). The kernel modules
themselves hold only the kernels and what the engine runs. The fused vision stage's random-weight
models (``random_llava``, ``tiny_vision``, ``llava15_vision``) are test fixtures: they live in
``fovea.testing.kernel_cases``.

- paged decode (``triton_decode.paged_decode``): ``random_decode_case``, ``poison_past_context``;
  the reference is ``fovea.engine.model.attention.paged_decode_torch`` (the engine's torch path);
- paged prefill (``triton_prefill.paged_prefill``): ``random_prefill_case``, ``random_spans``,
  ``prefill_torch_reference``;
- fused Llama ops (``triton_ops``): ``rms_norm_reference``, ``rope_reference``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_dtypes(device: torch.device) -> list[torch.dtype]:
    """The dtypes a kernel's ``--check`` covers: float32 on the CPU (triton's interpreter), all
    three on a GPU."""
    return [torch.float32] if device.type == "cpu" else [torch.float32, torch.bfloat16, torch.float16]


# ---- paged decode ------------------------------------------------------------------------------

def random_decode_case(batch: int, heads: int, kv_heads: int, dim: int, block_size: int, max_ctx: int,
                       dtype: torch.dtype, device: torch.device, seed: int = 0, width: int | None = None):
    """Random caches, shuffled block tables and context lengths 1..max_ctx (max_ctx included).

    ``width`` (at least the blocks max_ctx needs) widens the table as a CUDA graph's is: the
    columns past the context point at random blocks, as stale entries would.

    Returns (q, k_cache, v_cache, block_tables, context_lens)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    used = -(-max_ctx // block_size)
    width = max(width or used, used)
    num_blocks = batch * used + 3
    k_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen).to(device, dtype)
    v_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen).to(device, dtype)
    q = torch.randn((batch, heads, dim), generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * used].view(batch, used)
    if width > used:
        stale = torch.randint(0, num_blocks, (batch, width - used), generator=gen)
        tables = torch.cat([tables, stale], dim=1)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen)
    lens[0] = max_ctx
    return q, k_cache, v_cache, tables.to(device, torch.int32), lens.to(device, torch.int32)


def poison_past_context(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                        lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with one extra block of NaN and tables whose columns past each context point at
    it: a kernel that reads a block it should not returns NaN. Also returns the tables the
    reference should use (the same, with those columns at block 0).

    Returns (k_cache, v_cache, poisoned tables, reference tables)."""
    nan = torch.full_like(k_cache[:1], float("nan"))
    kc, vc = torch.cat([k_cache, nan]), torch.cat([v_cache, nan])
    block_size = k_cache.shape[1]
    cols = torch.arange(tables.shape[1], device=tables.device)[None, :]
    past = cols >= ((lens.long() + block_size - 1) // block_size)[:, None]
    poisoned = tables.masked_fill(past, k_cache.shape[0])
    return kc, vc, poisoned, tables.masked_fill(past, 0)


# ---- paged prefill -----------------------------------------------------------------------------

def random_prefill_case(spans: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, block_size: int,
                        dtype: torch.dtype, device: torch.device, seed: int = 0, poison: bool = True):
    """A random problem: chunk s sits at positions spans[s] = (start, length) of its own
    sequence. Block tables are shuffled over the cache and padded (one spare column, padding
    pointing at an unused block); the cache holds unit-variance random values, and with
    ``poison`` every slot that no query may read (past each chunk's end, unused blocks) is
    NaN, so any read past the causal bound shows in the output.

    Returns (q, k_cache, v_cache, cu_q_lens, q_starts, block_tables, max_q_len)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [-(-(start + n) // block_size) for start, n in spans]
    width = max(need) + 1
    num_blocks = sum(need) + 2
    k_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen)
    v_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    spare = int(perm[-1])
    tables = torch.full((len(spans), width), spare, dtype=torch.int32)
    readable = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    used = 0
    for s, ((start, n), nb) in enumerate(zip(spans, need, strict=True)):
        tables[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        readable.view(-1)[(tables[s, :nb].long()[:, None] * block_size
                           + torch.arange(block_size)).flatten()[:start + n]] = True
    if poison and dtype.is_floating_point:
        k_cache[~readable] = float("nan")
        v_cache[~readable] = float("nan")
    lens = torch.tensor([n for _, n in spans], dtype=torch.int32)
    cu = torch.zeros(len(spans) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    q = torch.randn((int(cu[-1]), heads, dim), generator=gen)
    starts = torch.tensor([start for start, _ in spans], dtype=torch.int32)
    return (q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), cu.to(device),
            starts.to(device), tables.to(device), int(lens.max()))


def random_spans(num: int, max_len: int, max_start: int, seed: int = 0) -> list[tuple[int, int]]:
    """``num`` chunks of lengths 1..max_len (the first max_len, the last 1 when num > 2) at starts
    0..max_start (the first at 0, the second past 0 when num > 1)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num,), generator=gen).tolist()
    starts = torch.randint(0, max_start + 1, (num,), generator=gen).tolist()
    lens[0], starts[0] = max_len, 0
    if num > 1:
        starts[1] = max(1, starts[1])
    if num > 2:
        lens[-1] = 1
    return list(zip(starts, lens, strict=True))


def prefill_torch_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_q_lens: torch.Tensor, q_starts: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, max_q_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``triton_prefill.paged_prefill`` in plain torch, computed in fp32: per chunk, gather its
    K/V through the block table and run SDPA with an explicit causal-with-prefix mask."""
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if out is None:
        out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    cu, starts = cu_q_lens.tolist(), q_starts.tolist()
    for s, start in enumerate(starts):
        lo, hi = cu[s], cu[s + 1]
        n = hi - lo
        if n == 0:
            continue
        if n > max_q_len:
            raise ValueError(f"chunk {s} has {n} queries, more than max_q_len={max_q_len}")
        total = start + n
        ids = block_tables[s, :-(-total // block_size)].long()
        k = k_cache[ids].flatten(0, 1)[:total].float().repeat_interleave(group, dim=1)  # [total, H, D]
        v = v_cache[ids].flatten(0, 1)[:total].float().repeat_interleave(group, dim=1)
        pos = torch.arange(start, total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= pos[:, None]  # [n, total]
        o = F.scaled_dot_product_attention(q[lo:hi].float().transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask[None, None], scale=scale)
        out[lo:hi] = o[0].transpose(0, 1).to(out.dtype)
    return out


# ---- fused Llama ops -----------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in float32, rounded to x's dtype, then scaled."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
