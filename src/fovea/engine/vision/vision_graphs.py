"""CUDA graphs of the vision stage (tower + projector) for a ladder of batch sizes.

Eagerly, one image through a CLIP ViT-L tower is hundreds of small launches from Python:
on an H200 that took about 25 ms for 1.5 ms of GPU work, most of a request's time to first
token. Image sizes are fixed by the processor, so the whole stage replays as one graph per
batch size; a batch of n images runs in the smallest captured size >= n (the padding rows
compute on stale pixels and are dropped). What is captured is ``encode`` (default:
``encode_images``; the engine may pass the fused stage of ``vision_fused``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from fovea.engine.runner.cuda_graphs import bucket_for, capture_sizes
from fovea.loading.loader import LoadedModel
from fovea.models.clip_vision import encode_images, vision_modules

log = logging.getLogger("fovea.engine")


class GraphedVision:
    def __init__(self, loaded: LoadedModel, max_batch: int,
                 encode: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        vision = loaded.model.config.vision_config
        size = getattr(vision, "image_size", None)
        if not size:
            raise ValueError("the vision config has no fixed image_size")
        tower, _ = vision_modules(loaded)
        dtype = next(tower.parameters()).dtype
        self.loaded = loaded
        self.encode = encode if encode is not None else functools.partial(encode_images, loaded)
        self.sizes = capture_sizes(max_batch, max_batch)
        self.input_shape = (getattr(vision, "num_channels", 3), size, size)
        self.pixels = torch.zeros((self.sizes[-1], *self.input_shape), dtype=dtype, device=loaded.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replayed = 0

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            inputs = self.pixels[:size]
            self.encode(inputs)  # warm-up outside the capture
            torch.cuda.synchronize(self.loaded.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.encode(inputs)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.loaded.device)
        log.info("captured CUDA graphs of the vision stage for batch sizes %s", self.sizes)

    def can_run(self, pixels: torch.Tensor) -> bool:
        return tuple(pixels.shape[1:]) == self.input_shape and bucket_for(pixels.shape[0], self.sizes) is not None

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, C, H, W] -> [n, tokens_per_image, hidden], a fresh tensor (the graph's output
        buffer is reused by the next replay)."""
        n = pixels.shape[0]
        size = bucket_for(n, self.sizes)
        assert size is not None and self.can_run(pixels)
        self.pixels[:n].copy_(pixels)
        graph, out = self.graphs[size]
        graph.replay()
        self.replayed += 1
        return out[:n].clone()


def try_graphed_vision(loaded: LoadedModel, max_batch: int,
                       encode: Callable[[torch.Tensor], torch.Tensor] | None = None) -> GraphedVision | None:
    """Captured graphs of ``encode`` (default ``encode_images``), or None (with the reason
    logged) where capture is not possible."""
    try:
        graphs = GraphedVision(loaded, max_batch, encode)
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - any failure means: encode eagerly
        log.warning("vision stage runs eagerly: CUDA-graph capture failed (%s: %s)", type(exc).__name__, exc)
        torch.cuda.synchronize(loaded.device)
        return None
    return graphs
