"""The engine's start-up self-check of its Triton kernels: one small case each against torch.

``ModelRunner`` runs ``triton_self_check`` (through ``self_check``) before it trusts the kernels;
any disagreement (or failure) sends the engine to the torch path: slower, never wrong. On a
first start most of the check's seconds are Triton compiling the kernels, so a server starts it
in a thread before it reads the weights (``start_early``): compiling and loading overlap. The full checks over many
shapes are ``bench/kernels_check.py --kernel decode|prefill|ops --check``.

The kernels are called through their modules (``triton_ops.silu_mul``, not an imported name),
so a test that swaps one for a wrong one sees this check fail.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F

from fovea.engine.kernels import triton_decode, triton_ops, triton_prefill, triton_util
from fovea.engine.kernels.cases import (
    prefill_torch_reference,
    random_decode_case,
    random_prefill_case,
    rms_norm_reference,
    rope_reference,
)
from fovea.engine.model.attention import paged_decode_torch


def ops_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """One small case per fused op of ``triton_ops`` against torch: None if all agree, else
    what disagreed."""
    gen = torch.Generator().manual_seed(0)
    tol = 2e-4 if dtype == torch.float32 else 3e-2

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    x, res, w = r(2, 256), r(2, 256), 1 + r(256, scale=0.1)
    summed = res + x
    errors = {"add_rms_norm": (triton_ops.add_rms_norm(x, w, 1e-5, residual=res),
                               rms_norm_reference(summed, w, 1e-5))}
    qkv = r(3, 8 * 64)  # 4 query heads, 2 kv heads, head_dim 64
    before = qkv.clone()
    pos = torch.tensor([0, 5, 9], device=device)
    emb = torch.arange(16).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))[None]
    cos, sin = torch.cat([emb, emb], -1).cos().to(device, dtype), torch.cat([emb, emb], -1).sin().to(device, dtype)
    kc, vc = torch.zeros(2, 16, 2, 64, device=device, dtype=dtype), torch.zeros(2, 16, 2, 64, device=device, dtype=dtype)
    slots = torch.tensor([3, 17, 30], device=device)
    triton_ops.rope_write_kv(qkv, pos, cos, sin, kc, vc, slots, 4, 2, 64)
    q_ref = rope_reference(before[:, :256].view(3, 4, 64), cos[pos][:, None], sin[pos][:, None])
    errors["rope_write_kv"] = (qkv[:, :256].view(3, 4, 64), q_ref)
    errors["kv write"] = (vc.view(-1, 2, 64)[slots], before[:, 384:].view(3, 2, 64))
    gu = r(2, 256)
    errors["silu_mul"] = (triton_ops.silu_mul(gu), F.silu(gu[:, :128]) * gu[:, 128:])
    a, b = r(2, 256), r(64, 256, scale=0.05)
    errors["gemv"] = (triton_ops.gemv(a, b), a.float() @ b.float().T)
    for name, (got, ref) in errors.items():
        err = (got.float() - ref.float()).abs().max().item()
        if not err <= tol:  # NaN fails too
            return f"{name}: max error {err:.2e} > {tol:.0e}"
    return None


def triton_self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run each Triton kernel once on a small case against torch: None if all agree, else
    what did not (the engine then runs the torch path: slower, never wrong)."""
    try:
        q, kc, vc, bt, cl = random_decode_case(3, 8, 2, 64, 16, 700, dtype, device)
        got = triton_decode.paged_decode(q, kc, vc, bt, cl, 0.125).float()
        ref = paged_decode_torch(q.float(), kc.float(), vc.float(), bt, cl, 0.125)
        decode_err = (got - ref).abs().max().item()
        case = random_prefill_case([(0, 40), (33, 20)], 8, 2, 64, 16, dtype, device)
        got = triton_prefill.paged_prefill(*case[:6], 0.125, case[6]).float()
        ref = prefill_torch_reference(*case[:6], 0.125, case[6]).float()
        prefill_err = (got - ref).abs().max().item()
        fused_problem = ops_problem(device, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the torch path
        return f"{type(exc).__name__}: {exc}"
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    for name, err in (("paged decode", decode_err), ("paged prefill", prefill_err)):
        if not err <= tol:  # NaN fails too
            return f"{name}: max error {err:.2e} > {tol:.0e}"
    return fused_problem


_EARLY: dict[tuple[str, str], Future] = {}  # (device, dtype) -> the self-check started before the load


def start_early(device: torch.device, dtype: torch.dtype) -> None:
    """Start ``triton_self_check`` for ``device`` and ``dtype`` in a thread of its own (CUDA with
    triton only): ``self_check`` then takes its answer instead of running it again."""
    key = (str(device), str(dtype))
    if device.type != "cuda" or not triton_util.available() or key in _EARLY:
        return

    def run() -> str | None:
        with torch.cuda.device(device):  # Triton launches on the current device
            return triton_self_check(device, dtype)

    pool = ThreadPoolExecutor(1, thread_name_prefix="fovea-kernel-check")
    _EARLY[key] = pool.submit(run)
    pool.shutdown(wait=False)


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """``triton_self_check``'s answer: the early thread's where one was started for this device and
    dtype (waiting for it), else checked now."""
    early = _EARLY.pop((str(device), str(dtype)), None)
    if early is not None:
        try:
            return early.result()
        except Exception as exc:  # noqa: BLE001 - as triton_self_check: any failure means the torch path
            return f"{type(exc).__name__}: {exc}"
    return triton_self_check(device, dtype)
