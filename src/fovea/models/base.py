"""The model adapter: everything that differs between VLM families, behind one interface.

The engine, scheduler, KV cache, graphs, caches, guard and server are written against this
and nothing else. An adapter owns:

- loading (the language part and the vision part, so an encode-only process can load the
  vision weights alone);
- the processor recipe the contract checks;
- the prompt codec: how a rendered chat and its images become token ids, with each image's
  placeholder expanded into that image's own token count (``ImageInput.num_tokens``);
- the vision forward over a batch of images;
- position ids: 1-D, or M-RoPE's three rows;
- the language model's execution on the paged cache (``engine.model.llama.PagedLlama``,
  configured by ``lm_spec``).

Adding a family is a file in ``fovea/models`` and a line in the registry (``__init__``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from blake3 import blake3
from PIL import Image

from fovea.errors import FoveaError


class PlaceholderMismatch(FoveaError):
    status, code = 400, "image_placeholder_mismatch"


@dataclass(slots=True)
class ImageInput:
    """One preprocessed image as the vision stage takes it, on the host."""

    # LLaVA: [3, H, W] in the model dtype; Qwen-VL images: [H, W, 3] uint8, resized to the grid's
    # size, or at their decoded size where the vision stage resizes them (on CUDA); the vision stage
    # makes the processor's patches of it, models.qwen_pixels; Qwen-VL videos (and images where the
    # processor is not PIL-based): [patches, C * T * P * P] in the model dtype.
    pixels: torch.Tensor
    num_tokens: int  # image-token positions it fills in the prompt
    hash: str  # content hash of what the model sees (the encoder- and prefix-cache key)
    grid: tuple[int, int, int] | None = None  # (t, h, w) in patches, for dynamic-resolution towers
    # A video (Qwen2.5-VL): seconds of video per temporal patch (None: an image); for Qwen3-VL,
    # whose items are a video's temporal patches one by one, that patch's timestamp. And the token
    # transformers marks its positions with. In the engine's token ids every vision position
    # carries the image token: its embedding is replaced by the tower's rows, so the id only
    # marks the slot; ``ModelAdapter.reference_ids`` restores the video token for transformers.
    seconds_per_grid: float | None = None
    token_id: int | None = None


@dataclass
class EncodedPrompt:
    input_ids: list[int]
    # Held on the host: a request waiting in the queue holds no device memory; the engine moves
    # a batch of images to the device when it encodes them.
    images: list[ImageInput]
    prompt_text: str
    # M-RoPE: the prompt's [3][len] (temporal, height, width) positions; None where every
    # position is its index. Past the prompt, token i has position i + position_delta.
    positions: list[list[int]] | None = None
    position_delta: int = 0

    @property
    def num_images(self) -> int:
        return len(self.images)

    @property
    def image_hashes(self) -> list[str]:
        return [image.hash for image in self.images]

    @property
    def image_token_counts(self) -> list[int]:
        return [image.num_tokens for image in self.images]


# OpenAI's low-detail image: at most 512 x 512 pixels. Dynamic-resolution families cap an image
# sent with image_url.detail "low" at this many pixels; fixed-resolution ones have one size.
LOW_DETAIL_PIXELS = 512 * 512


@dataclass(frozen=True)
class EncodeOptions:
    """What a request asks of its prompt's encoding, beyond text and images (picklable: it goes
    to preprocessing worker processes)."""

    # None: the family's rule (a rendered chat gets no second BOS, a raw prompt the tokenizer's
    # default); True/False: passed to the tokenizer as is (vLLM's add_special_tokens).
    add_special_tokens: bool | None = None
    # Per image, in prompt order: sent with detail "low" (families that resize use LOW_DETAIL_PIXELS).
    low_detail: tuple[bool, ...] = ()

    def is_low(self, index: int) -> bool:
        return index < len(self.low_detail) and self.low_detail[index]


DEFAULT_OPTIONS = EncodeOptions()


def pixel_hash(pixels: torch.Tensor, grid: Sequence[int] | None = None) -> str:
    """Content hash of one preprocessed image as the model will see it: its dtype, shape, grid
    and bytes, hashed in place (a bfloat16 image is half the bytes of float32). BLAKE3, as vLLM
    hashes its media: cryptographic, so no one can make an image that takes another's cache
    entry, and 3-4x faster than SHA-256 on the API process's request path (a 720p image's
    2.7 MB: 0.26 against 0.93 ms on the development machine)."""
    data = pixels.detach().to("cpu").contiguous()
    digest = blake3(f"{data.dtype}{tuple(data.shape)}{tuple(grid) if grid else ''}".encode())
    digest.update(data.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def with_text_tokens(prompt: EncodedPrompt, token_ids: list[int]) -> EncodedPrompt:
    """``prompt`` followed by the text tokens ``token_ids`` (an answer, teacher-forced), with the
    same images. M-RoPE positions continue past the prompt as any later token's do: token i at
    i + ``position_delta`` on all three rows, so the delta is unchanged."""
    positions = None
    if prompt.positions is not None:
        start = len(prompt.input_ids) + prompt.position_delta
        tail = list(range(start, start + len(token_ids)))
        positions = [list(row) + tail for row in prompt.positions]
    return replace(prompt, input_ids=[*prompt.input_ids, *token_ids], images=list(prompt.images),
                   positions=positions)


def tokenize_rendered(tokenizer: Any, text: str) -> dict[str, bool]:
    """The tokenizer arguments for a rendered chat: no second BOS when the template wrote one
    (as transformers' ``apply_chat_template(tokenize=True)`` and vLLM tokenize chats)."""
    bos = getattr(tokenizer, "bos_token", None)
    return {"add_special_tokens": not (bos and text.startswith(bos))}


def text_only_prompt(tokenizer: Any, text: str, kwargs: dict, image_token: str, image_token_id: int) -> EncodedPrompt:
    """A prompt without images; refused if its text still holds image tokens (typed by hand)."""
    ids = list(tokenizer(text, **kwargs)["input_ids"])
    if image_token_id in ids:
        raise PlaceholderMismatch(
            f"the text contains {ids.count(image_token_id)} image token(s) but no image was sent; "
            f"remove {image_token!r} from the text or attach the image.")
    return EncodedPrompt(ids, [], text)


def check_placeholders(text: str, image_token: str, images: int, template_rendered: bool) -> None:
    placeholders = text.count(image_token)
    if placeholders != images:
        where = "the chat template rendered" if template_rendered else "the prompt contains"
        raise PlaceholderMismatch(
            f"{where} {placeholders} image placeholder(s) ({image_token!r}) for "
            f"{images} image(s); every image needs exactly one placeholder."
            + ("" if not template_rendered else " The model's chat template is dropping images."),
            status=400 if not template_rendered else 500,
        )


class PromptCodec(ABC):
    """Rendered chat text + decoded images -> an ``EncodedPrompt``. Holds no weights and is
    picklable: preprocessing worker processes each get a copy."""

    # Families that take videos name their placeholder here and accept ``videos=`` in encode.
    video_token: str | None = None

    def __init__(self, processor: Any, image_token: str, image_token_id: int, dtype: torch.dtype) -> None:
        self.processor = processor  # has apply_chat_template, tokenizer, image_processor
        self.image_token = image_token
        self.image_token_id = image_token_id
        self.dtype = dtype

    @property
    def image_processor(self) -> Any:
        return self.processor.image_processor

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The model's own chat template over transformers-style messages, ready to generate
        (``tools``: OpenAI-style function tools, for templates that render them)."""
        extra = {"tools": tools} if tools else {}
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)

    @abstractmethod
    def reference_ids(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> list[int]:
        """transformers' own token ids for this chat: ``apply_chat_template(..., tokenize=True)``
        with the model's processor, image placeholders expanded as transformers expands them.
        The contract checks ``encode(render(messages), images)`` against it."""

    @abstractmethod
    def encode(self, text: str, images: list[Image.Image], *, template_rendered: bool = True,
               options: EncodeOptions = DEFAULT_OPTIONS) -> EncodedPrompt: ...

    def tokenizer_kwargs(self, text: str, template_rendered: bool, options: EncodeOptions) -> dict[str, bool]:
        """The tokenizer's arguments for ``text``: the request's add_special_tokens when it sent one,
        else the family's rule (no second BOS after a template's; a raw prompt as the tokenizer does)."""
        if options.add_special_tokens is not None:
            return {"add_special_tokens": options.add_special_tokens}
        return tokenize_rendered(self.tokenizer, text) if template_rendered else {}

    def target_short_side(self) -> int | None:
        """The short side images may be reduced to before the processor (twice this is kept),
        or None when the processor's output size does not bound it."""
        return None


@dataclass(frozen=True)
class LanguageModelSpec:
    """What the paged engine's forward needs to know beyond the Llama-style weights."""

    language_model: torch.nn.Module  # has embed_tokens, layers, norm
    lm_head: torch.nn.Module | None  # None: tied to embed_tokens
    config: Any  # the text config
    mrope_section: list[int] | None = None  # M-RoPE's frequencies per (t, h, w); None: 1-D RoPE
    mrope_interleaved: bool = False  # Qwen3-VL: the rows' frequencies interleaved (T H W T H W ...)
    # DeepStack (Qwen3-VL): the vision stage's rows carry, after the embedding, this many more
    # [hidden] feature levels, added to the image positions after decoder layers 0, 1, ...
    deepstack_layers: int = 0


@dataclass(frozen=True)
class WidthReport:
    vision_width: int  # what the vision tower hands the projector/merger
    projector_in: int
    projector_out: int
    lm_hidden: int
    explain_in: str  # where vision_width comes from, for the violation's text
    fix_in: str


@dataclass
class Family:
    """An adapter's static description, shown by ``fovea doctor`` and the registry."""

    name: str
    model_types: tuple[str, ...]
    notes: list[str] = field(default_factory=list)


class ModelAdapter(ABC):
    """One VLM family. Instances are stateless beyond the loaded config; one per model."""

    family: Family
    # The processor fields that define what the vision tower sees (the contract's recipe).
    recipe_fields: tuple[str, ...]
    normalisation_fields: frozenset[str]

    # ---- loading ------------------------------------------------------------------------
    @abstractmethod
    def model_class(self) -> type: ...

    @abstractmethod
    def load_processor(self, path: Any) -> Any:
        """The model's processor parts (whatever ``codec`` needs), from local files only."""

    @abstractmethod
    def codec(self, processor: Any, image_token_id: int, dtype: torch.dtype) -> PromptCodec: ...

    @abstractmethod
    def image_token(self, processor: Any, config: Any) -> tuple[str, int]:
        """(the placeholder text, the id the model expects)."""

    @abstractmethod
    def vision_module_names(self) -> tuple[str, ...]:
        """Attribute paths (from the top model) of the vision tower and projector."""

    @abstractmethod
    def build_vision_modules(self, config: Any) -> dict[str, torch.nn.Module]:
        """{attribute path: module} of the vision part alone, freshly built from the model's
        config (an encode-only process loads its weights into these; see model.vision_part)."""

    def vision_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        out = []
        for path in self.vision_module_names():
            module = model
            for part in path.split("."):
                module = getattr(module, part)
            out.append(module)
        return out

    # ---- vision -------------------------------------------------------------------------
    # The fused vision stage this family's tower can run, by its name in the engine's registry
    # (``fovea.engine.vision.vision_stage.FUSED_STAGES``): "clip" (CLIP-style towers, fixed size),
    # "qwen2_5_vit" / "qwen3_vit" (Qwen's dynamic-resolution towers); None: the eager forward
    # only. The engine checks a fused stage against ``vision_forward`` before it trusts it.
    fused_vision: str | None = None

    @abstractmethod
    def vision_forward(self, loaded: Any) -> Callable[[list[ImageInput]], list[torch.Tensor]]:
        """The eager vision stage: images (pixels on the model's device) -> each image's
        [num_tokens, lm_hidden] rows in the model dtype ([num_tokens, (1 + deepstack levels) *
        lm_hidden] for DeepStack models: the embedding, then each level's features)."""

    def preprocessing_problem(self, loaded: Any, images: list[Image.Image]) -> str | None:
        """Families that split the processor's work (the resize in the API process, the rest in the
        vision stage): None if both halves together give the processor's own pixel values for
        ``images``, else how they differ. Others run the processor whole in the codec: None."""
        return None

    def fixed_image_shape(self, config: Any) -> tuple[int, ...] | None:
        """The one pixel shape every image has (towers of a fixed resolution), else None."""
        return None

    def dummy_images(self, config: Any, codec: PromptCodec | None, count: int,
                     max_tokens: int | None = None, device: torch.device | str = "cpu") -> list[ImageInput]:
        """``count`` random images of the largest size the processor produces (memory profiles),
        and for dynamic-resolution families of at most ``max_tokens`` image tokens each (a prompt
        cannot hold a larger one: the profile runs only what the scheduler can form).
        Fixed-resolution towers: their one shape; dynamic-resolution families override this.
        ``device``: where the random pixels are made (the largest image is ~75 M values: seconds
        on the host, nothing on a GPU)."""
        shape = self.fixed_image_shape(config)
        if shape is None:
            raise TypeError(f"{type(self).__name__} has no fixed image shape: it must override dummy_images")
        dtype = codec.dtype if codec is not None else torch.float32
        return [ImageInput(torch.randn(shape, dtype=dtype, device=device), 0, f"profile-{i}") for i in range(count)]

    @abstractmethod
    def widths(self, model: torch.nn.Module) -> WidthReport: ...

    # ---- positions and the language model ----------------------------------------------
    def uses_mrope(self) -> bool:
        return False

    @abstractmethod
    def lm_spec(self, model: torch.nn.Module) -> LanguageModelSpec: ...

    def reference_positions(self, model: torch.nn.Module, prompt: EncodedPrompt,
                            image_token_id: int) -> tuple[list[list[int]], int] | None:
        """transformers' own position rows and delta for ``prompt`` (M-RoPE families), or None."""
        return None

    def reference_ids(self, prompt: EncodedPrompt, image_token_id: int) -> list[int]:
        """transformers' own input_ids for ``prompt`` (the engine's, but for families that mark
        videos with a token of their own)."""
        return list(prompt.input_ids)

    def reference_inputs(self, prompt: EncodedPrompt, device: torch.device, image_token_id: int) -> dict[str, Any]:
        """transformers' own forward/generate inputs for ``prompt`` (the reference that tests and
        ``fovea doctor`` compare against), without input_ids."""
        return {}
