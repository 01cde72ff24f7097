"""The process's GPU memory as a plan: one line per long-lived allocation, and what the KV cache gets.

Nothing here touches a device: the numbers come in (measured by ``profile`` on CUDA,
computed from sizes on CPU) and a ``MemoryPlan`` or a ``MemoryPlanError`` comes out, so
the arithmetic and the refusals are tested without a GPU.

The budget is what this process may hold: ``--gpu-memory-utilization`` of the device's
total memory, but never more than is really free (plus what the process already holds), so a
GPU that other processes use gets a plan from what is left to it. The KV cache gets what the
other lines leave, capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can
use (a small model on a big GPU leaves the rest to its neighbours), or exactly
``--kv-cache-memory``. A plan that cannot fit is refused at start-up with the need, what was
free and the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fovea.errors import FoveaError

GiB = 1024**3
MiB = 1024**2
DEFAULT_UTILIZATION = 0.9
# torch's caching allocator rounds each large tensor up to 2 MiB: a KV tensor per layer and K/V.
ALLOCATOR_ROUNDING = 2 * MiB


class MemoryPlanError(FoveaError):
    """The plan cannot fit: raised at start-up, never per request."""

    status, code, type = 500, "insufficient_memory", "server_error"


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True, slots=True)
class PlanLine:
    name: str
    bytes: int
    how: str  # where the number comes from, in a few words
    torch: bool = True  # held in torch's caching allocator (counts towards its cap on CUDA)

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "gib": round(self.bytes / GiB, 3), "how": self.how}


@dataclass(slots=True)
class MemoryPlan:
    device: str
    lines: list[PlanLine]
    kv_blocks: int
    block_size: int
    budget_bytes: int | None = None  # what the process may hold (None on CPU: host memory is not planned)
    budget_how: str = ""
    total_bytes: int | None = None  # the device's memory
    torch_cap_bytes: int | None = None  # the caching allocator's hard cap (CUDA)
    notes: list[str] = field(default_factory=list)

    @property
    def planned_bytes(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def line(self, name: str) -> PlanLine:
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "budget": self.budget_how,
            "total_bytes": self.total_bytes,
            "planned_bytes": self.planned_bytes,
            "torch_cap_bytes": self.torch_cap_bytes,
            "kv_cache": {"blocks": self.kv_blocks, "block_size": self.block_size, "tokens": self.kv_tokens},
            "lines": [line.to_dict() for line in self.lines],
            "notes": list(self.notes),
        }

    def render(self) -> str:
        """The plan as the start-up log shows it: one line per allocation, then the total."""
        width = max(len(line.name) for line in self.lines)
        rows = [f"memory plan on {self.device}"
                + (f": may hold {gib(self.budget_bytes)} ({self.budget_how})" if self.budget_bytes else
                   f" ({self.budget_how})" if self.budget_how else "")]
        rows += [f"  {line.name:<{width}}  {gib(line.bytes):>11}  {line.how}" for line in self.lines]
        rows.append(f"  {'planned':<{width}}  {gib(self.planned_bytes):>11}  KV cache of {self.kv_blocks} blocks = "
                    f"{self.kv_tokens} tokens")
        rows += [f"  note: {note}" for note in self.notes]
        return "\n".join(rows)


@dataclass(frozen=True, slots=True)
class Budget:
    bytes: int
    how: str
    limited_by_free: bool = False  # other processes hold what the flag would have given

    @property
    def advice(self) -> str:
        """Which flag to change (or what else to do) when something does not fit this budget."""
        if self.limited_by_free:
            return "free the GPU (other processes hold memory) or pick another one (--device cuda:N)"
        return "raise --gpu-memory-utilization"


def process_budget(total: int, free: int, held: int, utilization: float | None, exact_kv: bool = False) -> Budget:
    """What this process may hold: ``utilization`` x ``total``, but at most what is free plus
    what the process's allocator already ``held`` when the free memory was read. With an exact
    KV size (``--kv-cache-memory``) the share does not apply: the plan takes what it needs
    from what is free."""
    available = free + held
    if exact_kv:
        return Budget(available, f"--kv-cache-memory: the whole plan from the {gib(available)} free",
                      limited_by_free=True)
    share = DEFAULT_UTILIZATION if utilization is None else utilization
    wanted = int(share * total)
    flag = f"--gpu-memory-utilization {share:.2f} of {gib(total)}"
    if available < wanted:
        return Budget(available, f"{flag} is {gib(wanted)}, but only {gib(available)} is free: other processes "
                                 f"hold {gib(total - available)}", limited_by_free=True)
    return Budget(wanted, flag)


def runtime_line(reserved: tuple[int, int], own: tuple[int | None, int | None], used: tuple[int, int],
                 allowance: int) -> PlanLine:
    """The device memory outside torch's allocator, from (start, now) readings of torch's
    reserved bytes, this process's own usage (NVML, None where unknown) and the device's used bytes.

    With this process's own usage, the line is everything it holds beyond torch: the CUDA
    context, library workspaces and kernel modules. Without it only the growth of the whole
    device's usage is left, which counts what other processes allocated meanwhile too (two
    servers starting together on one GPU): the line says so.
    """
    if own[1] is not None:
        outside = max(0, own[1] - reserved[1])
        return PlanLine("CUDA context and runtime", outside + allowance,
                        f"measured: this process's device memory outside torch (NVML), +{allowance // MiB} MiB for "
                        "kernels loaded later", torch=False)
    grown = max(0, (used[1] - used[0]) - (reserved[1] - reserved[0]))
    return PlanLine("CUDA runtime", grown + allowance,
                    f"measured device-wide (no per-process reading): growth outside torch since start-up, which "
                    f"also counts other processes' allocations meanwhile; +{allowance // MiB} MiB", torch=False)


@dataclass(frozen=True, slots=True)
class LMShape:
    """What the language model's activations are made of: widths, and bytes per element."""

    hidden: int
    intermediate: int
    q_width: int  # heads x head_dim
    kv_width: int  # kv heads x head_dim
    dtype_bytes: int
    act_quant_bytes: float = 0.0  # per element of a quantised copy of a product's input (FP8: 1 + its scales)


def prefill_activation_bytes(tokens: int, lm: LMShape) -> int:
    """The language model's live activations at the worst point of one decoder layer of the fused
    forward (``PagedLlama._forward_fused``) for a step of ``tokens`` tokens. Held through the MLP:
    the residual stream, the normed input, q/k/v, the attention output, its projection and the
    previous layer's MLP output (each [T, width], referenced until the next layer rebinds them); then
    the larger of the gate/up product with its SiLU-and-multiply ([T, 2I] + [T, I]) and the down
    product's input, its quantised copy and its output ([T, I] + [T, I] quantised + [T, H])."""
    t, b = tokens, lm.dtype_bytes
    held = t * b * (4 * lm.hidden + 2 * lm.q_width + 2 * lm.kv_width)
    gate_up = t * b * 3 * lm.intermediate
    down = int(t * (b * lm.intermediate + lm.act_quant_bytes * lm.intermediate + b * lm.hidden))
    return held + max(gate_up, down)


def step_lines(measured: int, activations: int, tokens: int, how_measured: str) -> list[PlanLine]:
    """The worst step as two lines: the language model's prefill activations (computed from the
    shapes, ``prefill_activation_bytes``) and what the measured peak holds beyond them (attention
    and sampling temporaries, the vision batch, the overlapped step's outputs). Together they are
    max(measured, computed): a profile that missed part of the arithmetic cannot plan below it."""
    beyond = max(0, measured - activations)
    note = "" if measured >= activations else f" (the measured {gib(measured)} was below the computed line)"
    return [PlanLine("prefill activations", activations, f"computed: the language model's live tensors at one "
                                                         f"layer's MLP for a step of {tokens} tokens"),
            PlanLine("step peak", beyond, f"{how_measured}, beyond the prefill activations{note}")]


def kv_tensor_bytes(blocks: int, per_block: int, tensors: int) -> int:
    """Bytes the allocator reserves for ``tensors`` KV tensors holding ``blocks`` blocks (+1
    scratch block each), each rounded up as torch's caching allocator does."""
    per_tensor = (blocks + 1) * per_block // tensors
    return tensors * -(-per_tensor // ALLOCATOR_ROUNDING) * ALLOCATOR_ROUNDING


def blocks_for_bytes(available: int, per_block: int, tensors: int) -> int:
    """The most blocks whose tensors (``kv_tensor_bytes``) fit in ``available`` bytes."""
    blocks = max(0, available // per_block - 1)  # rounding only adds: this is an upper bound
    while blocks > 0 and kv_tensor_bytes(blocks, per_block, tensors) > available:
        blocks -= 1
    return max(0, blocks)


@dataclass(frozen=True, slots=True)
class KVRequest:
    """What the KV cache must and may hold."""

    per_block: int  # bytes of one block over all layers, K and V
    tensors: int  # KV tensors (2 per layer)
    block_size: int
    min_blocks: int  # one sequence of max_model_len tokens
    need_blocks: int  # what max_num_seqs sequences of max_model_len tokens can use (with prefix-cache slack)
    exact_bytes: int | None = None  # --kv-cache-memory
    max_model_len: int = 0


def plan_kv(budget: Budget, lines: list[PlanLine], kv: KVRequest, device: str, total: int,
            free_now: int | None = None, pending: int = 0) -> MemoryPlan:
    """Size the KV cache from the budget and the other lines, or refuse.

    ``free_now`` is the device's free memory at this point and ``pending`` the bytes of lines
    not allocated yet (step peaks, caches that fill while serving): the KV cache never takes
    memory that another process has taken since the budget was read.
    """
    others = sum(line.bytes for line in lines)
    need_text = ", ".join(f"{line.name} {gib(line.bytes)}" for line in lines)
    room = budget.bytes - others
    notes: list[str] = []
    if free_now is not None and free_now - pending < room:
        room = free_now - pending
        notes.append(f"KV cache limited by the free memory ({gib(free_now)}) at sizing time")
    if kv.exact_bytes is not None:
        blocks = kv.exact_bytes // kv.per_block
        kv_bytes = kv_tensor_bytes(blocks, kv.per_block, kv.tensors)
        if kv_bytes > room:
            raise MemoryPlanError(
                f"the memory plan does not fit on {device}: --kv-cache-memory {gib(kv.exact_bytes)} plus the "
                f"rest of the plan ({need_text}) needs {gib(others + kv_bytes)}, and this process may hold "
                f"{gib(budget.bytes)} ({budget.how}). Lower --kv-cache-memory, or {budget.advice}.")
        how = f"--kv-cache-memory {gib(kv.exact_bytes)}"
    else:
        blocks = blocks_for_bytes(room, kv.per_block, kv.tensors)
        how = f"what the budget leaves ({gib(max(room, 0))})"
        if blocks > kv.need_blocks:
            blocks = kv.need_blocks
            how = f"capped at the {kv.need_blocks} blocks max_num_seqs sequences of max_model_len tokens can use"
    if blocks < max(1, kv.min_blocks):
        short = kv_tensor_bytes(max(1, kv.min_blocks), kv.per_block, kv.tensors) - max(room, 0)
        raise MemoryPlanError(
            f"the memory plan does not fit on {device}: {need_text} leave {gib(max(room, 0))} of the "
            f"{gib(budget.bytes)} this process may hold ({budget.how}), and the KV cache needs "
            f"{gib(kv_tensor_bytes(max(1, kv.min_blocks), kv.per_block, kv.tensors))} for one sequence of "
            f"--max-model-len {kv.max_model_len} tokens ({gib(short)} more). Lower --max-model-len, "
            f"--max-batched-tokens or --max-batch-size, or {budget.advice}.")
    kv_line = PlanLine("kv_cache", kv_tensor_bytes(blocks, kv.per_block, kv.tensors),
                       f"{blocks} blocks of {kv.block_size} tokens, {kv.per_block // 1024} KiB each: {how}")
    plan = MemoryPlan(device=device, lines=[*lines, kv_line], kv_blocks=blocks, block_size=kv.block_size,
                      budget_bytes=budget.bytes, budget_how=budget.how, total_bytes=total, notes=notes)
    plan.torch_cap_bytes = sum(line.bytes for line in plan.lines if line.torch)
    return plan


def check_weights_fit(weights: int, dtype_name: str, device: str, total: int, free: int,
                      utilization: float | None, kv_exact: int | None, runtime_floor: int = 512 * MiB) -> None:
    """Before loading: refuse a model whose weights cannot fit, with need against free,
    instead of an out-of-memory traceback half-way through the load."""
    budget = process_budget(total, free, 0, utilization, exact_kv=kv_exact is not None)
    need = weights + runtime_floor + (kv_exact or 0)
    if need > budget.bytes:
        extra = f" plus --kv-cache-memory {gib(kv_exact)}" if kv_exact else ""
        raise MemoryPlanError(
            f"the model does not fit on {device}: its weights need {gib(weights)} ({dtype_name}){extra} plus at "
            f"least {gib(runtime_floor)} to run, and this process may hold {gib(budget.bytes)} ({budget.how}). "
            f"Nothing was loaded; {budget.advice}.")
