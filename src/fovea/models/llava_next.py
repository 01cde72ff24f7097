"""LLaVA-NeXT (LLaVA-1.6): LLaVA's CLIP tower, projector and Llama-style language model, at any resolution.

- **Anyres tiling.** The image processor picks, among the config's ``image_grid_pinpoints``,
  the resolution that keeps the most of the image (transformers' ``select_best_resolution``),
  resizes and pads the image to it and cuts it into tiles of the tower's size; a base tile of
  the whole image comes first. Each image's ``ImageInput.pixels`` holds its own tiles
  ([tiles, 3, H, W]); ``grid`` is (tiles, image height, image width) in pixels, what the
  packing needs.
- **Packing.** The tower and projector run over every tile of a batch at once; each image's
  grid tiles are then stitched into one feature map, the padding is cut away (``unpad``) and
  one ``image_newline`` row embedding is appended per row: transformers' own
  ``LlavaNextModel.pack_image_features``, so the rows equal ``get_image_features``'.
- **Token counts.** Each ``<image>`` expands into that image's own count (base tile + unpadded
  grid + newlines), as transformers' processor expands it; the codec takes the prompt ids from
  the processor itself and the per-image counts from its ``_get_num_multimodal_tokens``, and
  checks they add up.

Only the PIL/numpy image processor is used (``LlavaNextImageProcessorPil`` in transformers 5,
the slow ``LlavaNextImageProcessor`` before): its torchvision twin resizes differently, and
a directory whose processor only resolves to it is refused at load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor, LlavaNextForConditionalGeneration
from transformers.models.llava_next.modeling_llava_next import LlavaNextModel, image_size_to_num_patches

from fovea.errors import ModelLoadError
from fovea.models.base import (
    DEFAULT_OPTIONS,
    EncodedPrompt,
    EncodeOptions,
    Family,
    ImageInput,
    PlaceholderMismatch,
    check_placeholders,
    pixel_hash,
    text_only_prompt,
)
from fovea.models.llava import NORMALISATION_FIELDS, LlavaAdapter, LlavaCodec

RECIPE_FIELDS = ("do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor",
                 "do_normalize", "image_mean", "image_std", "do_convert_rgb", "do_pad", "image_grid_pinpoints")


def is_torchvision_backed(image_processor: Any) -> bool:
    """transformers' torchvision image processors (``TorchvisionBackend`` in 5.x, ``*Fast`` before)."""
    names = [cls.__name__ for cls in type(image_processor).__mro__]
    return "TorchvisionBackend" in names or any(n.endswith("ImageProcessorFast") for n in names)


class NewlineHolder(torch.nn.Module):
    """The ``image_newline`` parameter as a module of the vision part.

    In the full model it shares the model's own parameter (so a dtype move of the vision
    modules moves it too); for the encode-only loader it is built empty at path ``model`` and
    its one tensor is read from the checkpoint's ``model.image_newline``."""

    def __init__(self, parameter: torch.nn.Parameter) -> None:
        super().__init__()
        self.image_newline = parameter


class LlavaNextCodec(LlavaCodec):
    def prepares_pixels(self) -> bool:
        return False  # its encode runs its own processor whole

    def target_short_side(self) -> int | None:
        # The tile grid and the unpadding follow the image's own size: reducing it first would
        # change the token count and the features. No reduction.
        return None

    def tiles(self, image_size: tuple[int, int]) -> int:
        """Tiles the processor cuts an image of (height, width) px into: the base tile and the grid."""
        ip = self.image_processor
        return image_size_to_num_patches(list(image_size), ip.image_grid_pinpoints, tile_side(ip))

    def token_counts(self, image_sizes: list[tuple[int, int]]) -> list[int]:
        """Each image's image-token count, as transformers' processor expands its placeholder."""
        return list(self.processor._get_num_multimodal_tokens(image_sizes=image_sizes).num_image_tokens)

    def encode(self, text: str, images: list[Image.Image], *, template_rendered: bool = True,
               options: EncodeOptions = DEFAULT_OPTIONS) -> EncodedPrompt:
        check_placeholders(text, self.image_token, len(images), template_rendered)
        kwargs = self.tokenizer_kwargs(text, template_rendered, options)
        if not images:
            return text_only_prompt(self.tokenizer, text, kwargs, self.image_token, self.image_token_id)
        encoded = self.processor(text=text, images=images, return_tensors="pt", text_kwargs=kwargs)
        input_ids = encoded["input_ids"][0].tolist()
        sizes = [(int(h), int(w)) for h, w in encoded["image_sizes"].tolist()]
        counts = self.token_counts(sizes)
        expanded = sum(1 for t in input_ids if t == self.image_token_id)
        if sum(counts) != expanded:
            raise PlaceholderMismatch(
                f"the processor expanded {len(images)} image(s) into {expanded} image tokens but their sizes "
                f"{sizes} give {counts}", status=500)
        pixel_values = encoded["pixel_values"]  # [images, most tiles, 3, H, W], padded with zero tiles
        inputs = []
        for index, (size, count) in enumerate(zip(sizes, counts)):
            tiles = self.tiles(size)
            pixels = pixel_values[index, :tiles].to(self.dtype).contiguous()
            grid = (tiles, *size)
            inputs.append(ImageInput(pixels, count, pixel_hash(pixels, grid), grid))
        return EncodedPrompt(input_ids, inputs, text)


def check_tiles(config: Any, image: ImageInput) -> None:
    """The packing reads the grid from the model config's pinpoints: an image the processor cut
    by other pinpoints would be stitched wrong, so it is refused here (the contract's probe)."""
    expected = image_size_to_num_patches(list(image.grid[1:]), config.image_grid_pinpoints,
                                         config.vision_config.image_size)
    if image.pixels.shape[0] != expected:
        raise ValueError(
            f"a {image.grid[2]}x{image.grid[1]} px image came with {image.pixels.shape[0]} tiles, but the model "
            f"config's image_grid_pinpoints {config.image_grid_pinpoints} give {expected}: the processor's "
            "image_grid_pinpoints (preprocessor_config.json) must equal config.json's")


def tile_side(image_processor: Any) -> int:
    crop = getattr(image_processor, "crop_size", None) or {}
    crop = crop if isinstance(crop, dict) else {"height": getattr(crop, "height", None)}
    if crop.get("height"):
        return int(crop["height"])
    size = image_processor.size if isinstance(image_processor.size, dict) else vars(image_processor.size)
    return int(size.get("height") or size["shortest_edge"])


class LlavaNextAdapter(LlavaAdapter):
    family = Family("llava_next", ("llava_next",),
                    [("LLaVA-NeXT (1.6): anyres tiles of a CLIP-style tower, MLP projector, image_newline rows, "
                      "a Llama/Mistral language model")])
    recipe_fields = RECIPE_FIELDS
    normalisation_fields = NORMALISATION_FIELDS
    fused_vision = None  # anyres tiles and newline rows: the eager forward only

    def model_class(self) -> type:
        return LlavaNextForConditionalGeneration

    def load_processor(self, path: Path) -> Any:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True, backend="pil")
        if is_torchvision_backed(processor.image_processor):
            raise ModelLoadError(
                f"{path}: the image processor resolved to {type(processor.image_processor).__name__}, a torchvision "
                "one; fovea serves LLaVA-NeXT with the PIL/numpy LlavaNextImageProcessor only (the torchvision "
                "one resizes differently). Set image_processor_type to \"LlavaNextImageProcessor\" in "
                "preprocessor_config.json.")
        if not getattr(processor.image_processor, "image_grid_pinpoints", None):
            raise ModelLoadError(f"{path}: the image processor has no image_grid_pinpoints; it is not a "
                                 "LLaVA-NeXT processor.")
        return processor

    def codec(self, processor: Any, image_token_id: int, dtype: torch.dtype) -> LlavaNextCodec:
        image_token = getattr(processor, "image_token", None) or "<image>"
        return LlavaNextCodec(processor, image_token, image_token_id, dtype)

    def vision_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        inner = model.model
        return [inner.vision_tower, inner.multi_modal_projector, NewlineHolder(inner.image_newline)]

    def vision_module_names(self) -> tuple[str, ...]:
        # The image_newline parameter sits at model.image_newline beside these (see vision_modules).
        return ("model.vision_tower", "model.multi_modal_projector")

    def build_vision_modules(self, config: Any) -> dict[str, torch.nn.Module]:
        from transformers import AutoModel
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

        hidden = int(config.text_config.hidden_size)
        # "model" first: the shell puts this holder at model, and the tower and projector inside it,
        # so image_newline lands at model.image_newline as in the full model.
        return {"model": NewlineHolder(torch.nn.Parameter(torch.empty(hidden))),
                "model.vision_tower": AutoModel.from_config(config.vision_config),
                "model.multi_modal_projector": LlavaNextMultiModalProjector(config)}

    def vision_forward(self, loaded: Any) -> Callable[[list[ImageInput]], list[torch.Tensor]]:
        from fovea.models.clip_vision import encode_images

        config = loaded.model.config
        packer = SimpleNamespace(config=config)  # pack_image_features reads only self.config

        @torch.inference_mode()
        def run(images: list[ImageInput]) -> list[torch.Tensor]:
            for image in images:
                check_tiles(config, image)
            pixels = torch.cat([image.pixels for image in images])
            features = encode_images(loaded, pixels)  # [all tiles, tokens per tile, lm_hidden]
            per_image = features.split([image.pixels.shape[0] for image in images])
            sizes = torch.tensor([image.grid[1:] for image in images], dtype=torch.long)
            packed, _ = LlavaNextModel.pack_image_features(
                packer, list(per_image), sizes, config.vision_feature_select_strategy,
                image_newline=loaded.model.model.image_newline)
            return [rows.to(loaded.dtype) for rows in packed]

        return run

    def fixed_image_shape(self, config: Any) -> tuple[int, ...] | None:
        return None  # each image has its own number of tiles

    def dummy_images(self, config: Any, codec: Any, count: int, max_tokens: int | None = None,
                     device: torch.device | str = "cpu") -> list[ImageInput]:
        """Images the size of the pinpoint with the most tiles and tokens (the memory plan's largest)
        among those of at most ``max_tokens`` tokens (the smallest one if none is)."""
        assert codec is not None, "the largest image comes from the processor's image_grid_pinpoints"
        ip = codec.image_processor
        side = tile_side(ip)
        sizes = [(int(h), int(w)) for h, w in ip.image_grid_pinpoints]
        counts = codec.token_counts(sizes)
        options = [((codec.tiles(s), n), s) for s, n in zip(sizes, counts)]
        fitting = [o for o in options if max_tokens is None or o[0][1] <= max_tokens]
        (tiles, tokens), size = max(fitting) if fitting else min(options, key=lambda o: o[0][1])
        channels = int(getattr(config.vision_config, "num_channels", 3))
        return [ImageInput(torch.randn((tiles, channels, side, side), dtype=codec.dtype, device=device), tokens, f"profile-{i}",
                           (tiles, *size)) for i in range(count)]

    def reference_inputs(self, prompt: EncodedPrompt, device: torch.device, image_token_id: int) -> dict[str, Any]:
        if not prompt.images:
            return {}
        return {"pixel_values": torch.cat([image.pixels for image in prompt.images]).to(device),
                "image_sizes": torch.tensor([image.grid[1:] for image in prompt.images], device=device)}
