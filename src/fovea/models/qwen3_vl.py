"""Qwen3-VL: Qwen2.5-VL's dynamic resolution at 16 px patches, DeepStack, Qwen3 with interleaved M-RoPE.

What it shares with Qwen2.5-VL (``fovea.models.qwen2_5_vl``): the image processor
(``Qwen2VLImageProcessor``, now ``patch_size`` 16, so a token is 32 x 32 px), the
``<|vision_start|><|image_pad|><|vision_end|>`` placeholder expanded to each image's token
count, and the M-RoPE position rows of an image (t, row, column offsets from where it starts;
the text after it resumes at start + max(rows, columns)). What differs:

- **The vision tower** (transformers' ``Qwen3VLVisionModel``, run as it is): full attention in
  every block (no windows), a learned position embedding bilinearly interpolated to each
  image's grid, a 2x2 merger; and **DeepStack**: the hidden states after the blocks named by
  ``deepstack_visual_indexes`` each go through their own merger. The vision stage returns, per
  image token, the embedding and then those levels' features side by side
  (``[tokens, (1 + levels) * hidden]``); the paged engine adds level k to the image positions'
  hidden states after decoder layer k (``PagedLlama.add_deepstack``), in every prefill chunk that
  holds them. Decode steps never carry image tokens.
- **The language model** is Qwen3: per-head RMSNorm of q and k before RoPE, an explicit
  ``head_dim``, no qkv bias; its M-RoPE frequencies are **interleaved** (T H W T H W ...,
  ``mrope_section`` [24, 20, 20]) rather than sectioned.
- **Videos** are frames at timestamps: each temporal patch (two frames) is written as
  ``<t.t seconds><|vision_start|><|video_pad|><|vision_end|>`` in place of the chat template's
  ``<|video_pad|>`` (transformers' ``Qwen3VLProcessor.replace_video_token``; the template's own
  vision_start/end around it stay), and each such group is a (1, h, w) grid for the tower and
  for positions, as ``get_rope_index`` splits a video's grid. Time is in the text, not in the
  temporal position row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration

from fovea.errors import ModelLoadError
from fovea.models.base import (
    DEFAULT_OPTIONS,
    EncodedPrompt,
    EncodeOptions,
    Family,
    ImageInput,
    LanguageModelSpec,
    pixel_hash,
)
from fovea.models.qwen2_5_vl import (
    VIDEO_TOKEN,
    FrameRecipe,
    Qwen2_5_VLAdapter,
    QwenCodec,
    mrope_positions,
    read_video_config,
)

# Qwen3VLVideoProcessor's class defaults, for keys its config leaves out.
VIDEO_DEFAULTS = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32, "fps": 2.0, "min_frames": 4,
                  "max_frames": 768}
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def video_smart_resize(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """transformers' ``qwen3_vl`` video smart_resize: the pixel budget is over all frames."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time, the last
    patch padded with the last index (``Qwen3VLProcessor._calculate_timestamps``)."""
    indices = list(indices)
    if len(indices) % temporal:
        indices.extend(indices[-1] for _ in range(temporal - len(indices) % temporal))
    seconds = [i / fps for i in indices]
    return [(seconds[i] + seconds[i + temporal - 1]) / 2 for i in range(0, len(seconds), temporal)]


def sample_indices(total: int, source_fps: float, fps: float, max_frames: int, min_frames: int = 4,
                   temporal_patch_size: int = 2) -> list[int]:
    """The frame indices ``Qwen3VLVideoProcessor.sample_frames`` keeps: ``total / source_fps * fps``
    frames within [min_frames, max_frames] and the video's own count, spread by linspace."""
    if total <= 0:
        return []
    count = int(total / source_fps * fps) if source_fps > 0 else total
    count = min(max(count, min_frames), max_frames, total)
    return [int(i) for i in np.linspace(0, total - 1, count).round().astype(int)]


@dataclass(frozen=True)
class Qwen3VideoRecipe(FrameRecipe):
    """What Qwen3VLVideoProcessor does to a video's frames (its own resize, over the frame count too)."""

    @staticmethod
    def sample_indices(total: int, source_fps: float, fps: float, max_frames: int, min_frames: int = 4,
                       temporal_patch_size: int = 2) -> list[int]:
        """How fovea.media.video samples this model's frames (decode_video_bytes' ``sampler``)."""
        return sample_indices(total, source_fps, fps, max_frames, min_frames, temporal_patch_size)

    @classmethod
    def read(cls, path: Path, image_processor: Any, config: Any) -> Qwen3VideoRecipe:
        raw = read_video_config(path)
        size = raw.get("size") or {}

        def get(key: str) -> Any:
            value = size.get(key) if key in ("shortest_edge", "longest_edge") else raw.get(key)
            return VIDEO_DEFAULTS[key] if value is None else value

        return cls(min_pixels=int(get("shortest_edge")), max_pixels=int(get("longest_edge")), fps=float(get("fps")),
                   min_frames=int(get("min_frames")), max_frames=int(get("max_frames")),
                   **cls.patching(raw, image_processor, config))

    def resized(self, frames: int, height: int, width: int) -> tuple[int, int]:
        tp, factor = self.temporal_patch_size, self.patch_size * self.merge_size
        return video_smart_resize(max(frames, tp), height, width, tp, factor, self.min_pixels, self.max_pixels)


class Qwen3Codec(QwenCodec):
    """Qwen2.5-VL's codec, with Qwen3-VL's video prompt (timestamped frame groups)."""

    def frame_groups(self, video: Any) -> tuple[list[ImageInput], str]:
        """One decoded video (fovea.media.video.DecodedVideo) as its temporal patches, each a (1, h, w)
        image for the tower, and the text that replaces its ``<|video_pad|>``."""
        assert self.video is not None
        pixels, (gt, gh, gw) = self.video.pixels(video.frames)
        pixels = pixels.to(self.dtype)
        per_group = gh * gw
        seconds = frame_timestamps(video.indices, video.source_fps, self.video.temporal_patch_size)
        groups, text = [], ""
        for index in range(gt):
            chunk = pixels[index * per_group:(index + 1) * per_group]
            # The rows depend on the pixels alone (the time is text): the frame's content keys the caches.
            groups.append(ImageInput(chunk, per_group // (self.merge * self.merge), pixel_hash(chunk, (1, gh, gw)),
                                     (1, gh, gw), seconds[index], self.video.token_id))
            text += f"<{seconds[index]:.1f} seconds>{VISION_START}{VIDEO_TOKEN}{VISION_END}"
        return groups, text

    def encode(self, text: str, images: list[Image.Image], *, template_rendered: bool = True,
               options: EncodeOptions = DEFAULT_OPTIONS, videos: list[Any] | None = None) -> EncodedPrompt:
        videos = self.check_media(text, images, videos, template_rendered)
        frames: list[ImageInput] = []
        if videos:  # each <|video_pad|> becomes the video's timestamped frame groups, in order
            parts = text.split(VIDEO_TOKEN)
            out = parts[0]
            for video, rest in zip(videos, parts[1:]):
                groups, expansion = self.frame_groups(video)
                frames.extend(groups)
                out += expansion + rest
            text = out
        ids = self._checked_ids(text, len(images), template_rendered, len(frames), "video frame group(s)",
                                video_status=500, options=options)
        if not images and not frames:
            return EncodedPrompt(list(ids), [], text)
        inputs, expanded = self._expanded(ids, self._image_inputs(images, options), frames)
        # Every image and frame group has t = 1: Qwen2.5-VL's image positions are Qwen3-VL's.
        rows, delta = mrope_positions(expanded, self.image_token_id, [item.grid for item in inputs], self.merge)
        return EncodedPrompt(expanded, inputs, text, rows, delta)


def vision_rows(out: Any) -> torch.Tensor:
    """[tokens, (1 + levels) * hidden]: the merged embedding, then each DeepStack level's features.
    transformers 5.x returns an output object (``get_image_features``: the merged embedding and each
    level split per image); 4.57 returned (merged, [features per level])."""
    if isinstance(out, tuple):
        merged, levels = out[0], list(out[1] or [])
    else:
        merged, levels = out.pooler_output, list(out.deepstack_features or [])
    joined = [torch.cat(list(t)) if isinstance(t, (tuple, list)) else t for t in (merged, *levels)]
    return torch.cat(joined, dim=-1)


class Qwen3_VLAdapter(Qwen2_5_VLAdapter):
    family = Family("qwen3_vl", ("qwen3_vl",),
                    ["Qwen3-VL: dynamic resolution at 16 px patches, DeepStack, Qwen3 language model",
                     "interleaved M-RoPE; videos as timestamped frame groups"])
    video_recipe = Qwen3VideoRecipe
    codec_class = Qwen3Codec
    fused_vision = "qwen3_vit"  # engine.vision.qwen_vision_fused: LayerNorm, learned positions, DeepStack

    def model_class(self) -> type:
        return Qwen3VLForConditionalGeneration

    def build_vision_modules(self, config: Any) -> dict[str, torch.nn.Module]:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return {"model.visual": Qwen3VLVisionModel._from_config(config.vision_config)}

    @staticmethod
    def vision_rows(out: Any) -> torch.Tensor:
        return vision_rows(out)

    def lm_spec(self, model: torch.nn.Module) -> LanguageModelSpec:
        text, vision = model.config.text_config, model.config.vision_config
        params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        section = list(params.get("mrope_section") or [24, 20, 20])
        levels = len(getattr(vision, "deepstack_visual_indexes", None) or [])
        hidden = int(text.hidden_size)
        for index, merger in enumerate(getattr(model.model.visual, "deepstack_merger_list", [])):
            out = merger.linear_fc2.out_features
            if out != hidden:
                raise ModelLoadError(f"DeepStack merger {index} outputs {out} features; the language model's "
                                     f"hidden_size is {hidden}: use the vision tower trained for this model")
        tied = getattr(text, "tie_word_embeddings", False) or getattr(model.config, "tie_word_embeddings", False)
        return LanguageModelSpec(model.model.language_model, None if tied else model.lm_head, text, section,
                                 mrope_interleaved=True, deepstack_layers=levels)

    @staticmethod
    def video_timing(videos: list[ImageInput], device: torch.device) -> dict[str, Any]:
        return {}  # the timestamps are text in the prompt; get_rope_index takes no seconds

