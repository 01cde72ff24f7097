"""Knobs of the paged engine, with device-dependent defaults resolved once at start-up."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fovea.errors import FoveaError

MiB = 1024 * 1024
# Below this size a model's steps are shorter than the host's work per step, and the step
# overlap and the fused vision stage cost more than they save: on an H200 the 5 M-parameter
# demo model served 16 closed-loop clients at 520 requests/s with neither, 330 with both,
# while LLaVA-7B gained about 25% in throughput and 22% in vision speed (docs/benchmarks.md).
GPU_MODEL_MIN_PARAMETERS = 1_000_000_000


class SettingsError(FoveaError):
    """Settings that cannot work with this model or device: refused at start-up."""

    status, code, type = 500, "invalid_settings", "server_error"


VISION_BATCH = 8  # images per vision forward unless configured


@dataclass(slots=True)
class PagedEngineConfig:
    block_size: int = 16
    # Tokens one step may compute (decodes + prefill chunks). None: 8192 on CUDA (on the H200 a
    # 256-request LLaVA-7B burst ran at 3,250 tokens/s with 8192 against 2,470 with 2048), 512 on CPU.
    max_num_batched_tokens: int | None = None
    # Sequences in the running batch at once. None: 256 on CUDA, 16 on CPU.
    max_num_seqs: int | None = None
    max_queue: int | None = None  # requests waiting beyond this are refused with 429; None: unbounded
    max_model_len: int | None = None  # None: the model's context length
    # The memory plan (memory/planner.py). CUDA: the share of the device this process may hold
    # (None: 0.9), at most what is free. kv_cache_memory: the KV cache's exact size in bytes,
    # instead of what that share leaves (CPU: the KV budget, None: 256 MiB).
    gpu_memory_utilization: float | None = None
    kv_cache_memory: int | None = None
    num_blocks: int | None = None  # a fixed block count (tests, experiments): skips sizing
    memory_headroom_bytes: int = 512 * MiB  # planned for the caching allocator's fragmentation (CUDA)
    enable_prefix_caching: bool = True
    cuda_graphs: bool | None = None  # None: on when the device is CUDA (needs the Triton decode)
    max_graph_batch: int = 256
    triton_decode: bool | None = None  # None: on CUDA when triton imports and passes a self-check
    # Fused q/k/v and gate/up products and Triton norm/rotary/activation kernels (CUDA, with
    # the Triton decode). None or True: on wherever the Triton decode is; False: off.
    fused_kernels: bool | None = None
    # The vision stage's fused kernels (engine/vision/vision_fused.py), checked against transformers'
    # modules at start-up. None: with fused_kernels, for models of at least
    # GPU_MODEL_MIN_PARAMETERS; False: transformers' modules.
    fused_vision: bool | None = None
    # Queue each step before the previous step's tokens are read back, so the host's work
    # (scheduling, input building, emitting) overlaps the GPU's. None: on CUDA for models of
    # at least GPU_MODEL_MIN_PARAMETERS (see there).
    overlap_steps: bool | None = None
    vision_batch_size: int = VISION_BATCH  # images per vision-tower call: bounds the encoder's activation peak
    cpu_threads: int | None = None  # as EngineConfig.cpu_threads: all cores but one by default
    encoder_cache_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        if self.block_size < 1 or (self.max_queue or 1) < 1 or self.vision_batch_size < 1:
            raise ValueError("block_size, max_queue and vision_batch_size must be positive")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be above 0 and at most 1")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive")

    def resolved(self, device: torch.device, context_length: int, parameters: int = 0) -> PagedEngineConfig:
        """A copy with every None default filled in for this device and model (``parameters``:
        the model's parameter count)."""
        cuda = device.type == "cuda"
        large = cuda and parameters >= GPU_MODEL_MIN_PARAMETERS
        tokens = self.max_num_batched_tokens or (8192 if cuda else 512)
        # A decode takes one token of the step budget, so more sequences than tokens cannot run.
        seqs = min(self.max_num_seqs or (256 if cuda else 16), tokens)
        if self.max_model_len is not None and self.max_model_len > context_length:
            raise SettingsError(f"--max-model-len {self.max_model_len} is longer than the model's context of "
                                f"{context_length} tokens (max_position_embeddings); lower it")
        model_len = self.max_model_len or context_length
        triton_decode = cuda if self.triton_decode is None else (self.triton_decode and cuda)
        graphs = cuda if self.cuda_graphs is None else (self.cuda_graphs and cuda)
        overlap = large if self.overlap_steps is None else self.overlap_steps
        fused_vision = large if self.fused_vision is None else self.fused_vision
        return dataclasses.replace(self, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                                   max_model_len=model_len, triton_decode=triton_decode, cuda_graphs=graphs,
                                   overlap_steps=overlap, fused_vision=fused_vision)
