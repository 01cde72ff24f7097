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

- **Videos** (``<|video_pad|>``): frames sampled at the video processor's ``fps`` (fovea.media.video)
  are resized with Qwen's smart resize within the video processor's own min/max pixels, normalised
  and cut into ``temporal_patch_size`` x 14 x 14 patches here, in torch (``VideoRecipe``), in
  ``Qwen2VLVideoProcessor``'s patch order; the last frame is repeated to fill the last temporal
  patch. The tower takes them as it takes an image, with grid (t, h, w); their temporal M-RoPE
  positions step by ``tokens_per_second * seconds_per_grid``, as transformers' ``get_rope_index``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from fovea.errors import InvalidRequest
from fovea.models.base import (
    DEFAULT_OPTIONS,
    LOW_DETAIL_PIXELS,
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
from fovea.models.qwen_pixels import (
    PatchRecipe,
    defers_resize,
    host_resize_supported,
    resize_image,
    size_rule,
    vision_pixels,
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


VIDEO_TOKEN = "<|video_pad|>"
# Qwen2VLVideoProcessor's class defaults, for keys its config leaves out.
VIDEO_DEFAULTS = {"min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28, "fps": 2.0, "min_frames": 4,
                  "max_frames": 768}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``qwen2_vl`` smart_resize: both sides multiples of ``factor``, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def read_video_config(path: Path) -> dict:
    """The video processor's settings as transformers loads them: processor_config.json's
    ``video_processor``, else video_preprocessor_config.json, else preprocessor_config.json."""
    raw: dict = {}
    nested = path / "processor_config.json"
    if nested.is_file():
        raw = json.loads(nested.read_text()).get("video_processor") or {}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if not raw and (path / name).is_file():
            raw = json.loads((path / name).read_text())
    return raw


@dataclass(frozen=True)
class FrameRecipe:
    """What a Qwen video processor does to a video's frames, read from the model's files: the
    part Qwen2.5-VL and Qwen3-VL share. Each family's recipe reads its files and sizes the frames
    its own way (``read``, ``resized``)."""

    min_pixels: int
    max_pixels: int
    fps: float
    min_frames: int
    max_frames: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float
    token_id: int

    def resized(self, frames: int, height: int, width: int) -> tuple[int, int]:
        raise NotImplementedError

    @staticmethod
    def patching(raw: dict[str, Any], image_processor: Any, config: Any) -> dict[str, Any]:
        """The fields both families read alike: patching and normalisation from the video
        config (``raw``), else the image processor's; the video token from the model config."""
        return {"patch_size": int(raw.get("patch_size") or image_processor.patch_size),
                "temporal_patch_size": int(raw.get("temporal_patch_size") or image_processor.temporal_patch_size),
                "merge_size": int(raw.get("merge_size") or image_processor.merge_size),
                "mean": tuple(float(v) for v in raw.get("image_mean") or image_processor.image_mean),
                "std": tuple(float(v) for v in raw.get("image_std") or image_processor.image_std),
                "rescale_factor": float(raw.get("rescale_factor") or image_processor.rescale_factor),
                "token_id": int(config.video_token_id)}

    def pixels(self, frames: list[Image.Image]) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """[t*h*w, C*T*P*P] float32 patches and the grid (t, h, w), in the video processor's layout."""
        width, height = frames[0].size
        if max(width, height) / max(1, min(width, height)) > MAX_ASPECT:
            raise InvalidRequest(f"the video is {width}x{height} px: its aspect ratio is over {MAX_ASPECT}:1, which "
                                 "this model's processor cannot tile; crop it.", code="invalid_video")
        rh, rw = self.resized(len(frames), height, width)
        stack = np.stack([np.asarray(f.convert("RGB").resize((rw, rh), Image.Resampling.BICUBIC)) for f in frames])
        video = torch.from_numpy(stack).permute(0, 3, 1, 2).to(torch.float32) * self.rescale_factor
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        video = (video - mean) / std
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -video.shape[0] % tp:  # the last frame repeated, as the processor pads
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        frames_n, channels = video.shape[:2]
        gt, gh, gw = frames_n // tp, rh // p, rw // p
        patches = video.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(gt * gh * gw, channels * tp * p * p), (gt, gh, gw)


@dataclass(frozen=True)
class VideoRecipe(FrameRecipe):
    """What Qwen2VLVideoProcessor does to a video's frames (its frames resized as images are)."""

    tokens_per_second: float = 0.0

    @classmethod
    def read(cls, path: Path, image_processor: Any, config: Any) -> VideoRecipe:
        """As transformers' video processor loads: processor_config.json's ``video_processor``,
        else video_preprocessor_config.json, else preprocessor_config.json (the image
        processor's: Qwen2.5-VL checkpoints ship only that), then the class defaults."""
        raw = read_video_config(path)
        size = raw.get("size") or {}

        def get(key: str, size_key: str | None = None) -> Any:
            value = raw.get(key)
            if value is None and size_key:
                value = size.get(size_key)
            return VIDEO_DEFAULTS[key] if value is None else value

        return cls(min_pixels=int(get("min_pixels", "shortest_edge")), max_pixels=int(get("max_pixels", "longest_edge")),
                   fps=float(get("fps")), min_frames=int(get("min_frames")), max_frames=int(get("max_frames")),
                   tokens_per_second=float(config.vision_config.tokens_per_second),
                   **cls.patching(raw, image_processor, config))

    def resized(self, frames: int, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)


@dataclass
class QwenProcessor:
    """The parts of Qwen2.5-VL's processor that fovea needs: tokenizer, image processor and,
    torchvision-free, the video recipe."""

    tokenizer: Any
    image_processor: Any
    video: VideoRecipe | None = None

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def mrope_positions(input_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]],
                    merge: int, intervals: list[torch.Tensor | float | None] | None = None
                    ) -> tuple[list[list[int]], int]:
    """The prompt's three position rows and the delta of every position past it (as
    transformers' ``get_rope_index``). ``intervals[k]``: None for an image, else the video's
    ``tokens_per_second * seconds_per_grid`` (its temporal positions are ``floor(ti * interval)``;
    the text after it resumes at start + max(rows, columns), as transformers 5.x)."""
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
        interval = intervals[image] if intervals else None
        if interval is not None:
            temporal = (torch.arange(t) * interval).long().tolist()  # get_vision_position_ids' arithmetic
            for ti in range(t):
                for hi in range(lh):
                    for wi in range(lw):
                        rows[0].append(current + temporal[ti])
                        rows[1].append(current + hi)
                        rows[2].append(current + wi)
            i += t * lh * lw
            current += max(lh, lw)
            image += 1
            continue
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
    # Whether images go to the vision stage at their decoded size, for it to resize them on the
    # device (qwen_pixels): set at start-up where the model runs on CUDA (fovea.loading.loader),
    # and used only where the processor's filter is BICUBIC and pil_resize matches this Pillow.
    resize_on_device = False

    def __init__(self, processor: QwenProcessor, image_token: str, image_token_id: int, dtype: torch.dtype) -> None:
        super().__init__(processor, image_token, image_token_id, dtype)
        self.merge = int(getattr(processor.image_processor, "merge_size", 2))
        self.video = getattr(processor, "video", None)
        self.video_token = VIDEO_TOKEN if self.video is not None else None

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

    def _bounds(self, max_pixels: int | None) -> tuple[int, int]:
        """(min_pixels, max_pixels) of the resize; ``max_pixels`` caps the model's own bound
        (image_url.detail "low")."""
        low, high = pixel_bounds(self.image_processor)
        return (low, high) if max_pixels is None or max_pixels >= high else (low, max(low, max_pixels))

    def _upsized(self, images: list[Image.Image]) -> list[Image.Image]:
        """Older processors refuse sides under one 28 px tile (vllm#21109): those images resized up
        to the model's minimum, for the processor to take it from there."""
        factor = self._factor()
        return [im if min(im.size) >= factor else im.resize(
            (max(factor, round(im.size[0] * factor / min(im.size))),
             max(factor, round(im.size[1] * factor / min(im.size)))), Image.Resampling.BICUBIC)
            for im in images]

    def _preprocess(self, images: list[Image.Image], max_pixels: int | None = None
                    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The processor's own patches and grids for ``images`` (the whole processor, on the host);
        ``max_pixels`` caps the model's own bound (image_url.detail "low")."""
        low, high = self._bounds(max_pixels)
        kwargs = {} if high == pixel_bounds(self.image_processor)[1] else \
            {"size": {"shortest_edge": low, "longest_edge": high}}
        try:
            out = self.image_processor(images=images, return_tensors="pt", **kwargs)
        except ValueError as exc:
            if "factor" not in str(exc) and "smaller" not in str(exc):
                raise
            out = self.image_processor(images=self._upsized(images), return_tensors="pt", **kwargs)
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        return out["pixel_values"].to(self.dtype), grids

    def _resized(self, images: list[Image.Image], max_pixels: int | None = None) -> list[ImageInput]:
        """Each image resized as the processor resizes it (its ``smart_resize`` within its bounds,
        its ``resample`` filter): [H, W, 3] uint8 pixels, which the vision stage patches on the
        device (``qwen_pixels``); the grid is the processor's. With ``resize_on_device`` the pixels
        are the decoded RGB image at its own size (unless it is much larger than its target), which
        the vision stage resizes to the grid's size first; the key covers its pixels and grid."""
        ip = self.image_processor
        low, high = self._bounds(max_pixels)
        rule, factor, patch = size_rule(ip, smart_resize), self._factor(), int(ip.patch_size)
        convert = bool(getattr(ip, "do_convert_rgb", True))
        defer = self.resize_on_device and defers_resize(ip.resample)
        out = []
        for image in images:
            try:
                height, width = rule(image.height, image.width, factor=factor, min_pixels=low, max_pixels=high)
            except ValueError as exc:
                if "factor" not in str(exc) and "smaller" not in str(exc):
                    raise
                image = self._upsized([image])[0]
                height, width = rule(image.height, image.width, factor=factor, min_pixels=low, max_pixels=high)
            pixels = resize_image(image, (height, width), ip.resample, convert, defer)
            grid = (1, height // patch, width // patch)
            out.append(ImageInput(pixels, grid[1] * grid[2] // (self.merge * self.merge), pixel_hash(pixels, grid),
                                  grid))
        return out

    def check_media(self, text: str, images: list[Image.Image], videos: list[Any] | None,
                    template_rendered: bool) -> list[Any]:
        """The prompt's image and video placeholders against what came with it: the videos, as a list."""
        videos = list(videos or [])
        check_placeholders(text, self.image_token, len(images), template_rendered)
        if videos and self.video is None:
            raise InvalidRequest("this model's files describe no video processor", code="videos_not_supported")
        if text.count(VIDEO_TOKEN) != len(videos):
            raise PlaceholderMismatch(f"the prompt contains {text.count(VIDEO_TOKEN)} video placeholder(s) "
                                      f"({VIDEO_TOKEN!r}) for {len(videos)} video(s)",
                                      status=500 if template_rendered else 400)
        return videos

    def _video_input(self, video: Any) -> ImageInput:
        """One decoded video (fovea.media.video.DecodedVideo) as the tower takes it."""
        assert self.video is not None
        pixels, grid = self.video.pixels(video.frames)
        pixels = pixels.to(self.dtype)
        seconds = self.video.temporal_patch_size / video.sampled_fps  # the processor's second_per_grid_ts
        # Its positions depend on seconds_per_grid as well as its pixels: both key the caches.
        key = hashlib.sha256(f"{pixel_hash(pixels, grid)}|video|{seconds!r}".encode()).hexdigest()
        return ImageInput(pixels, grid[0] * grid[1] * grid[2] // (self.merge * self.merge), key, grid, seconds,
                          self.video.token_id)

    def encode(self, text: str, images: list[Image.Image], *, template_rendered: bool = True,
               options: EncodeOptions = DEFAULT_OPTIONS, videos: list[Any] | None = None) -> EncodedPrompt:
        videos = self.check_media(text, images, videos, template_rendered)
        ids = self._checked_ids(text, len(images), template_rendered, len(videos), "video(s)", options=options)
        if not images and not videos:
            return EncodedPrompt(list(ids), [], text)
        video_inputs = [self._video_input(video) for video in videos]
        inputs, expanded = self._expanded(ids, self._image_inputs(images, options), video_inputs)
        intervals = [None if item.seconds_per_grid is None else
                     self.video.tokens_per_second * torch.tensor(item.seconds_per_grid)  # float32, as transformers
                     for item in inputs] if videos else None
        rows, delta = mrope_positions(expanded, self.image_token_id, [item.grid for item in inputs], self.merge,
                                      intervals)
        return EncodedPrompt(expanded, inputs, text, rows, delta)

    def _checked_ids(self, text: str, images: int, template_rendered: bool, video_slots: int, video_what: str,
                     video_status: int = 400, options: EncodeOptions = DEFAULT_OPTIONS) -> list[int]:
        """The text's token ids, once its image and video tokens are one per image and per video
        slot (``video_what`` names the slots; ``video_status`` 500 where fovea wrote them)."""
        kwargs = self.tokenizer_kwargs(text, template_rendered, options)
        ids = self.tokenizer(text, **kwargs)["input_ids"]
        placeholders = sum(1 for t in ids if t == self.image_token_id)
        if placeholders != images:
            raise PlaceholderMismatch(
                f"the text tokenizes to {placeholders} {self.image_token!r} token(s) for {images} image(s)"
                + ("; the text must not contain the image token itself" if not template_rendered else ""))
        video_id = self.video.token_id if self.video is not None else None
        videos = sum(1 for t in ids if t == video_id)
        if videos != video_slots:
            raise PlaceholderMismatch(f"the text tokenizes to {videos} video token(s) for {video_slots} {video_what}",
                                      status=video_status if video_slots else 400)
        return ids

    def _expanded(self, ids: list[int], images: list[ImageInput],
                  videos: list[ImageInput]) -> tuple[list[ImageInput], list[int]]:
        """The vision inputs in prompt order, and the ids with each vision slot expanded to its
        tokens: every slot carries the image token in the engine's ids."""
        video_id = self.video.token_id if self.video is not None else None
        inputs, expanded = [], []
        pending_images, pending_videos = iter(images), iter(videos)
        for token in ids:
            if token == self.image_token_id or (videos and token == video_id):
                item = next(pending_images if token == self.image_token_id else pending_videos)
                inputs.append(item)
                expanded.extend([self.image_token_id] * item.num_tokens)
            else:
                expanded.append(token)
        return inputs, expanded

    def _image_inputs(self, images: list[Image.Image], options: EncodeOptions = DEFAULT_OPTIONS) -> list[ImageInput]:
        """Each image's pixels, tokens after the merge and key: the resized uint8 image where the
        processor resizes with PIL (the vision stage patches it on the device), else its patches (a
        slice of the processor's batch). Images sent with detail "low" are resized within
        LOW_DETAIL_PIXELS."""
        for index, image in enumerate(images):
            width, height = image.size
            if max(width, height) / max(1, min(width, height)) > MAX_ASPECT:
                raise InvalidRequest(
                    f"image {index} is {width}x{height} px: its aspect ratio is over {MAX_ASPECT}:1, which this "
                    "model's processor cannot tile; crop it.", code="invalid_image")
        out: list[ImageInput | None] = [None] * len(images)
        low = [options.is_low(i) for i in range(len(images))]
        for cap in (None, LOW_DETAIL_PIXELS):
            indices = [i for i in range(len(images)) if low[i] == (cap is not None)]
            if indices:
                chosen = [images[i] for i in indices]
                if host_resize_supported(self.image_processor):
                    items = self._resized(chosen, cap)
                else:
                    items = self._sliced(*self._preprocess(chosen, cap))
                for i, item in zip(indices, items, strict=True):
                    out[i] = item
        return out  # type: ignore[return-value]

    def _sliced(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[ImageInput]:
        out, offset = [], 0
        for grid in grids:
            patches = grid[0] * grid[1] * grid[2]
            chunk = pixels[offset:offset + patches]
            offset += patches
            out.append(ImageInput(chunk, patches // (self.merge * self.merge), pixel_hash(chunk, grid), grid))
        if offset != pixels.shape[0]:
            raise PlaceholderMismatch(f"the processor returned {pixels.shape[0]} patches for grids summing to {offset}",
                                      status=500)
        return out


class Qwen2_5_VLAdapter(ModelAdapter):
    family = Family("qwen2_5_vl", ("qwen2_5_vl",),
                    ["Qwen2.5-VL: dynamic resolution, window-attention ViT, Qwen2 language model with M-RoPE"])
    recipe_fields = RECIPE_FIELDS
    normalisation_fields = NORMALISATION_FIELDS
    video_recipe: type[FrameRecipe] = VideoRecipe  # what the family's video processor does
    codec_class: type[QwenCodec] = QwenCodec
    fused_vision = "qwen2_5_vit"  # engine.vision.qwen_vision_fused: window attention, RMSNorm, SiLU-gated MLP

    def model_class(self) -> type:
        return Qwen2_5_VLForConditionalGeneration

    def load_processor(self, path: Path) -> QwenProcessor:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        # The PIL backend on every machine: with torchvision installed transformers would pick its
        # torchvision twin, whose resize differs from PIL's and which the device patching
        # (qwen_pixels) does not reproduce, so the same model would preprocess differently by host.
        image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
        template = path / "chat_template.jinja"
        if not getattr(tokenizer, "chat_template", None) and template.is_file():
            tokenizer.chat_template = template.read_text()
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        video = self.video_recipe.read(path, image_processor, config) if getattr(config, "video_token_id", None) \
            else None
        return QwenProcessor(tokenizer, image_processor, video)  # type: ignore[arg-type]

    def codec(self, processor: QwenProcessor, image_token_id: int, dtype: torch.dtype) -> QwenCodec:
        self._image_processor = processor.image_processor  # the patch recipe's source (patch_recipe)
        return self.codec_class(processor, "<|image_pad|>", image_token_id, dtype)

    _image_processor: Any = None

    def image_processor_of(self, loaded: Any = None) -> Any:
        """The loaded image processor: the model's codec's (a --processor-override included), else
        (an encode worker's vision part, which has no codec) the model directory's, read once."""
        codec = getattr(loaded, "codec", None)
        processor = codec.image_processor if codec is not None else self._image_processor
        if processor is None:
            processor = self._image_processor = AutoImageProcessor.from_pretrained(loaded.path, local_files_only=True,
                                                                                   backend="pil")
        return processor

    def patch_recipe(self, loaded: Any = None) -> PatchRecipe:
        """What the vision stage does to a resized image (``qwen_pixels``), read now from the loaded
        image processor."""
        return PatchRecipe.of(self.image_processor_of(loaded))

    def preprocessing_problem(self, loaded: Any, images: list[Image.Image]) -> str | None:
        """None if the codec's pixels for ``images``, patched as the vision stage patches them, equal
        the image processor's own ``pixel_values`` and grids bit for bit, else how they differ."""
        codec = loaded.codec
        if not host_resize_supported(codec.image_processor):
            return None  # the processor's own patches cross as they are
        items = codec._image_inputs(images)
        theirs = codec.image_processor(images=images, return_tensors="pt")
        grids = [tuple(int(v) for v in g) for g in theirs["image_grid_thw"].tolist()]
        if [item.grid for item in items] != grids:
            return f"grids {[item.grid for item in items]}, the processor's {grids}"
        # On the model's device, as the vision stage runs (where it resizes too, on CUDA: pil_resize's kernels).
        ours = vision_pixels(items, lambda: self.patch_recipe(loaded), loaded.device, torch.float32).cpu()
        want = theirs["pixel_values"].to(torch.float32)
        if ours.shape != want.shape or not torch.equal(ours, want):
            worst = (ours - want).abs().max().item() if ours.shape == want.shape else float("nan")
            return f"patches {tuple(ours.shape)} differing by up to {worst:.3g} from the processor's {tuple(want.shape)}"
        return None

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
            pixels = vision_pixels(images, lambda: self.patch_recipe(loaded), loaded.device, vision_dtype)
            grid = torch.tensor([image.grid for image in images], dtype=torch.long, device=pixels.device)
            with grouped(visual):  # windows and images of one size in one SDPA call each
                rows = self.vision_rows(visual(pixels, grid_thw=grid))
            return list(rows.to(dtype).split([image.num_tokens for image in images]))

        return run

    @staticmethod
    def vision_rows(out: Any) -> torch.Tensor:
        """The tower's output as one row per image token (transformers 5.x returns an object)."""
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    def dummy_images(self, config: Any, codec: PromptCodec | None, count: int,
                     max_tokens: int | None = None, device: torch.device | str = "cpu") -> list[ImageInput]:
        assert codec is not None, "the largest image comes from the processor's max_pixels"
        ip = codec.image_processor
        patch, merge, temporal = int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size)
        side = int((pixel_bounds(ip)[1] ** 0.5) // (patch * merge)) * merge  # patches per side of the largest square
        if max_tokens is not None:  # (side / merge)^2 image tokens must fit a prompt
            side = max(merge, min(side, math.isqrt(max(1, max_tokens)) * merge))
        width = 3 * temporal * patch * patch
        resized = host_resize_supported(ip)  # as the codec sends them: resized uint8 images, else patches
        out = []
        for index in range(count):
            pixels = torch.randint(0, 256, (side * patch, side * patch, 3), dtype=torch.uint8, device=device) \
                if resized else torch.randn((side * side, width), dtype=codec.dtype, device=device)
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

    def reference_ids(self, prompt: EncodedPrompt, image_token_id: int) -> list[int]:
        out, slots = [], iter(item for item in prompt.images for _ in range(item.num_tokens))
        for token in prompt.input_ids:
            if token == image_token_id:
                item = next(slots)
                out.append(item.token_id if item.token_id is not None else token)
            else:
                out.append(token)
        return out

    @staticmethod
    def _split(prompt: EncodedPrompt) -> tuple[list[ImageInput], list[ImageInput]]:
        return ([i for i in prompt.images if i.seconds_per_grid is None],
                [i for i in prompt.images if i.seconds_per_grid is not None])

    def _token_types(self, ids: torch.Tensor, prompt: EncodedPrompt, image_token_id: int) -> torch.Tensor:
        types = (ids == image_token_id).int()
        videos = {i.token_id for i in prompt.images if i.token_id is not None}
        for token in videos:
            types[ids == token] = 2
        return types

    def reference_positions(self, model: torch.nn.Module, prompt: EncodedPrompt,
                            image_token_id: int) -> tuple[list[list[int]], int] | None:
        ids = torch.tensor([self.reference_ids(prompt, image_token_id)])
        images, videos = self._split(prompt)
        grid = torch.tensor([image.grid for image in images]) if images else None
        video_grid = torch.tensor([video.grid for video in videos]) if videos else None
        timing = self.video_timing(videos, torch.device("cpu"))
        try:
            rows, delta = model.model.get_rope_index(ids, mm_token_type_ids=self._token_types(ids, prompt, image_token_id),
                                                     image_grid_thw=grid, video_grid_thw=video_grid, **timing)
        except TypeError:  # transformers before the mm_token_type_ids argument
            rows, delta = model.model.get_rope_index(ids, image_grid_thw=grid, video_grid_thw=video_grid, **timing)
        return rows[:, 0].tolist(), int(delta)

    @staticmethod
    def video_timing(videos: list[ImageInput], device: torch.device) -> dict[str, Any]:
        """What transformers takes about the videos' time beside their grids: Qwen2.5-VL's
        seconds per temporal patch (Qwen3-VL puts time in the prompt's text instead)."""
        if not videos:
            return {}
        return {"second_per_grid_ts": torch.tensor([video.seconds_per_grid for video in videos], device=device)}

    def reference_inputs(self, prompt: EncodedPrompt, device: torch.device, image_token_id: int) -> dict[str, Any]:
        if not prompt.images:
            return {}
        images, videos = self._split(prompt)
        inputs: dict[str, Any] = {}
        if images:  # resized images patched as the vision stage patches them (transformers casts them)
            inputs["pixel_values"] = vision_pixels(images, self.patch_recipe, device, torch.float32)
            inputs["image_grid_thw"] = torch.tensor([image.grid for image in images], device=device)
        if videos:
            inputs["pixel_values_videos"] = torch.cat([video.pixels for video in videos]).to(device)
            inputs["video_grid_thw"] = torch.tensor([video.grid for video in videos], device=device)
            inputs.update(self.video_timing(videos, device))
        forward = inspect.signature(self.model_class().forward).parameters
        if "mm_token_type_ids" in forward:  # transformers >= 5.2x computes M-RoPE from it
            ids = torch.tensor(self.reference_ids(prompt, image_token_id), device=device)
            inputs["mm_token_type_ids"] = self._token_types(ids, prompt, image_token_id).unsqueeze(0)
        return inputs
