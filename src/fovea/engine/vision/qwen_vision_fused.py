"""A fused, variable-length forward of the Qwen2.5-VL and Qwen3-VL vision towers.

transformers' towers (run by ``Qwen2_5_VLAdapter.vision_forward``) spend most of their time
outside the matrix products: a Conv3d patch embedding, an upcast-and-copy rotary, per-chunk
attention calls, and separate kernels for each norm, residual add and activation. Here a
batch of images of any sizes is one packed sequence of patches, and each block is

    [norm] -> one q/k/v product -> [rotary of q, k; v copied: [3, T, H, D]] -> varlen attention
    -> proj -> [residual add + norm] -> MLP -> [residual add + the next block's norm]

with the MLP ``gate/up as one product -> [silu(gate) * up] -> down`` (Qwen2.5-VL: RMSNorm,
window attention in all blocks but ``fullatt_block_indexes``) or ``fc1 -> [gelu] -> fc2``
(Qwen3-VL: LayerNorm, full attention, a learned position grid interpolated to each image and
added after the patch embedding, DeepStack mergers at ``deepstack_visual_indexes``). The
bracketed steps are one Triton kernel each (``qwen_vision_kernels``; their torch twins off
CUDA); the patch embedding (a Conv3d whose kernel is its stride) is one product over the pixel
rows; the last block's residual add is fused with the merger's norm. Attention runs over
``cu_seqlens`` (windows or whole images, one call per block) without materialising scores
(``varlen_attention``). Qwen2.5-VL's patches are put in window order before the blocks
(gathering the pixel rows) and the merged tokens restored after the merger, as transformers does.

The weights are transformers' own: gate/up are stacked once and the modules' parameters
become views (``fuse_rows``); the patch embedding's weight is viewed as a matrix. The index
bookkeeping (window order, chunks, rotary positions, position-grid taps) comes from
transformers' helpers, once per image grid (``qwen_vision_layout``).

No CUDA graphs: every batch has its own number of patches and chunk layout, so a graph per
shape would be captured for nearly every call; the launches are per block, not per window.

``startup_problem`` compares the stage with the adapter's eager forward on images of several
sizes and aspect ratios packed in one call before the engine trusts it (``vision_stage``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fovea.engine.kernels import triton_util
from fovea.engine.kernels.qwen_vision_kernels import TorchOps, TritonOps
from fovea.engine.model.weights import fuse_rows, pad_columns
from fovea.engine.vision.qwen_vision_layout import GridLayouts
from fovea.engine.vision.varlen_attention import GROUPED, varlen_attention, varlen_backend
from fovea.engine.vision.vision_fused import MODEL_TOLERANCE, relative_error
from fovea.models.base import ImageInput
from fovea.models.qwen_pixels import vision_pixels

log = logging.getLogger("fovea.engine")

QWEN2_5, QWEN3 = "qwen2_5_vit", "qwen3_vit"  # the two towers (the adapters' ``fused_vision``)
MAX_ATTENTION_LAYOUTS = 256  # the grouped backend's index tensors, per chunk layout


def _activation(fn: nn.Module) -> str | None:
    """'silu', 'gelu_tanh' or 'gelu' for transformers' activation modules of those, else None."""
    name = type(fn).__name__
    act = getattr(fn, "act", None)
    if name == "SiLUActivation" or isinstance(fn, nn.SiLU):
        return "silu"
    if isinstance(fn, nn.GELU):
        return {"tanh": "gelu_tanh", "none": "gelu"}.get(fn.approximate)
    if name in ("GELUTanh", "PytorchGELUTanh") and getattr(act, "keywords", {}).get("approximate") == "tanh":
        return "gelu_tanh"
    if name == "GELUActivation" and act is F.gelu:
        return "gelu"
    return None


def _is_rms_norm(module: object) -> bool:
    return "RMSNorm" in type(module).__name__ and hasattr(module, "weight") and hasattr(module, "variance_epsilon")


def _is_layer_norm(module: object) -> bool:
    return isinstance(module, nn.LayerNorm) and module.weight is not None and module.bias is not None


def _patch_problem(visual: nn.Module) -> str | None:
    proj = getattr(getattr(visual, "patch_embed", None), "proj", None)
    if not isinstance(proj, nn.Conv3d) or tuple(proj.kernel_size) != tuple(proj.stride) or any(proj.padding):
        return "the patch embedding is not a Conv3d whose kernel is its stride"
    if not proj.weight.is_contiguous():
        return "the patch embedding's weight is not contiguous"
    return None


def _block_problem(block: nn.Module, kind: str) -> str | None:
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if attn is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("qkv", "proj")):
        return "its attention is not one q/k/v product and a projection"
    if attn.qkv.out_features % (3 * attn.num_heads) or (attn.qkv.out_features // 3 // attn.num_heads) % 2:
        return "its q/k/v width is not 3 x heads x an even head size"
    if attn.training and getattr(attn, "attention_dropout", 0.0):
        return "attention dropout is active (training mode)"
    norm_ok = _is_rms_norm if kind == QWEN2_5 else _is_layer_norm
    if not (norm_ok(block.norm1) and norm_ok(block.norm2)):
        return f"its norms are not {'RMSNorm' if kind == QWEN2_5 else 'affine LayerNorm'}"
    if kind == QWEN2_5:
        if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            return "its MLP is not gate/up/down"
        if _activation(mlp.act_fn) != "silu":
            return f"its MLP activation {type(mlp.act_fn).__name__} is not SiLU"
    else:
        if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("linear_fc1", "linear_fc2")):
            return "its MLP is not fc1/fc2"
        if _activation(mlp.act_fn) not in ("gelu_tanh", "gelu"):
            return f"its MLP activation {type(mlp.act_fn).__name__} is not GELU"
    return None


def _merger_problem(visual: nn.Module, kind: str) -> str | None:
    merger = getattr(visual, "merger", None)
    if kind == QWEN2_5:
        if merger is None or not _is_rms_norm(getattr(merger, "ln_q", None)) or not hasattr(merger, "mlp"):
            return "the merger is not RMSNorm then an MLP"
    elif merger is None or getattr(merger, "use_postshuffle_norm", True) or not _is_layer_norm(
            getattr(merger, "norm", None)) or not all(hasattr(merger, n) for n in ("linear_fc1", "act_fn",
                                                                                  "linear_fc2")):
        return "the merger is not LayerNorm then fc1 -> activation -> fc2"
    return None


def supports(visual: nn.Module, kind: str) -> str | None:
    """None if ``QwenFusedVision`` can run this tower as ``kind``, else why not."""
    if kind not in (QWEN2_5, QWEN3):
        return f"unknown Qwen tower kind {kind!r}"
    needed = ("blocks", "spatial_merge_size", "rotary_pos_emb") + (
        ("fullatt_block_indexes", "window_size", "patch_size") if kind == QWEN2_5 else
        ("pos_embed", "deepstack_visual_indexes", "deepstack_merger_list"))
    missing = [name for name in needed if not hasattr(visual, name)]
    if missing:
        return f"{type(visual).__name__} has no {', '.join(missing)}"
    if not isinstance(getattr(visual.rotary_pos_emb, "inv_freq", None), torch.Tensor):
        return "its rotary embedding has no inv_freq"
    if kind == QWEN3 and not hasattr(visual, "num_grid_per_side") and not hasattr(visual, "fast_pos_embed_interpolate"):
        return "its learned position grid has no interpolation this stage knows"
    dtypes = {p.dtype for p in visual.parameters()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in MODEL_TOLERANCE:
        return f"tower parameters in {sorted(map(str, dtypes))}, not one of float32/bfloat16/float16"
    problem = _patch_problem(visual) or _merger_problem(visual, kind)
    if problem:
        return problem
    for index, block in enumerate(visual.blocks):
        problem = _block_problem(block, kind)
        if problem:
            return f"vision block {index}: {problem}"
    return None


@dataclass(frozen=True)
class Block:
    """One block's tensors (transformers' parameters; gate_up is the fused view owner)."""

    norm1: tuple[torch.Tensor, torch.Tensor | None, float]
    norm2: tuple[torch.Tensor, torch.Tensor | None, float]
    qkv: nn.Linear
    proj: nn.Linear
    fc1_weight: torch.Tensor  # Qwen2.5-VL: gate and up stacked by rows; Qwen3-VL: linear_fc1
    fc1_bias: torch.Tensor | None
    fc2: nn.Linear
    fc2_weight: torch.Tensor  # fc2's weight, with zero columns where fc1 has padding rows
    act: str
    heads: int
    scale: float
    full: bool  # attends over whole images (else over windows)

    @classmethod
    def of(cls, block: nn.Module, kind: str, full: bool) -> Block:
        attn, mlp = block.attn, block.mlp
        head_dim = attn.qkv.out_features // 3 // attn.num_heads
        scale = float(getattr(attn, "scaling", None) or head_dim ** -0.5)
        first = [mlp.gate_proj, mlp.up_proj] if kind == QWEN2_5 else [mlp.linear_fc1]
        fc2 = mlp.down_proj if kind == QWEN2_5 else mlp.linear_fc2
        multiple = mlp_width_multiple(fc2.in_features)
        return cls(_norm(block.norm1), _norm(block.norm2), attn.qkv, attn.proj,
                   fuse_rows(first, "weight", multiple), fuse_rows(first, "bias", multiple), fc2,
                   pad_columns(fc2, multiple), _activation(mlp.act_fn) or "", attn.num_heads, scale, full)


def mlp_width_multiple(width: int) -> int:
    """What the MLP's hidden width is padded to. Qwen2.5-VL's 3,420 makes rows of 6,840 bytes, not a
    multiple of 16, and cuBLAS then runs the down product with an sm80 kernel at a quarter of the
    H200's rate (1.58 of the 3.9 ms of products per block on a batch of 8 1280x720 images,
    profiled). Zero rows in
    gate/up and zero columns in down change no value."""
    return 1 if width % 8 == 0 else 128


def _norm(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    if isinstance(module, nn.LayerNorm):
        return module.weight, module.bias, float(module.eps)
    return module.weight, None, float(module.variance_epsilon)


def choose_ops(device: torch.device, kernels: bool | None = None) -> type[TritonOps | TorchOps]:
    """Triton kernels on CUDA where triton imports (``kernels``: force either), else torch ops."""
    if kernels is None:
        kernels = device.type == "cuda" and triton_util.available()
    return TritonOps if kernels else TorchOps


class QwenFusedVision:
    """The adapter's eager vision forward (``vision_forward(loaded)``) fused: images (pixels on the
    model's device, any grids) -> each image's rows in the model dtype, as the adapter returns them.

    ``kind``: ``QWEN2_5`` or ``QWEN3`` (the adapter's ``fused_vision``; read from it when None).
    ``kernels``: Triton kernels (True), torch ops (False), or Triton exactly where it runs (None).
    Building one re-points each block's gate/up parameters at slices of one stacked tensor
    (values unchanged; transformers' own forward keeps working on them)."""

    def __init__(self, loaded, kind: str | None = None, kernels: bool | None = None) -> None:
        kind = kind or loaded.adapter.fused_vision
        visual = loaded.adapter.vision_modules(loaded.model)[0]
        problem = supports(visual, kind)
        if problem:
            raise ValueError(f"the fused Qwen vision stage cannot run this tower: {problem}")
        self.loaded, self.visual, self.kind = loaded, visual, kind
        self.device = next(visual.parameters()).device
        self.dtype = next(visual.parameters()).dtype
        self.out_dtype = loaded.dtype
        self.ops = choose_ops(self.device, kernels)
        full = set(visual.fullatt_block_indexes) if kind == QWEN2_5 else set(range(len(visual.blocks)))
        self.blocks = [Block.of(block, kind, index in full) for index, block in enumerate(visual.blocks)]
        proj = visual.patch_embed.proj
        self.patch_weight = proj.weight.view(proj.out_channels, -1)  # a view: the Conv3d's own tensor
        self.patch_bias = proj.bias
        self.merge_unit = int(visual.spatial_merge_size) ** 2
        self.merger_norm = _norm(visual.merger.ln_q if kind == QWEN2_5 else visual.merger.norm)
        self.deepstack = {int(layer): visual.deepstack_merger_list[i]
                          for i, layer in enumerate(visual.deepstack_visual_indexes)} if kind == QWEN3 else {}
        rotary = visual.rotary_pos_emb
        self.inv_freq = rotary.inv_freq.detach().to(self.device, torch.float32)
        self.rotary_scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
        heads = self.blocks[0].heads
        self.head_dim = self.blocks[0].qkv.out_features // 3 // heads
        self.attention = varlen_backend(self.device, self.dtype, self.head_dim)
        self.layouts = GridLayouts(visual, windows=kind == QWEN2_5, learned_positions=kind == QWEN3,
                                   device=self.device)
        self._attention_groups: dict = {}
        self._lock = threading.Lock()

    @property
    def label(self) -> str:
        return f"fused ({self.ops.name}, {self.attention} attention)"

    # ---- pieces ---------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, norm: tuple) -> torch.Tensor:
        weight, bias, eps = norm
        return self.ops.rms_norm(x, weight, eps) if bias is None else self.ops.layer_norm(x, weight, bias, eps)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        weight, bias, eps = norm
        if bias is None:
            return self.ops.add_rms_norm(x, residual, weight, eps)
        return self.ops.add_layer_norm(x, residual, weight, bias, eps)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D] cos and sin in float32: transformers' 2-D rotary (row frequencies, then column
        frequencies, the pair twice)."""
        freqs = (positions.unsqueeze(-1).float() * self.inv_freq).flatten(1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rotary_scale != 1.0:
            cos, sin = cos * self.rotary_scale, sin * self.rotary_scale
        return cos, sin

    def _position_grid(self, layout, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Qwen3-VL: the learned position embedding of each patch, interpolated to its image."""
        table = self.visual.pos_embed.weight
        if layout.taps is None:  # transformers before vision_utils: its own method, per image
            return torch.cat([self.visual.fast_pos_embed_interpolate(torch.tensor([grid], device=self.device))
                              for grid in grids]).to(self.dtype)
        acc = torch.zeros((layout.taps.shape[0], table.shape[1]), dtype=torch.float32, device=self.device)
        for tap in range(layout.taps.shape[1]):  # sum of weight x row, in float32, rounded once
            acc += F.embedding(layout.taps[:, tap], table).float() * layout.weights[:, tap, None]
        return acc.to(self.dtype)

    def _attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block: Block,
                cu: tuple[torch.Tensor, list[int], int]) -> torch.Tensor:
        q, k, v = self.ops.rotary(qkv, cos, sin, block.heads).unbind(0)
        cu_device, cu_host, max_len = cu
        cache = self._attention_groups if self.attention == GROUPED else None
        out = varlen_attention(q, k, v, cu_device, cu_host, max_len, block.scale, self.attention, cache)
        return out.reshape(qkv.shape[0], -1)

    def _mlp(self, x: torch.Tensor, block: Block) -> torch.Tensor:
        hidden = F.linear(x, block.fc1_weight, block.fc1_bias)
        if block.act == "silu":
            hidden = self.ops.silu_and_mul(hidden)
        elif block.act == "gelu_tanh":
            hidden = self.ops.gelu_tanh(hidden)
        else:
            hidden = self.ops.gelu(hidden)
        return F.linear(hidden, block.fc2_weight, block.fc2.bias)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        """The merger after its norm (``x``: the normed rows)."""
        merger = self.visual.merger
        x = x.view(-1, merger.hidden_size)
        if self.kind == QWEN2_5:
            return merger.mlp(x)
        return merger.linear_fc2(merger.act_fn(merger.linear_fc1(x)))

    def _chunks(self, bounds: list[int]) -> tuple[torch.Tensor, list[int], int]:
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        return torch.tensor(bounds, dtype=torch.int32, device=self.device), bounds, max(lengths)

    # ---- the forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's [num_tokens, lm_hidden] rows (Qwen3-VL: [num_tokens, (1 + levels) * lm_hidden])."""
        grids = [tuple(int(g) for g in image.grid) for image in images]
        layout = self.layouts.batch(grids)
        # Resized images become the processor's patches here, on the device (models.qwen_pixels).
        pixels = vision_pixels(images, lambda: self.loaded.adapter.patch_recipe(self.loaded), self.device, self.dtype)
        if layout.patch_order is not None:
            pixels = pixels[layout.patch_order]
        h = F.linear(pixels, self.patch_weight, self.patch_bias)
        if self.kind == QWEN3:
            h += self._position_grid(layout, grids)
        cos, sin = self._rotary(layout.positions)
        full = self._chunks(layout.full_cu)
        windows = self._chunks(layout.window_cu) if layout.window_cu is not None else full
        with self._lock:  # the grouped backend's layout cache
            if len(self._attention_groups) > MAX_ATTENTION_LAYOUTS:
                self._attention_groups.clear()
        levels = []
        x = self._norm(h, self.blocks[0].norm1)
        for index, block in enumerate(self.blocks):
            attended = self._attend(F.linear(x, block.qkv.weight, block.qkv.bias), cos, sin, block,
                                    full if block.full else windows)
            h, x = self._add_norm(F.linear(attended, block.proj.weight, block.proj.bias), h, block.norm2)
            out = self._mlp(x, block)
            following = self.blocks[index + 1].norm1 if index + 1 < len(self.blocks) else self.merger_norm
            h, x = self._add_norm(out, h, following)
            if index in self.deepstack:
                levels.append(self.deepstack[index](h))
        merged = self._merge(x)
        if layout.merged_order is not None:
            merged = merged[layout.merged_order]
        rows = torch.cat([merged, *levels], dim=-1) if levels else merged
        return list(rows.to(self.out_dtype).split([image.num_tokens for image in images]))


# ---- start-up check ------------------------------------------------------------------------------

def sample_images(loaded, seed: int = 0) -> list[ImageInput]:
    """Three random images packed in one call: a square, a wide and a tall one (two temporal
    patches, as a video's), each spanning full and partial windows, sized from the tower's
    own patch, merge and window sizes."""
    vision = loaded.model.config.vision_config
    patch, merge = int(vision.patch_size), int(vision.spatial_merge_size)
    temporal, channels = int(getattr(vision, "temporal_patch_size", 2)), int(getattr(vision, "in_channels", 3))
    window = getattr(vision, "window_size", None)
    units = max(1, int(window) // merge // patch) if window else 4  # merged tokens per window side
    shapes = [(1, 2 * units + 1, 2 * units + 1), (1, units, 3 * units + 1), (2, 3 * units - 1, units + 1)]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for index, (t, rows, cols) in enumerate(shapes):
        grid = (t, rows * merge, cols * merge)
        patches = t * rows * cols * merge * merge
        pixels = torch.randn((patches, channels * temporal * patch * patch), generator=gen)
        out.append(ImageInput(pixels.to(loaded.device, loaded.dtype), patches // (merge * merge), f"check-{index}",
                              grid))
    return out


def startup_problem(loaded, fused: QwenFusedVision) -> str | None:
    """The sample images through the fused stage and through the adapter's eager forward: None if
    every image's rows agree within the dtype's tolerance, else what went wrong."""
    try:
        images = sample_images(loaded)
        got, ref = fused(images), loaded.adapter.vision_forward(loaded)(images)
    except Exception as exc:  # noqa: BLE001 - any failure means: encode eagerly
        return f"fused vision stage failed: {type(exc).__name__}: {exc}"
    tol = MODEL_TOLERANCE[fused.dtype]
    for index, (a, b) in enumerate(zip(got, ref, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return (f"fused vision stage gave image {index} {tuple(a.shape)} {a.dtype} on {a.device}, "
                    f"transformers' {tuple(b.shape)} {b.dtype} on {b.device}")
        err = relative_error(a, b)
        if not err <= tol:  # NaN fails too
            return (f"fused vision stage differs from transformers' modules on image {index} "
                    f"(grid {images[index].grid}): relative error {err:.2e} > {tol:.0e}")
    return None
