"""Qwen-VL images in two halves: the decode (and, on a CPU, the resize) in the API process, the rest
on the model's device.

transformers' ``Qwen2VLImageProcessor`` (PIL backend) resizes each image with ``smart_resize``
and its ``resample`` filter, rescales it in float64 (``image.astype(float64) * rescale_factor``,
then float32), normalises it in float32 (``(x - mean) / std``), repeats it ``temporal_patch_size``
times and cuts it into ``[patches, C * T * P * P]`` rows. On a 1280 x 720 image everything after
the resize is most of the processor's CPU time, and its output (22.5 MB of float32) is eight
times the resized uint8 image (2.8 MB).

So the API process decodes the image (to RGB, as the processor converts it), computes its size
(the processor's own ``smart_resize``: the grid), resizes it unless the vision stage will (below)
and sends the ``[H, W, 3]`` uint8 image; the vision stage turns it into the processor's patches on
the device (``PatchRecipe.patches``), bit for bit.

Where the resize runs: PIL's bicubic resize of a 1280 x 720 photo takes 17-22 ms of the API
process's time before the first token, so when the engine runs on CUDA (``QwenCodec.resize_on_device``,
set at start-up from the model's device) and the processor's filter is BICUBIC, the API process
sends the image at its decoded size and the vision stage resizes it on the device first
(``fovea.models.pil_resize``: Pillow's fixed-point arithmetic and pass order, bit for bit, which
``pil_resize.matches_pillow`` checks against the installed Pillow once; a Pillow it does not match
keeps the resize on the host). The grid fixes the target size (grid * patch_size), so an image whose
uint8 size differs from it is resized there. Images more than ``DEFER_MAX_RATIO`` times the target's
pixels (or over ``DEFER_MAX_PIXELS``) are still resized on the host: their decoded bytes would
cross the shared memory (``engine.process.wire``) and the host link for little. On a CPU-only server
Pillow's resize is faster than ``pil_resize`` on the CPU (~4x), so it stays in the API process
(``resize_image``).

After the resize, the rescale and normalisation map each (channel, uint8 value) to one float32, so
they are computed once per recipe, on the CPU, with the processor's own arithmetic on the 256
possible values of each channel, and an image is a gather from that table followed by the patch
permute (copies, exact on any device). The recipe is read from the loaded image processor, never
written here. Video frames (``FrameRecipe``) still arrive as patches; an image's pixels are patches too
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

DEFER_MAX_RATIO = 4  # an original over 4x the target's pixels is resized on the host
DEFER_MAX_PIXELS = 4096 * 2048  # and so is one over 8 Mpx (24 MiB decoded), whatever its target


def is_resized_image(pixels: torch.Tensor) -> bool:
    """True for an image as the API process sends it (``[H, W, C]`` uint8: resized to its grid's
    size, or at its decoded size for the vision stage to resize), False for patches."""
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


def rgb_image(image: Image.Image, convert_rgb: bool) -> Image.Image:
    """``image`` as the processor takes it before the resize: RGB (transformers' ``convert_to_rgb``:
    alpha over white); any other mode is refused."""
    if convert_rgb and image.mode != "RGB":
        from transformers.image_transforms import convert_to_rgb

        image = convert_to_rgb(image)
    if image.mode != "RGB":
        raise ValueError(f"a {image.mode} image: the processor's recipe does not convert it to RGB")
    return image


def resize_image(image: Image.Image, size: tuple[int, int], resample: Any, convert_rgb: bool,
                 defer: bool = False) -> torch.Tensor:
    """``image`` as the processor resizes it: RGB (``rgb_image``), then PIL's ``resize`` to ``size``
    = (height, width) with ``resample``; [H, W, 3] uint8. ``defer`` (``defers_resize``): the RGB
    image at its own size, for the vision stage to resize on the device, unless it is too large for
    that (``DEFER_MAX_RATIO``, ``DEFER_MAX_PIXELS``)."""
    image = rgb_image(image, convert_rgb)
    height, width = size
    pixels = image.width * image.height
    if not (defer and pixels <= DEFER_MAX_PIXELS and pixels <= DEFER_MAX_RATIO * height * width):
        image = image.resize((width, height), resample=resample)
    return torch.from_numpy(np.array(image))


def defers_resize(resample: Any) -> bool:
    """Whether an image resized with ``resample`` (the processor's filter) can be resized by the
    vision stage instead, bit for bit: BICUBIC, with ``pil_resize`` equal to the installed Pillow."""
    from fovea.models.pil_resize import matches_pillow

    return resample is not None and int(resample) == int(Image.Resampling.BICUBIC) and matches_pillow()


def normalisation_fields(image_processor: Any) -> dict[str, Any]:
    """The processor's rescale and normalisation, as ``PatchRecipe``'s fields of the same names."""
    def floats(value: Any) -> tuple[float, ...]:
        return tuple(float(v) for v in value) if isinstance(value, Sequence) else (float(value),) * 3

    return {"do_rescale": bool(image_processor.do_rescale), "rescale_factor": float(image_processor.rescale_factor),
            "do_normalize": bool(image_processor.do_normalize), "mean": floats(image_processor.image_mean),
            "std": floats(image_processor.image_std)}


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
    resample: int = int(Image.Resampling.BICUBIC)  # the processor's filter: the device resize is BICUBIC's

    @classmethod
    def of(cls, image_processor: Any) -> PatchRecipe:
        return cls(int(image_processor.patch_size), int(image_processor.temporal_patch_size),
                   int(image_processor.merge_size), **normalisation_fields(image_processor),
                   resample=int(Image.Resampling.BICUBIC if getattr(image_processor, "resample", None) is None
                                else image_processor.resample))

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

    def patches(self, image: torch.Tensor, dtype: torch.dtype = torch.float32,
                grid: Sequence[int] | None = None) -> torch.Tensor:
        """One image ([H, W, C] uint8, on any device) as the processor's ``pixel_values`` rows
        ([H/P * W/P, C * T * P * P], on that device): float32 values equal to the processor's, cast
        to ``dtype``. ``grid`` (t, h, w) in patches: an image of another size than h*P x w*P is
        resized to it first, as the processor's PIL resize does it (``resized``)."""
        if grid is not None:
            image = self.resized(image, grid)
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

    def resized(self, image: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """``image`` ([H, W, C] uint8) at ``grid``'s size (h*P x w*P): as it is when it has that
        size, else resized there by ``pil_resize`` (Pillow's bicubic, bit for bit) on its device."""
        size = (int(grid[1]) * self.patch_size, int(grid[2]) * self.patch_size)
        if tuple(image.shape[:2]) == size:
            return image
        if self.resample != int(Image.Resampling.BICUBIC):
            raise ValueError(f"a {image.shape[1]}x{image.shape[0]} image for a {size[1]}x{size[0]} grid: the "
                             f"vision stage resizes only with BICUBIC, not the processor's filter {self.resample}")
        from fovea.models.pil_resize import pil_resize

        return pil_resize(image, size)


@functools.lru_cache(maxsize=16)
def _table(recipe: PatchRecipe, channels: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[C, 256] on ``device``: each channel's normalised value of every uint8 value, computed on
    the CPU by the recipe's own arithmetic (elementwise, so each entry is exactly what the whole
    image would give there); on the device an image is then only a gather and copies."""
    values = torch.arange(256, dtype=torch.uint8).expand(channels, 256)
    return recipe.normalised(values).to(dtype).contiguous().to(device)


def vision_pixels(images: Sequence[Any], recipe: Callable[[], PatchRecipe], device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """The rows the tower takes for ``images`` (``ImageInput``s) on ``device`` in ``dtype``: uint8
    images (resized there first when not at their grid's size) patched there by ``recipe()`` (read
    only when one is), patches (videos) as they are."""
    parts, found = [], None
    for image in images:
        pixels = image.pixels.to(device, non_blocking=True)
        if is_resized_image(pixels):
            found = found or recipe()
            parts.append(found.patches(pixels, dtype, image.grid))
        else:
            parts.append(pixels.to(dtype))
    return torch.cat(parts) if len(parts) > 1 else parts[0]
