"""Quantized copies of a model directory, written by the formats' own tools, as users download them.

    python -m fovea.testing.quantized SRC DST --scheme fp8-dynamic|w4a16|w4a16-asym|fp8-block [--group-size 128]

Three formats, each the way its released checkpoints are made:

- ``fp8-dynamic``: compressed-tensors ``float-quantized``, made by llmcompressor's ``oneshot`` with
  ``QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC")`` (FP8 e4m3 weights with one scale
  per output channel, FP8 activations quantised per token at run time), as
  ``RedHatAI/Qwen2.5-VL-7B-Instruct-FP8-Dynamic`` was.
- ``w4a16`` / ``w4a16-asym``: compressed-tensors ``pack-quantized`` (int4 weights, eight to an
  int32, one scale per group of input columns; the asymmetric preset adds packed zero points),
  made by the same ``QuantizationModifier`` with the ``W4A16`` / ``W4A16_ASYM`` presets' settings
  and only the group size changed (the presets' 128 is the default; the tiny test models are
  32-256 wide, so their fixtures use 32). ``QuantizationModifier`` alone rounds to nearest
  (the weight observer's min/max): no GPTQ, no AWQ.
- ``fp8-block``: Qwen's own fine-grained FP8 (``quant_method: fp8``, e4m3 weights with one float32
  ``weight_scale_inv`` per ``weight_block_size`` block), as ``Qwen/Qwen3-VL-8B-Instruct-FP8``
  ships it. Quantised by transformers' own FP8 op (``Fp8Quantize``, what its
  ``FineGrainedFP8Config`` quantizer applies on load) and written by ``save_pretrained`` (see
  ``write_fine_grained_fp8`` for why not through the quantizer itself).

FP8_DYNAMIC, round-to-nearest W4A16 and the fine-grained FP8 need no calibration data, so a 7B
bf16 directory is quantised the same way on the GPU machine (llmcompressor moves the layers to
the GPU itself): ``python -m fovea.testing.quantized /models/qwen7b /models/qwen7b-fp8 --scheme
fp8-dynamic``.

Everything but the language model's linear layers stays unquantised and in the source dtype: the
vision tower, the projector / merger and ``lm_head``, exactly as the released checkpoints' recipes
ignore them. The tokenizer, processor and chat template are copied, so the directory is
servable. The writers are deterministic (round to nearest, no data).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
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
SCHEMES = (*COMPRESSED_TENSORS_SCHEMES, "fp8-block")
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


@contextlib.contextmanager
def _tokenizers_parallelism_kept() -> Iterator[None]:
    """llmcompressor's ``oneshot`` sets TOKENIZERS_PARALLELISM=false for the whole process; put it back."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def compressed_tensors_scheme(scheme: str, group_size: int | None):
    """The preset's ``QuantizationScheme`` for Linear layers; W4A16's group size replaced when given."""
    from compressed_tensors.quantization import preset_name_to_scheme

    preset = preset_name_to_scheme(COMPRESSED_TENSORS_SCHEMES[scheme], ["Linear"])
    if group_size is not None and scheme != "fp8-dynamic":
        preset.weights = preset.weights.model_copy(update={"group_size": group_size})
    return preset


def write_compressed_tensors(src: Path, dst: Path, scheme: str, group_size: int | None = 128,
                             ignore: list[str] = IGNORE) -> Path:
    """A compressed-tensors copy of ``src`` made by llmcompressor's ``oneshot`` (no calibration data).

    ``scheme``: "fp8-dynamic" (the FP8_DYNAMIC preset), "w4a16" (W4A16: symmetric int4, groups
    along the input) or "w4a16-asym" (W4A16_ASYM: with zero points); ``group_size`` replaces the
    W4A16 presets' 128 and must divide every quantized layer's input width. ``ignore``: the
    recipe's ignore list (tests pass a shorter one to make a wrongly quantized directory). Saved with
    ``save_compressed=True``, so the tensors are the compressed format's (``weight`` e4m3 and
    ``weight_scale`` [N, 1]; ``weight_packed`` int32, ``weight_scale``, ``weight_shape`` and, for
    the asymmetric preset, ``weight_zero_point``).
    """
    if scheme not in COMPRESSED_TENSORS_SCHEMES:
        raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; one of {sorted(COMPRESSED_TENSORS_SCHEMES)}")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    src, dst = Path(src), Path(dst)
    model = load_source(src)
    if scheme == "fp8-dynamic" or group_size is None:  # the released recipes' own form
        recipe = QuantizationModifier(targets="Linear", scheme=COMPRESSED_TENSORS_SCHEMES[scheme], ignore=list(ignore))
    else:
        group = {"group_0": compressed_tensors_scheme(scheme, group_size)}
        recipe = QuantizationModifier(config_groups=group, ignore=list(ignore))
    with _tokenizers_parallelism_kept():
        oneshot(model=model, recipe=recipe)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst, save_compressed=True)
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


def write_quantized(src: Path, dst: Path, scheme: str, group_size: int | None = 128,
                    block: tuple[int, int] = (128, 128)) -> Path:
    """One of ``SCHEMES``: "fp8-block" through ``write_fine_grained_fp8``, the others through
    ``write_compressed_tensors``."""
    if scheme == "fp8-block":
        return write_fine_grained_fp8(src, dst, block)
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
