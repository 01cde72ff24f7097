"""Quantized copies of a model directory, written by the formats' own code, as users download them.

    python -m fovea.testing.quantized SRC DST --scheme fp8-dynamic|w4a16|w4a16-asym|fp8-block [--group-size 128]

Three formats, each the way its released checkpoints are made:

- ``fp8-dynamic``: compressed-tensors ``float-quantized``, what llmcompressor's
  ``QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=...)`` writes (FP8 e4m3
  weights with one scale per output channel, FP8 activations quantised per token at run time), as
  ``RedHatAI/Qwen2.5-VL-7B-Instruct-FP8-Dynamic`` was made.
- ``w4a16`` / ``w4a16-asym``: compressed-tensors ``pack-quantized`` (int4 weights, eight to an
  int32, one scale per group of input columns; the asymmetric preset adds packed zero points),
  what the same recipe writes with the ``W4A16`` / ``W4A16_ASYM`` presets and only the group size
  changed (the presets' 128 is the default; the tiny test models are 32-256 wide, so their
  fixtures use 32). That recipe alone rounds to nearest: no GPTQ, no AWQ.
- ``fp8-block``: Qwen's own fine-grained FP8 (``quant_method: fp8``, e4m3 weights with one float32
  ``weight_scale_inv`` per ``weight_block_size`` block), as ``Qwen/Qwen3-VL-8B-Instruct-FP8``
  ships it. Quantised by transformers' own FP8 op (``Fp8Quantize``, what its
  ``FineGrainedFP8Config`` quantizer applies on load) and written by ``save_pretrained`` (see
  ``write_fine_grained_fp8`` for why not through the quantizer itself).

The compressed-tensors directories are made without llmcompressor: it pins an older transformers
(0.14: ``transformers<=5.17``) that cannot load Qwen's image processors without torchvision, so it
cannot be a test dependency. What llmcompressor contributes to these recipes is one choice, the
scales: its default ``minmax`` observer's per-channel / per-group min and max, turned into scales
and zero points by compressed-tensors' ``calculate_qparams`` (``observe_minmax`` here). Everything
about the format is compressed-tensors' own code: the preset scheme, attaching it to the layers
(``apply_quantization_config``), quantising and packing (``ModelCompressor.compress_model``), the
ignore list and the ``quantization_config`` it writes into config.json (``update_config``).

FP8_DYNAMIC, round-to-nearest W4A16 and the fine-grained FP8 need no calibration data, so a 7B
bf16 directory is quantised the same way, on the CPU: ``python -m fovea.testing.quantized
/models/qwen7b /models/qwen7b-fp8 --scheme fp8-dynamic``.

Everything but the language model's linear layers stays unquantised and in the source dtype, bit
for bit: the vision tower, the projector / merger and ``lm_head``, exactly as the released
checkpoints' recipes ignore them, and the embeddings, norms and biases. The tokenizer, processor
and chat template are copied, so the directory is servable. The writers are deterministic (round
to nearest, no data).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import torch

# What the released recipes leave unquantised, in their own patterns: llmcompressor's
# examples/multimodal_vision and quantization_w8a8_fp8 (LLaVA: "re:.*lm_head",
# "re:multi_modal_projector.*", "re:vision_tower.*"; Qwen-VL: "re:.*lm_head", "re:visual.*",
# "re:model.visual.*"). transformers 5 puts LLaVA's tower and projector under ``model.``
# too, hence the "re:model.*" forms of LLaVA's patterns (the recipes' own would match nothing).
IGNORE = ["re:.*lm_head", "re:visual.*", "re:model.visual.*", "re:vision_tower.*", "re:model.vision_tower.*",
          "re:multi_modal_projector.*", "re:model.multi_modal_projector.*"]
COMPRESSED_TENSORS_SCHEMES = {"fp8-dynamic": "FP8_DYNAMIC", "w4a16": "W4A16", "w4a16-asym": "W4A16_ASYM"}
SCHEMES = (*COMPRESSED_TENSORS_SCHEMES, "fp8-block", "awq")
# The tiny test models (``write_model_dir(arch="tiny")``) are 32-256 wide: W4A16 in groups of 32
# input columns and FP8 in 32 x 32 blocks, so each row has several (the releases' 128 would leave one).
TINY_GROUP_SIZE = 32
TINY_BLOCK = (32, 32)
WEIGHT_FILES = re.compile(r".*\.safetensors(\.index\.json)?$")


def unquantized(name: str) -> bool:
    """Whether a module of this name stays in the source dtype (matches one of ``IGNORE``)."""
    return any(re.match(pattern[3:], name) for pattern in IGNORE)


def tensor_headers(directory: Path) -> dict[str, dict]:
    """Every tensor of the directory's safetensors files: name -> {"dtype": "F8_E4M3", "shape": [...]},
    read from the files' JSON headers (nothing is loaded)."""
    headers: dict[str, dict] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        headers.update({name: {"dtype": t["dtype"], "shape": t["shape"]} for name, t in header.items()})
    return headers


def source_dtype(src: Path) -> torch.dtype:
    """The floating dtype most of the source's tensors are stored in (bf16 for the random and real dirs)."""
    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    counts = Counter(t["dtype"] for t in tensor_headers(src).values() if t["dtype"] in names)
    if not counts:
        raise ValueError(f"{src}: no bf16/f16/f32 tensors in its safetensors files")
    return names[counts.most_common(1)[0][0]]


def load_source(src: Path, **kwargs) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(src, dtype=source_dtype(src), **kwargs).eval()


def linear_names(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]


def copy_serving_files(src: Path, dst: Path) -> None:
    """The tokenizer, processor and chat-template files (everything but the weights and the
    files the quantized save wrote itself, e.g. config.json)."""
    for file in sorted(Path(src).iterdir()):
        if file.is_file() and not WEIGHT_FILES.match(file.name) and not (dst / file.name).exists():
            shutil.copy2(file, dst / file.name)


def compressed_tensors_scheme(scheme: str, group_size: int | None):
    """The preset's ``QuantizationScheme`` for Linear layers; W4A16's group size replaced when given."""
    from compressed_tensors.quantization import preset_name_to_scheme

    preset = preset_name_to_scheme(COMPRESSED_TENSORS_SCHEMES[scheme], ["Linear"])
    if group_size is not None and scheme != "fp8-dynamic":
        preset.weights = preset.weights.model_copy(update={"group_size": group_size})
    return preset


def observe_minmax(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's scale and zero point as llmcompressor's default ``minmax`` weight observer chooses
    them: the min and max of each quantization unit (the whole tensor, an output channel, a group
    of input columns or a block, zero-padded to whole blocks), in the weight's dtype, given to
    compressed-tensors' ``calculate_qparams`` (which widens the range to hold 0 and divides by the
    type's range). Shapes are the compressed-tensors parameters': [N, 1] per channel, [N, K / g]
    per group, [ceil(N / bn), ceil(K / bk)] per block."""
    from compressed_tensors.quantization.utils import calculate_qparams, maybe_pad_tensor_for_block_quant

    if args.strategy == "tensor":
        lo, hi = weight.amin(), weight.amax()
    elif args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif args.strategy == "group":
        groups = weight.unflatten(-1, (-1, args.group_size))
        lo, hi = groups.amin(-1), groups.amax(-1)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        padded = maybe_pad_tensor_for_block_quant(weight, args.block_structure)
        blocks = padded.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        raise ValueError(f"no min/max observation for the {args.strategy!r} strategy")
    return calculate_qparams(lo, hi, args)


def quantize_compressed_tensors(model: torch.nn.Module, scheme, ignore: list[str]):
    """Quantize ``model`` in place as llmcompressor's ``QuantizationModifier(config_groups={"group_0":
    scheme}, ignore=ignore)`` does without data, and compress it for saving; returns the
    ``ModelCompressor`` whose ``update_config`` writes the ``quantization_config``.

    compressed-tensors attaches the scheme to every targeted, not ignored module
    (``apply_quantization_config``: the scale and zero-point parameters, in the weight's dtype),
    ``observe_minmax`` fills them, and compressed-tensors compresses each layer in the format it
    infers for the scheme (``float-quantized``, ``pack-quantized``) and lists every module of a
    quantized type left unquantized, by name, as the config's ``ignore``."""
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )

    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    layers = [(name, module) for name, module in model.named_modules()
              if getattr(module, "quantization_scheme", None) is not None]
    if not layers:
        raise ValueError(f"no module matches {scheme.targets} outside the ignore list {list(ignore)}")
    with torch.no_grad():
        for name, module in layers:
            args = module.quantization_scheme.weights
            if args.strategy == "group" and module.weight.shape[-1] % args.group_size:
                raise ValueError(f"{name}: {module.weight.shape[-1]} input columns do not divide into groups "
                                 f"of {args.group_size}")
            scale, zero_point = observe_minmax(module.weight, args)
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    return compressor


def save_compressed(model: torch.nn.Module, compressor, dst: Path) -> Path:
    """What llmcompressor's ``save_pretrained(dst, save_compressed=True)`` does with a compressed model:
    transformers' ``save_pretrained``, then compressed-tensors' ``update_config`` adds the
    ``quantization_config`` to config.json."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    return dst


def write_compressed_tensors(src: Path, dst: Path, scheme: str, group_size: int | None = 128,
                             ignore: list[str] = IGNORE) -> Path:
    """A compressed-tensors copy of ``src``, as llmcompressor's ``QuantizationModifier(targets="Linear",
    scheme=..., ignore=...)`` writes it (no calibration data), made with compressed-tensors alone.

    ``scheme``: "fp8-dynamic" (the FP8_DYNAMIC preset), "w4a16" (W4A16: symmetric int4, groups
    along the input) or "w4a16-asym" (W4A16_ASYM: with zero points); ``group_size`` replaces the
    W4A16 presets' 128 and must divide every quantized layer's input width. ``ignore``: the
    recipe's ignore list (tests pass a shorter one to make a wrongly quantized directory). Saved
    compressed, so the tensors are the format's (``weight`` e4m3 and ``weight_scale`` [N, 1];
    ``weight_packed`` int32, ``weight_scale``, ``weight_shape`` and, for the asymmetric preset,
    ``weight_zero_point``).
    """
    if scheme not in COMPRESSED_TENSORS_SCHEMES:
        raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; one of {sorted(COMPRESSED_TENSORS_SCHEMES)}")
    src, dst = Path(src), Path(dst)
    model = load_source(src)
    compressor = quantize_compressed_tensors(model, compressed_tensors_scheme(scheme, group_size), ignore)
    save_compressed(model, compressor, dst)
    copy_serving_files(src, dst)
    return dst


def write_fine_grained_fp8(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Qwen's fine-grained FP8 copy of ``src``: each linear layer of the language model quantized by
    transformers' own ``Fp8Quantize`` (``integrations/finegrained_fp8.py``, the op its
    ``FineGrainedFP8Config`` quantizer applies on load: per block, ``weight_scale_inv`` = absmax / 448
    in float32 and the weight divided by it, cast to e4m3) and the model saved by ``save_pretrained``.

    Why not ``from_pretrained(..., quantization_config=FineGrainedFP8Config(...))`` and
    ``save_pretrained``: in transformers 5.17 the quantizer refuses to run without a CUDA or XPU
    device, and, worse, its on-the-fly loading casts each bf16 weight to float8_e4m3fn unscaled
    (the FP8Linear's dtype) before quantizing it, flushing small weights to e4m3's subnormals
    (huggingface/transformers#48352, "Fix fp8 dtype", open). The op on the source tensors is the
    quantizer's arithmetic without that cast.

    ``block`` is ``weight_block_size`` [bn, bk] and must divide every quantized layer's shape (the
    op leaves a layer it cannot tile unquantized; refused here rather than written unlisted).
    ``quantization_config`` has the fields Qwen's releases carry: ``quant_method``, ``fmt``,
    ``activation_scheme``, ``weight_block_size`` and ``modules_to_not_convert`` (the vision tower's,
    the merger's / projector's linear layers and ``lm_head``, by name).
    """
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    src, dst = Path(src), Path(dst)
    model = load_source(src)
    names = linear_names(model)
    keep = [name for name in names if unquantized(name)]
    config = FineGrainedFP8Config(activation_scheme="dynamic", weight_block_size=list(block),
                                  modules_to_not_convert=keep)
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    state = {key: tensor.detach() for key, tensor in model.state_dict().items()}
    for name in names:
        if name in keep:
            continue
        weight = state.pop(f"{name}.weight")
        if weight.shape[0] % block[0] or weight.shape[1] % block[1]:
            raise ValueError(f"{name}: weight {tuple(weight.shape)} does not tile into {list(block)} blocks")
        state.update(quantize.convert({f"{name}.weight": weight}))
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst, state_dict=state)
    written = json.loads((dst / "config.json").read_text())
    written["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block), "modules_to_not_convert": keep}
    (dst / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    copy_serving_files(src, dst)
    return dst


def write_awq(src: Path, dst: Path, group_size: int = 128) -> Path:
    """An AWQ GEMM copy of ``src`` as AutoAWQ writes one (``Qwen/Qwen2.5-VL-7B-Instruct-AWQ``'s
    format): each language-model linear's ``qweight``, ``qzeros`` (int32, AWQ's column order) and
    fp16 ``scales``, round-to-nearest with zero points (AutoAWQ's quantizer without its activation-
    aware search, which picks the scales, not the format). The packing is ``fovea.quant.awq``'s,
    pinned bit for bit to AutoAWQ 0.2.9's own packer in ``tests/quant/test_awq.py``. The
    ``quantization_config`` is AutoAWQ's ``to_transformers_dict`` with the vision part named in
    ``modules_to_not_convert``."""
    from fovea.quant.awq import pack_awq, quantize_awq

    src, dst = Path(src), Path(dst)
    model = load_source(src)
    names = linear_names(model)
    state = {key: tensor.detach() for key, tensor in model.state_dict().items()}
    for name in names:
        if unquantized(name):
            continue
        weight = state.pop(f"{name}.weight")
        if weight.shape[1] % group_size or weight.shape[0] % 8:
            raise ValueError(f"{name}: weight {tuple(weight.shape)} does not fit AWQ groups of {group_size} "
                             "(input width) and 8-column packs (output width)")
        state.update({f"{name}.{key}": value for key, value in pack_awq(quantize_awq(weight.float(), group_size)).items()})
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst, state_dict=state)
    written = json.loads((dst / "config.json").read_text())
    written["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
                                      "zero_point": True,
                                      "modules_to_not_convert": sorted({"visual", "vision_tower", "multi_modal_projector"})}
    (dst / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    copy_serving_files(src, dst)
    return dst


def write_quantized(src: Path, dst: Path, scheme: str, group_size: int | None = 128,
                    block: tuple[int, int] = (128, 128)) -> Path:
    """One of ``SCHEMES``: "fp8-block" through ``write_fine_grained_fp8``, "awq" through
    ``write_awq``, the others through ``write_compressed_tensors``."""
    if scheme == "fp8-block":
        return write_fine_grained_fp8(src, dst, block)
    if scheme == "awq":
        return write_awq(src, dst, group_size or 128)
    return write_compressed_tensors(src, dst, scheme, group_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a bf16 Hugging Face model directory")
    parser.add_argument("dst", type=Path)
    parser.add_argument("--scheme", choices=SCHEMES, required=True)
    parser.add_argument("--group-size", type=int, default=128, help="W4A16's group (the preset's 128)")
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128), metavar=("BN", "BK"),
                        help="fp8-block's weight_block_size (Qwen's 128 128)")
    args = parser.parse_args(argv)
    print(write_quantized(args.src, args.dst, args.scheme, args.group_size, tuple(args.block)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
