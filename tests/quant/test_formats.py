"""``quantization_config`` as released checkpoints write it: the four formats fovea runs, and the refusals."""

import pytest

from fovea.errors import ModelLoadError
from fovea.quant.formats import SUPPORTED_FORMATS, read_format

# compressed-tensors args as llmcompressor writes them (every field spelled out).
_FP8_CHANNEL = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True, "type": "float"}
_FP8_TOKEN = {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None, "num_bits": 8,
              "observer": None, "observer_kwargs": {}, "strategy": "token", "symmetric": True, "type": "float"}
_INT4_G128 = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 128, "num_bits": 4,
              "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int"}


def _ct(fmt: str, weights: dict, activations: dict | None, ignore: list[str], **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "kv_cache_scheme": None, "global_compression_ratio": None, "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}},
            **extra}


# The vision tower and lm_head stay in bf16; llmcompressor writes the ignore list as explicit names
# (truncated here to a few of Qwen2.5-VL's).
_QWEN25_VL_IGNORE = ["lm_head", "visual.blocks.0.attn.qkv", "visual.blocks.0.attn.proj",
                     "visual.blocks.0.mlp.gate_proj", "visual.merger.mlp.0", "visual.merger.mlp.2"]

# RedHatAI/Qwen2.5-VL-7B-Instruct-FP8-Dynamic (llmcompressor QuantizationModifier(scheme="FP8_DYNAMIC")).
CT_FP8_DYNAMIC = _ct("float-quantized", _FP8_CHANNEL, _FP8_TOKEN, _QWEN25_VL_IGNORE)
# RedHatAI/Qwen2.5-VL-7B-Instruct-quantized.w4a16 (GPTQ, symmetric int4, group 128, pack-quantized).
CT_W4A16 = _ct("pack-quantized", _INT4_G128, None, _QWEN25_VL_IGNORE)
# llmcompressor's W4A16_ASYM preset (zero points).
CT_W4A16_ASYM = _ct("pack-quantized", {**_INT4_G128, "symmetric": False}, None, ["lm_head", "re:visual.*"])
# llmcompressor's FP8_BLOCK preset (e.g. RedHatAI ...-FP8-block releases).
CT_FP8_BLOCK = _ct("float-quantized", {**_FP8_CHANNEL, "strategy": "block", "block_structure": [128, 128]},
                   {**_FP8_TOKEN, "strategy": "group", "group_size": 128}, ["lm_head", "re:.*visual.*"])
# Qwen/Qwen3-VL-8B-Instruct-FP8 (modules_to_not_convert truncated: the real one names every vision linear).
QWEN3_VL_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": ["lm_head", "model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.proj",
                                           "model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"]}
# Qwen/Qwen2.5-VL-7B-Instruct-AWQ (AutoAWQ's to_transformers_dict).
QWEN25_VL_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True,
                 "modules_to_not_convert": ["visual"]}


@pytest.mark.parametrize("qc,method,scheme,label", [
    (CT_FP8_DYNAMIC, "compressed-tensors", "fp8-channel",
     "compressed-tensors FP8 (per-channel weights, dynamic per-token activations)"),
    (_ct("float-quantized", {**_FP8_CHANNEL, "strategy": "tensor"}, _FP8_TOKEN, []), "compressed-tensors",
     "fp8-channel", "compressed-tensors FP8 (per-tensor weights, dynamic per-token activations)"),
    (CT_FP8_BLOCK, "compressed-tensors", "fp8-block",
     "compressed-tensors FP8 (128x128 weight blocks, dynamic per-token activations in 128-column groups)"),
    (CT_W4A16, "compressed-tensors", "w4a16",
     "compressed-tensors W4A16 (int4 weights, groups of 128, symmetric; 16-bit activations)"),
    (CT_W4A16_ASYM, "compressed-tensors", "w4a16",
     "compressed-tensors W4A16 (int4 weights, groups of 128, zero points; 16-bit activations)"),
    (QWEN3_VL_FP8, "fp8", "fp8-block",
     "fine-grained FP8 (128x128 weight blocks, dynamic per-token activations in 128-column groups)"),
    (QWEN25_VL_AWQ, "awq", "awq", "AWQ GEMM (4-bit weights, groups of 128, zero points; 16-bit activations)"),
])
def test_supported_configs(qc, method, scheme, label):
    fmt = read_format({"model_type": "qwen2_5_vl", "quantization_config": qc})
    assert (fmt.method, fmt.scheme, fmt.label) == (method, scheme, label)
    assert "\n" not in fmt.label


def test_parsed_details():
    assert read_format({"quantization_config": CT_W4A16}).group_size == 128
    assert read_format({"quantization_config": CT_W4A16}).symmetric
    assert not read_format({"quantization_config": CT_W4A16_ASYM}).symmetric
    assert read_format({"quantization_config": CT_FP8_BLOCK}).block == (128, 128)
    fp8 = read_format({"quantization_config": QWEN3_VL_FP8})
    assert fp8.block == (128, 128) and "lm_head" in fp8.ignore
    awq = read_format({"quantization_config": QWEN25_VL_AWQ})
    assert (awq.group_size, awq.symmetric, awq.ignore) == (128, False, ("visual",))
    # The preset spelling: a config group named after a scheme, with targets only.
    preset = read_format({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                                  "quantization_status": "compressed",
                                                  "config_groups": {"FP8_DYNAMIC": ["Linear"]}}})
    assert preset.scheme == "fp8-channel"
    # GPTQ's static activation ordering keeps the plain group layout (no weight_g_idx).
    assert read_format({"quantization_config": _ct("pack-quantized", {**_INT4_G128, "actorder": "static"},
                                                   None, [])}).scheme == "w4a16"


def test_no_quantization_config():
    assert read_format({"model_type": "qwen2_5_vl"}) is None
    nested = read_format({"model_type": "llava", "text_config": {"quantization_config": QWEN25_VL_AWQ}})
    assert nested.scheme == "awq"


_W8A8_INT = {**_FP8_CHANNEL, "type": "int"}
_NVFP4_W = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
            "dynamic": False}
_NVFP4_A = {**_NVFP4_W, "dynamic": "local"}

REFUSED = [
    ("bitsandbytes (4-bit)", {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                              "bnb_4bit_compute_dtype": "bfloat16", "_load_in_4bit": True}),
    ("bitsandbytes (8-bit)", {"quant_method": "bitsandbytes", "load_in_8bit": True}),
    ("GGUF", {"quant_method": "gguf"}),
    ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}),
    # RedHatAI ...-quantized.w8a8: int8 weights and activations.
    ("compressed-tensors int-quantized (int8 channel weights, int8 activations)",
     _ct("int-quantized", _W8A8_INT, {**_FP8_TOKEN, "type": "int"}, [])),
    ("compressed-tensors nvfp4-pack-quantized", _ct("nvfp4-pack-quantized", _NVFP4_W, _NVFP4_A, [])),
    ("compressed-tensors pack-quantized (int8 group weights, 16-bit activations)",
     _ct("pack-quantized", {**_INT4_G128, "num_bits": 8}, None, [])),
    ("compressed-tensors pack-quantized (int3 group weights",
     _ct("pack-quantized", {**_INT4_G128, "num_bits": 3}, None, [])),
    ("activation ordering", _ct("pack-quantized", {**_INT4_G128, "actorder": "group"}, None, [])),
    ("static activation scales", _ct("float-quantized", {**_FP8_CHANNEL, "strategy": "tensor"},
                                     {**_FP8_TOKEN, "strategy": "tensor", "dynamic": False}, [])),
    ("W8A16", _ct("float-quantized", _FP8_CHANNEL, None, [])),
    ("quantized KV cache", {**CT_FP8_DYNAMIC, "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                                  "strategy": "tensor", "dynamic": False}}),
    ("mixing 2 schemes", {**CT_W4A16, "format": "mixed-precision", "config_groups": {
        "group_0": {"targets": ["re:.*mlp.*"], "weights": _INT4_G128, "format": "pack-quantized"},
        "group_1": {"targets": ["re:.*self_attn.*"], "weights": _FP8_CHANNEL, "input_activations": _FP8_TOKEN,
                    "format": "float-quantized"}}}),
    ("status 'frozen'", {**CT_FP8_DYNAMIC, "quantization_status": "frozen"}),
    ("sparse (sparse-24-bitmask)", {**CT_FP8_DYNAMIC, "sparsity_config": {"format": "sparse-24-bitmask"}}),
    ("awq 8-bit", {**QWEN25_VL_AWQ, "bits": 8}),
    ("awq version 'gemv'", {**QWEN25_VL_AWQ, "version": "gemv"}),
    ("awq version 'exllama'", {**QWEN25_VL_AWQ, "version": "exllama"}),
    ("awq without zero points", {**QWEN25_VL_AWQ, "zero_point": False}),
    ("fp8 with static activation scales", {**QWEN3_VL_FP8, "activation_scheme": "static"}),
    ("fp8 with fmt 'e5m2'", {**QWEN3_VL_FP8, "fmt": "e5m2"}),
    ("fp8 with weight_block_size None", {**QWEN3_VL_FP8, "weight_block_size": None}),
    ("fp8 with scale_fmt 'ue8m0'", {**QWEN3_VL_FP8, "scale_fmt": "ue8m0"}),
    ("torchao", {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig"}}}),
]


@pytest.mark.parametrize("named,qc", REFUSED, ids=[r[0] for r in REFUSED])
def test_refusals_name_the_format_and_list_the_supported(named, qc):
    with pytest.raises(ModelLoadError) as info:
        read_format({"quantization_config": qc})
    message = info.value.message
    assert "\n" not in message
    assert named in message, message
    assert all(supported in message for supported in SUPPORTED_FORMATS)
    assert info.value.code == "unsupported_quantization"


def test_leaves_unquantized_compressed_tensors():
    fmt = read_format({"quantization_config": CT_W4A16_ASYM})  # ignore: lm_head, re:visual.*
    assert fmt.leaves_unquantized("lm_head")
    assert fmt.leaves_unquantized("visual.blocks.0.attn.qkv")
    assert not fmt.leaves_unquantized("model.layers.0.self_attn.q_proj")
    assert not fmt.leaves_unquantized("model.lm_head_extra")  # plain names are exact
    explicit = read_format({"quantization_config": CT_FP8_DYNAMIC})
    assert explicit.leaves_unquantized("visual.merger.mlp.0")
    assert not explicit.leaves_unquantized("visual.blocks.1.attn.qkv")  # not listed: compressed-tensors' rule
    # Name targets take only what they match.
    attn_only = {**CT_FP8_DYNAMIC, "config_groups": {"group_0": {
        "targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"], "weights": _FP8_CHANNEL, "input_activations": _FP8_TOKEN}}}
    fmt = read_format({"quantization_config": attn_only})
    assert not fmt.leaves_unquantized("model.layers.3.self_attn.k_proj")
    assert fmt.leaves_unquantized("model.layers.3.mlp.down_proj")


def test_leaves_unquantized_modules_to_not_convert():
    awq = read_format({"quantization_config": QWEN25_VL_AWQ})  # ["visual"]
    assert awq.leaves_unquantized("visual.blocks.0.attn.qkv")
    assert awq.leaves_unquantized("model.visual.blocks.0.attn.qkv")  # transformers 5's spelling
    assert not awq.leaves_unquantized("model.layers.0.mlp.down_proj")
    assert not awq.leaves_unquantized("model.visualizer.proj")  # whole names only
    fp8 = read_format({"quantization_config": QWEN3_VL_FP8})
    assert fp8.leaves_unquantized("lm_head")
    assert fp8.leaves_unquantized("model.visual.merger.linear_fc1")
    assert not fp8.leaves_unquantized("model.language_model.layers.0.self_attn.q_proj")
    layers = read_format({"quantization_config": {**QWEN3_VL_FP8, "modules_to_not_convert": ["model.layers.1"]}})
    assert layers.leaves_unquantized("model.layers.1.mlp.up_proj")
    assert not layers.leaves_unquantized("model.layers.10.mlp.up_proj")


def test_compressed_tensors_missing_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "compressed_tensors.quantization", None)  # import now raises ImportError
    with pytest.raises(ModelLoadError, match="needs the compressed-tensors package"):
        read_format({"quantization_config": CT_W4A16})
    assert read_format({"quantization_config": QWEN25_VL_AWQ}).scheme == "awq"  # the others need nothing
