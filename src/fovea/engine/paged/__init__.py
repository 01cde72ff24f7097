"""The paged engine: continuous batching over a paged KV cache with prefix caching,
chunked prefill, fovea's own Llama forward, a Triton paged-decode kernel and CUDA graphs.

``PagedEngine`` is a drop-in replacement for ``fovea.engine.engine.Engine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fovea.engine.paged.config import PagedEngineConfig
    from fovea.engine.paged.engine import PagedEngine

__all__ = ["PagedEngine", "PagedEngineConfig"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing one module of the package (a kernel, say) does not import the
    # whole engine first.
    if name == "PagedEngine":
        from fovea.engine.paged.engine import PagedEngine

        return PagedEngine
    if name == "PagedEngineConfig":
        from fovea.engine.paged.config import PagedEngineConfig

        return PagedEngineConfig
    raise AttributeError(name)
