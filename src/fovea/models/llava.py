"""LLaVA-1.5: a CLIP-style tower at one fixed resolution, an MLP projector, a Llama language model.

Every image is resized and cropped to the tower's ``image_size`` and fills the same number of
tokens (576 for LLaVA-1.5 at 336 px). The vision stage runs transformers' own modules layer by
layer (``fovea.models.clip_vision``); on CUDA the engine may swap in the fused kernels of
``engine.vision.vision_fused`` or graphs of ``engine.vision.vision_graphs``, both checked against it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from fovea.models.base import (
    DEFAULT_OPTIONS,
    EncodedPrompt,
    EncodeOptions,
    Family,
    ImageInput,
    LanguageModelSpec,
    ModelAdapter,
    PlaceholderMismatch,
    PromptCodec,
    WidthReport,
    check_placeholders,
    pixel_hash,
)
from fovea.models.clip_pixels import PREPARED, clip_pixels, fast_path_supported

RECIPE_FIELDS = ("do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale",
                 "rescale_factor", "do_normalize", "image_mean", "image_std", "do_convert_rgb")
NORMALISATION_FIELDS = frozenset({"do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
                                  "do_convert_rgb"})


def short_side_of(image_processor: Any) -> int | None:
    """The shortest side the processor resizes images to (None when it does not say)."""
    size = getattr(image_processor, "size", None) or {}
    if not isinstance(size, dict):
        size = {k: getattr(size, k, None) for k in ("shortest_edge", "height", "width")}
    if size.get("shortest_edge"):
        return int(size["shortest_edge"])
    sides = [size[k] for k in ("height", "width") if size.get(k)]
    return int(min(sides)) if sides else None


class LlavaCodec(PromptCodec):
    def target_short_side(self) -> int | None:
        return short_side_of(self.image_processor)

    def reference_ids(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> list[int]:
        # The images go in their content parts, as transformers' chat templating reads them.
        pending = iter(images)
        filled = [{**m, "content": [{**part, "image": next(pending)} if part.get("type") == "image" else part
                                    for part in m["content"]]} if isinstance(m["content"], list) else m
                  for m in messages]
        out = self.processor.apply_chat_template(filled, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = out["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def prepares_pixels(self) -> bool:
        """Whether ``encode`` makes each image's pixels itself (``clip_pixels``) and hands them to the
        processor ready, which then only expands the placeholders by their size."""
        return fast_path_supported(self.image_processor)

    def encode(self, text: str, images: list[Image.Image], *, template_rendered: bool = True,
               options: EncodeOptions = DEFAULT_OPTIONS) -> EncodedPrompt:
        check_placeholders(text, self.image_token, len(images), template_rendered)
        kwargs = self.tokenizer_kwargs(text, template_rendered, options)
        if images:
            # text_kwargs: transformers' processors take tokenizer arguments there (as keywords
            # they warn, and may stop passing them on).
            if self.prepares_pixels():  # the same pixels, bit for bit (clip_pixels)
                prepared = [clip_pixels(image, self.image_processor) for image in images]
                encoded = self.processor(text=text, images=prepared, return_tensors="pt", text_kwargs=kwargs,
                                         images_kwargs=PREPARED)
            else:
                encoded = self.processor(text=text, images=images, return_tensors="pt", text_kwargs=kwargs)
            pixel_values = encoded["pixel_values"].to(dtype=self.dtype)
        else:
            encoded = self.tokenizer(text, return_tensors="pt", **kwargs)
            pixel_values = None
        input_ids = encoded["input_ids"][0].tolist()
        image_tokens = sum(1 for t in input_ids if t == self.image_token_id)
        if not images:
            if image_tokens:
                raise PlaceholderMismatch(
                    f"the text contains {image_tokens} image token(s) but no image was sent; remove "
                    f"{self.image_token!r} from the text or attach the image.")
            return EncodedPrompt(input_ids, [], text)
        per_image = image_tokens // len(images)
        if image_tokens % len(images) or per_image == 0:
            raise PlaceholderMismatch(
                f"the processor expanded {len(images)} image(s) into {image_tokens} image tokens, "
                "which is not a whole number of tokens per image.", status=500)
        return EncodedPrompt(input_ids, [ImageInput(p, per_image, pixel_hash(p)) for p in pixel_values], text)


class LlavaAdapter(ModelAdapter):
    family = Family("llava", ("llava",), ["LLaVA-1.5: CLIP-style tower at a fixed resolution, MLP projector, Llama"])
    recipe_fields = RECIPE_FIELDS
    normalisation_fields = NORMALISATION_FIELDS
    fused_vision = "clip"

    def model_class(self) -> type:
        return LlavaForConditionalGeneration

    def load_processor(self, path: Path) -> Any:
        return AutoProcessor.from_pretrained(path, local_files_only=True)

    def codec(self, processor: Any, image_token_id: int, dtype: torch.dtype) -> LlavaCodec:
        image_token = getattr(processor, "image_token", None) or "<image>"
        return LlavaCodec(processor, image_token, image_token_id, dtype)

    def image_token(self, processor: Any, config: Any) -> tuple[str, int]:
        return getattr(processor, "image_token", None) or "<image>", int(config.image_token_id)

    def vision_module_names(self) -> tuple[str, ...]:
        return ("model.vision_tower", "model.multi_modal_projector")

    def build_vision_modules(self, config: Any) -> dict[str, torch.nn.Module]:
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        return {"model.vision_tower": AutoModel.from_config(config.vision_config),
                "model.multi_modal_projector": LlavaMultiModalProjector(config)}

    def vision_forward(self, loaded: Any) -> Callable[[list[ImageInput]], list[torch.Tensor]]:
        from fovea.models.clip_vision import encode_images

        return stacked(functools.partial(encode_images, loaded))

    def preprocessing_problem(self, loaded: Any, images: list[Image.Image]) -> str | None:
        """None if the codec's pixels for ``images`` (``clip_pixels``, where it takes the processor)
        equal the image processor's own ``pixel_values`` bit for bit, else how they differ."""
        codec = getattr(loaded, "codec", None)  # (an encode worker's vision part has none)
        if codec is None or not codec.prepares_pixels():
            return None  # the processor runs whole in the codec
        processor = codec.image_processor
        for i, image in enumerate(images):
            rgb = image.convert("RGB")
            ours = clip_pixels(rgb, processor)
            theirs = processor(images=[rgb], return_tensors="pt")["pixel_values"][0].to(torch.float32)
            if ours.shape != theirs.shape or not torch.equal(ours, theirs):
                worst = (ours - theirs).abs().max().item() if ours.shape == theirs.shape else float("nan")
                return (f"probe image {i} ({rgb.width}x{rgb.height}): pixels {tuple(ours.shape)} differing by up to "
                        f"{worst:.3g} from the processor's {tuple(theirs.shape)}")
        return None

    def fixed_image_shape(self, config: Any) -> tuple[int, ...] | None:
        vision = config.vision_config
        size = getattr(vision, "image_size", None)
        return (getattr(vision, "num_channels", 3), size, size) if size else None


    def widths(self, model: torch.nn.Module) -> WidthReport:
        config = model.config
        layers = config.vision_feature_layer
        n_layers = 1 if isinstance(layers, int) else len(layers)
        projector = model.model.multi_modal_projector
        linears = [m for m in projector.modules() if isinstance(m, torch.nn.Linear)]
        return WidthReport(
            vision_width=int(config.vision_config.hidden_size) * n_layers,
            projector_in=linears[0].in_features if linears else -1,
            projector_out=linears[-1].out_features if linears else -1,
            lm_hidden=int(config.text_config.hidden_size),
            explain_in=f"vision hidden_size {config.vision_config.hidden_size} x {n_layers} feature layer(s)",
            fix_in="use the projector trained for this vision tower, or fix vision_config / vision_feature_layer")

    def lm_spec(self, model: torch.nn.Module) -> LanguageModelSpec:
        text = model.config.text_config
        tied = getattr(text, "tie_word_embeddings", False) or getattr(model.config, "tie_word_embeddings", False)
        return LanguageModelSpec(model.model.language_model, None if tied else model.lm_head, text)

    def reference_inputs(self, prompt: EncodedPrompt, device: torch.device, image_token_id: int) -> dict[str, Any]:
        if not prompt.images:
            return {}
        return {"pixel_values": torch.stack([image.pixels for image in prompt.images]).to(device)}


def stacked(encode: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[list[ImageInput]], list[torch.Tensor]]:
    """A fixed-resolution stage over a batch tensor, as one over a list of images."""

    def run(images: list[ImageInput]) -> list[torch.Tensor]:
        return list(encode(torch.stack([image.pixels for image in images])).unbind(0))

    run.batched = encode  # the [n, C, H, W] stage itself (graphs and the profile call it directly)
    return run
