"""Server settings, validated once at start-up."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fovea.media.config import MediaConfig

# auto/on/off flags -> the engine's None (decide from device and model) / True / False
SWITCH: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


@dataclass(slots=True)
class ServerSettings:
    model: Path | None = None  # None: the shipped demo model
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    # "auto": the directory's weights (bf16/fp16/fp32, or a quantized format its config names);
    # "dummy": random weights of its shapes and format, made on the device (benchmarks only).
    load_format: str = "auto"
    served_model_name: str | None = None
    # "agg": the vision stage in this process; "e_pd": in encode_workers processes of their
    # own (fovea.disagg: vision weights only, verified hand-off), this one prefills and decodes.
    topology: str = "agg"
    # "process": the engine (model, scheduler, KV cache, vision stage) runs in a process of its
    # own and this one does HTTP, media, templates and tokenisation (fovea.engine.process);
    # "thread": the engine's worker thread runs in this process.
    engine_core: str = "thread"
    # API processes that share the port and feed the one engine core (preprocessing-heavy loads).
    api_server_count: int = 1
    encode_workers: int | None = None  # e_pd; None: 1
    encode_timeout_s: float | None = None  # e_pd: a worker that holds a batch longer is restarted; None: 60 s
    # e_pd: the encode workers' device (e.g. cuda:1 beside a PD worker on cuda:0); None: the PD
    # worker's --device. The hand-off goes through pinned host memory either way (disagg/wire.py).
    encode_device: str | None = None
    # A Ray cluster ("local": start one): e_pd's encode workers as its actors, and with
    # --pd-workers the PD workers (or agg replicas) too, on any node with the resources.
    ray_address: str | None = None
    # What each Ray actor asks for ({"GPU": 1, "fovea_pd": 1}, ...); None: fovea's defaults
    # (ray_resources below).
    ray_pd_resources: dict[str, float] | None = None
    ray_encode_resources: dict[str, float] | None = None
    # e_pd: prefill/decode worker processes; set, this process is only a front that routes HTTP to
    # them and supervises them and the encode workers they share (fovea.front). None: it serves.
    pd_workers: int | None = None
    pd_timeout_s: float | None = None  # --pd-workers: a PD worker silent on /health this long is killed; None: 30 s
    # A PD worker behind a front (internal): the shared encode workers' sockets, and their key.
    encode_addresses: tuple[str, ...] = ()
    encode_authkey: bytes | None = field(default=None, repr=False)
    vision_batch_size: int | None = None  # images per vision forward (e_pd: per encode-worker batch); None: 8
    max_batch_size: int | None = None  # sequences decoded together; None: 256 on a GPU, 16 on CPU
    # Tokens one paged-engine step may compute (prefill chunks + decodes); None: the engine's
    # default (8192 on CUDA, 512 on CPU). Larger: faster bursts, longer gaps between tokens.
    max_batched_tokens: int | None = None
    # Paged engine: queue each step before reading the last one's tokens; run the vision stage
    # through fused kernels. "auto": on a GPU for models of 1 B parameters or more (docs/engine.md).
    step_overlap: str = "auto"
    fused_vision: str = "auto"
    # Memory (paged engine, docs/memory.md): the share of the GPU's total memory this process may
    # hold (None: 0.9), or an exact KV-cache budget in bytes that overrides it; the longest
    # sequence (prompt + answer) served, None: the model's context length.
    gpu_memory_utilization: float | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    # Processes that decode images and run the model's processor (None or 0: this process's
    # threads, measured faster on the H200 machine; serve/preprocess.py, docs/benchmarks.md).
    preprocess_workers: int | None = None
    # Requests waiting for the engine beyond this get 429 before any response starts; None:
    # unbounded, as in vLLM and SGLang (docs/operations.md says what a waiting request holds).
    max_queue: int | None = None
    limit_images_per_prompt: int = 4
    max_body_bytes: int = 32 * 1024 * 1024
    api_key: str | None = None
    media: MediaConfig = field(default_factory=MediaConfig)
    processor_override: dict[str, Any] = field(default_factory=dict)
    force_processor_override: bool = False
    canary: bool = True  # run the grounding canary at start-up (and every canary_interval_s)
    canary_interval_s: float = 600.0  # 0: only at start-up
    strict: bool = False  # refuse to start on a failing canary; /health answers 503 while degraded

    def __post_init__(self) -> None:
        if self.engine_core not in ("thread", "process"):
            raise ValueError(f"--engine-core must be thread or process, not {self.engine_core!r}")
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be at least 1, not {self.api_server_count}")
        if self.api_server_count > 1 and self.engine_core != "process":
            raise ValueError("--api-server-count feeds one engine core from several API processes: it needs "
                             "--engine-core process")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is not between 1 and 65535")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, not {self.load_format!r}")
        if self.load_format == "dummy" and self.topology != "agg":
            raise ValueError("--load-format dummy makes random weights in the engine's process; encode workers "
                             "read theirs from the directory's files: use --topology agg with it")
        if self.topology not in ("agg", "e_pd"):
            raise ValueError(f"--topology must be agg or e_pd, not {self.topology!r}")
        if self.topology == "agg" and (self.encode_workers is not None or self.encode_timeout_s is not None):
            raise ValueError("--encode-workers and --encode-timeout place encode workers: they need --topology e_pd")
        if self.topology == "agg" and self.encode_device is not None:
            raise ValueError("--encode-device places the encode workers: it needs --topology e_pd (in agg the "
                             "vision tower runs on --device with the language model)")
        if self.encode_device is not None and self.ray_address is not None:
            raise ValueError("--encode-device places local encode workers; on Ray the actors' own GPUs serve: "
                             "drop one of the two")
        if self.encode_workers is not None and self.encode_workers < 1:
            raise ValueError("--encode-workers must be at least 1")
        if self.ray_address is not None and self.topology != "e_pd" and self.pd_workers is None:
            raise ValueError("--ray-address places encode workers (--topology e_pd) or replicas (--pd-workers) on "
                             "a Ray cluster: give it one of them")
        for flag, resources, needs in (("--ray-pd-resources", self.ray_pd_resources, self.pd_workers),
                                       ("--ray-encode-resources", self.ray_encode_resources,
                                        self.topology == "e_pd" and self.pd_workers)):
            if resources is None:
                continue
            if self.ray_address is None or not needs:
                raise ValueError(f"{flag} sizes the Ray actors of --ray-address with --pd-workers"
                                 + (" in --topology e_pd" if flag == "--ray-encode-resources" else ""))
            if not resources or not all(isinstance(k, str) and isinstance(v, int | float) and v > 0
                                        for k, v in resources.items()):
                raise ValueError(f"{flag} must be a JSON object of resource names and positive amounts, such as "
                                 '\'{"GPU": 1}\' or \'{"CPU": 1, "fovea_pd": 1}\'')
        if self.pd_timeout_s is not None and self.pd_workers is None:
            raise ValueError("--pd-timeout watches the PD workers of --pd-workers: it needs --pd-workers")
        if self.pd_workers is not None:
            if self.pd_timeout_s is not None and not 0 < self.pd_timeout_s < math.inf:  # nan too
                raise ValueError("--pd-timeout must be a positive number of seconds")
            if self.pd_workers < 1:
                raise ValueError("--pd-workers must be at least 1")
        if self.encode_addresses and (self.topology != "e_pd" or self.ray_address is not None):
            raise ValueError("shared encode workers (a PD worker behind a front) need --topology e_pd without "
                             "--ray-address")
        if self.encode_timeout_s is not None and not 0 < self.encode_timeout_s < math.inf:
            raise ValueError("--encode-timeout must be a positive number of seconds")
        if self.vision_batch_size is not None and self.vision_batch_size < 1:
            raise ValueError("--vision-batch-size must be at least 1")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError("--max-batch-size must be at least 1")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError("--max-queue must be at least 1")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError("--max-batched-tokens must be at least 1")
        for flag, value in (("--step-overlap", self.step_overlap), ("--fused-vision", self.fused_vision)):
            if value not in SWITCH:
                raise ValueError(f"{flag} must be one of auto, on, off, not {value!r}")
        if self.preprocess_workers is not None and self.preprocess_workers < 0:
            raise ValueError("--preprocess-workers must be 0 (threads of this process) or more")
        if self.limit_images_per_prompt < 0:
            raise ValueError("--limit-images-per-prompt must be 0 or more")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be at least 1024")
        if not self.canary_interval_s >= 0:  # nan too
            raise ValueError("--canary-interval must be 0 (start-up only) or a positive number of seconds")
        if self.strict and not self.canary:
            raise ValueError("--strict needs the canary; drop --no-canary")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be above 0 and at most 1, "
                             f"not {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("--kv-cache-memory must be a positive number of bytes")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be at least 1")
        cores = usable_cores()
        local_encoders = self.encode_workers if self.ray_address is None else None  # Ray's actors run elsewhere
        local_replicas = self.pd_workers if self.ray_address is None else None
        for flag, count in (("--encode-workers", local_encoders), ("--pd-workers", local_replicas),
                            ("--preprocess-workers", self.preprocess_workers),
                            ("--api-server-count", self.api_server_count)):
            if count is not None and count > cores:
                raise ValueError(f"{flag} {count} is more than this machine's {cores} CPU cores: each worker is a "
                                 f"process of its own, and more than one a core only makes them wait for each "
                                 f"other; use at most {cores}")


def engine_config(settings: ServerSettings):
    """The paged engine's settings (a ``PagedEngineConfig``) from the server's: the one place where
    server flags become engine settings (``fovea serve``, the CLI's chat and doctor, the demo's
    evaluation). Defaults left as None are resolved by the engine for its device."""
    from fovea.engine.config import VISION_BATCH, PagedEngineConfig

    return PagedEngineConfig(max_num_seqs=settings.max_batch_size,
                             max_queue=settings.max_queue,
                             max_num_batched_tokens=settings.max_batched_tokens,
                             overlap_steps=SWITCH[settings.step_overlap],
                             fused_vision=SWITCH[settings.fused_vision],
                             gpu_memory_utilization=settings.gpu_memory_utilization,
                             kv_cache_memory=settings.kv_cache_memory,
                             max_model_len=settings.max_model_len,
                             vision_batch_size=settings.vision_batch_size or VISION_BATCH)


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ray_resources(requested: dict[str, float] | None, gpu: bool, kind: str) -> dict[str, float]:
    """What a Ray actor of ``kind`` ("pd" or "encode") asks for: as requested, else a whole GPU
    for a PD worker on a GPU (Ray hands it over in CUDA_VISIBLE_DEVICES), a sliver of one for an
    encode worker (its own memory plan sizes what it takes, and it shares the GPU), one CPU on CPU."""
    if requested is not None:
        return dict(requested)
    if not gpu:
        return {"CPU": 1}
    return {"CPU": 1, "GPU": 1} if kind == "pd" else {"CPU": 1, "GPU": 0.01}
