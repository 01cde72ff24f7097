"""``--load-format dummy``: random weights of the config's shapes and format, made on the device,
with no weight file read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from quant_helpers import chat, engine_greedy

from fovea.config import ServerSettings
from fovea.loading.contract import check_contract
from fovea.loading.loader import load_model
from fovea.loading.quantized import QuantLinear, quantized_linears
from fovea.quant.weights import Fp8Weight, Int4Weight
from fovea.testing import random_qwen2_5_vl


def without_weights(source, target):
    """``source``'s directory minus its safetensors files (what a user has for a shape they plan)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    assert not list(target.glob("*.safetensors"))
    return target


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return random_qwen2_5_vl.write_model_dir(tmp_path_factory.mktemp("q") / "tiny", arch="tiny", seed=5)


def test_an_unquantized_shape_loads_without_files_and_answers(qwen_dir, tmp_path):
    loaded = load_model(without_weights(qwen_dir, tmp_path / "d"), "cpu", "float32", load_format="dummy")
    assert loaded.load_format == "dummy" and loaded.quantization is None
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in loaded.model.parameters())
    contract = check_contract(loaded)
    assert contract.load_format == "dummy" and any("random" in note for note in contract.notes)
    tokens = engine_greedy(loaded, [chat(loaded, 1)])[0]
    assert len(tokens) == 8


def test_without_dummy_a_directory_without_weights_is_refused(qwen_dir, tmp_path):
    from fovea.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="weights"):
        load_model(without_weights(qwen_dir, tmp_path / "d"), "cpu", "float32")


@pytest.mark.parametrize("scheme, kind", [("fp8-dynamic", Fp8Weight), ("w4a16", Int4Weight),
                                          ("fp8-block", Fp8Weight), ("awq", Int4Weight)])
def test_a_quantized_shape_gets_its_format_made_at_random(quantized_dir, tmp_path, scheme, kind):
    source = quantized_dir("qwen2_5_vl", scheme)
    loaded = load_model(without_weights(source, tmp_path / "d"), "cpu", "float32", load_format="dummy")
    layers = quantized_linears(loaded.model)
    decoder = loaded.adapter.lm_spec(loaded.model).language_model.layers
    assert len(layers) == 7 * len(decoder) and all(isinstance(m.quant, kind) for m in layers.values())
    config = json.loads((source / "config.json").read_text())["quantization_config"]
    if scheme == "fp8-block":
        assert all(m.quant.block == tuple(config["weight_block_size"]) for m in layers.values())
    q_proj = decoder[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear)
    std = float(q_proj.quant.dequantize(torch.float32).std())
    assert 0.005 < std < 0.08  # about the 0.02 of an initialised linear: activations stay finite
    assert len(engine_greedy(loaded, [chat(loaded, 2)])[0]) == 8


def test_dummy_weights_run_in_agg_only():
    with pytest.raises(ValueError, match="--topology agg"):
        ServerSettings(load_format="dummy", topology="e_pd")
    with pytest.raises(ValueError, match="auto or dummy"):
        ServerSettings(load_format="npz")


def test_a_dummy_server_says_so_and_its_canary_verdict_does_not_count(qwen_dir, tmp_path):
    import httpx
    from scene_helpers import free_port, start_server, stop_server

    path = without_weights(qwen_dir, tmp_path / "d")
    loaded = load_model(path, "cpu", "float32", load_format="dummy")
    settings = ServerSettings(model=path, host="127.0.0.1", port=free_port(), device="cpu", dtype="float32",
                              load_format="dummy", strict=True)  # --strict: a failed canary would refuse to start
    live, server, thread = start_server(settings, loaded)
    try:
        health = httpx.get(live.base_url + "/health", timeout=30).json()
    finally:
        stop_server(server, thread)
    assert health["load_format"] == "dummy" and health["status"] == "ok"
    assert health["canary"] is not None and health["canary"]["meaningful"] is False
    assert any("random" in warning for warning in health["warnings"])


def test_the_canary_is_checked_against_max_model_len_without_weight_files(qwen_dir, tmp_path):
    """The start-up check that fits the canary to --max-model-len reads only the processor and
    config: a dummy directory, which has no weights, passes it (and a too-short limit is still refused)."""
    from fovea.serve.startup_checks import StartupRefused, check_before_load
    from scene_helpers import free_port

    path = without_weights(qwen_dir, tmp_path / "d")
    settings = lambda length: ServerSettings(model=path, host="127.0.0.1", port=free_port(), device="cpu",
                                             dtype="float32", load_format="dummy", max_model_len=length)
    check_before_load(settings(4096))
    with pytest.raises(StartupRefused, match="--max-model-len"):
        check_before_load(settings(16))
