"""Which quantized format a checkpoint uses, read from ``config.json``'s ``quantization_config``.

fovea runs four formats, as their tools write them; everything else is refused at start-up in one line
that names what was found and lists ``SUPPORTED_FORMATS``:

* compressed-tensors ``float-quantized`` FP8: per-channel or per-tensor weight scales, or 128x128-style block
  scales, with *dynamic* activations (per token, or per token and column group for blocks). Static activation
  scales (``input_scale``) are refused: the kernels quantise activations on the fly, and ignoring a
  checkpoint's calibrated scales would serve a different model than the one published.
* compressed-tensors ``pack-quantized`` W4A16: int4 weights in groups, symmetric or with zero points.
* fine-grained FP8 (``quant_method: fp8``, Qwen's and DeepSeek's releases): e4m3 weights in blocks with float32
  ``weight_scale_inv``, dynamic activations.
* AWQ GEMM: 4-bit, zero points, groups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fovea.errors import ModelLoadError

SUPPORTED_FORMATS: tuple[str, ...] = (
    "compressed-tensors FP8 (float-quantized; channel, tensor or block weight scales; dynamic activations)",
    "compressed-tensors W4A16 (pack-quantized int4, group scales, optional zero points)",
    "fine-grained FP8 (quant_method fp8, e4m3, weight_block_size, dynamic activations)",
    "AWQ GEMM (4-bit, group_size, zero_point)",
)


@dataclass(frozen=True)
class QuantFormat:
    """One checkpoint's quantization, reduced to what fovea's loader and kernels need."""

    method: str                       # "compressed-tensors" | "fp8" | "awq"
    scheme: str                       # "fp8-channel" | "fp8-block" | "w4a16" | "awq"
    label: str                        # one line for logs, /health, fovea doctor, /v1/models
    group_size: int | None = None     # int4 schemes
    block: tuple[int, int] | None = None  # fp8-block
    symmetric: bool = True
    ignore: tuple[str, ...] = ()      # the format's own list of modules left unquantized
    targets: tuple[str, ...] = ()     # compressed-tensors config-group targets ("Linear", "re:...", names)

    @property
    def is_fp8(self) -> bool:
        return self.scheme in ("fp8-channel", "fp8-block")

    @property
    def is_int4(self) -> bool:
        return self.scheme in ("w4a16", "awq")

    def leaves_unquantized(self, module_name: str) -> bool:
        """True when this format's own rules leave ``module_name`` (a linear's checkpoint name) unquantized."""
        if self.method == "compressed-tensors":
            if any(_ct_match(module_name, rule) for rule in self.ignore):
                return True
            # A class target ("Linear") takes every linear; name targets only the names they match.
            return not any(_is_class_target(t) or _ct_match(module_name, t) for t in self.targets)
        return any(_hf_match(module_name, rule) for rule in self.ignore)


def _ct_match(name: str, rule: str) -> bool:
    # compressed-tensors' own rule (compressed_tensors.utils.match.match_name): "re:" is re.match, else equality.
    if rule.startswith("re:"):
        return re.match(rule[3:], name) is not None
    return rule == name


def _is_class_target(target: str) -> bool:
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _hf_match(name: str, rule: str) -> bool:
    # transformers' should_convert_module (what its fp8 and awq quantizers apply): the rule as a regex matching
    # at the start, or a suffix; here always at a dotted boundary ("model.layers.1" is not "model.layers.10").
    # Also a run of whole segments anywhere, because transformers 5 renames modules ("visual." ->
    # "model.visual.") while checkpoints and their lists keep either spelling.
    if name == rule or name.endswith("." + rule) or f".{rule}." in f".{name}.":
        return True
    try:
        return re.match(f"(?:{rule})(?:\\.|$)", name) is not None
    except re.error:
        return False


def refuse(found: str) -> ModelLoadError:
    """The one-line refusal: what was found, and what fovea runs."""
    return ModelLoadError(f"quantization {found} is not supported by fovea; supported: "
                          + "; ".join(SUPPORTED_FORMATS) + " (or serve the unquantized checkpoint)",
                          code="unsupported_quantization")


def read_format(config: dict) -> QuantFormat | None:
    """The ``QuantFormat`` of a model's ``config.json`` (a dict), None when it has no ``quantization_config``."""
    qc = config.get("quantization_config")
    if qc is None:
        text = config.get("text_config")
        qc = text.get("quantization_config") if isinstance(text, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise refuse(f"config {type(qc).__name__!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _read_compressed_tensors(qc)
    if method == "fp8":
        return _read_fine_grained_fp8(qc)
    if method == "awq":
        return _read_awq(qc)
    described = {"bitsandbytes": f"bitsandbytes ({'4-bit' if qc.get('load_in_4bit') else '8-bit'})",
                 "gguf": "GGUF"}.get(method, method or "without a quant_method")
    raise refuse(described)


def _read_fine_grained_fp8(qc: dict) -> QuantFormat:
    activation = str(qc.get("activation_scheme", "dynamic")).lower()
    fmt = str(qc.get("fmt", "e4m3")).lower()
    block = qc.get("weight_block_size", (128, 128))  # transformers' default when the key is absent
    if fmt != "e4m3":
        raise refuse(f"fp8 with fmt {fmt!r}")
    if activation != "dynamic":
        raise refuse(f"fp8 with {activation} activation scales")
    if block is None or len(block) != 2 or min(int(b) for b in block) <= 0:
        raise refuse(f"fp8 with weight_block_size {block!r}")
    if str(qc.get("scale_fmt", "float")) != "float":
        raise refuse(f"fp8 with scale_fmt {qc.get('scale_fmt')!r}")
    if qc.get("modules_to_convert"):
        raise refuse("fp8 with quantized embeddings (modules_to_convert)")
    bn, bk = (int(b) for b in block)
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    return QuantFormat("fp8", "fp8-block", f"fine-grained FP8 ({bn}x{bk} weight blocks, dynamic per-token "
                       f"activations in {bk}-column groups)", block=(bn, bk), ignore=tuple(ignore))


def _read_awq(qc: dict) -> QuantFormat:
    bits = qc.get("bits", qc.get("w_bit", 4))
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    zero_point = bool(qc.get("zero_point", True))
    if bits != 4:
        raise refuse(f"awq {bits}-bit")
    if version != "gemm":
        raise refuse(f"awq version {version!r}")
    if group <= 0:
        raise refuse(f"awq with group_size {group}")
    if not zero_point:
        raise refuse("awq without zero points")
    ignore = qc.get("modules_to_not_convert") or []
    return QuantFormat("awq", "awq", f"AWQ GEMM (4-bit weights, groups of {group}, zero points; 16-bit "
                       "activations)", group_size=group, symmetric=False, ignore=tuple(ignore))


def _read_compressed_tensors(qc: dict) -> QuantFormat:
    # compressed-tensors' own pydantic classes parse the config (presets, aliases, defaults), imported here
    # because only quantized checkpoints need them.
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as exc:
        raise ModelLoadError("this checkpoint is quantized with compressed-tensors; reading it needs the "
                             "compressed-tensors package (pip install compressed-tensors)",
                             code="unsupported_quantization") from exc

    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise refuse(f"compressed-tensors sparse ({sparsity.get('format')})")
    if qc.get("transform_config"):
        raise refuse("compressed-tensors with rotations (transform_config)")
    for group in (qc.get("config_groups") or {}).values():
        # Checked before parsing: compressed-tensors 0.19 no longer parses the group ordering at all.
        if isinstance(group, dict) and str((group.get("weights") or {}).get("actorder")) in ("group", "dynamic"):
            raise refuse("compressed-tensors int4 with activation ordering (act-order, weight_g_idx)")
    try:
        config = QuantizationConfig.model_validate(qc)
    except Exception as exc:  # pydantic's ValidationError or a preset's ValueError: either way unreadable
        raise refuse(f"compressed-tensors config it cannot parse ({str(exc).splitlines()[0]})") from exc
    if config.kv_cache_scheme is not None:
        raise refuse("compressed-tensors with a quantized KV cache (kv_cache_scheme)")
    status = getattr(config.quantization_status, "value", config.quantization_status)
    if status != "compressed":
        raise refuse(f"compressed-tensors in status {status!r} (weights not compressed)")
    found: set[tuple] = set()
    targets: list[str] = []
    for scheme in config.config_groups.values():
        found.add(_ct_scheme(scheme, str(scheme.format or config.format)))
        targets += scheme.targets
    if len(found) != 1:
        raise refuse(f"compressed-tensors mixing {len(found)} schemes ({', '.join(sorted(f[0] for f in found))})")
    kind, group, block, symmetric, label = found.pop()
    return QuantFormat("compressed-tensors", kind, label, group_size=group, block=block, symmetric=symmetric,
                       ignore=tuple(config.ignore or ()), targets=tuple(targets))


def _ct_scheme(scheme, fmt: str) -> tuple[str, int | None, tuple[int, int] | None, bool, str]:
    """(scheme, group_size, block, symmetric, label) of one config group, or the refusal naming it."""
    w, a = scheme.weights, scheme.input_activations
    if w is None:
        raise refuse(f"compressed-tensors {fmt} without weight quantization")
    kind = f"{w.type}{w.num_bits}"
    if scheme.output_activations is not None:
        raise refuse(f"compressed-tensors {fmt} with output activation quantization")
    if w.type == "float" and w.num_bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        return _ct_fp8(w, a, fmt)
    if w.type == "int" and w.num_bits == 4 and fmt == "pack-quantized":
        if a is not None:
            raise refuse(f"compressed-tensors W4A{a.num_bits} (quantized activations)")
        if w.strategy != "group" or not w.group_size or w.group_size <= 0:
            raise refuse(f"compressed-tensors pack-quantized int4 with {w.strategy} scales")
        if w.actorder in ("group", "dynamic"):
            raise refuse("compressed-tensors int4 with activation ordering (act-order, weight_g_idx)")
        zeros = "symmetric" if w.symmetric else "zero points"
        return ("w4a16", w.group_size, None, w.symmetric,
                f"compressed-tensors W4A16 (int4 weights, groups of {w.group_size}, {zeros}; 16-bit activations)")
    acts = "16-bit activations" if a is None else f"{a.type}{a.num_bits} activations"
    raise refuse(f"compressed-tensors {fmt} ({kind} {w.strategy} weights, {acts})")


def _ct_fp8(w, a, fmt: str) -> tuple[str, int | None, tuple[int, int] | None, bool, str]:
    if not w.symmetric:
        raise refuse(f"compressed-tensors {fmt} FP8 with zero points")
    if a is None:
        raise refuse(f"compressed-tensors {fmt} FP8 weights with 16-bit activations (W8A16)")
    if a.type != "float" or a.num_bits != 8 or not a.symmetric:
        raise refuse(f"compressed-tensors {fmt} FP8 weights with {a.type}{a.num_bits} activations")
    if a.dynamic is not True:
        raise refuse(f"compressed-tensors {fmt} FP8 with static activation scales (input_scale)")
    if w.strategy in ("channel", "tensor") and a.strategy == "token":
        label = f"compressed-tensors FP8 (per-{w.strategy} weights, dynamic per-token activations)"
        return ("fp8-channel", None, None, True, label)
    if w.strategy == "block" and w.block_structure and a.strategy == "group" \
            and a.group_size == w.block_structure[1]:
        bn, bk = (int(b) for b in w.block_structure)
        label = (f"compressed-tensors FP8 ({bn}x{bk} weight blocks, dynamic per-token activations in "
                 f"{bk}-column groups)")
        return ("fp8-block", None, (bn, bk), True, label)
    raise refuse(f"compressed-tensors {fmt} FP8 ({w.strategy} weights, {a.strategy} activations)")
