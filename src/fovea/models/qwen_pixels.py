"""Qwen-VL images in two halves: the resize in the API process, the rest on the model's device.

transformers' ``Qwen2VLImageProcessor`` (PIL backend) resizes each image with ``smart_resize``
and its ``resample`` filter, rescales it in float64 (``image.astype(float64) * rescale_factor``,
then float32), normalises it in float32 (``(x - mean) / std``), repeats it ``temporal_patch_size``
times and cuts it into ``[patches, C * T * P * P]`` rows. On a 1280 x 720 image everything after
the resize is most of the processor's CPU time, and its output (22.5 MB of float32) is eight
times the resized uint8 image (2.8 MB).

So the API process only resizes (``resize_image``: the processor's own size rule and filter) and
sends the ``[H, W, 3]`` uint8 image; the vision stage turns it into the processor's patches on the
device (``PatchRecipe.patches``), bit for bit: the rescale and normalisation map each (channel,
uint8 value) to one float32, so they are computed once per recipe, on the CPU, with the
processor's own arithmetic on the 256 possible values of each channel, and an image is a gather
from that table followed by the patch permute (copies, exact on any device). The recipe is read from the loaded image processor, never written
here. Video frames (``FrameRecipe``) still arrive as patches; an image's pixels are patches too
where the processor is not PIL-based (``host_resize_supported``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image


def is_resized_image(pixels: torch.Tensor) -> bool:
    """True for an image as the API process sends it (``[H, W, C]`` uint8), False for patches."""
    return pixels.dtype == torch.uint8 and pixels.dim() == 3


def host_resize_supported(image_processor: Any) -> bool:
    """Whether the processor resizes with PIL (the PIL backend, or transformers 4.x's slow class), so
    that ``resize_image`` reproduces it; torchvision-based processors resize with torch and keep the
    whole processor in the API process."""
    backend = getattr(image_processor, "backend", None)
    if backend is not None:
        return backend == "pil" and bool(getattr(image_processor, "do_resize", True))
    return not type(image_processor).__name__.endswith("Fast") and bool(getattr(image_processor, "do_resize", True))


def size_rule(image_processor: Any, fallback: Callable[..., tuple[int, int]]) -> Callable[..., tuple[int, int]]:
    """The processor's own ``smart_resize`` (from its module), else ``fallback`` (fovea's copy)."""
    return getattr(sys.modules.get(type(image_processor).__module__), "smart_resize", None) or fallback


def resize_image(image: Image.Image, size: tuple[int, int], resample: Any, convert_rgb: bool) -> torch.Tensor:
    """``image`` as the processor resizes it: RGB (transformers' ``convert_to_rgb``: alpha over
    white), then PIL's ``resize`` to ``size`` = (height, width) with ``resample``; [H, W, 3] uint8."""
    if convert_rgb and image.mode != "RGB":
        from transformers.image_transforms import convert_to_rgb

        image = convert_to_rgb(image)
    if image.mode != "RGB":
        raise ValueError(f"a {image.mode} image: the processor's recipe does not convert it to RGB")
    height, width = size
    resized = image.resize((width, height), resample=resample)
    return torch.from_numpy(np.array(resized))


@dataclass(frozen=True)
class PatchRecipe:
    """What the processor does after the resize, read from the loaded image processor."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of(cls, image_processor: Any) -> PatchRecipe:
        def floats(value: Any) -> tuple[float, ...]:
            return tuple(float(v) for v in value) if isinstance(value, Sequence) else (float(value),) * 3

        return cls(int(image_processor.patch_size), int(image_processor.temporal_patch_size),
                   int(image_processor.merge_size), bool(image_processor.do_rescale),
                   float(image_processor.rescale_factor), bool(image_processor.do_normalize),
                   floats(image_processor.image_mean), floats(image_processor.image_std))

    def normalised(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ([C, ...] uint8) rescaled and normalised as transformers does it in numpy:
        the rescale in float64 and then float32, the normalisation in float32."""
        x = values.to(torch.float64) * self.rescale_factor if self.do_rescale else values
        x = x.to(torch.float32)
        if self.do_normalize:
            shape = (-1,) + (1,) * (x.dim() - 1)
            mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device).view(shape)
            std = torch.tensor(self.std, dtype=torch.float32, device=x.device).view(shape)
            x = (x - mean) / std
        return x

    def patches(self, image: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One resized image ([H, W, C] uint8, on any device) as the processor's ``pixel_values``
        rows ([H/P * W/P, C * T * P * P], on that device): float32 values equal to the processor's,
        cast to ``dtype``."""
        height, width, channels = image.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if height % (p * m) or width % (p * m):
            raise ValueError(f"a {width}x{height} image is not a multiple of {p * m} px: it was not resized "
                             "by this recipe")
        table = _table(self, channels, image.device, dtype)  # [C, 256]
        planes = image.permute(2, 0, 1).reshape(channels, -1).to(torch.int32)
        values = torch.stack([table[c].index_select(0, planes[c]) for c in range(channels)])
        gh, gw = height // p, width // p
        x = values.view(channels, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        x = x.unsqueeze(5).expand(gh // m, gw // m, m, m, channels, t, p, p)
        return x.reshape(gh * gw, channels * t * p * p)


@functools.lru_cache(maxsize=16)
def _table(recipe: PatchRecipe, channels: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[C, 256] on ``device``: each channel's normalised value of every uint8 value, computed on
    the CPU by the recipe's own arithmetic (elementwise, so each entry is exactly what the whole
    image would give there); on the device an image is then only a gather and copies."""
    values = torch.arange(256, dtype=torch.uint8).expand(channels, 256)
    return recipe.normalised(values).to(dtype).contiguous().to(device)


def vision_pixels(images: Sequence[Any], recipe: Callable[[], PatchRecipe], device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """The rows the tower takes for ``images`` (``ImageInput``s) on ``device`` in ``dtype``: resized
    images patched there by ``recipe()`` (read only when one is), patches (videos) as they are."""
    parts, found = [], None
    for image in images:
        pixels = image.pixels.to(device, non_blocking=True)
        if is_resized_image(pixels):
            found = found or recipe()
            parts.append(found.patches(pixels, dtype))
        else:
            parts.append(pixels.to(dtype))
    return torch.cat(parts) if len(parts) > 1 else parts[0]
