"""The index bookkeeping of a batch of images for the Qwen vision towers, from transformers' helpers.

Per image grid (t, h, w) in patches, computed once on the host and kept (``GridLayouts``):
the window order of its merged tokens and its windows' lengths (Qwen2.5-VL), its attention
chunks (one per temporal patch, as transformers' ``cu_seqlens``), its patches' (row, column)
positions for the 2-D rotary, and (Qwen3-VL) the taps and weights that interpolate the learned
position grid. A batch (``BatchLayout``) is its images' layouts one after another, offsets
added: every index stays inside its own image, so per-image pieces compose exactly as
transformers' batched helpers do.

transformers 5.x has module-level helpers (``transformers.vision_utils``); older releases have
methods on the tower (``get_window_index``, ``fast_pos_embed_interpolate``). Both are used
where present; the start-up parity check catches any disagreement.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

# Device bytes of the grids remembered per tower (index tensors: ~40 bytes a patch, so a 1280 x 720
# image's layout is ~0.2 MiB and the largest Qwen image's ~3 MiB); least recently used dropped past it.
MAX_LAYOUT_BYTES = 32 * 1024**2


def _vision_utils():
    try:
        from transformers import vision_utils
    except ImportError:
        return None
    return vision_utils


def positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[t * h * w, 2] (row, column) of each patch, merge blocks one after another (transformers'
    ``get_vision_position_ids`` / ``rot_pos_emb`` order), repeated per temporal patch."""
    t, h, w = grid
    rows = torch.arange(h).unsqueeze(1).expand(h, w)
    cols = torch.arange(w).unsqueeze(0).expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten()
    cols = cols.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def window_index(visual: nn.Module, grid: tuple[int, int, int]) -> tuple[torch.Tensor, list[int]]:
    """(the merged tokens' window order, the windows' lengths in patches) of one image, by
    transformers' own helper (empty windows dropped, as its ``unique_consecutive``)."""
    grid_thw = torch.tensor([grid])
    utils = _vision_utils()
    if utils is not None and hasattr(utils, "get_vision_window_index"):
        order, cu = utils.get_vision_window_index(grid_thw, spatial_merge_size=visual.spatial_merge_size,
                                                  window_size=visual.window_size, patch_size=visual.patch_size)
    else:
        order, cu = visual.get_window_index(grid_thw)
    bounds = torch.unique_consecutive(torch.as_tensor(cu, dtype=torch.long)).tolist()
    return order.to("cpu", torch.long), [b - a for a, b in itertools.pairwise(bounds)]


def interpolation(visual: nn.Module, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Qwen3-VL: (taps [n, k], weights [n, k]) resampling the learned position grid to this image,
    or None where transformers has no such helper (``fast_pos_embed_interpolate`` is then called)."""
    utils = _vision_utils()
    if utils is None or not hasattr(utils, "get_vision_interpolation_indices_and_weights"):
        return None
    return utils.get_vision_interpolation_indices_and_weights(
        torch.tensor([grid]), num_grid_per_side=visual.num_grid_per_side,
        mode=getattr(visual, "interpolation_mode", "bilinear"),
        align_corners=getattr(visual, "interpolation_align_corners", True),
        spatial_merge_size=visual.spatial_merge_size)


@dataclass(frozen=True)
class GridLayout:
    """One image grid's bookkeeping, in the order the blocks see its patches."""

    patches: int
    patch_order: torch.Tensor | None  # [patches] long: pixel row for each position (None: as given)
    merged_order: torch.Tensor | None  # [patches / unit] long: the inverse, over merged tokens
    positions: torch.Tensor  # [patches, 2] long (row, column), in block order
    full_chunks: list[int]  # full-attention chunk lengths (one per temporal patch)
    window_chunks: list[int] | None  # window lengths (Qwen2.5-VL), in block order
    taps: torch.Tensor | None = None  # Qwen3-VL: [patches, k] long, into the learned grid
    weights: torch.Tensor | None = None  # Qwen3-VL: [patches, k] float32

    @property
    def nbytes(self) -> int:
        held = (self.patch_order, self.merged_order, self.positions, self.taps, self.weights)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


def grid_layout(visual: nn.Module, grid: tuple[int, int, int], windows: bool, learned_positions: bool,
                device: torch.device) -> GridLayout:
    merge = int(visual.spatial_merge_size)
    unit = merge * merge
    t, h, w = grid
    patches = t * h * w
    pos = positions(grid, merge)
    patch_order = merged_order = window_chunks = None
    if windows:
        order, window_chunks = window_index(visual, grid)
        patch_order = (order.unsqueeze(1) * unit + torch.arange(unit)).flatten()
        pos = pos[patch_order]
        merged_order = torch.argsort(order)
        patch_order, merged_order = patch_order.to(device), merged_order.to(device)
    taps = weights = None
    if learned_positions:
        found = interpolation(visual, grid)
        if found is not None:
            taps, weights = found[0].to(device), found[1].to(device, torch.float32)
    return GridLayout(patches, patch_order, merged_order, pos.to(device), [h * w] * t, window_chunks, taps, weights)


@dataclass(frozen=True)
class BatchLayout:
    """A batch of images' layouts one after another."""

    grids: list[tuple[int, int, int]]
    patch_order: torch.Tensor | None
    merged_order: torch.Tensor | None
    positions: torch.Tensor
    full_cu: list[int]
    window_cu: list[int] | None
    taps: torch.Tensor | None
    weights: torch.Tensor | None

    @staticmethod
    def of(layouts: list[GridLayout], grids: list[tuple[int, int, int]], unit: int) -> BatchLayout:
        patch_orders, merged_orders, full, window = [], [], [0], [0] if layouts[0].window_chunks is not None else None
        offset = 0
        for layout in layouts:
            if layout.patch_order is not None:
                patch_orders.append(layout.patch_order + offset)
                merged_orders.append(layout.merged_order + offset // unit)
            for length in layout.full_chunks:
                full.append(full[-1] + length)
            if window is not None:
                for length in layout.window_chunks:
                    window.append(window[-1] + length)
            offset += layout.patches
        taps = weights = None
        if layouts[0].taps is not None:
            taps = torch.cat([layout.taps for layout in layouts])
            weights = torch.cat([layout.weights for layout in layouts])
        return BatchLayout(grids, torch.cat(patch_orders) if patch_orders else None,
                           torch.cat(merged_orders) if merged_orders else None,
                           torch.cat([layout.positions for layout in layouts]), full, window, taps, weights)


class GridLayouts:
    """Each grid's layout, computed once (least recently used dropped past ``MAX_LAYOUT_BYTES``)."""

    def __init__(self, visual: nn.Module, windows: bool, learned_positions: bool, device: torch.device) -> None:
        self.visual, self.windows, self.learned, self.device = visual, windows, learned_positions, device
        self.unit = int(visual.spatial_merge_size) ** 2
        self._cache: OrderedDict[tuple[int, int, int], GridLayout] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, grid: tuple[int, int, int]) -> GridLayout:
        grid = tuple(int(g) for g in grid)
        with self._lock:
            layout = self._cache.get(grid)
            if layout is not None:
                self._cache.move_to_end(grid)
                return layout
        layout = grid_layout(self.visual, grid, self.windows, self.learned, self.device)
        with self._lock:
            if grid not in self._cache:
                self._cache[grid] = layout
                self._bytes += layout.nbytes
            while self._bytes > MAX_LAYOUT_BYTES and len(self._cache) > 1:
                self._bytes -= self._cache.popitem(last=False)[1].nbytes
        return layout

    def batch(self, grids: list[tuple[int, int, int]]) -> BatchLayout:
        return BatchLayout.of([self.get(grid) for grid in grids], grids, self.unit)
