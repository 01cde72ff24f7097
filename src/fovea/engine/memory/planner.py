"""Start-up of the paged engine's memory: measure every long-lived allocation, size the KV cache, cap the rest.

On CUDA (``Planner.plan``), in order, each phase measured from a settled allocator
(``profile.measure``):
1. the budget: ``--gpu-memory-utilization`` of the device, at most what is free;
2. the weights and the tensors already held;
3. kernel choices made now, not while serving (the matrix-vector kernel's timing against
   cuBLAS for every row count, the autotuner, Triton compiles): they allocate benchmark
   buffers, which must not happen under load;
4. the vision stage's CUDA graphs (held);
5. the worst step (a peak): a vision batch, then two overlapped steps of
   max_num_batched_tokens tokens sampling max_num_seqs rows with log-probabilities (prompt
   scoring takes its rows through the LM head in slices within those rows: prompt_scores.py);
6. the decode graphs, captured once against a one-block probe cache (held);
7. what the process holds outside torch: with NVML its own usage (CUDA context, workspaces,
   kernel modules); without it, the device-wide growth since start-up (``runtime_line``);
then the caches that fill while serving (encoder cache, prompt embeddings in flight) and a
headroom line, and the KV cache gets the rest (``plan.plan_kv``).

``enforce`` then caps torch's caching allocator at the plan's torch lines: an allocation past
the plan raises out-of-memory at once, which the engine recovers from, instead of taking
memory another process on the GPU was promised.

On CPU, and with a fixed block count, the plan is computed from sizes and not enforced.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fovea.engine.kernels import triton_ops
from fovea.engine.memory import tuning_cache
from fovea.engine.memory.plan import (
    KVRequest,
    LMShape,
    MemoryPlan,
    MemoryPlanError,
    MiB,
    PlanLine,
    gib,
    plan_kv,
    prefill_activation_bytes,
    process_budget,
    runtime_line,
    step_lines,
)
from fovea.engine.memory.profile import CudaMeter, measure, tensor_bytes
from fovea.engine.memory.tuning_cache import TuningCache
from fovea.engine.model.kv_cache import KVCache, KVShape
from fovea.engine.sampling.logits_processors import penalise, penalty_slots, token_counts_bytes
from fovea.quant.weights import Fp8Weight, Int4Weight
from fovea.startup_clock import STARTUP

if TYPE_CHECKING:
    from fovea.engine.config import PagedEngineConfig
    from fovea.engine.model.llama import PagedLlama
    from fovea.loading.loader import LoadedModel

log = logging.getLogger("fovea.engine.paged")

CPU_KV_BYTES = 256 * MiB  # the CPU KV cache unless --kv-cache-memory says otherwise
RUNTIME_ALLOWANCE = 64 * MiB  # kernel modules the CUDA runtime may still load after start-up
SAMPLED_ROWS = 8  # rows the profile samples with temperature and top-p (the rest greedy)
SCRATCH = "int4 dequant scratch"
HELD_WHILE_SIZING = ("weights", SCRATCH, "engine tensors", "vision graphs")  # allocated when the KV cache is sized
HELD = (*HELD_WHILE_SIZING, "decode graphs", "kv_cache")  # allocated once start-up is done


def gpu_share_off_gpu(device: str) -> MemoryPlanError:
    """The refusal of --gpu-memory-utilization for an engine that runs on the host."""
    return MemoryPlanError(f"--gpu-memory-utilization applies to a GPU, and this engine runs on {device}; size the "
                           "KV cache with --kv-cache-memory instead.")


def host_available_bytes() -> int | None:
    """Memory this host can still give (Linux's MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def lm_shape(llama) -> LMShape:
    """``PagedLlama``'s widths for ``prefill_activation_bytes`` (FP8 layers quantise their inputs)."""
    down = llama.layers[0].down
    intermediate = down.in_features if isinstance(down, Fp8Weight | Int4Weight) else down.shape[1]
    quant = 0.0
    if isinstance(down, Fp8Weight):  # one byte per element, a float32 scale per row (and group)
        quant = 1.0 + 4.0 / (down.block[1] if down.block is not None else intermediate)
    return LMShape(hidden=llama.embed.shape[1], intermediate=intermediate, q_width=llama.num_heads * llama.head_dim,
                   kv_width=llama.num_kv_heads * llama.head_dim, dtype_bytes=llama.embed.element_size(),
                   act_quant_bytes=quant)


def scratch_lines(llama) -> list[PlanLine]:
    """The int4 dequantisation buffer the fused forward holds (``PagedLlama.int4_scratch``), if any."""
    scratch = getattr(llama, "int4_scratch", None)
    if scratch is None:
        return []
    return [PlanLine(SCRATCH, scratch.numel() * scratch.element_size(),
                     f"the largest int4 layer's weight ({scratch.numel()} {str(scratch.dtype).removeprefix('torch.')}), "
                     "dequantised there for products of many rows; one buffer for all layers")]


class PlannedRunner(Protocol):
    """What the planner needs of the model runner (``ModelRunner``): its sizes, a dummy step and
    vision batch to measure, and the graphs it captures while measuring."""

    config: PagedEngineConfig
    device: torch.device
    block_size: int
    max_prefill_tokens: int
    decode_graphs_enabled: bool
    llama: PagedLlama
    loaded: LoadedModel

    def scratch_blocks(self) -> int: ...

    def dummy_step(self, cache: KVCache, tokens: int | None = None, rows: int | None = None) -> torch.Tensor: ...

    def dummy_vision_batch(self) -> torch.Tensor | None: ...

    def capture_vision_graphs(self) -> None: ...

    def build_graphs(self, *, cache: KVCache | None = None) -> Any: ...


class Planner:
    def __init__(self, runner: PlannedRunner, shape: KVShape) -> None:
        self.runner = runner
        self.config = runner.config
        self.shape = shape
        self.device = runner.device
        self.meter = CudaMeter(self.device) if self.device.type == "cuda" else None
        self._tuning: TuningCache | None = None  # the kernel choices' file, once the choices are made

    # ---- the plan ---------------------------------------------------------------------
    def plan(self) -> MemoryPlan:
        if self.meter is None:
            return self._plan_host()
        if self.config.num_blocks is not None:
            self.runner.capture_vision_graphs()
            return self._plan_fixed("fixed at --num-blocks (an experiment): not measured, not enforced")
        try:
            return self._plan_measured()
        except torch.OutOfMemoryError as exc:
            self.meter.settle()
            free, total = self.meter.free_total()
            raise MemoryPlanError(
                f"the start-up profile ran out of memory on {self.device} ({str(exc).splitlines()[0][:160]}); "
                f"{gib(free)} of {gib(total)} is free. Lower --max-batched-tokens, --max-batch-size or "
                "--vision-batch-size, or free the GPU.") from None

    def _request(self, exact: int | None) -> KVRequest:
        cfg, bs = self.config, self.runner.block_size
        per_seq = -(-cfg.max_model_len // bs)
        return KVRequest(per_block=self.shape.bytes_per_block, tensors=2 * self.shape.num_layers, block_size=bs,
                         min_blocks=per_seq, need_blocks=2 * cfg.max_num_seqs * per_seq, exact_bytes=exact,
                         max_model_len=cfg.max_model_len)

    def _caches(self) -> list[PlanLine]:
        """Lines that fill while serving: their bound, not their use."""
        r, cfg = self.runner, self.config
        # DeepStack models hold each prompt position's feature levels beside its embedding.
        width = r.llama.embed.shape[1] * (1 + r.llama.deepstack_layers)
        embed_bytes = r.max_prefill_tokens * width * r.llama.embed.element_size()
        return [
            PlanLine("encoder cache", cfg.encoder_cache_bytes, "bound: image embeddings kept by content hash"),
            PlanLine("prompt embeddings", embed_bytes, f"bound: input embeddings of at most {r.max_prefill_tokens} "
                                                       "prompt tokens held while prefilling"),
            PlanLine("penalty counts", token_counts_bytes(penalty_slots(cfg.max_num_seqs), r.llama.lm_head.shape[0]),
                     f"bound: token counts of {penalty_slots(cfg.max_num_seqs)} penalised sequences, on first use"),
        ]

    def _weights(self) -> PlanLine:
        return PlanLine("weights", tensor_bytes(self.runner.loaded.model), "parameters and buffers of the loaded model")

    def _scratch(self) -> list[PlanLine]:
        return scratch_lines(self.runner.llama)

    def _plan_host(self) -> MemoryPlan:
        cfg = self.config
        if cfg.gpu_memory_utilization is not None:  # refused, not ignored: host memory is not shared out
            raise gpu_share_off_gpu(str(self.device))
        per_block = self.shape.bytes_per_block
        if cfg.num_blocks is not None:
            blocks, how = cfg.num_blocks, "fixed block count"
        else:
            kv_bytes = cfg.kv_cache_memory or CPU_KV_BYTES
            blocks = kv_bytes // per_block
            how = f"--kv-cache-memory {gib(kv_bytes)}" if cfg.kv_cache_memory else f"CPU default {gib(kv_bytes)}"
            if blocks < 1:
                raise MemoryPlanError(f"--kv-cache-memory {kv_bytes} bytes holds no KV block ({per_block} bytes "
                                      "each); raise it.")
            available = host_available_bytes()
            if available is not None and blocks * per_block > available:
                raise MemoryPlanError(f"--kv-cache-memory {gib(kv_bytes)} is more than this host has available "
                                      f"({gib(available)}); lower it.")
        lines = [self._weights(), *self._scratch(),
                 PlanLine("kv_cache", (blocks + 1) * per_block, f"{blocks} blocks of {self.runner.block_size} tokens: "
                          f"{how}"), *self._caches()]
        return MemoryPlan(device=str(self.device), lines=lines, kv_blocks=blocks, block_size=self.runner.block_size,
                          budget_how="host memory: sized from the settings, not reserved up front")

    def _plan_fixed(self, how: str) -> MemoryPlan:
        blocks, per_block = self.config.num_blocks, self.shape.bytes_per_block
        lines = [self._weights(), *self._scratch(), PlanLine("kv_cache", (blocks + 1) * per_block, how),
                 *self._caches()]
        return MemoryPlan(device=str(self.device), lines=lines, kv_blocks=blocks, block_size=self.runner.block_size,
                          budget_how=how)

    def _plan_measured(self) -> MemoryPlan:
        r, cfg, meter, device = self.runner, self.config, self.meter, self.device
        assert meter is not None
        meter.settle()
        free0, total = meter.free_total()
        held0, used0, own0 = meter.reserved(), total - free0, meter.process_used()
        # What the process holds already is its own: all of it where NVML says, else torch's part.
        budget = process_budget(total, free0, own0 if own0 is not None else held0, cfg.gpu_memory_utilization,
                                exact_kv=cfg.kv_cache_memory is not None)
        weights = self._weights()
        lines = [weights, *self._scratch()]
        tables = meter.allocated() - sum(line.bytes for line in lines)
        if tables > MiB:
            lines.append(PlanLine("engine tensors", tables, "rotary tables and other tensors held before the profile"))
        vision, step = self._profile_steps()
        if vision:
            lines.append(PlanLine("vision graphs", vision, "measured: CUDA graphs of the vision stage for "
                                  f"batches up to {cfg.vision_batch_size}"))
        rows = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        tokens = cfg.max_num_batched_tokens
        lines += step_lines(step, prefill_activation_bytes(tokens, lm_shape(r.llama)), tokens,
                            f"measured: a vision batch of {cfg.vision_batch_size}, then two overlapped steps of "
                            f"{tokens} tokens sampling {rows} rows with log-probabilities")
        if r.decode_graphs_enabled:
            probe = KVCache(self.shape, 1, device)
            with STARTUP.phase("decode graphs (sizing)"):
                graphs, held, _ = measure(meter, lambda: self._capture(probe))
            if self._tuning is not None:  # the quantized kernels' choices for the larger batches, made here
                self._tuning.save()
            lines.append(PlanLine("decode graphs", held, f"measured: {len(graphs.sizes)} CUDA graphs of decode "
                                  f"steps (batch sizes up to {graphs.sizes[-1]}) and their inputs"))
            del graphs, probe
        meter.settle()
        lines.append(runtime_line((held0, meter.reserved()), (own0, meter.process_used()), (used0, meter.used()),
                                  RUNTIME_ALLOWANCE))
        lines += self._caches()
        lines.append(PlanLine("headroom", cfg.memory_headroom_bytes, "the caching allocator's fragmentation"))
        # Not allocated while the KV cache is sized: the decode graphs (captured after it) and
        # everything that fills while serving.
        pending = sum(line.bytes for line in lines if line.name not in HELD_WHILE_SIZING and line.torch)
        free_now, _ = meter.free_total()
        plan = plan_kv(budget, lines, self._request(cfg.kv_cache_memory), str(device), total,
                       free_now=free_now, pending=pending)
        return plan

    # ---- the profile's phases -----------------------------------------------------------
    def _profile_steps(self) -> tuple[int, int]:
        """Kernel choices, then (bytes the vision graphs hold, the worst step's peak), all run
        against a scratch KV cache allocated outside every measurement (and freed on return)."""
        meter = self.meter
        assert meter is not None
        scratch = KVCache(self.shape, self.runner.scratch_blocks(), self.device)
        with STARTUP.phase("kernel choices"):
            measure(meter, lambda: self._choose_kernels(scratch))
        with STARTUP.phase("vision graphs"):
            _, vision, _ = measure(meter, self.runner.capture_vision_graphs)
        with STARTUP.phase("worst step"):
            _, _, step = measure(meter, lambda: self._worst_steps(scratch))
        return vision, step

    @torch.inference_mode()
    def _choose_kernels(self, scratch: KVCache) -> None:
        """Every choice made on first use, made now: for each row count the matrix-vector kernel
        may take, one step of that many tokens times it against cuBLAS on every weight shape
        (the timing allocates a cache-flush buffer); sampling kernels load once."""
        cache = TuningCache.for_model(self.device, dict(self.runner.loaded.model.named_parameters())) \
            if tuning_cache.enabled() else None
        self._tuning = cache
        cached = cache.load() if cache is not None else 0
        for rows in range(1, triton_ops.GEMV_MAX_ROWS + 1):
            self._sample(self.runner.dummy_step(scratch, tokens=rows, rows=rows))
        if cache is not None:
            saved = cache.save()
            log.info("kernel choices: %d from the tuning cache%s (%s)", cached,
                     ", the rest timed and saved" if saved else "", cache.path)

    @torch.inference_mode()
    def _worst_steps(self, scratch: KVCache) -> tuple:
        r = self.runner
        with STARTUP.phase("vision batch"):
            vision = r.dummy_vision_batch()
            torch.cuda.synchronize(self.device)  # (the profile runs on CUDA only) its time, not the next phase's
        with STARTUP.phase("two steps"):
            first = r.dummy_step(scratch)
            first_out = self._sample(first)
            second = r.dummy_step(scratch)  # while the first step's outputs are held (step overlap)
            out = vision, first, first_out, second, self._sample(second)
            torch.cuda.synchronize(self.device)
        return out

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """What sampling a step holds: every row penalised, greedy rows, a few drawn with
        temperature and top-p, and every row's log-probabilities (as for requests that asked)."""
        from fovea.engine.sampling.params import SamplingParams, sample_next_on_device

        generator = torch.Generator(device=logits.device).manual_seed(0)
        # Every row penalised, as if all asked for penalties: the gathered counts and the
        # temporaries of ``penalise`` are part of the peak (the result is dropped).
        penalise(logits, torch.ones_like(logits, dtype=torch.int32), torch.ones_like(logits, dtype=torch.bool),
                 torch.tensor(1.1, device=logits.device), torch.tensor(0.5, device=logits.device),
                 torch.tensor(0.5, device=logits.device))
        params = SamplingParams(temperature=0.7, top_p=0.9)
        drawn = [sample_next_on_device(logits[i], params, generator) for i in range(min(SAMPLED_ROWS, len(logits)))]
        return logits.argmax(dim=-1), torch.log_softmax(logits, dim=-1), drawn

    def _capture(self, probe: KVCache):
        graphs = self.runner.build_graphs(cache=probe)
        graphs.capture()
        return graphs

    # ---- holding the process to it --------------------------------------------------------
    def enforce(self, plan: MemoryPlan) -> None:
        """Cap torch's caching allocator at the plan's torch lines (CUDA, measured plans)."""
        meter = self.meter
        if meter is None or plan.total_bytes is None or plan.torch_cap_bytes is None:
            return
        meter.settle()
        held = meter.reserved()
        planned_held = sum(line.bytes for line in plan.lines if line.name in HELD)
        if held > planned_held + RUNTIME_ALLOWANCE:
            note = (f"start-up holds {gib(held)}, {gib(held - planned_held)} more than the plan's lines for it "
                    f"({gib(planned_held)})")
            log.warning("memory plan: %s", note)
            plan.notes.append(note)
        pending = sum(line.bytes for line in plan.lines if line.name not in HELD and line.torch)
        cap = max(plan.torch_cap_bytes, held + pending)
        plan.torch_cap_bytes = cap
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / plan.total_bytes), self.device)
        meter.reset_peak()  # from here on the peak is serving's (/health, the benchmark's check)
        plan.notes.append(f"torch's allocator is capped at {gib(cap)}: an allocation past the plan fails at once, "
                          "and the engine retries the step smaller")
