"""The quantized test checkpoints are the real formats, as their tools write them and as users download them.

For each tiny family (LLaVA, Qwen2.5-VL, Qwen3-VL) and scheme (compressed-tensors FP8_DYNAMIC,
W4A16 symmetric and asymmetric, Qwen's fine-grained FP8):

- ``config.json``'s ``quantization_config`` has the released configs' fields and values;
- the safetensors hold the format's tensors (names, dtypes, shapes) for every linear layer of
  the language model and nothing else quantized: the vision tower, the projector / merger,
  ``lm_head``, embeddings, norms and biases are the source's bf16 tensors, bit for bit;
- the weights, dequantised by this file's own reading of each format (not the tools' code), lie
  within the format's rounding bound of the source weights, and a misreading breaks that bound;
- transformers (compressed-tensors installed; its own FP8 dequantiser for ``fp8-block``) loads
  each directory on the CPU into exactly those weights, and its logits on an image prompt are
  those of the source model carrying them, and close to the unquantized model's.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file

from fovea.testing import quantized, random_llava, random_qwen2_5_vl, random_qwen3_vl

FAMILIES = {"llava": random_llava, "qwen2_5_vl": random_qwen2_5_vl, "qwen3_vl": random_qwen3_vl}
# AWQ's checkpoints are checked against AutoAWQ's own packing in test_awq.py (transformers needs gptqmodel).
SCHEMES = tuple(s for s in quantized.SCHEMES if s != "awq")
GROUP_SIZE = quantized.TINY_GROUP_SIZE
BLOCK = quantized.TINY_BLOCK

CT_SCHEMES = tuple(quantized.COMPRESSED_TENSORS_SCHEMES)
# Where each family keeps what stays unquantized, under transformers 5's module names.
UNQUANTIZED_PREFIXES = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "lm_head")
LANGUAGE_PREFIX = "model.language_model."

E4M3_MAX = 448.0
# e4m3 has 3 mantissa bits: rounding to nearest is within half a unit in the last place, 2^-4 of
# the value, in the normal range (|x| >= 2^-6 after scaling); below it the spacing is 2^-9, so the
# error is at most 2^-10 in scaled units. BF16_ROUND covers the stored scale's own rounding
# (compressed-tensors keeps FP8_DYNAMIC's per-channel scale in the source dtype, bf16: 2^-9).
E4M3_REL = 2.0**-4
E4M3_SUBNORMAL = 2.0**-10
BF16_ROUND = 2.0**-8
# int4 round to nearest: half a step (one scale), plus the tool's own arithmetic: compressed-tensors
# computes x / scale and the asymmetric zero point in the weights' dtype, bf16, whose 2^-9 relative
# rounding at |x / scale| <= 15 is up to 2^-5 of a step each and can move a value across a rounding
# or clamping edge: an eighth of a step in all (measured: 0.526 symmetric, 0.59 asymmetric).
INT4_STEPS = 0.5 + 2.0**-3

# The quantized model's logits against the unquantized model's, ||dl|| / ||l|| over the prompt's
# last positions. Each quantized linear's output is W x + dW x; with errors uncorrelated with x
# (random weights, round to nearest) ||dW x|| / ||W x|| is about the weights' RMS relative error
# rho. FP8 e4m3: rho <= 2^-4. int4 with absmax scaling: the error is at most scale / 2 =
# absmax / 15 per weight; a group of 32 N(0, s) weights has absmax about 2.5 s, so rho <= 0.17.
# A decoder layer puts two quantized linears in series on each branch (v then o, up then down),
# and the branches add into the residual stream, so the stream's relative error is at most about
# 2 rho per layer-sum; RMSNorm and the unquantized lm_head carry a relative error through. With
# the random tiny models' branches as large as the stream, that is allowed once more: 4 rho.
# A misread format (a permuted nibble order, a scale on the wrong axis) makes rho ~ 1 and the
# logits' error ~ 1 or more, far outside these. The measured errors are 0.04-0.055 (FP8) and
# 0.11-0.14 (int4).
LOGITS_TOLERANCE = {"fp8-dynamic": 4 * E4M3_REL, "fp8-block": 4 * E4M3_REL, "w4a16": 4 * 0.17, "w4a16-asym": 4 * 0.17}
# The same directory in transformers and in the source model carrying this file's dequantised
# weights: the same weights and modules in the same order, so the same logits (measured: equal).
SAME_WEIGHTS_TOLERANCE = 1e-6

# transformers 5.24 with compressed-tensors 0.19 cannot load an asymmetric pack-quantized directory left
# compressed (``dequantize=False``, the default): it builds the empty model on the meta device and compresses it
# with compressed-tensors' compressor to receive the packed tensors, and that compressor's meta-device branch
# leaves ``weight_zero_point`` unpacked, [N, K / g], where the files hold it packed, [N / 8, K / g], as the same
# compressor writes it from real weights; the load refuses the mismatched sizes. Dequantised at load the model
# stays dense and reads (test_transformers_loads_the_weights_this_file_reads). Pinned, so a fixed release shows.
COMPRESSED_LOAD_FAILS = {"w4a16-asym"}

# The released configs' fields (RedHatAI/Qwen2.5-VL-7B-Instruct-FP8-Dynamic, the W4A16 releases
# of llmcompressor's examples), with the tiny models' group size.
FP8_DYNAMIC_GROUP = {
    "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                "group_size": None, "block_structure": None, "actorder": None},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True,
                          "group_size": None},
}
W4A16_GROUP = {
    "targets": ["Linear"], "format": "pack-quantized", "output_activations": None, "input_activations": None,
    "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP_SIZE, "symmetric": True,
                "dynamic": False, "block_structure": None, "actorder": None},
}
EXPECTED_GROUP = {"fp8-dynamic": FP8_DYNAMIC_GROUP, "w4a16": W4A16_GROUP,
                  "w4a16-asym": {**W4A16_GROUP, "weights": {**W4A16_GROUP["weights"], "symmetric": False}}}
EXPECTED_FORMAT = {"fp8-dynamic": "float-quantized", "w4a16": "pack-quantized", "w4a16-asym": "pack-quantized"}


@functools.cache
def linear_shapes(family: str) -> dict[str, tuple[int, int]]:
    """Every nn.Linear of the family's tiny model (built on the meta device): name -> weight shape."""
    from transformers import AutoModelForImageTextToText

    module = FAMILIES[family]
    config = module.build_config(module.ARCHITECTURES["tiny"])
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return {name: tuple(m.weight.shape) for name, m in model.named_modules() if type(m) is torch.nn.Linear}


def quantized_linears(family: str) -> dict[str, tuple[int, int]]:
    return {name: shape for name, shape in linear_shapes(family).items() if name.startswith(LANGUAGE_PREFIX)}


def unquantized_linears(family: str) -> set[str]:
    names = {name for name in linear_shapes(family) if name.startswith(UNQUANTIZED_PREFIXES)}
    assert names | set(quantized_linears(family)) == set(linear_shapes(family)), "a linear of neither kind"
    return names


def expected_tensors(scheme: str, shape: tuple[int, int], dtype: str) -> dict[str, tuple[str, list[int]]]:
    """A quantized linear's tensors in the format: suffix -> (safetensors dtype, shape)."""
    n, k = shape
    if scheme == "fp8-dynamic":  # per output channel, in the source dtype; no input scale (dynamic)
        return {"weight": ("F8_E4M3", [n, k]), "weight_scale": (dtype, [n, 1])}
    if scheme == "fp8-block":
        bn, bk = BLOCK
        return {"weight": ("F8_E4M3", [n, k]), "weight_scale_inv": ("F32", [-(-n // bn), -(-k // bk)])}
    tensors = {"weight_packed": ("I32", [n, k // 8]), "weight_scale": (dtype, [n, k // GROUP_SIZE]),
               "weight_shape": ("I64", [2])}
    if scheme == "w4a16-asym":  # int4 zero points, eight to an int32 along the output axis
        tensors["weight_zero_point"] = ("I32", [n // 8, k // GROUP_SIZE])
    return tensors


# This file's own reading of each format, from its definition.
def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized int4: eight values to an int32 along the last axis, value
    8j + i of a row in bits 4i..4i+3 of word j, each stored as q + 8 (unsigned)."""
    nibbles = (packed.unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int32))) & 0xF
    return nibbles.reshape(*packed.shape[:-1], -1) - 8


def dequantize(scheme: str, tensors: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear ``prefix``'s weight in float32 from the format's tensors, and each weight's scale."""
    if scheme == "fp8-dynamic":
        weight, scale = tensors[prefix + "weight"].float(), tensors[prefix + "weight_scale"].float()
        return weight * scale, scale.expand_as(weight)
    if scheme == "fp8-block":
        weight, inverse = tensors[prefix + "weight"].float(), tensors[prefix + "weight_scale_inv"]
        scale = inverse.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:weight.shape[0], :weight.shape[1]]
        return weight * scale, scale
    n, k = tensors[prefix + "weight_shape"].tolist()
    q = unpack_int4(tensors[prefix + "weight_packed"])[:, :k].float()
    scale = tensors[prefix + "weight_scale"].float().repeat_interleave(GROUP_SIZE, 1)
    zero = torch.zeros_like(q)
    if prefix + "weight_zero_point" in tensors:  # packed along the output axis: unpack the transpose
        zero = unpack_int4(tensors[prefix + "weight_zero_point"].T.contiguous()).T[:n].float()
        zero = zero.repeat_interleave(GROUP_SIZE, 1)
    return (q - zero) * scale, scale


def rounding_bound(scheme: str, source: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most a weight may move in the format: e4m3 rounding for FP8, half a step for int4."""
    if scheme.startswith("fp8"):
        return (E4M3_REL + BF16_ROUND) * source.abs() + E4M3_SUBNORMAL * scale
    return INT4_STEPS * scale


@functools.cache
def _tensors(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def tensors_of(path) -> dict[str, torch.Tensor]:
    return _tensors(path)


def inputs_with_an_image(model) -> dict[str, torch.Tensor]:
    """Words, one random image's tokens and its pixels, as each family's processor would lay them out."""
    config, generator = model.config, torch.Generator().manual_seed(0)
    words = torch.randint(10, 900, (8,), generator=generator)
    if config.model_type == "llava":  # 576 tokens of a 336 px image
        ids = torch.cat([torch.tensor([1]), words[:4], torch.full((config.image_seq_length,), config.image_token_id),
                         words[4:]])
        pixels = torch.randn(1, 3, 336, 336, generator=generator)
        return {"input_ids": ids[None], "pixel_values": pixels.to(model.dtype)}
    patch = config.vision_config.patch_size  # a 4 x 4 patch grid: 4 tokens after the 2 x 2 merge
    image = torch.full((4,), config.image_token_id)
    ids = torch.cat([words[:4], torch.tensor([config.vision_start_token_id]), image,
                     torch.tensor([config.vision_end_token_id]), words[4:]])[None]
    pixels = torch.randn(16, 3 * 2 * patch * patch, generator=generator)
    return {"input_ids": ids, "pixel_values": pixels.to(model.dtype), "image_grid_thw": torch.tensor([[1, 4, 4]]),
            "mm_token_type_ids": (ids == config.image_token_id).int()}


def logits(model, inputs) -> torch.Tensor:
    """The last 8 positions' logits (the words after the image), in float32."""
    with torch.no_grad():
        return model(**inputs).logits[0, -8:].float()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def load(path, dequantize: bool = False):
    """The directory in transformers on the CPU. A compressed-tensors one is left compressed and
    decompressed by compressed-tensors on the first forward, unless ``dequantize`` (at load);
    a fine-grained FP8 one is dequantised at load by transformers wherever FP8 matmuls cannot run."""
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16, **extra).eval()


def fp8_per_token(module, args):
    """FP8_DYNAMIC's input_activations (float 8, strategy token, dynamic, symmetric): each token
    scaled by its absmax / 448, rounded to e4m3 and scaled back, in the activations' dtype, as
    compressed-tensors does it in the forward of a layer it loaded."""
    x = args[0]
    scale = x.abs().amax(-1, keepdim=True) / E4M3_MAX
    return ((x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale,)


def problems_in_unquantized_parts(family: str, source, directory) -> list[str]:
    """Every tensor that is not a quantized linear's: present, the source's dtype and bits."""
    src, out = tensors_of(source), tensors_of(directory)
    quantized_weights = {name + ".weight" for name in quantized_linears(family)}
    found = []
    for name, tensor in src.items():
        if name in quantized_weights:
            continue
        if name not in out:
            found.append(f"{name}: missing (quantized?)")
        elif out[name].dtype != tensor.dtype or not torch.equal(out[name], tensor):
            found.append(f"{name}: {out[name].dtype}, not the source's {tensor.dtype} tensor")
    return found


def problems_in_ignore_list(family: str, config: dict) -> list[str]:
    q = config["quantization_config"]
    listed = set(q["ignore"] if "ignore" in q else q["modules_to_not_convert"])
    expected = unquantized_linears(family)
    return [f"not kept unquantized: {sorted(expected - listed)}"] * bool(expected - listed) + \
        [f"kept unquantized but in the language model: {sorted(listed - expected)}"] * bool(listed - expected)


PAIRS = [(family, scheme) for family in FAMILIES for scheme in SCHEMES]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", CT_SCHEMES)
def test_compressed_tensors_config_is_the_released_format(quantized_dir, family, scheme):
    config = json.loads((quantized_dir(family, scheme) / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == EXPECTED_FORMAT[scheme]
    assert q["quantization_status"] == "compressed"
    assert q["kv_cache_scheme"] is None and not q.get("sparsity_config")
    assert list(q["config_groups"]) == ["group_0"]
    group = q["config_groups"]["group_0"]
    for key, value in EXPECTED_GROUP[scheme].items():
        if isinstance(value, dict):
            assert {k: group[key][k] for k in value} == value, key
        else:
            assert group[key] == value, key
    assert problems_in_ignore_list(family, config) == []
    assert config["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", FAMILIES)
def test_fine_grained_fp8_config_is_qwens_format(quantized_dir, family):
    config = json.loads((quantized_dir(family, "fp8-block") / "config.json").read_text())
    q = config["quantization_config"]
    assert {k: v for k, v in q.items() if k != "modules_to_not_convert"} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    assert problems_in_ignore_list(family, config) == []


@pytest.mark.parametrize(("family", "scheme"), PAIRS)
def test_tensors_have_the_formats_names_dtypes_and_shapes(source_dir, quantized_dir, family, scheme):
    source = quantized.tensor_headers(source_dir(family))
    written = quantized.tensor_headers(quantized_dir(family, scheme))
    expected = {name: (t["dtype"], t["shape"]) for name, t in source.items()}
    for name, shape in quantized_linears(family).items():
        assert expected.pop(name + ".weight") == ("BF16", list(shape))
        expected.update({f"{name}.{suffix}": spec for suffix, spec in expected_tensors(scheme, shape, "BF16").items()})
    assert {name: (t["dtype"], t["shape"]) for name, t in written.items()} == expected
    if scheme in ("w4a16", "w4a16-asym"):
        tensors = tensors_of(quantized_dir(family, scheme))
        for name, shape in quantized_linears(family).items():
            assert tensors[name + ".weight_shape"].tolist() == list(shape)


@pytest.mark.parametrize(("family", "scheme"), PAIRS)
def test_vision_projector_and_lm_head_are_the_source_bits(source_dir, quantized_dir, family, scheme):
    assert problems_in_unquantized_parts(family, source_dir(family), quantized_dir(family, scheme)) == []


def test_the_checks_notice_a_quantized_vision_tower(source_dir, tmp_path):
    """A directory quantized with only lm_head ignored (the vision tower and merger quantized) fails
    the checks above: they can fail."""
    wrong = quantized.write_compressed_tensors(source_dir("qwen2_5_vl"), tmp_path / "wrong", "fp8-dynamic",
                                               ignore=["re:.*lm_head"])
    config = json.loads((wrong / "config.json").read_text())
    assert problems_in_ignore_list("qwen2_5_vl", config)
    found = problems_in_unquantized_parts("qwen2_5_vl", source_dir("qwen2_5_vl"), wrong)
    assert any(p.startswith("model.visual.blocks.0.attn.qkv.weight") for p in found)
    assert any(p.startswith("model.visual.merger.mlp.0.weight") for p in found)
    assert not any(p.startswith("lm_head") for p in found)


@pytest.mark.parametrize(("family", "scheme"), PAIRS)
def test_weights_are_within_the_formats_rounding_of_the_source(source_dir, quantized_dir, family, scheme):
    src, out = tensors_of(source_dir(family)), tensors_of(quantized_dir(family, scheme))
    for name in quantized_linears(family):
        source = src[name + ".weight"].float()
        weight, scale = dequantize(scheme, out, name + ".")
        error = (weight - source).abs()
        bound = rounding_bound(scheme, source, scale)
        assert (error <= bound).all(), f"{name}: {(error - bound).max().item():.3g} past the bound"
        assert error.max() > 0, f"{name}: not rounded at all"
        if scheme.startswith("w4a16"):  # the groups' full int4 range is used: symmetric -8..7 (or 0..15 asym)
            q = unpack_int4(out[name + ".weight_packed"])
            assert q.min() >= -8 and q.max() <= 7 and (q.max() - q.min()) >= 14


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_misread_format_breaks_the_bound(source_dir, quantized_dir, scheme):
    """The bound check above fails for a plausible misreading: the nibbles in the other order, the
    FP8 scale per input column instead of per output channel, the blocks' scales transposed."""
    family = "qwen2_5_vl"
    src, out = tensors_of(source_dir(family)), dict(tensors_of(quantized_dir(family, scheme)))
    name = "model.language_model.layers.0.mlp.gate_proj"  # 128 x 64: not square, several groups and blocks
    source = src[name + ".weight"].float()
    if scheme.startswith("w4a16"):
        packed = out[name + ".weight_packed"]
        reordered = (packed.unsqueeze(-1) >> (4 * torch.arange(7, -1, -1, dtype=torch.int32))) & 0xF
        out[name + ".weight_packed"] = (reordered << (4 * torch.arange(8, dtype=torch.int32))).sum(-1).to(torch.int32)
    elif scheme == "fp8-dynamic":
        out[name + ".weight_scale"] = out[name + ".weight_scale"][: source.shape[1]].reshape(1, -1)
    else:
        out[name + ".weight_scale_inv"] = out[name + ".weight_scale_inv"].flip(0)
    weight, scale = dequantize(scheme, out, name + ".")
    assert ((weight - source).abs() > rounding_bound(scheme, source, scale)).any()


@functools.cache
def source_model(family: str, path):
    return load(path)


@pytest.mark.parametrize(("family", "scheme"), PAIRS)
def test_transformers_loads_the_weights_this_file_reads(source_dir, quantized_dir, family, scheme):
    """transformers, with compressed-tensors (or its own FP8 dequantiser), decompresses each quantized
    linear into this file's dequantisation and leaves the rest the source's: the reading above is
    the tools' own, not a mirror of the writer."""
    model = load(quantized_dir(family, scheme), dequantize=scheme in CT_SCHEMES)
    out, src = tensors_of(quantized_dir(family, scheme)), tensors_of(source_dir(family))
    for name in quantized_linears(family):
        loaded = model.get_submodule(name).weight
        assert loaded.dtype == torch.bfloat16, name
        reference = dequantize(scheme, out, name + ".")[0].to(torch.bfloat16)
        assert torch.equal(loaded, reference), f"{name}: {(loaded.float() - reference.float()).abs().max()}"
    for name in unquantized_linears(family):
        assert torch.equal(model.get_submodule(name).weight, src[name + ".weight"]), name


@pytest.mark.parametrize(("family", "scheme"), PAIRS)
def test_logits_are_the_unquantized_models_within_the_formats_error(source_dir, quantized_dir, family, scheme):
    if scheme in COMPRESSED_LOAD_FAILS:
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            load(quantized_dir(family, scheme))
        model = load(quantized_dir(family, scheme), dequantize=True)
    else:
        model = load(quantized_dir(family, scheme))
    reference = source_model(family, source_dir(family))
    inputs = inputs_with_an_image(reference)
    expected, got = logits(reference, inputs), logits(model, inputs)
    error = relative(got, expected)
    assert 0 < error <= LOGITS_TOLERANCE[scheme], f"{error:.3f}"
    # The source model carrying this file's dequantised weights (and, for FP8_DYNAMIC, quantising its
    # linear layers' inputs per token) gives transformers' logits: the directory's meaning is the
    # format's, the vision tower included (a quantized tower would change the image's tokens).
    carrying = load(source_dir(family))
    out = tensors_of(quantized_dir(family, scheme))
    with torch.no_grad():
        for name in quantized_linears(family):
            carrying.get_submodule(name).weight.copy_(dequantize(scheme, out, name + ".")[0])
            if scheme == "fp8-dynamic":
                carrying.get_submodule(name).register_forward_pre_hook(fp8_per_token)
    assert relative(logits(carrying, inputs), got) <= SAME_WEIGHTS_TOLERANCE


def test_the_writers_are_deterministic(source_dir, quantized_dir, tmp_path):
    family = "qwen2_5_vl"
    for scheme in SCHEMES:
        again = quantized.write_quantized(source_dir(family), tmp_path / scheme, scheme, GROUP_SIZE, BLOCK)
        first = quantized_dir(family, scheme)
        assert json.loads((again / "config.json").read_text()) == json.loads((first / "config.json").read_text())
        a, b = tensors_of(again), tensors_of(first)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), scheme


def test_the_written_directories_are_servable(source_dir, quantized_dir):
    """The tokenizer, processor and chat-template files come along; the weights are the format's only."""
    for family in FAMILIES:
        source = {p.name for p in source_dir(family).iterdir() if "safetensors" not in p.name}
        for scheme in SCHEMES:
            written = {p.name for p in quantized_dir(family, scheme).iterdir()}
            assert source <= written, (family, scheme, source - written)
            assert {name for name in written if "safetensors" in name} == {"model.safetensors"}


def test_the_command_line_writes_a_directory(source_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert quantized.main([str(source_dir("qwen3_vl")), str(out), "--scheme", "fp8-block", "--block", "32", "32"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [32, 32]
    with pytest.raises(ValueError, match="does not tile"):
        quantized.write_fine_grained_fp8(source_dir("qwen3_vl"), tmp_path / "odd", (48, 48))
