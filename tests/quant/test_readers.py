"""Checkpoint readers against the formats' own code: compressed-tensors' compressors (quantise, pack, decompress)
and transformers' fine-grained FP8 quantiser and dequantiser; AWQ against its own packer (pinned in test_awq)."""

import math
from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
from transformers.utils.quantization_config import FineGrainedFP8Config

from fovea.errors import ModelLoadError
from fovea.quant.awq import pack_awq, quantize_awq
from fovea.quant.formats import read_format
from fovea.quant.readers import QUANT_SUFFIXES, quantized_prefixes, read_linear, tensor_suffixes
from fovea.quant.weights import Fp8Weight, Int4Weight

PREFIX = "model.layers.0.mlp.down_proj"


def _getter(tensors: dict[str, torch.Tensor], prefix: str = PREFIX):
    return lambda name: tensors.get(name.removeprefix(prefix + ".")) if name.startswith(prefix + ".") else None


def _ct_format(preset: str, fmt: str, **weights) -> tuple:
    scheme = preset_name_to_scheme(preset, ["Linear"])
    for key, value in weights.items():
        setattr(scheme.weights, key, value)
    w, a = scheme.weights.model_dump(), scheme.input_activations
    group = {"targets": ["Linear"], "weights": w, "input_activations": a and a.model_dump()}
    config = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
              "config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    return scheme, read_format({"quantization_config": config})


def _ct_compress(weight: torch.Tensor, scheme, fmt: str):
    """Scales from compressed-tensors' calculate_qparams, then its compressor; its decompress is the reference."""
    args, (n, k) = scheme.weights, weight.shape
    if args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif args.strategy == "tensor":
        lo, hi = weight.amin(), weight.amax()
    elif args.strategy == "group":
        r = weight.reshape(n, k // args.group_size, args.group_size)
        lo, hi = r.amin(-1), r.amax(-1)
    else:  # block: pad like compressed-tensors does, so edge blocks see only real values and zeros
        bn, bk = args.block_structure
        padded = torch.zeros(math.ceil(n / bn) * bn, math.ceil(k / bk) * bk, dtype=weight.dtype)
        padded[:n, :k] = weight
        r = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        lo, hi = r.amin(dim=(1, 3)), r.amax(dim=(1, 3))
    scale, zero_point = calculate_qparams(lo, hi, args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    compressed = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point},
                                     scheme)
    return compressed, compressor.decompress(compressed, scheme)["weight"]


def _weight(n: int, k: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compressed_tensors_fp8_dynamic(strategy, dtype):
    scheme, fmt = _ct_format("FP8_DYNAMIC", "float-quantized", strategy=strategy)
    assert fmt.scheme == "fp8-channel"
    tensors, reference = _ct_compress(_weight(48, 96, dtype), scheme, "float-quantized")
    w = read_linear(fmt, _getter(tensors), PREFIX)
    assert isinstance(w, Fp8Weight) and w.block is None and w.scale.shape == (48,)
    # compressed-tensors multiplies fp8 by the model-dtype scale in the model dtype: one rounding, like ours.
    assert torch.equal(w.dequantize(dtype), reference)


@pytest.mark.parametrize("shape", [(256, 384), (200, 330)])
def test_compressed_tensors_fp8_block(shape):
    scheme, fmt = _ct_format("FP8_BLOCK", "float-quantized")
    assert fmt.scheme == "fp8-block" and fmt.block == (128, 128)
    tensors, reference = _ct_compress(_weight(*shape, torch.bfloat16, seed=1), scheme, "float-quantized")
    w = read_linear(fmt, _getter(tensors), PREFIX)
    assert w.block == (128, 128) and w.scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(w.dequantize(torch.bfloat16), reference)


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
@pytest.mark.parametrize("dtype,group,shape", [(torch.bfloat16, 32, (40, 128)), (torch.float16, 128, (24, 256)),
                                               (torch.float32, 16, (7, 48))])
def test_compressed_tensors_w4a16(preset, dtype, group, shape):
    scheme, fmt = _ct_format(preset, "pack-quantized", group_size=group)
    assert fmt.scheme == "w4a16" and fmt.group_size == group and fmt.symmetric == (preset == "W4A16")
    tensors, reference = _ct_compress(_weight(*shape, dtype, seed=2), scheme, "pack-quantized")
    assert ("weight_zero_point" in tensors) == (preset == "W4A16_ASYM")
    w = read_linear(fmt, _getter(tensors), PREFIX)
    assert isinstance(w, Int4Weight) and w.group == group and (w.zeros is None) == fmt.symmetric
    assert w.scales.dtype == dtype and (w.out_features, w.in_features) == shape
    # compressed-tensors computes (q - z) * s in the model dtype: a small integer times s rounds once, like ours.
    assert torch.equal(w.dequantize(dtype), reference)


def test_w4a16_scales_cast_to_the_model_dtype():
    scheme, fmt = _ct_format("W4A16_ASYM", "pack-quantized", group_size=32)
    tensors, reference = _ct_compress(_weight(16, 64, torch.float32), scheme, "pack-quantized")
    w = read_linear(fmt, _getter(tensors), PREFIX, dtype=torch.bfloat16)
    assert w.scales.dtype == w.zeros.dtype == torch.bfloat16
    assert torch.allclose(w.dequantize(torch.float32), reference, rtol=2**-8, atol=0)


def _hf_fp8(weight: torch.Tensor, block=(128, 128)) -> dict[str, torch.Tensor]:
    quantizer = SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block))
    return {k.removeprefix(PREFIX + "."): v for k, v in
            Fp8Quantize(quantizer)._quantize_one(f"{PREFIX}.weight", weight).items()}


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((96, 64), (32, 16))])
def test_fine_grained_fp8_against_transformers(shape, block):
    fmt = read_format({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                               "weight_block_size": list(block)}})
    tensors = _hf_fp8(_weight(*shape, torch.bfloat16, seed=3), block)
    assert set(tensors) == {"weight", "weight_scale_inv"}
    w = read_linear(fmt, _getter(tensors), PREFIX)
    assert w.block == block
    reference = Fp8Dequantize(None)._dequantize_one(tensors["weight"], tensors["weight_scale_inv"], torch.float32)
    assert torch.equal(w.dequantize(torch.float32), reference)
    # And the scale multiplies: the dequantised weight is close to the original.
    assert torch.allclose(w.dequantize(torch.float32), _weight(*shape, torch.bfloat16, seed=3).float(),
                          atol=0.02 * 4 * 2**-3)


def test_fine_grained_fp8_partial_blocks_from_the_definition():
    # 200 x 330 in 128 x 128 blocks (transformers' dequantiser needs whole blocks, so the reference is the rule).
    fmt = read_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    g = torch.Generator().manual_seed(4)
    weight = (torch.randn(200, 330, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g)
    w = read_linear(fmt, _getter({"weight": weight, "weight_scale_inv": scale}), PREFIX)
    ref = weight.float().clone()
    for i in range(2):
        for j in range(3):
            ref[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= scale[i, j]
    assert torch.equal(w.dequantize(torch.float32), ref)
    with pytest.raises(ModelLoadError, match=r"\[2, 3\]"):
        read_linear(fmt, _getter({"weight": weight, "weight_scale_inv": scale[:, :2]}), PREFIX)


def test_awq_reader():
    fmt = read_format({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                               "version": "gemm", "zero_point": True}})
    w = quantize_awq(_weight(64, 128, torch.float32, seed=5), 32)
    tensors = pack_awq(w)
    back = read_linear(fmt, _getter(tensors), PREFIX)  # scales as stored (fp16): the same weight exactly
    assert back.scales.dtype == torch.float16 and back.group == 32
    assert torch.equal(back.dequantize(torch.float32), w.dequantize(torch.float32))
    bf16 = read_linear(fmt, _getter(tensors), PREFIX, dtype=torch.bfloat16)
    assert bf16.scales.dtype == bf16.zeros.dtype == torch.bfloat16 and torch.equal(bf16.packed, w.packed)
    # Only the scales' cast to bf16 rounds: within bf16's half-ulp, relative.
    assert torch.allclose(bf16.dequantize(torch.float32), w.dequantize(torch.float32), rtol=2**-8, atol=0)
    wrong = read_format({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}})
    with pytest.raises(ModelLoadError, match="groups of 32 in the tensors, 64 in the config"):
        read_linear(wrong, _getter(tensors), PREFIX)


def _all_formats():
    return {
        "ct-fp8": _ct_format("FP8_DYNAMIC", "float-quantized")[1],
        "ct-w4a16": _ct_format("W4A16", "pack-quantized")[1],
        "fp8": read_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}),
        "awq": read_format({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}),
    }


@pytest.mark.parametrize("name", ["ct-fp8", "ct-w4a16", "fp8", "awq"])
def test_unquantized_linear_reads_as_none(name):
    plain = {"weight": torch.zeros(4, 8, dtype=torch.bfloat16), "bias": torch.zeros(4)}
    assert read_linear(_all_formats()[name], _getter(plain), PREFIX) is None


@pytest.mark.parametrize("name,tensors,message", [
    ("ct-w4a16", {"weight": torch.zeros(4, 8), "weight_scale": torch.ones(4, 1)}, "but no .*weight_packed"),
    ("ct-fp8", {"weight": torch.zeros(4, 8), "input_scale": torch.ones(1)}, "but no .*weight_scale"),
    ("fp8", {"weight": torch.zeros(4, 8), "activation_scale": torch.ones(1)}, "but no .*weight_scale_inv"),
    ("awq", {"qzeros": torch.zeros(1, 1, dtype=torch.int32)}, "but no .*qweight"),
    ("ct-w4a16", {"weight_packed": torch.zeros(4, 1, dtype=torch.int32)}, "lacks .*weight_shape"),
    ("fp8", {"weight_scale_inv": torch.ones(1, 1)}, r"lacks .*down_proj\.weight$"),
    ("awq", {"qweight": torch.zeros(8, 1, dtype=torch.int32)}, "lacks .*qzeros"),
    ("fp8", {"weight": torch.zeros(4, 8, dtype=torch.bfloat16), "weight_scale_inv": torch.ones(1, 1)},
     "float8_e4m3fn"),
])
def test_stray_or_missing_format_tensors_are_errors(name, tensors, message):
    with pytest.raises(ModelLoadError, match=message) as info:
        read_linear(_all_formats()[name], _getter(tensors), PREFIX)
    assert PREFIX in info.value.message


def test_static_input_scale_is_refused():
    scheme, fmt = _ct_format("FP8_DYNAMIC", "float-quantized")
    tensors, _ = _ct_compress(_weight(16, 32), scheme, "float-quantized")
    with pytest.raises(ModelLoadError, match="static activation scale"):
        read_linear(fmt, _getter({**tensors, "input_scale": torch.ones(1)}), PREFIX)


def test_quantized_prefixes_and_suffixes():
    names = ["model.embed_tokens.weight", "lm_head.weight",
             "model.layers.0.self_attn.q_proj.weight_packed", "model.layers.0.self_attn.q_proj.weight_scale",
             "model.layers.0.self_attn.q_proj.weight_shape", "model.layers.0.mlp.up_proj.weight_packed",
             "visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.bias"]
    fmts = _all_formats()
    assert quantized_prefixes(names, fmts["ct-w4a16"]) == {"model.layers.0.self_attn.q_proj",
                                                           "model.layers.0.mlp.up_proj"}
    assert quantized_prefixes(names, fmts["awq"]) == set()
    assert quantized_prefixes(["a.qweight", "a.qzeros", "a.scales", "b.weight"], fmts["awq"]) == {"a"}
    assert quantized_prefixes(["a.weight", "a.weight_scale_inv"], fmts["fp8"]) == {"a"}
    assert tensor_suffixes(fmts["awq"]) == {"qweight", "qzeros", "scales"}
    assert {"weight_packed", "weight_zero_point", "weight_shape"} <= tensor_suffixes(fmts["ct-w4a16"])
    assert "bias" not in QUANT_SUFFIXES and "weight_scale_inv" in QUANT_SUFFIXES


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    # k/v_proj have 64 rows: a partial 128-row block for FP8_BLOCK.
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-bf16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _decompressed_by_transformers(directory, auto_class) -> dict[str, torch.Tensor]:
    """The reference: transformers loading the directory with compressed-tensors decompressing each layer at load
    (``dequantize=True``, what ``run_compressed=False`` was before transformers 5.24 renamed it)."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return auto_class.from_pretrained(directory, dtype=torch.bfloat16,
                                      quantization_config=CompressedTensorsConfig(dequantize=True)).state_dict()


def _reads_like_the_reference(directory, reference: dict[str, torch.Tensor]) -> tuple:
    """Every quantized linear of the directory read by ``read_linear`` against the reference's weight, bit for bit."""
    import json

    from safetensors import safe_open

    fmt = read_format(json.loads((directory / "config.json").read_text()))
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = set(f.keys())
        prefixes = quantized_prefixes(names, fmt)
        for prefix in sorted(prefixes):
            w = read_linear(fmt, lambda n: f.get_tensor(n) if n in names else None, prefix, dtype=torch.bfloat16)
            assert torch.equal(w.dequantize(torch.bfloat16), reference[f"{prefix}.weight"]), prefix
        assert read_linear(fmt, lambda n: f.get_tensor(n) if n in names else None, "lm_head") is None
    return fmt, prefixes


@pytest.mark.parametrize("scheme,expected", [("FP8_DYNAMIC", "fp8-channel"), ("FP8_BLOCK", "fp8-block"),
                                             ("W4A16", "w4a16"), ("W4A16_ASYM", "w4a16")])
def test_compressed_tensors_checkpoint_reads_like_transformers_decompresses_it(tiny_llama, tmp_path, scheme, expected):
    """A checkpoint as users get it: the recipe ``QuantizationModifier(targets="Linear", scheme=..., ignore=["lm_head"])``
    made by fovea.testing.quantized with compressed-tensors' own code (the preset, its compressor and config; the
    scales as llmcompressor's minmax observer picks them) and saved; the reference is transformers decompressing it.
    FP8_BLOCK's 128-row blocks leave k/v_proj (64 rows) a partial one."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from fovea.testing import quantized

    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    compressor = quantized.quantize_compressed_tensors(model, preset_name_to_scheme(scheme, ["Linear"]), ["lm_head"])
    quantized.save_compressed(model, compressor, tmp_path)
    fmt, prefixes = _reads_like_the_reference(tmp_path, _decompressed_by_transformers(tmp_path, AutoModelForCausalLM))
    assert fmt.scheme == expected and fmt.leaves_unquantized("lm_head")
    assert len(prefixes) == 7 and not any(fmt.leaves_unquantized(p) for p in prefixes)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("scheme", ["fp8-dynamic", "w4a16", "w4a16-asym"])
def test_written_vlm_checkpoints_read_like_transformers_decompresses_them(quantized_dir, family, scheme):
    """The test checkpoints themselves (write_compressed_tensors, groups of 32): every linear of the language model
    is read as transformers decompresses it, and nothing of the vision tower, the projector or lm_head is."""
    from transformers import AutoModelForImageTextToText

    directory = quantized_dir(family, scheme)
    fmt, prefixes = _reads_like_the_reference(directory,
                                              _decompressed_by_transformers(directory, AutoModelForImageTextToText))
    assert fmt.scheme == ("fp8-channel" if scheme == "fp8-dynamic" else "w4a16")
    assert prefixes and all(p.startswith("model.language_model.layers.") for p in prefixes)
