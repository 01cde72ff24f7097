"""The Llama-style language model run by fovea over the paged KV cache (Llama, Qwen2, Qwen3, the Qwen-VLs').

The parameters are the loaded transformers model's own tensors (referenced, never
copied); only the execution is ours: a flat [tokens, hidden] batch in which decodes and
prefill chunks of different sequences sit side by side.

Two executions of the same weights:
- the torch path (CPU, or CUDA without triton): transformers' eager ops one by one, so the
  demo model's greedy answers are token-identical to ``generate``;
- the fused path (CUDA with triton): q/k/v and gate/up each one matrix product (the HF
  modules' weights become views into one fused tensor, so memory is not doubled), and the
  Triton kernels of ``triton_ops`` for residual add + RMSNorm, rotary + KV write and
  SiLU * up. A decode layer is then about 10 launches instead of about 35.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fovea.engine.kernels import triton_ops
from fovea.engine.kernels.fp8_activation import Fp8Activation
from fovea.engine.model.attention import AttentionBackend, AttnMeta, attention, write_kv
from fovea.engine.model.kv_cache import KVCache, KVShape
from fovea.engine.model.quant_linear import (
    fp8_input_group,
    fuse_weights,
    fused_linear,
    int4_scratch_elements,
    mixed_linear,
    torch_linear,
    weight_of,
)
from fovea.engine.model.weights import fuse_rows
from fovea.errors import ModelLoadError
from fovea.models.base import LanguageModelSpec


@dataclass(slots=True)
class LayerWeights:
    in_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    # The fused path's views: [q; k; v] and [gate; up] rows of one tensor each.
    qkv: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    # Qwen3: RMSNorm over each q and k head before RoPE (None elsewhere).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class FP8Inputs:
    """The groups (columns a scale) by which a layer's producers quantise its FP8 products' inputs,
    or None where a product quantises its own (``PagedLlama.fp8_groups``)."""
    qkv: int | None = None
    gate_up: int | None = None
    down: int | None = None


def rope_parameters(config) -> dict:
    """The rope dict of a transformers 5.x config (``rope_parameters``) or an older one
    (``rope_theta`` + ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    return scaling


def inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies in float32 for the supported rope types."""
    params = rope_parameters(config)
    kind = params.get("rope_type") or "default"
    if kind == "mrope":  # older Qwen-VL configs: default frequencies, split into M-RoPE sections
        kind = "default"
    base = float(params["rope_theta"])
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("the paged engine does not support partial_rotary_factor != 1")
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"the paged engine supports rope_type default, linear, llama3 and mrope, not {kind!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: statistics in float32, scale in the model dtype.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Text models with Llama's layer structure (q/k/v/o, gate/up/down, RMSNorm, SiLU, RoPE).
# Mistral is Llama's layers with an optional sliding window (refused below where it can bite).
# Qwen3 adds a per-head RMSNorm of q and k before RoPE (``LayerWeights.q_norm``/``k_norm``).
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3", "qwen3_vl_text")


def mrope_section_index(section: list[int], interleaved: bool) -> list[int]:
    """For each rotary frequency, the position row (0 temporal, 1 height, 2 width) it rotates by.
    Sectioned (Qwen2-VL, Qwen2.5-VL): [T..T H..H W..W]. Interleaved (Qwen3-VL): T H W T H W ...,
    height at frequencies 1, 4, ... below 3 * section[1], width at 2, 5, ... below 3 * section[2],
    temporal everywhere else (transformers' Qwen3VLTextRotaryEmbedding)."""
    if not interleaved:
        return [row for row, width in enumerate(section) for _ in range(width)]
    out = [0] * sum(section)
    for row, offset in ((1, 1), (2, 2)):
        for freq in range(offset, min(3 * section[row], len(out)), 3):
            out[freq] = row
    return out


def mrope_cos_sin(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  section_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token [T, D] cos/sin of M-RoPE: dimension d rotates by the position of row
    ``section_index[d]`` (0 temporal, 1 height, 2 width), as transformers' sectioned M-RoPE."""
    index = section_index.view(1, 1, -1).expand(1, positions.shape[1], -1)
    return cos[positions].gather(0, index)[0], sin[positions].gather(0, index)[0]


class PagedLlama:
    def __init__(self, spec: LanguageModelSpec, max_positions: int, backend: AttentionBackend | None,
                 fused: bool = False) -> None:
        text = spec.config
        if getattr(text, "model_type", None) not in LLAMA_STYLE:
            raise ModelLoadError(f"the paged engine runs Llama-style language models ({', '.join(LLAMA_STYLE)}); "
                                 f"this one is {getattr(text, 'model_type', None)!r}")
        if getattr(text, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"the paged engine needs hidden_act 'silu', not {text.hidden_act!r}")
        if getattr(text, "use_sliding_window", False):
            raise ModelLoadError("the paged engine does not run sliding-window attention (use_sliding_window: true)")
        window = getattr(text, "sliding_window", None) if text.model_type == "mistral" else None
        if window is not None and window < max_positions:
            raise ModelLoadError(f"the paged engine does not run sliding-window attention (sliding_window: {window}, "
                                 f"below the {max_positions} positions served)")
        lm = spec.language_model
        self.num_heads = text.num_attention_heads
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.num_heads
        self.eps = text.rms_norm_eps
        self.scale = self.head_dim ** -0.5  # as transformers: head_dim ** -0.5
        self.embed = lm.embed_tokens.weight
        self.final_norm = lm.norm.weight
        self.lm_head = self.embed if spec.lm_head is None else spec.lm_head.weight
        self.fused = fused
        self.quant_kernels = True  # False: quantized layers dequantised per call (their start-up check failed)
        self.layers = [self._layer(layer, fused) for layer in lm.layers]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        # Int4 products with many rows dequantise their weight into this one buffer (the largest
        # layer's, allocated once; a line of the memory plan), then call torch's matmul.
        scratch = int4_scratch_elements(self.layers) if fused and self.device.type == "cuda" else 0
        self.int4_scratch = torch.empty(scratch, dtype=self.dtype, device=self.device) if scratch else None
        # FP8 products whose inputs their producers quantise (fp8_activation): per layer, the groups
        # of q/k/v's input (the input RMSNorm's), gate/up's (the post-attention RMSNorm's) and
        # down's (SiLU * up's); None where the product quantises its own. Off (False) when the
        # start-up check finds the producers wrong on this device.
        self.fp8_groups = [FP8Inputs(*(fp8_input_group(w, self.device) if fused else None
                                       for w in (layer.qkv, layer.gate_up, layer.down)))
                           for layer in self.layers]
        self.fp8_producers = any(g != FP8Inputs() for g in self.fp8_groups)
        inv = inverse_frequencies(text, self.head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.device, self.dtype)  # [positions, head_dim]
        self.sin = emb.sin().to(self.device, self.dtype)
        self.backend = backend
        # DeepStack (Qwen3-VL): vision features added to the image positions' hidden states
        # after each of the first ``deepstack_layers`` decoder layers.
        self.deepstack_layers = spec.deepstack_layers
        if self.deepstack_layers > len(self.layers):
            raise ModelLoadError(f"{self.deepstack_layers} DeepStack feature levels for {len(self.layers)} layers")
        self.mrope_section = spec.mrope_section
        self.section_index: torch.Tensor | None = None
        if spec.mrope_section is not None:
            if sum(spec.mrope_section) != self.head_dim // 2:
                raise ModelLoadError(f"mrope_section {spec.mrope_section} does not cover the head's "
                                     f"{self.head_dim // 2} rotary frequencies")
            half = mrope_section_index(spec.mrope_section, spec.mrope_interleaved)
            self.section_index = torch.tensor(half + half, dtype=torch.long, device=self.device)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos table, sin table, index per token): 1-D positions index the model's tables;
        M-RoPE's [3, T] positions get per-token tables indexed by 0..T-1."""
        if positions.dim() == 1:
            return self.cos, self.sin, positions
        assert self.section_index is not None, "M-RoPE positions for a 1-D RoPE model"
        cos, sin = mrope_cos_sin(self.cos, self.sin, positions, self.section_index)
        return cos, sin, torch.arange(positions.shape[1], device=positions.device)

    @staticmethod
    def _layer(layer, fused: bool) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        extra = {}
        if fused:
            qkv_modules, gate_up_modules = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
            extra = {"qkv": fuse_weights(qkv_modules), "qkv_bias": fuse_rows(qkv_modules, "bias"),
                     "gate_up": fuse_weights(gate_up_modules),
                     "gate_up_bias": fuse_rows(gate_up_modules, "bias")}
            if extra["qkv"] is None or extra["gate_up"] is None:  # quantized weights that cannot be stacked
                raise ModelLoadError("the fused forward stacks q/k/v and gate/up into one product each, and this "
                                     "checkpoint's quantized weights cannot be (mixed formats, or block-FP8 rows "
                                     "that do not fall on the scale blocks); report the checkpoint, with its config.json")
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        extra["q_norm"] = q_norm.weight if q_norm is not None else None
        extra["k_norm"] = k_norm.weight if k_norm is not None else None
        return LayerWeights(
            layer.input_layernorm.weight, weight_of(attn.q_proj), weight_of(attn.k_proj), weight_of(attn.v_proj),
            weight_of(attn.o_proj), attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias,
            layer.post_attention_layernorm.weight, weight_of(mlp.gate_proj), weight_of(mlp.up_proj),
            weight_of(mlp.down_proj), mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias, **extra)

    def kv_shape(self, block_size: int) -> KVShape:
        return KVShape(len(self.layers), self.num_kv_heads, self.head_dim, block_size, self.dtype)

    def embed_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        # Some checkpoints give the image token an id past the table; such rows are replaced.
        ids = token_ids.masked_fill(token_ids >= self.embed.shape[0], 0)
        return F.embedding(ids, self.embed)

    def head_norms(self, q: torch.Tensor, k: torch.Tensor, w: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm of q and k ([T, heads, D]); unchanged for other models."""
        if w.q_norm is None:
            return q, k
        return rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)

    @staticmethod
    def add_deepstack(hidden: torch.Tensor, deepstack: tuple[torch.Tensor, torch.Tensor] | None, layer: int) -> None:
        """DeepStack: ``hidden[rows] += features[:, layer]`` in place, as transformers'
        ``_deepstack_process`` (one add in the model dtype). ``deepstack`` is (rows [N], features
        [N, levels, hidden]): prefill rows of prompts with images (text rows carry zero features, an
        exact no-op); decode rows are never among them."""
        if deepstack is not None and layer < deepstack[1].shape[1] and deepstack[0].numel():
            rows, features = deepstack
            hidden[rows] = hidden[rows] + features[:, layer]

    @torch.inference_mode()  # never let autograd record the KV-cache writes (the weights require grad)
    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttnMeta, cache: KVCache,
                logit_rows: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
                score_rows: torch.Tensor | None = None):
        """hidden: [T, hidden] input embeddings -> logits [rows, vocab] (model dtype) of
        ``logit_rows`` (all rows if None). ``deepstack``: see ``add_deepstack``. With
        ``score_rows``: (those logits, the final-normed hidden states of ``score_rows``), whose
        logits the caller takes through ``lm_logits`` a slice at a time (prompt scoring)."""
        if self.fused:
            return self._forward_fused(hidden, positions, meta, cache, logit_rows, deepstack, score_rows)
        tokens = hidden.shape[0]
        cos_table, sin_table, index = self.rope_tables(positions)
        cos = cos_table[index].unsqueeze(1)  # [T, 1, D]: broadcasts over heads
        sin = sin_table[index].unsqueeze(1)
        for index, w in enumerate(self.layers):
            x = rms_norm(hidden, w.in_norm, self.eps)
            q = torch_linear(x, w.q, w.q_bias).view(tokens, self.num_heads, self.head_dim)
            k = torch_linear(x, w.k, w.k_bias).view(tokens, self.num_kv_heads, self.head_dim)
            v = torch_linear(x, w.v, w.v_bias).view(tokens, self.num_kv_heads, self.head_dim)
            q, k = self.head_norms(q, k, w)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k_cache, v_cache = cache.k[index], cache.v[index]
            write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
            out = attention(q, k, v, k_cache, v_cache, meta, self.scale, self.backend)
            hidden = hidden + torch_linear(out.reshape(tokens, -1), w.o, w.o_bias)
            x = rms_norm(hidden, w.post_norm, self.eps)
            gated = F.silu(torch_linear(x, w.gate, w.gate_bias)) * torch_linear(x, w.up, w.up_bias)
            hidden = hidden + torch_linear(gated, w.down, w.down_bias)
            self.add_deepstack(hidden, deepstack, index)
        scored = rms_norm(hidden[score_rows], self.final_norm, self.eps) if score_rows is not None else None
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        logits = F.linear(rms_norm(hidden, self.final_norm, self.eps), self.lm_head)
        return logits if scored is None else (logits, scored)

    def lm_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed rows (``forward``'s ``score_rows``)."""
        return (triton_ops.linear if self.fused else F.linear)(normed, self.lm_head)

    def _forward_fused(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttnMeta, cache: KVCache,
                       logit_rows: torch.Tensor | None,
                       deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
                       score_rows: torch.Tensor | None = None):
        """The same forward with fused weights and kernels. ``hidden`` is the residual stream
        and is updated in place."""
        tokens = hidden.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        linear = functools.partial(fused_linear, scratch=self.int4_scratch) if self.quant_kernels else mixed_linear
        groups = self.fp8_groups if self.quant_kernels and self.fp8_producers else [FP8Inputs()] * len(self.layers)
        cos_table, sin_table, positions = self.rope_tables(positions)
        x = norm(hidden, self.layers[0].in_norm, self.eps, groups[0].qkv)
        for index, w in enumerate(self.layers):
            qkv = linear(x, w.qkv, w.qkv_bias)
            if w.q_norm is not None:  # Qwen3: q and k heads normed in place before the rotary kernel
                qkv[:, :q_end] = triton_ops.add_rms_norm(qkv[:, :q_end].reshape(-1, dim), w.q_norm,
                                                         self.eps).view(tokens, -1)
                qkv[:, q_end:k_end] = triton_ops.add_rms_norm(qkv[:, q_end:k_end].reshape(-1, dim), w.k_norm,
                                                              self.eps).view(tokens, -1)
            k_cache, v_cache = cache.k[index], cache.v[index]
            triton_ops.rope_write_kv(qkv, positions, cos_table, sin_table, k_cache, v_cache, meta.slot_mapping,
                                     heads, kv_heads, dim)
            q = qkv[:, :q_end].view(tokens, heads, dim)
            k = qkv[:, q_end:k_end].view(tokens, kv_heads, dim)
            v = qkv[:, k_end:].view(tokens, kv_heads, dim)
            out = attention(q, k, v, k_cache, v_cache, meta, self.scale, self.backend)
            o = linear(out.reshape(tokens, -1), w.o, w.o_bias)
            x = norm(o, w.post_norm, self.eps, groups[index].gate_up, residual=hidden)
            down = linear(silu_mul(linear(x, w.gate_up, w.gate_up_bias), groups[index].down), w.down, w.down_bias)
            if deepstack is not None and index < self.deepstack_layers:
                # The residual add, then the features (as transformers rounds), then the next norm.
                hidden += down
                self.add_deepstack(hidden, deepstack, index)
                down = torch.zeros_like(down)
            if index + 1 < len(self.layers):
                x = norm(down, self.layers[index + 1].in_norm, self.eps, groups[index + 1].qkv, residual=hidden)
        scored = None
        if score_rows is not None:  # first: without logit_rows the residual add below is in place
            scored = triton_ops.add_rms_norm(down[score_rows], self.final_norm, self.eps, residual=hidden[score_rows])
        if logit_rows is not None:
            hidden, down = hidden[logit_rows], down[logit_rows]
        logits = linear(triton_ops.add_rms_norm(down, self.final_norm, self.eps, residual=hidden), self.lm_head)
        return logits if scored is None else (logits, scored)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_group: int | None,
         residual: torch.Tensor | None = None) -> torch.Tensor | Fp8Activation:
    """``triton_ops.add_rms_norm``, its rows quantised to FP8 by ``fp8_group`` when not None."""
    if fp8_group is None:
        return triton_ops.add_rms_norm(x, weight, eps, residual=residual)
    return triton_ops.add_rms_norm_fp8(x, weight, eps, fp8_group, residual=residual)


def silu_mul(gate_up: torch.Tensor, fp8_group: int | None) -> torch.Tensor | Fp8Activation:
    """``triton_ops.silu_mul``, its rows quantised to FP8 by ``fp8_group`` when not None."""
    return triton_ops.silu_mul(gate_up) if fp8_group is None else triton_ops.silu_mul_fp8(gate_up, fp8_group)
