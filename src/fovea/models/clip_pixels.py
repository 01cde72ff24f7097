"""CLIP-style images (LLaVA-1.5) prepared as transformers' PIL image processor prepares them, faster.

transformers' PIL backend (``CLIPImageProcessorPil``, what runs where torchvision is not installed)
turns each image into a numpy array, resizes it through PIL, crops it in numpy, rescales it in
float64 and normalises it in float32. At 336 px that is ~2.5 ms of the API process's time per image,
most of it the float64 rescale and the normalisation, before the first token.

Here each step is the processor's own, and only the arithmetic is faster:
- the resize is the same PIL call, to the size transformers' ``get_resize_output_image_size`` gives;
- the crop is transformers' ``center_crop``;
- the rescale and normalisation map each (channel, uint8 value) to one float32. The 256 values of
  each channel are computed once by the processor's arithmetic (``qwen_pixels._table``), and an
  image is a gather from that table.

So the pixel values are the processor's, bit for bit. The contract checks this at start-up on its
probe images (``LlavaAdapter.preprocessing_problem``). Other processors (torchvision-based ones,
or another resize rule) keep the processor's own path (``fast_path_supported``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from fovea.models.qwen_pixels import PatchRecipe, _table, normalisation_fields

# What the processor is told to skip when it is handed these pixels: it then only stacks them and
# expands each image placeholder by their size, as it does for its own.
PREPARED = {"do_convert_rgb": False, "do_resize": False, "do_center_crop": False, "do_rescale": False,
            "do_normalize": False}


def fast_path_supported(image_processor: Any) -> bool:
    """Whether ``clip_pixels`` reproduces ``image_processor``: transformers' PIL backend, a resize
    of the shortest edge (or none) and a crop to a height and width (or none), no padding."""
    if getattr(image_processor, "backend", None) != "pil" or getattr(image_processor, "do_pad", False):
        return False
    size, crop = getattr(image_processor, "size", None), getattr(image_processor, "crop_size", None)
    resize_ok = not getattr(image_processor, "do_resize", False) or (
        size is not None and bool(getattr(size, "shortest_edge", None)) and not getattr(size, "longest_edge", None))
    crop_ok = not getattr(image_processor, "do_center_crop", False) or (
        crop is not None and bool(getattr(crop, "height", None)) and bool(getattr(crop, "width", None)))
    return resize_ok and crop_ok


def normalisation(image_processor: Any) -> PatchRecipe:
    """The processor's rescale and normalisation (a ``PatchRecipe`` whose patch fields go unused)."""
    return PatchRecipe(1, 1, 1, **normalisation_fields(image_processor))


def clip_pixels(image: Image.Image, image_processor: Any) -> torch.Tensor:
    """``image`` (RGB, as fovea decodes every image) as the processor's float32 ``pixel_values`` row
    ([C, H, W]), bit for bit, for a processor ``fast_path_supported`` takes."""
    from transformers.image_transforms import center_crop, get_resize_output_image_size
    from transformers.image_utils import ChannelDimension

    if image.mode != "RGB":
        raise ValueError(f"a {image.mode} image: fovea decodes images to RGB before the processor")
    if image_processor.do_resize:
        # (the rule reads only the array's shape: a broadcast view, not a copy of the image)
        shape_only = np.broadcast_to(np.uint8(0), (image.height, image.width, 3))
        height, width = get_resize_output_image_size(shape_only, size=image_processor.size.shortest_edge,
                                                      default_to_square=False,
                                                      input_data_format=ChannelDimension.LAST)
        if (width, height) != image.size:  # (PIL returns a copy at the same size)
            image = image.resize((width, height), resample=image_processor.resample)
    pixels = np.array(image)  # [H, W, C] uint8, writable
    if image_processor.do_center_crop:
        crop = image_processor.crop_size
        pixels = np.ascontiguousarray(center_crop(pixels, (crop.height, crop.width),
                                                  input_data_format=ChannelDimension.LAST))
    height, width, channels = pixels.shape
    table = _table(normalisation(image_processor), channels, torch.device("cpu"), torch.float32)
    planes = torch.from_numpy(pixels).permute(2, 0, 1).reshape(channels, -1).to(torch.int32)
    return torch.stack([table[c].index_select(0, planes[c]) for c in range(channels)]).view(channels, height, width)
