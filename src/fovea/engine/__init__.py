"""The engine: continuous batching over a paged KV cache with prefix caching, chunked prefill,
fovea's own Llama forward, Triton kernels and CUDA graphs. ``PagedEngine`` (``engine``) with
its ``PagedEngineConfig`` (``config``) is the one engine every model runs on.

- ``core``: requests and their events, sequences, the scheduler and the block manager;
- ``runner``: the model runner (one step's forward), decode CUDA graphs, pending decode inputs
  and the kernels' start-up self-check;
- ``model``: fovea's forward of the language model, its attention backends and KV cache;
- ``sampling``: sampling parameters, the batched on-device sampler, logits processors,
  logprobs and prompt scores;
- ``vision``: the vision stage (encoder, encoder cache, embeddings, graphs, fused stages);
- ``kernels``: every Triton kernel; a kernel module imports no engine object;
- ``memory``: the memory plan, its planner and profile, the tuning cache;
- ``structured``: structured outputs (grammars, matchers, token masks);
- ``reference``: transformers' own forward, what tests, benchmarks and doctor compare against;
- ``transfer``: a step's small inputs to the device in one pinned, asynchronous copy (imports
  only torch, so every package above may use it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fovea.engine.config import PagedEngineConfig
    from fovea.engine.engine import PagedEngine

__all__ = ["PagedEngine", "PagedEngineConfig"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing one module of the package (a kernel, say) does not import the
    # whole engine first.
    if name == "PagedEngine":
        from fovea.engine.engine import PagedEngine

        return PagedEngine
    if name == "PagedEngineConfig":
        from fovea.engine.config import PagedEngineConfig

        return PagedEngineConfig
    raise AttributeError(name)
