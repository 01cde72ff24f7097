"""``fovea_vlm``: a custom VLM described by its config alone, served without writing fovea code.

A model directory whose ``config.json`` says ``"model_type": "fovea_vlm"`` names three parts:

- ``vision_config``: any transformers vision config that ``AutoModel.from_config`` builds
  (``clip_vision_model``, ``siglip_vision_model``, ...), at one fixed square resolution;
- ``projector``: ``{"type": "mlp", "layers": L, "activation": A, "input_width": I, "output_width": O}``,
  L linear layers with activation A between them;
- ``text_config``: a Llama-family language model the paged engine runs (llama, mistral, qwen2).

Weights, in ``model.safetensors`` (or shards with an index):

- ``vision_tower.*``: the transformers vision model's own state-dict names
  (``vision_tower.encoder.layers.0...``, ``vision_tower.embeddings...`` for CLIP and SigLIP
  in transformers 5);
- ``projector.linears.{i}.weight`` / ``.bias``, i = 0 .. L-1;
- ``language_model.*``: transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` names
  (``language_model.model.layers.0...``, ``language_model.lm_head.weight``).

Each image is resized to the tower's ``image_size``; the tower's hidden states at
``vision_feature_layer`` (one index or a list, concatenated) lose their first position when
``vision_feature_select_strategy`` is ``"default"`` (CLIP's CLS), go through the projector and
replace the image's run of ``image_token`` ids in the prompt. The run's length is the tower's
sequence length, found by running the tower on the meta device (no weights, no compute), less
the dropped position; ``image_seq_length`` in the config, if given, must agree.

transformers has no class for this composite, so ``FoveaVLMForConditionalGeneration`` is the
reference: a plain forward (tower -> feature select -> projector -> scatter into the input
embeddings -> the language model's own forward) and ``generate`` through the language model's
own ``generate`` on those embeddings. ``AutoConfig`` and ``AutoModel`` know ``fovea_vlm``
once ``fovea.models`` is imported (no ``trust_remote_code``, nothing downloaded).

Anything the contract cannot verify is refused at load, naming the field (``check_config``).
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.activations import ACT2FN
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fovea.errors import ModelLoadError
from fovea.models.base import (
    DEFAULT_OPTIONS,
    EncodedPrompt,
    EncodeOptions,
    Family,
    ImageInput,
    LanguageModelSpec,
    ModelAdapter,
    PlaceholderMismatch,
    WidthReport,
    check_placeholders,
    pixel_hash,
    text_only_prompt,
)
from fovea.models.llava import NORMALISATION_FIELDS, RECIPE_FIELDS, LlavaCodec, stacked

MODEL_TYPE = "fovea_vlm"
# The text model types the paged engine runs (engine.model.llama.LLAMA_STYLE) that transformers
# builds as a plain causal LM.
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")
STRATEGIES = ("default", "full")


class FoveaVLMConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vision_config: dict | PretrainedConfig | None = None,
                 text_config: dict | PretrainedConfig | None = None, projector: dict | None = None,
                 vision_feature_layer: int | list[int] = -2, vision_feature_select_strategy: str = "default",
                 image_token: str = "<image>", image_token_id: int | None = None,
                 image_seq_length: int | None = None, **kwargs: Any) -> None:
        self.vision_config = _sub_config(vision_config, "clip_vision_model")
        self.text_config = _sub_config(text_config, "llama")
        self.projector = dict(projector or {})
        self.vision_feature_layer = vision_feature_layer
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self.image_token = image_token
        self.image_token_id = image_token_id
        self.image_seq_length = image_seq_length
        kwargs.setdefault("tie_word_embeddings", bool(getattr(self.text_config, "tie_word_embeddings", False)))
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in ("vision_config", "text_config"):
            value = getattr(self, key)
            out[key] = value.to_dict() if isinstance(value, PretrainedConfig) else value
        return out


def _sub_config(value: dict | PretrainedConfig | None, default_type: str) -> PretrainedConfig | dict:
    """A sub-config as transformers builds it; a dict transformers cannot build is kept as it is
    (``check_config`` refuses it, naming the field)."""
    if isinstance(value, PretrainedConfig):
        return value
    data = dict(value or {"model_type": default_type})
    try:
        return AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError):
        return data


class MLPProjector(torch.nn.Module):
    """``layers`` linear layers, ``activation`` between each pair: input_width -> output_width
    (the hidden layers are output_width wide, as LLaVA's)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        layers, width_in, width_out = int(spec["layers"]), int(spec["input_width"]), int(spec["output_width"])
        widths = [width_in] + [width_out] * layers
        self.linears = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=bool(spec.get("bias", True)))
                                           for a, b in itertools.pairwise(widths))
        self.act = ACT2FN[spec.get("activation", "gelu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, linear in enumerate(self.linears):
            x = linear(x if i == 0 else self.act(x))
        return x


def feature_layers(config: FoveaVLMConfig) -> list[int]:
    layer = config.vision_feature_layer
    return [layer] if isinstance(layer, int) else list(layer)


def tower_sequence_length(vision_config: PretrainedConfig) -> int:
    """Positions in the tower's hidden states for one image: the tower run on the meta device."""
    size = int(vision_config.image_size)
    channels = int(getattr(vision_config, "num_channels", 3))
    with torch.device("meta"):
        tower = AutoModel.from_config(vision_config)
        out = tower(torch.zeros(1, channels, size, size), output_hidden_states=True)
    return int(out.hidden_states[-1].shape[1])


def refuse(path: Any, field: str, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: config.json's {field} {problem} (see docs/models.md, "
                          "\"A custom VLM without fovea code\").")


def check_raw_config(path: Path) -> None:
    """What must hold before transformers can build the config: the sub-configs' model types."""
    data = json.loads((path / "config.json").read_text())
    for key in ("vision_config", "text_config"):
        sub = data.get(key)
        if not isinstance(sub, dict):
            raise refuse(path, key, "is missing: it must be a transformers config (a dict with its model_type)")
        if sub.get("model_type") not in CONFIG_MAPPING:
            raise refuse(path, f"{key}.model_type", f"{sub.get('model_type')!r} is not a config transformers can "
                         "build")


def check_config(config: FoveaVLMConfig, path: Any = "model") -> int:
    """Refuse, naming the field, anything the contract cannot verify; return the image tokens per image."""
    vision, text, projector = config.vision_config, config.text_config, config.projector
    if not isinstance(vision, PretrainedConfig):
        raise refuse(path, "vision_config", f"({vision.get('model_type')!r}) is not a config transformers can build")
    if not isinstance(text, PretrainedConfig):
        raise refuse(path, "text_config", f"({text.get('model_type')!r}) is not a config transformers can build")
    if text.model_type not in TEXT_MODEL_TYPES:
        raise refuse(path, "text_config.model_type", f"is {text.model_type!r}; the paged engine runs "
                     f"{', '.join(TEXT_MODEL_TYPES)}")
    try:
        with torch.device("meta"):
            AutoModel.from_config(vision)
    except Exception as exc:
        raise refuse(path, "vision_config", f"({vision.model_type!r}) does not build a transformers vision "
                     f"model: {type(exc).__name__}: {exc}") from exc
    for name in ("image_size", "hidden_size", "num_hidden_layers"):
        if not isinstance(getattr(vision, name, None), int):
            raise refuse(path, f"vision_config.{name}", "is missing: fovea_vlm needs a tower of one fixed, "
                         "square resolution")
    if config.image_token_id is None:
        raise refuse(path, "image_token_id", "is missing: the id of image_token in the tokenizer")
    if not config.image_token:
        raise refuse(path, "image_token", "is missing: the placeholder text the chat template writes")
    if config.vision_feature_select_strategy not in STRATEGIES:
        raise refuse(path, "vision_feature_select_strategy", f"is {config.vision_feature_select_strategy!r}, "
                     f"not one of {STRATEGIES}")
    layers = feature_layers(config)
    states = int(vision.num_hidden_layers) + 1
    if not layers or any(not isinstance(i, int) or not -states <= i < states for i in layers):
        raise refuse(path, "vision_feature_layer", f"{config.vision_feature_layer!r} is outside the tower's "
                     f"{states} hidden states")
    if projector.get("type") != "mlp":
        raise refuse(path, "projector.type", f"is {projector.get('type')!r}; fovea_vlm builds \"mlp\" projectors")
    for name in ("layers", "input_width", "output_width"):
        if not isinstance(projector.get(name), int) or projector[name] < 1:
            raise refuse(path, f"projector.{name}", f"is {projector.get(name)!r}: it must be a positive integer")
    if projector.get("activation", "gelu") not in ACT2FN:
        raise refuse(path, "projector.activation", f"{projector.get('activation')!r} is not an activation "
                     "transformers knows")
    vision_width = int(vision.hidden_size) * len(layers)
    if projector["input_width"] != vision_width:
        raise refuse(path, "projector.input_width", f"is {projector['input_width']}, but the tower hands it "
                     f"{vision_width} (vision_config.hidden_size {vision.hidden_size} x {len(layers)} feature "
                     "layer(s))")
    if projector["output_width"] != int(text.hidden_size):
        raise refuse(path, "projector.output_width", f"is {projector['output_width']}, but text_config."
                     f"hidden_size is {text.hidden_size}")
    try:
        tokens = tower_sequence_length(vision)
    except Exception as exc:
        raise refuse(path, "vision_config", f"gives a tower whose sequence length could not be found: {exc}") from exc
    tokens -= 1 if config.vision_feature_select_strategy == "default" else 0
    if config.image_seq_length is not None and config.image_seq_length != tokens:
        raise refuse(path, "image_seq_length", f"is {config.image_seq_length}, but the tower gives {tokens} rows "
                     f"per image (vision_feature_select_strategy {config.vision_feature_select_strategy!r})")
    return tokens


def output_side(image_processor: Any) -> int | None:
    """The square side the image processor's output has, or None when it is not square and fixed."""
    def sides(value: Any) -> dict:
        return value if isinstance(value, dict) else {k: getattr(value, k, None) for k in ("height", "width")}

    crop, size = sides(getattr(image_processor, "crop_size", None) or {}), sides(image_processor.size or {})
    chosen = crop if getattr(image_processor, "do_center_crop", False) else size
    h, w = chosen.get("height"), chosen.get("width")
    return int(h) if h and h == w else None


class FoveaVLMProcessor:
    """The tokenizer and image processor, with the placeholder expanded to the image's token run
    as transformers' LLaVA processor expands it (in the text, before tokenizing). Picklable."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token: str, tokens_per_image: int) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = image_token
        self.tokens_per_image = tokens_per_image

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text: str, images: list[Image.Image], return_tensors: str = "pt",
                 text_kwargs: dict | None = None) -> dict[str, Any]:
        expanded = text.replace(self.image_token, self.image_token * self.tokens_per_image)
        out = dict(self.tokenizer(expanded, return_tensors=return_tensors, **(text_kwargs or {})))
        out["pixel_values"] = self.image_processor(images, return_tensors=return_tensors)["pixel_values"]
        return out


class FoveaVLMCodec(LlavaCodec):
    def prepares_pixels(self) -> bool:
        return False  # its encode runs its own processor whole

    def tokenizer_kwargs(self, text: str, template_rendered: bool, options: EncodeOptions) -> dict[str, bool]:
        """As transformers' ``apply_chat_template(tokenize=True)``: a rendered chat is tokenized
        with no special tokens added (a BOS is the template's to write); a raw prompt as the
        tokenizer's default; the request's add_special_tokens when it sent one."""
        if options.add_special_tokens is None and template_rendered:
            return {"add_special_tokens": False}
        return super().tokenizer_kwargs(text, template_rendered, options)

    def encode(self, text: str, images: list[Image.Image], *, template_rendered: bool = True,
               options: EncodeOptions = DEFAULT_OPTIONS) -> EncodedPrompt:
        check_placeholders(text, self.image_token, len(images), template_rendered)
        kwargs = self.tokenizer_kwargs(text, template_rendered, options)
        if not images:
            return text_only_prompt(self.tokenizer, text, kwargs, self.image_token, self.image_token_id)
        encoded = self.processor(text=text, images=images, return_tensors="pt", text_kwargs=kwargs)
        input_ids = encoded["input_ids"][0].tolist()
        run = self.processor.tokens_per_image
        if input_ids.count(self.image_token_id) != run * len(images):
            raise PlaceholderMismatch(
                f"{len(images)} image(s) of {run} tokens each, but the prompt holds "
                f"{input_ids.count(self.image_token_id)} image tokens", status=500)
        pixels = encoded["pixel_values"].to(dtype=self.dtype)
        return EncodedPrompt(input_ids, [ImageInput(p, run, pixel_hash(p)) for p in pixels], text)

    def reference_ids(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> list[int]:
        """transformers' ``apply_chat_template(tokenize=True)`` with the model's tokenizer, each
        image token id then repeated into the image's run (at the id level, unlike ``encode``)."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)
        ids = out["input_ids"]
        ids = list(ids[0] if ids and isinstance(ids[0], list) else ids)
        run = self.processor.tokens_per_image
        return [t for i in ids for t in ([i] * run if i == self.image_token_id else [i])]


class FoveaVLMForConditionalGeneration(PreTrainedModel, GenerationMixin):
    """The reference model: transformers' vision model, the projector, transformers' causal LM."""

    config_class = FoveaVLMConfig
    base_model_prefix = ""
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: FoveaVLMConfig) -> None:
        super().__init__(config)
        check_config(config)
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.projector = MLPProjector(config.projector)
        self.language_model = AutoModelForCausalLM.from_config(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.language_model.get_input_embeddings()

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, tokens per image, text hidden]: the tower's whole forward."""
        dtype = next(self.vision_tower.parameters()).dtype
        states = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True).hidden_states
        picked = [states[i] for i in feature_layers(self.config)]
        if self.config.vision_feature_select_strategy == "default":
            picked = [h[:, 1:] for h in picked]
        return self.projector(torch.cat(picked, dim=-1))

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
        embeds = self.get_input_embeddings()(input_ids)
        mask = input_ids == self.config.image_token_id
        if pixel_values is None:
            return embeds
        rows = self.image_features(pixel_values).reshape(-1, embeds.shape[-1])
        if int(mask.sum()) != rows.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens in the prompt for {rows.shape[0]} image rows")
        return embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), rows.to(embeds.dtype))

    def forward(self, input_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, pixel_values)
        return self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """The language model's own ``generate`` on the prompt's embeddings; returns the prompt's
        ids followed by the new tokens, as a causal LM's ``generate`` does."""
        config = copy.deepcopy(kwargs.pop("generation_config", None) or self.generation_config)
        rest = config.update(**kwargs)  # the generation arguments go into the config; the others stay
        return self.language_model.generate(input_ids=input_ids, inputs_embeds=self.embed(input_ids, pixel_values),
                                            attention_mask=attention_mask, generation_config=config, **rest)


AutoConfig.register(MODEL_TYPE, FoveaVLMConfig, exist_ok=True)
AutoModel.register(FoveaVLMConfig, FoveaVLMForConditionalGeneration, exist_ok=True)


@torch.inference_mode()
def encode_images(loaded: Any, pixel_values: torch.Tensor) -> torch.Tensor:
    """fovea's vision stage: [n, 3, S, S] -> [n, tokens, text hidden] in the model dtype. A
    CLIP-style tower runs layer by layer up to the deepest feature layer (``model.vision``)."""
    from fovea.models.clip_vision import select_features, tower_hidden_states

    model, config = loaded.model, loaded.model.config
    tower = getattr(model.vision_tower, "vision_model", model.vision_tower)
    dtype = next(tower.parameters()).dtype
    layers = feature_layers(config)
    picked = tower_hidden_states(tower, pixel_values.to(device=loaded.device, dtype=dtype), layers)
    features = select_features(picked, list(range(len(picked))), config.vision_feature_select_strategy)
    return model.projector(features).to(loaded.dtype)


class FoveaVLMAdapter(ModelAdapter):
    family = Family(MODEL_TYPE, (MODEL_TYPE,),
                    [("a custom VLM from its config: any transformers vision tower at a fixed resolution, "
                     "an MLP projector, a Llama/Mistral/Qwen2 language model")])
    recipe_fields = RECIPE_FIELDS
    normalisation_fields = NORMALISATION_FIELDS

    def model_class(self) -> type:
        return FoveaVLMForConditionalGeneration

    def load_processor(self, path: Path) -> FoveaVLMProcessor:
        from fovea.models.llava_next import is_torchvision_backed

        check_raw_config(path)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        tokens = check_config(config, path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
        if is_torchvision_backed(image_processor):
            raise ModelLoadError(f"{path}: the image processor resolved to {type(image_processor).__name__}, a "
                                 "torchvision one; fovea_vlm uses the PIL/numpy image processors only.")
        side, tower_side = output_side(image_processor), int(config.vision_config.image_size)
        if side != tower_side:
            raise ModelLoadError(
                f"{path}: the image processor (preprocessor_config.json) makes images of side {side} px "
                f"(size {image_processor.size}, crop_size {getattr(image_processor, 'crop_size', None)}), but "
                f"vision_config.image_size is {tower_side}: fix the processor's size/crop_size.")
        if not getattr(tokenizer, "chat_template", None):
            raise ModelLoadError(f"{path}: the tokenizer has no chat template (chat_template.jinja).")
        return FoveaVLMProcessor(tokenizer, image_processor, config.image_token, tokens)

    def codec(self, processor: Any, image_token_id: int, dtype: torch.dtype) -> FoveaVLMCodec:
        return FoveaVLMCodec(processor, processor.image_token, image_token_id, dtype)

    def image_token(self, processor: Any, config: Any) -> tuple[str, int]:
        return config.image_token, int(config.image_token_id)

    def vision_module_names(self) -> tuple[str, ...]:
        return ("vision_tower", "projector")

    def build_vision_modules(self, config: Any) -> dict[str, torch.nn.Module]:
        check_config(config)
        return {"vision_tower": AutoModel.from_config(config.vision_config), "projector": MLPProjector(config.projector)}

    def vision_forward(self, loaded: Any) -> Callable:
        return stacked(functools.partial(encode_images, loaded))

    def fixed_image_shape(self, config: Any) -> tuple[int, ...] | None:
        vision = config.vision_config
        return (int(getattr(vision, "num_channels", 3)), int(vision.image_size), int(vision.image_size))

    def widths(self, model: torch.nn.Module) -> WidthReport:
        config = model.config
        layers = len(feature_layers(config))
        linears = list(model.projector.linears)
        return WidthReport(
            vision_width=int(config.vision_config.hidden_size) * layers,
            projector_in=linears[0].in_features, projector_out=linears[-1].out_features,
            lm_hidden=int(config.text_config.hidden_size),
            explain_in=f"vision hidden_size {config.vision_config.hidden_size} x {layers} feature layer(s)",
            fix_in="fix projector.input_width, vision_config or vision_feature_layer in config.json")

    def lm_spec(self, model: torch.nn.Module) -> LanguageModelSpec:
        text = model.config.text_config
        lm = model.language_model
        tied = bool(getattr(text, "tie_word_embeddings", False))
        return LanguageModelSpec(lm.model, None if tied else lm.lm_head, text)

    def reference_inputs(self, prompt: EncodedPrompt, device: torch.device, image_token_id: int) -> dict[str, Any]:
        if not prompt.images:
            return {}
        return {"pixel_values": torch.stack([image.pixels for image in prompt.images]).to(device)}
