"""Pillow's bicubic resize of 8-bit images, bit for bit, in torch (on any device).

Pillow resamples a uint8 image in two separable passes (``src/libImaging/Resample.c``): for each
output position along an axis, ``precompute_coeffs`` computes the bicubic (a = -0.5) weights of
the input pixels in double precision (support 2 * max(scale, 1), weights normalised by their
sum), ``normalize_coeffs_8bpc`` rounds them to fixed point with 22 fractional bits, and a pass is
``clip8(2^21 + sum(pixel * coeff))``: 0 below zero, 255 at or above 2^30, else ``acc >> 22``.
The result of the first pass is stored as uint8 before the second runs, and a pass is skipped
when its axis keeps its size.

Every value here is an integer: the coefficient tables are computed in float64 on the CPU exactly
as Pillow computes them, the sums are int32 (or int64 where a table could overflow int32), so the
output does not depend on the device or on the order of the additions.

The order of the passes is Pillow's own choice, and it changes the result (the intermediate image
is rounded to uint8). It differs between releases (``RULES``): up to 12.1 the horizontal pass is
always first; 12.2 and 12.3 run the vertical pass first for a shrinking image more than 100 times
taller than wide; 13.0 (python-pillow/Pillow#9549, "if height is scaled down significantly more
than width, resize vertically first") when the height shrinks by more than twice as many pixels
as the width. ``pillow_rule`` finds the installed Pillow's rule once, by comparing; callers use the
device resize only where one matched (``matches_pillow``) and resize with Pillow otherwise.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

PRECISION_BITS = 22
_HALF = 1 << (PRECISION_BITS - 1)
_INT32_LIMIT = 1 << 31
CHUNK_ELEMENTS = 1 << 22  # outputs of a pass computed at once: 16 MiB per int32 temporary


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's ``bicubic_filter`` (a = -0.5), elementwise in float64, each branch's operations in
    the C code's order (so each weight is the same double)."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=64)
def _host_coeffs(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """([out, k] int64 input indices, [out, k] int64 fixed-point coefficients) of one pass from
    ``in_size`` to ``out_size`` pixels, as Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc``
    compute them, vectorised over the outputs with the same double operations in the same order
    (unused taps: coefficient 0 at a valid index)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ksize = math.ceil(support) * 2 + 1
    ss = 1.0 / filterscale
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C's (int): toward zero
    xmax = np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin
    taps = np.arange(ksize, dtype=np.int64)
    used = taps[None, :] < xmax[:, None]
    position = (taps[None, :] + xmin[:, None]).astype(np.float64)  # C: x + xmin, an int, then - center
    weights = np.where(used, _bicubic((position - center[:, None] + 0.5) * ss), 0.0)
    total = np.zeros(out_size, dtype=np.float64)
    for k in range(ksize):  # summed tap by tap, as the C loop (the unused taps add 0.0)
        total = total + weights[:, k]
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None], weights)
    unit = float(1 << PRECISION_BITS)
    scaled = weights * unit
    coeff = np.where(used, np.where(weights < 0, -0.5 + scaled, 0.5 + scaled).astype(np.int64), 0)
    index = np.where(used, taps[None, :] + xmin[:, None], xmin[:, None])
    return index, coeff


@functools.lru_cache(maxsize=32)
def _coeffs(in_size: int, out_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``_host_coeffs`` on ``device``: indices [k, out] int64, coefficients [k, out] in the
    accumulator's dtype (int32 unless a sum could leave int32's range)."""
    index, coeff = _host_coeffs(in_size, out_size)
    bound = _HALF + 255 * int(np.abs(coeff).sum(axis=1).max())
    dtype = torch.int32 if bound < _INT32_LIMIT else torch.int64
    return (torch.from_numpy(index.T.copy()).to(device),
            torch.from_numpy(coeff.T.copy()).to(dtype).to(device))


def _pass(image: torch.Tensor, out_size: int, axis: int) -> torch.Tensor:
    """One resampling pass of ``image`` ([H, W, C] uint8) along ``axis`` (0: rows, vertical;
    1: columns, horizontal) to ``out_size``; uint8, as Pillow stores its intermediate image. In
    slices across the other axis of at most ``CHUNK_ELEMENTS`` outputs, so that the integer
    temporaries stay small (~50 MB) whatever the image."""
    index, coeff = _coeffs(image.shape[axis], out_size, image.device)
    shape = [1, 1, 1]
    shape[axis] = out_size
    taps = coeff.view(-1, *shape)
    across = 1 - axis
    out_shape = list(image.shape)
    out_shape[axis] = out_size
    out = torch.empty(out_shape, dtype=torch.uint8, device=image.device)
    step = max(1, CHUNK_ELEMENTS // (out_size * image.shape[2]))
    for start in range(0, image.shape[across], step):
        part = image.narrow(across, start, min(step, image.shape[across] - start))
        acc = None
        for k in range(index.shape[0]):  # a few taps (5 for bicubic up to 1x, ~13 at 3x down)
            term = part.index_select(axis, index[k]).to(coeff.dtype) * taps[k]
            acc = term if acc is None else acc.add_(term)
        acc.add_(_HALF)
        # clip8: Pillow looks ``acc >> 22`` up in a table that is 0 below 0 and 255 from 255 on
        out.narrow(across, start, part.shape[across]).copy_(
            torch.bitwise_right_shift(acc, PRECISION_BITS).clamp_(0, 255))
    return out


def _rule_pillow13(source: tuple[int, int], target: tuple[int, int]) -> bool:
    """Pillow 13.0: vertical first when the height shrinks by more than twice as many pixels as
    the width (python-pillow/Pillow#9549; fitted with 0 misses on 1,455 cases where the order matters)."""
    (in_h, in_w), (out_h, out_w) = source, target
    return out_h < in_h and in_h - out_h > 2 * (in_w - out_w)


def _rule_tall_strips(source: tuple[int, int], target: tuple[int, int]) -> bool:
    """Pillow 12.2-12.3: vertical first when the height shrinks and is more than 100 times the width."""
    (in_h, in_w), (out_h, _) = source, target
    return out_h < in_h and in_h > 100 * in_w


def _rule_horizontal(source: tuple[int, int], target: tuple[int, int]) -> bool:
    """Pillow up to 12.1 (and PIL's Resample.c of old): the horizontal pass always first."""
    return False


# The pass-order rules of the Pillow releases checked (against 12.0, 12.1, 12.2, 12.3 and 13.0 on
# 368 size pairs where the order matters: each release matches exactly one rule). The installed
# Pillow's is found by ``pillow_rule``, not guessed from its version.
RULES = {"pillow13": _rule_pillow13, "tall-strips": _rule_tall_strips, "horizontal-first": _rule_horizontal}


def _vertical_first(source: tuple[int, int], target: tuple[int, int]) -> bool:
    """Whether the installed Pillow runs the vertical pass first for (height, width) ``source`` ->
    ``target`` when both axes change: its rule as ``matches_pillow`` found it (Pillow 13's if
    none matched; the device path is not used then)."""
    return RULES[pillow_rule() or "pillow13"](source, target)


def pil_resize(image: torch.Tensor, size: tuple[int, int], vertical_first: bool | None = None) -> torch.Tensor:
    """``image`` ([H, W, C] uint8, any device) resized to ``size`` = (height, width) exactly as
    ``Image.fromarray(image).resize((width, height), Image.Resampling.BICUBIC)`` does it (an RGB
    or L image; Pillow premultiplies RGBA by alpha first, which this does not); same device.
    ``vertical_first`` forces the pass order (tests); None is Pillow's own rule."""
    if image.dtype != torch.uint8 or image.dim() != 3:
        raise ValueError(f"pil_resize takes an [H, W, C] uint8 image, not {image.dtype} {tuple(image.shape)}")
    height, width = int(size[0]), int(size[1])
    if height < 1 or width < 1 or image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"cannot resize a {tuple(image.shape)} image to {(height, width)}")
    need_h, need_v = width != image.shape[1], height != image.shape[0]
    if vertical_first is None:
        vertical_first = need_h and need_v and _vertical_first(tuple(image.shape[:2]), (height, width))
    out = image
    if vertical_first:
        if need_v:
            out = _pass(out, height, 0)
        if need_h:
            out = _pass(out, width, 1)
    else:
        if need_h:
            out = _pass(out, width, 1)
        if need_v:
            out = _pass(out, height, 0)
    return out.clone() if out is image else out


# (source width, height) -> (target width, height): both orders under each rule (a tall strip,
# heights reduced more than twice the width's reduction, and neither), one axis unchanged,
# upscales, a 1-px side, Qwen-like targets
SELF_CHECK_CASES = (((64, 48), (56, 56)), ((61, 47), (28, 84)), ((90, 40), (84, 14)), ((40, 90), (14, 84)),
                    ((33, 80), (30, 20)), ((80, 33), (20, 30)), ((50, 50), (50, 23)), ((50, 50), (77, 50)),
                    ((1, 9), (3, 5)), ((3, 101), (2, 7)), ((130, 70), (140, 84)), ((97, 130), (56, 28)),
                    ((3, 301), (5, 56)), ((3, 300), (5, 56)), ((60, 100), (40, 59)))


@functools.lru_cache(maxsize=1)
def pillow_rule() -> str | None:
    """The name of the rule in ``RULES`` under which ``pil_resize`` equals the installed Pillow's
    bicubic resize on a few pseudo-random RGB images (CPU, a few tens of ms; run once), or None
    where none does."""
    from PIL import Image

    rng = np.random.default_rng(20261203)
    cases = []
    for (w0, h0), (w1, h1) in SELF_CHECK_CASES:
        src = rng.integers(0, 256, (h0, w0, 3), dtype=np.uint8)
        src[: h0 // 2] = src[: h0 // 2] // 64 * 85  # flat areas and hard edges: overshoot and clipping
        cases.append((src, (h1, w1), np.asarray(Image.fromarray(src).resize((w1, h1), Image.Resampling.BICUBIC))))
    for name, rule in RULES.items():
        try:
            if all(np.array_equal(pil_resize(torch.from_numpy(src), size, vertical_first=bool(
                    rule(src.shape[:2], size))).numpy(), want) for src, size, want in cases):
                return name
        except Exception:  # noqa: BLE001 - any failure means: do not use it
            return None
    return None


def matches_pillow() -> bool:
    """Whether ``pil_resize`` equals the installed Pillow's bicubic resize under one of the known
    pass-order rules (``pillow_rule``): the device resize is used only when it does, so a Pillow
    with another rule falls back to resizing with Pillow."""
    return pillow_rule() is not None
