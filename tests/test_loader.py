import json
import shutil

import pytest
import torch

from fovea.errors import ModelLoadError
from fovea.loading.loader import default_model_dir, load_model, resolve_device, resolve_dtype


def copy_demo(tmp_path):
    target = tmp_path / "model"
    shutil.copytree(default_model_dir(), target)
    return target


def test_demo_model_loads_on_one_device_and_dtype(demo_model):
    assert demo_model.device == torch.device("cpu") and demo_model.dtype == torch.float32
    tensors = list(demo_model.model.parameters()) + list(demo_model.model.buffers())
    assert {t.device.type for t in tensors} == {"cpu"}
    assert {t.dtype for t in demo_model.model.parameters()} == {torch.float32}
    assert demo_model.name == "fovea-shapes"
    assert demo_model.tokenizer.convert_ids_to_tokens(demo_model.image_token_id) == "<image>"


def test_auto_device_and_dtype_on_a_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without a GPU")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ModelLoadError, match="float32"):
        resolve_dtype("float8", torch.device("cpu"))


def test_bfloat16_load_converts_every_parameter():
    loaded = load_model(None, device="cpu", dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_model(tmp_path, device="cpu")


def test_unsupported_architecture_is_named(tmp_path):
    path = copy_demo(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "qwen2_vl"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'qwen2_vl' is not supported"):
        load_model(path, device="cpu")


@pytest.mark.parametrize("remove, named", [
    (["model.safetensors"], "weights"),
    (["tokenizer.json"], "tokenizer"),
    (["preprocessor_config.json", "processor_config.json"], "image processor"),
    (["chat_template.jinja"], "chat template"),
])
def test_each_missing_part_is_named(tmp_path, remove, named):
    path = copy_demo(tmp_path)
    for name in remove:
        (path / name).unlink()
    for name in ("tokenizer_config.json", "processor_config.json"):
        file = path / name
        if "chat_template.jinja" in remove and file.exists():
            data = json.loads(file.read_text())
            data.pop("chat_template", None)
            file.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=named):
        load_model(path, device="cpu")


def test_loading_never_touches_the_network(monkeypatch, tmp_path):
    import os

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    # A directory that looks like a hub id must not be resolved remotely.
    with pytest.raises(ModelLoadError):
        load_model("llava-hf/llava-1.5-7b-hf", device="cpu")


def test_missing_weights_are_refused_not_randomly_initialised(tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_demo(tmp_path)
    state = load_file(path / "model.safetensors")
    key = next(k for k in state if "multi_modal_projector.linear_1.weight" in k)
    state.pop(key)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing from the checkpoint.*randomly initialised"):
        load_model(path, device="cpu")


def test_cuda_device_gets_a_concrete_index(monkeypatch):
    # Tensors on a GPU report cuda:0, never cuda: the loaded model's device must be spelt the
    # same way, or the placement contract refuses every parameter of a `--device cuda` load.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda:0")
    assert resolve_device("auto") == torch.device("cuda:0")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ModelLoadError, match="sees 2 CUDA GPU"):
        resolve_device("cuda:2")
