"""Qwen2.5-VL: dynamic resolution, a window-attention ViT with a 2x2 patch merger, Qwen2 with M-RoPE.

- **Dynamic resolution.** The model's own image processor resizes each image to a multiple of
  28 px within its ``min_pixels``/``max_pixels`` (the recipe the contract pins), so each image
  fills its own number of tokens: (h / 14) * (w / 14) / 4.
- **The placeholder.** The chat template writes ``<|vision_start|><|image_pad|><|vision_end|>``
  per image; this codec expands the k-th ``<|image_pad|>`` into image k's token count, from the
  processor's ``image_grid_thw``, and checks the total against the grids before the engine runs.
- **M-RoPE.** Text tokens advance one position on all three rows (temporal, height, width);
  an image's tokens take (t, row, column) offsets from the position where it starts, and the
  text after it resumes at start + max(rows, columns). Past the prompt, every row is
  ``index + position_delta``, so decode is plain 1-D RoPE at a shifted position.
- **The vision forward** is transformers' own tower (window attention in all blocks but the
  ``fullatt_block_indexes``), run over a batch of images of different sizes at once.

The processor is assembled from the tokenizer and the image processor, not through
``AutoProcessor``: transformers' Qwen2.5-VL processor also builds a video processor, which
needs torchvision.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from fovea.errors import InvalidRequest
from fovea.models.base import (
    EncodedPrompt,
    Family,
    ImageInput,
    LanguageModelSpec,
    ModelAdapter,
    PlaceholderMismatch,
    PromptCodec,
    WidthReport,
    check_placeholders,
    pixel_hash,
    tokenize_rendered,
)
from fovea.models.qwen_vision_attention import grouped

RECIPE_FIELDS = ("do_resize", "size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                 "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
                 "do_convert_rgb")
NORMALISATION_FIELDS = frozenset({"do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
                                  "do_convert_rgb"})
MAX_ASPECT = 200  # the processor's own limit: a longer strip is refused


def pixel_bounds(image_processor: Any) -> tuple[int, int]:
    """(min_pixels, max_pixels): attributes of their own in older transformers, ``size``'s
    shortest_edge/longest_edge in newer ones."""
    size = getattr(image_processor, "size", None) or {}
    if not isinstance(size, dict):
        size = {k: getattr(size, k, None) for k in ("shortest_edge", "longest_edge")}
    low = getattr(image_processor, "min_pixels", None) or size.get("shortest_edge")
    high = getattr(image_processor, "max_pixels", None) or size.get("longest_edge")
    if not low or not high:
        raise ValueError("the image processor states no min_pixels/max_pixels")
    return int(low), int(high)


@dataclass
class QwenProcessor:
    """The parts of Qwen2.5-VL's processor that images need (no video processor)."""

    tokenizer: Any
    image_processor: Any

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def mrope_positions(input_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]],
                    merge: int) -> tuple[list[list[int]], int]:
    """The prompt's three position rows and the delta of every position past it (as
    transformers' ``get_rope_index`` for images)."""
    rows: list[list[int]] = [[], [], []]
    current, i, image = 0, 0, 0
    while i < len(input_ids):
        if input_ids[i] != image_token_id:
            for row in rows:
                row.append(current)
            current += 1
            i += 1
            continue
        t, h, w = grids[image]
        lh, lw = h // merge, w // merge
        for ti in range(t):
            for hi in range(lh):
                for wi in range(lw):
                    rows[0].append(current + ti)
                    rows[1].append(current + hi)
                    rows[2].append(current + wi)
        i += t * lh * lw
        current += max(t, lh, lw) if t > 1 else max(lh, lw)
        image += 1
    top = max(max(row) for row in rows) if input_ids else -1
    return rows, top + 1 - len(input_ids)


class QwenCodec(PromptCodec):
    def __init__(self, processor: QwenProcessor, image_token: str, image_token_id: int, dtype: torch.dtype) -> None:
        super().__init__(processor, image_token, image_token_id, dtype)
        self.merge = int(getattr(processor.image_processor, "merge_size", 2))

    def target_short_side(self) -> int | None:
        # The processor keeps the aspect ratio within max_pixels: its short side is at most
        # the square root of that, so a decode reduced to twice it loses nothing visible.
        return int(pixel_bounds(self.image_processor)[1] ** 0.5)

    def reference_ids(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> list[int]:
        # transformers' Qwen2.5-VL processor: the tokenizer's apply_chat_template, then each
        # <|image_pad|> repeated image_grid_thw.prod() // merge_size**2 times (replace_image_token).
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if not images:
            return list(ids)
        grids = self.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        counts = iter(int(g.prod()) // (self.merge * self.merge) for g in grids)
        out: list[int] = []
        for token in ids:
            out.extend([token] * next(counts) if token == self.image_token_id else [token])
        return out

    def _factor(self) -> int:
        return int(self.image_processor.patch_size) * self.merge

    def _preprocess(self, images: list[Image.Image]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        factor = self._factor()
        ready = []
        for index, image in enumerate(images):
            width, height = image.size
            if max(width, height) / max(1, min(width, height)) > MAX_ASPECT:
                raise InvalidRequest(
                    f"image {index} is {width}x{height} px: its aspect ratio is over {MAX_ASPECT}:1, which this "
                    "model's processor cannot tile; crop it.", code="invalid_image")
            ready.append(image)
        try:
            out = self.image_processor(images=ready, return_tensors="pt")
        except ValueError as exc:
            # Older processors refuse sides under one 28 px tile (vllm#21109): resize those up to
            # the model's minimum and let the processor take it from there.
            if "factor" not in str(exc) and "smaller" not in str(exc):
                raise
            ready = [im if min(im.size) >= factor else im.resize(
                (max(factor, round(im.size[0] * factor / min(im.size))),
                 max(factor, round(im.size[1] * factor / min(im.size)))), Image.Resampling.BICUBIC)
                for im in ready]
            out = self.image_processor(images=ready, return_tensors="pt")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        return out["pixel_values"].to(self.dtype), grids

    def encode(self, text: str, images: list[Image.Image], *, template_rendered: bool = True) -> EncodedPrompt:
        check_placeholders(text, self.image_token, len(images), template_rendered)
        kwargs = tokenize_rendered(self.tokenizer, text) if template_rendered else {}
        ids = self.tokenizer(text, **kwargs)["input_ids"]
        placeholders = sum(1 for t in ids if t == self.image_token_id)
        if placeholders != len(images):
            raise PlaceholderMismatch(
                f"the text tokenizes to {placeholders} {self.image_token!r} token(s) for {len(images)} image(s)"
                + ("; the text must not contain the image token itself" if not template_rendered else ""))
        if not images:
            return EncodedPrompt(list(ids), [], text)
        pixels, grids = self._preprocess(images)
        inputs, expanded, offset = [], [], 0
        for grid in grids:
            patches = grid[0] * grid[1] * grid[2]
            chunk = pixels[offset:offset + patches]
            offset += patches
            tokens = patches // (self.merge * self.merge)
            inputs.append(ImageInput(chunk, tokens, pixel_hash(chunk, grid), grid))
        if offset != pixels.shape[0]:
            raise PlaceholderMismatch(f"the processor returned {pixels.shape[0]} patches for grids summing to "
                                      f"{offset}", status=500)
        image = 0
        for token in ids:
            if token == self.image_token_id:
                expanded.extend([token] * inputs[image].num_tokens)
                image += 1
            else:
                expanded.append(token)
        rows, delta = mrope_positions(expanded, self.image_token_id, grids, self.merge)
        return EncodedPrompt(expanded, inputs, text, rows, delta)


class Qwen2_5_VLAdapter(ModelAdapter):
    family = Family("qwen2_5_vl", ("qwen2_5_vl",),
                    ["Qwen2.5-VL: dynamic resolution, window-attention ViT, Qwen2 language model with M-RoPE"])
    recipe_fields = RECIPE_FIELDS
    normalisation_fields = NORMALISATION_FIELDS

    def model_class(self) -> type:
        return Qwen2_5_VLForConditionalGeneration

    def load_processor(self, path: Path) -> QwenProcessor:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        template = path / "chat_template.jinja"
        if not getattr(tokenizer, "chat_template", None) and template.is_file():
            tokenizer.chat_template = template.read_text()
        return QwenProcessor(tokenizer, image_processor)

    def codec(self, processor: QwenProcessor, image_token_id: int, dtype: torch.dtype) -> QwenCodec:
        return QwenCodec(processor, "<|image_pad|>", image_token_id, dtype)

    def image_token(self, processor: Any, config: Any) -> tuple[str, int]:
        return "<|image_pad|>", int(config.image_token_id)

    def vision_module_names(self) -> tuple[str, ...]:
        return ("model.visual",)

    def build_vision_modules(self, config: Any) -> dict[str, torch.nn.Module]:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return {"model.visual": Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)}

    def vision_forward(self, loaded: Any) -> Callable[[list[ImageInput]], list[torch.Tensor]]:
        visual = loaded.model.model.visual
        dtype = loaded.dtype

        @torch.inference_mode()
        def run(images: list[ImageInput]) -> list[torch.Tensor]:
            vision_dtype = next(visual.parameters()).dtype
            pixels = torch.cat([image.pixels for image in images]).to(vision_dtype)
            grid = torch.tensor([image.grid for image in images], dtype=torch.long, device=pixels.device)
            with grouped(visual):  # windows and images of one size in one SDPA call each
                out = visual(pixels, grid_thw=grid)
            rows = out if isinstance(out, torch.Tensor) else out.pooler_output
            return list(rows.to(dtype).split([image.num_tokens for image in images]))

        return run

    def dummy_images(self, config: Any, codec: PromptCodec | None, count: int) -> list[ImageInput]:
        assert codec is not None, "the largest image comes from the processor's max_pixels"
        ip = codec.image_processor
        patch, merge, temporal = int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size)
        side = int((pixel_bounds(ip)[1] ** 0.5) // (patch * merge)) * merge  # patches per side of the largest square
        width = 3 * temporal * patch * patch
        out = []
        for index in range(count):
            pixels = torch.randn((side * side, width), dtype=codec.dtype)
            out.append(ImageInput(pixels, side * side // (merge * merge), f"profile-{index}", (1, side, side)))
        return out

    def widths(self, model: torch.nn.Module) -> WidthReport:
        config = model.config
        merge = int(config.vision_config.spatial_merge_size)
        linears = [m for m in model.model.visual.merger.modules() if isinstance(m, torch.nn.Linear)]
        return WidthReport(
            vision_width=int(config.vision_config.hidden_size) * merge * merge,
            projector_in=linears[0].in_features if linears else -1,
            projector_out=linears[-1].out_features if linears else -1,
            lm_hidden=int(config.text_config.hidden_size),
            explain_in=f"vision hidden_size {config.vision_config.hidden_size} x {merge}x{merge} merged patches",
            fix_in="use the merger trained for this vision tower, or fix vision_config (hidden_size, "
                   "spatial_merge_size)")

    def uses_mrope(self) -> bool:
        return True

    def lm_spec(self, model: torch.nn.Module) -> LanguageModelSpec:
        text = model.config.text_config
        params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        section = list(params.get("mrope_section") or [16, 24, 24])
        tied = getattr(text, "tie_word_embeddings", False) or getattr(model.config, "tie_word_embeddings", False)
        return LanguageModelSpec(model.model.language_model, None if tied else model.lm_head, text, section)

    def reference_positions(self, model: torch.nn.Module, prompt: EncodedPrompt,
                            image_token_id: int) -> tuple[list[list[int]], int] | None:
        ids = torch.tensor([prompt.input_ids])
        grid = torch.tensor([image.grid for image in prompt.images]) if prompt.images else None
        try:
            rows, delta = model.model.get_rope_index(ids, mm_token_type_ids=(ids == image_token_id).int(),
                                                     image_grid_thw=grid)
        except TypeError:  # transformers before the mm_token_type_ids argument
            rows, delta = model.model.get_rope_index(ids, image_grid_thw=grid)
        return rows[:, 0].tolist(), int(delta)

    def reference_inputs(self, prompt: EncodedPrompt, device: torch.device, image_token_id: int) -> dict[str, Any]:
        if not prompt.images:
            return {}
        inputs: dict[str, Any] = {
            "pixel_values": torch.cat([image.pixels for image in prompt.images]).to(device),
            "image_grid_thw": torch.tensor([image.grid for image in prompt.images], device=device)}
        forward = inspect.signature(Qwen2_5_VLForConditionalGeneration.forward).parameters
        if "mm_token_type_ids" in forward:  # transformers >= 5.2x computes M-RoPE from it
            ids = torch.tensor(prompt.input_ids, device=device)
            inputs["mm_token_type_ids"] = (ids == image_token_id).int().unsqueeze(0)
        return inputs

