"""A fused forward of the vision stage (CLIP-style tower up to the feature layer + projector).

``fovea.models.clip_vision.encode_images`` runs transformers' CLIP modules layer by layer. On an
H200 at batch 32 (LLaVA-1.5-7B, ViT-L/14 at 336 px) half of its time goes to memory-bound
elementwise work outside the matrix products: quick_gelu is three kernels over a
[tokens, 4096] tensor, each residual add and LayerNorm is its own kernel, and q/k/v are
three products. Here each layer is

    LayerNorm -> one q/k/v product -> SDPA -> out_proj -> [residual add + LayerNorm]
    -> fc1 -> [activation] -> fc2 -> [residual add + next layer's LayerNorm]

where the bracketed steps are one Triton kernel each (``fovea.engine.kernels.vision_kernels``), and the matrix products are cuBLAS's
(with their bias in the epilogue). The weights are transformers' own: q/k/v are stacked once
into one tensor and the modules' parameters become views of it (``fuse_rows``), so nothing is
duplicated and transformers' forward still works. The feature selection and the projector
are the ones ``encode_images`` uses.

The kernels round where the eager ops round (each eager op's result in the model dtype), so
the two paths differ only by summation order in the products. ``startup_problem`` compares
them on the loaded model before the engine trusts this path; ``choose_vision_encoder`` picks
one. triton is imported lazily. Check against torch and time on a GPU:

    python3 bench/kernels_check.py --kernel vision --check [--bench]
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fovea.engine.kernels import triton_util
from fovea.engine.kernels.vision_kernels import GELU, QUICK_GELU, activation, add_layer_norm, layer_norm
from fovea.engine.model.weights import fuse_rows
from fovea.loading.loader import LoadedModel
from fovea.models.clip_vision import encode_images, select_features, vision_modules

log = logging.getLogger("fovea.engine")

ATTENTION_TYPES = {"CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2"}  # 4.x had one per backend
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Relative (Frobenius) error allowed between the fused stage and encode_images: the two paths
# round alike, but products summed in another order shift a half-precision result by an ulp
# here and there, and that compounds over 20-odd layers.
MODEL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}


# ---- what the fused path can run -------------------------------------------------------------

def activation_kind(fn: nn.Module) -> int | None:
    """QUICK_GELU or GELU for transformers' modules of those activations, else None."""
    name = type(fn).__name__
    if name == "QuickGELUActivation":
        return QUICK_GELU
    if name == "GELUActivation" and getattr(fn, "act", None) is F.gelu:
        return GELU
    if isinstance(fn, nn.GELU) and fn.approximate == "none":
        return GELU
    return None


def hidden_indices(tower: nn.Module, layer: int | list[int]) -> list[int]:
    """The feature layers as indices into transformers' hidden_states (0: the embeddings)."""
    total = len(tower.encoder.layers) + 1
    wanted = [layer] if isinstance(layer, int) else list(layer)
    indices = [i if i >= 0 else total + i for i in wanted]
    if not indices or any(not 0 <= i < total for i in indices):
        raise ValueError(f"vision_feature_layer {layer!r} is outside the tower's {total} hidden states")
    return indices


def _is_layer_norm(module: object) -> bool:
    return isinstance(module, nn.LayerNorm) and module.weight is not None and module.bias is not None and len(
        module.normalized_shape) == 1


def _layer_problem(block: nn.Module) -> str | None:
    if type(block).__name__ != "CLIPEncoderLayer":
        return f"{type(block).__name__} is not a CLIP encoder layer"
    attn, mlp = block.self_attn, block.mlp
    if type(attn).__name__ not in ATTENTION_TYPES:
        return f"attention module {type(attn).__name__} is not CLIP's"
    if not all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "out_proj")):
        return "q/k/v/out projections are not nn.Linear"
    if attn.num_heads * attn.head_dim != attn.q_proj.out_features:
        return "heads * head_dim differs from the attention width"
    if attn.training and attn.dropout:
        return "attention dropout is active (training mode)"
    if not (_is_layer_norm(block.layer_norm1) and _is_layer_norm(block.layer_norm2)):
        return "its norms are not affine LayerNorms"
    if type(mlp).__name__ != "CLIPMLP" or not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("fc1", "fc2")):
        return f"MLP {type(mlp).__name__} is not CLIP's fc1 -> activation -> fc2"
    if activation_kind(mlp.activation_fn) is None:
        return f"activation {type(mlp.activation_fn).__name__} is not quick_gelu or exact GELU"
    return None


def supports(loaded: LoadedModel) -> str | None:
    """None if ``FusedVision`` can run this model's vision stage, else why not."""
    tower, _ = vision_modules(loaded)
    config = loaded.model.config
    if not all(hasattr(tower, name) for name in ("embeddings", "pre_layrnorm", "encoder")) or not hasattr(
            tower.encoder, "layers"):
        return f"{type(tower).__name__} is not a CLIP-style tower (embeddings, pre_layrnorm, encoder layers)"
    strategy = config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        return f"vision_feature_select_strategy {strategy!r} is not 'default' or 'full'"
    try:
        indices = hidden_indices(tower, config.vision_feature_layer)
    except ValueError as exc:
        return str(exc)
    if not _is_layer_norm(tower.pre_layrnorm):
        return "pre_layrnorm is not an affine LayerNorm"
    dtypes = {p.dtype for p in tower.parameters()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in MODEL_TOLERANCE:
        return f"tower parameters in {sorted(map(str, dtypes))}, not one of float32/bfloat16/float16"
    for index, block in enumerate(tower.encoder.layers[:max(indices)]):
        problem = _layer_problem(block)
        if problem:
            return f"vision layer {index}: {problem}"
    return None


# ---- the fused forward --------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerWeights:
    """One CLIP layer's tensors (transformers' parameters; qkv is the fused view owner)."""

    ln1: tuple[torch.Tensor, torch.Tensor, float]
    ln2: tuple[torch.Tensor, torch.Tensor, float]
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: nn.Linear
    fc1: nn.Linear
    fc2: nn.Linear
    heads: int
    head_dim: int
    scale: float
    act: int

    @classmethod
    def of(cls, block: nn.Module) -> LayerWeights:
        attn = block.self_attn
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        kind = activation_kind(block.mlp.activation_fn)
        assert kind is not None
        return cls(_norm(block.layer_norm1), _norm(block.layer_norm2), fuse_rows(projections, "weight"),
                   fuse_rows(projections, "bias"), attn.out_proj, block.mlp.fc1, block.mlp.fc2, attn.num_heads,
                   attn.head_dim, float(attn.scale), kind)


def _norm(module: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor, float]:
    return module.weight, module.bias, float(module.eps)


def attention(qkv: torch.Tensor, images: int, tokens: int, w: LayerWeights) -> torch.Tensor:
    """[images * tokens, 3C] fused q/k/v -> [images * tokens, C], bidirectional (no mask)."""
    q, k, v = qkv.view(images, tokens, 3, w.heads, w.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, scale=w.scale)
    return out.transpose(1, 2).reshape(images * tokens, w.heads * w.head_dim)


class FusedVision:
    """``encode_images(loaded, pixels)`` with fused kernels: same shape, dtype and device.

    Building one re-points each run layer's q/k/v parameters at slices of one stacked tensor
    (values unchanged; transformers' own forward keeps working on them)."""

    def __init__(self, loaded: LoadedModel) -> None:
        problem = supports(loaded)
        if problem:
            raise ValueError(f"the fused vision stage cannot run this model: {problem}")
        tower, projector = vision_modules(loaded)
        config = loaded.model.config
        self.loaded = loaded
        self.tower = tower
        self.projector = projector
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        self.indices = hidden_indices(tower, self.feature_layer)
        self.dtype = next(tower.parameters()).dtype
        self.projector_dtype = next(projector.parameters()).dtype
        self.pre_norm = _norm(tower.pre_layrnorm)
        self.layers = [LayerWeights.of(block) for block in tower.encoder.layers[:max(self.indices)]]

    def hidden_states(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states ``tower_hidden_states`` returns, for the feature layers only."""
        embedded = self.tower.embeddings(pixels)
        images, tokens, width = embedded.shape
        h = layer_norm(embedded.reshape(images * tokens, width), *self.pre_norm)
        kept = {0: h} if 0 in self.indices else {}
        x = layer_norm(h, *self.layers[0].ln1) if self.layers else h
        for index, w in enumerate(self.layers):
            attended = attention(F.linear(x, w.qkv, w.qkv_bias), images, tokens, w)
            h, x = add_layer_norm(F.linear(attended, w.out.weight, w.out.bias), h, *w.ln2)
            hidden = F.linear(x, w.fc1.weight, w.fc1.bias)
            hidden = activation(hidden, w.act, out=hidden)
            mlp_out = F.linear(hidden, w.fc2.weight, w.fc2.bias)
            if index + 1 < len(self.layers):
                h, x = add_layer_norm(mlp_out, h, *self.layers[index + 1].ln1)
            else:
                h = h + mlp_out
            if index + 1 in self.indices:
                kept[index + 1] = h
        return [kept[i].view(images, tokens, width) for i in self.indices]

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] pixels -> [n, tokens_per_image, lm_hidden] embeddings in the LM's dtype."""
        states = self.hidden_states(pixels.to(device=self.loaded.device, dtype=self.dtype))
        positions = list(range(len(states))) if isinstance(self.feature_layer, list) else 0
        features = select_features(states, positions, self.strategy)
        return self.projector(features.to(self.projector_dtype)).to(self.loaded.dtype)


# ---- start-up check and choice -----------------------------------------------------------------

def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (Frobenius, in float32); NaN or inf if either is not finite."""
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def sample_pixels(loaded: LoadedModel, images: int, seed: int = 0) -> torch.Tensor:
    """Normalised-looking random pixels of the size the tower takes."""
    vision = loaded.model.config.vision_config
    size, channels = vision.image_size, getattr(vision, "num_channels", 3)
    pixels = torch.randn(images, channels, size, size, generator=torch.Generator().manual_seed(seed))
    return pixels.to(loaded.device, loaded.dtype)


def startup_problem(loaded: LoadedModel, fused: FusedVision | None = None) -> str | None:
    """Two images through the fused path and through ``encode_images``: None if they agree
    within the dtype's tolerance, else what went wrong (the engine then encodes eagerly)."""
    problem = supports(loaded)
    if problem:
        return problem
    try:
        fused = fused or FusedVision(loaded)
        pixels = sample_pixels(loaded, 2)
        got, ref = fused(pixels), encode_images(loaded, pixels)
    except Exception as exc:  # noqa: BLE001 - any failure means: encode eagerly
        return f"fused vision stage failed: {type(exc).__name__}: {exc}"
    if got.shape != ref.shape or got.dtype != ref.dtype or got.device != ref.device:
        return (f"fused vision stage gave {tuple(got.shape)} {got.dtype} on {got.device}, transformers' "
                f"{tuple(ref.shape)} {ref.dtype} on {ref.device}")
    err, tol = relative_error(got, ref), MODEL_TOLERANCE[fused.dtype]
    if not err <= tol:  # NaN fails too
        return f"fused vision stage differs from transformers' modules: relative error {err:.2e} > {tol:.0e}"
    return None


def platform_problem(loaded: LoadedModel) -> str | None:
    """Why the fused kernels cannot run on this machine at all (None: they can)."""
    if loaded.device.type != "cuda":
        return f"device {loaded.device} is not CUDA"
    if not triton_util.available():
        return "triton is not importable"
    return None


NOT_ENABLED = ("the fused stage is not enabled: it needs a GPU, triton and, unless --fused-vision on, a model of "
               "1 B parameters or more")


def checked_fused(loaded, enabled: bool, eager: Callable, build: Callable, check: Callable) -> tuple[Callable, str]:
    """(the vision forward to run, a label saying which and why): ``build(loaded)`` where the
    fused stage is ``enabled``, this machine runs its kernels and ``check(loaded, fused)`` finds
    it agreeing with transformers' modules; else ``eager``, with the reason."""
    if not enabled:
        return eager, f"transformers' modules ({NOT_ENABLED})"
    problem = platform_problem(loaded)
    if problem:
        log.info("vision stage: transformers' modules (%s)", problem)
        return eager, f"transformers' modules ({problem})"
    try:
        fused = build(loaded)  # refuses, naming why, a tower it cannot run
        problem = check(loaded, fused)
    except Exception as exc:  # noqa: BLE001 - any failure means: encode eagerly
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        log.warning("vision stage uses transformers' modules, not the fused kernels: %s", problem)
        return eager, f"transformers' modules ({problem})"
    label = getattr(fused, "label", "fused (Triton kernels)")
    log.info("vision stage: %s (checked against transformers' modules)", label)
    return fused, label


def choose_vision_encoder(loaded: LoadedModel, enabled: bool = True
                          ) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """(the vision stage to run, a label saying which and why): ``FusedVision`` where it runs
    and agrees with transformers' modules on this model, else ``encode_images``."""
    return checked_fused(loaded, enabled, functools.partial(encode_images, loaded), FusedVision, startup_problem)
