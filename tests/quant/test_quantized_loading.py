"""Quantized checkpoints through fovea's loader and engine, on CPU (the torch path: each layer's
weight dequantised for the call).

The checkpoints are the tiny families' random models quantized by the formats' own tools
(``tests/quant/conftest.py``). References:
- compressed-tensors: transformers loading the same directory with compressed-tensors installed,
  which decompresses the weights (the format's own code, not fovea's);
- fine-grained FP8 and AWQ, which transformers cannot run on a CPU: transformers' forward over
  fovea's dequantised layers (``QuantLinear``), whose unpacking is checked against the formats'
  references in ``test_readers.py`` / ``test_awq.py``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from quant_helpers import GREEDY, chat, engine_greedy

from fovea.engine.reference import reference_generate, reference_logits
from fovea.errors import ModelLoadError
from fovea.loading.contract import check_contract
from fovea.loading.loader import load_model
from fovea.loading.quantized import QuantLinear, quantized_linears

FAMILIES = ["llava", "qwen2_5_vl", "qwen3_vl"]
COMPRESSED = ["fp8-dynamic", "w4a16"]
SCHEMES = [*COMPRESSED, "fp8-block", "awq"]
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def transformers_decompressed(loaded):
    """``loaded`` with transformers' own model of the same directory (compressed-tensors decompresses)."""
    model_class = loaded.adapter.model_class()
    model = model_class.from_pretrained(loaded.path, dtype=loaded.dtype, local_files_only=True).eval()
    return dataclasses.replace(loaded, model=model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_decoder_is_quantized_and_the_vision_part_is_not(quantized_dir, family, scheme):
    loaded = load_model(quantized_dir(family, scheme), "cpu", "float32")
    contract = check_contract(loaded)
    layers = loaded.adapter.lm_spec(loaded.model).language_model.layers
    assert loaded.quantization is not None and contract.quantization == loaded.quantization.label
    assert contract.quantized_layers == LINEARS_PER_LAYER * len(layers)
    assert set(quantized_linears(loaded.model)) and all(
        isinstance(getattr(layer.self_attn, name), QuantLinear) for layer in layers for name in ("q_proj", "o_proj"))
    # Everything that is a parameter (vision tower, projector, embeddings, norms, lm_head) is float32.
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    assert contract.vision_dtype == "float32"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", COMPRESSED)
def test_compressed_tensors_answers_equal_transformers_decompressing_the_same_directory(quantized_dir, family,
                                                                                        scheme):
    loaded = load_model(quantized_dir(family, scheme), "cpu", "float32")
    reference = transformers_decompressed(loaded)
    assert not quantized_linears(reference.model)  # transformers' own layers, not fovea's
    prompts = [chat(loaded, seed) for seed in range(3)]
    for prompt, tokens in zip(prompts, engine_greedy(loaded, prompts), strict=True):
        ref = reference_generate(reference, prompt, GREEDY.max_tokens)  # stops at EOS; the engine ignores it
        assert ref and tokens[:len(ref)] == ref
    # First-token log-probabilities: the same float32 weights either way, so float32 rounding only.
    ours = torch.log_softmax(reference_logits(loaded, prompts[0]).float(), -1)
    theirs = torch.log_softmax(reference_logits(reference, prompts[0]).float(), -1)
    assert float((ours - theirs).abs().max()) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", ["fp8-block", "awq"])
def test_fp8_block_and_awq_answers_equal_transformers_over_the_dequantised_layers(quantized_dir, family, scheme):
    loaded = load_model(quantized_dir(family, scheme), "cpu", "float32")
    prompts = [chat(loaded, seed) for seed in range(3)]
    for prompt, tokens in zip(prompts, engine_greedy(loaded, prompts), strict=True):
        ref = reference_generate(loaded, prompt, GREEDY.max_tokens)
        assert ref and tokens[:len(ref)] == ref


def test_an_unsupported_format_is_refused_in_one_line_that_lists_the_supported(quantized_dir, tmp_path):
    source = quantized_dir("qwen2_5_vl", "fp8-dynamic")
    target = tmp_path / "bnb"
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as refused:
        load_model(target, "cpu", "float32")
    message = refused.value.message
    assert "bitsandbytes" in message and "\n" not in message
    assert "compressed-tensors" in message and "awq" in message.lower()


@pytest.mark.parametrize("family, dropped, refusal", [
    ("llava", ".layers.0.mlp.down_proj.", "missing from the checkpoint"),  # a whole quantized layer
    ("qwen2_5_vl", ".layers.0.self_attn.q_proj.bias", "has no bias in the checkpoint"),  # a quantized layer's bias
])
def test_a_tensor_missing_from_the_checkpoint_is_refused_not_left_random(quantized_dir, tmp_path, family, dropped,
                                                                         refusal):
    from safetensors.torch import load_file, save_file

    source = quantized_dir(family, "w4a16")
    target = tmp_path / "holed"
    target.mkdir()
    for file in source.iterdir():
        if not file.name.endswith(".safetensors") and file.name != "model.safetensors.index.json":
            (target / file.name).symlink_to(file)
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(file))
    names = [name for name in tensors if dropped in name]
    assert names
    for name in names:
        del tensors[name]
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ModelLoadError, match=refusal):
        load_model(target, "cpu", "float32")


def test_health_models_and_doctor_name_the_format(quantized_dir):
    from fastapi.testclient import TestClient

    from fovea.config import ServerSettings
    from fovea.guard.doctor import contract_checks
    from fovea.serve.app import create_app

    path = quantized_dir("qwen2_5_vl", "w4a16")
    settings = ServerSettings(model=path, device="cpu", dtype="float32", canary=False)
    with TestClient(create_app(settings)) as client:
        health = client.get("/health").json()
        card = client.get("/v1/models").json()["data"][0]
        answer = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0})
    label = load_model(path, "cpu", "float32", weights=False).quantization.label
    assert health["quantization"] == label and card["quantization"] == label and "W4A16" in label
    assert health["load_format"] == "auto" and health["dtype"] == "float32" and health["vision_dtype"] == "float32"
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    checks = {c.name: c for c in contract_checks(path, "cpu", "float32")}
    assert label in checks["model.quantization"].detail and checks["model.quantization"].status.name == "PASS"


def test_fovea_serve_refuses_an_unsupported_format_in_one_line_before_serving(quantized_dir, tmp_path):
    import subprocess
    import sys

    source = quantized_dir("llava", "w4a16")
    target = tmp_path / "gguf"
    target.mkdir()
    for file in source.iterdir():
        if file.name != "config.json":
            (target / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    (target / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "fovea.cli", "serve", "--model", str(target), "--device", "cpu",
                             "--port", "1", "--no-canary"], check=False, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if "gptq" in line.lower()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-2000:]
    assert "supported:" in lines[0] and "AWQ" in lines[0] and "Traceback" not in result.stderr
