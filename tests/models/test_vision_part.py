"""An encode-only process loads the vision part alone, and it encodes as the whole model does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_qwen2_5_vl import noise, qwen  # noqa: F401 - the module's fixture

from fovea.errors import ModelLoadError
from fovea.loading.vision_part import load_vision_part


def one_image_prompt(model, image):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "you"}]}]
    return model.codec.encode(model.codec.render(messages), [image])


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_the_vision_part_alone_encodes_as_the_whole_model(family, demo_model, qwen):  # noqa: F811
    full = demo_model if family == "llava" else qwen
    part = load_vision_part(full.path, "cpu", "float32")
    vision = sum(p.numel() for m in full.adapter.vision_modules(full.model) for p in m.parameters())
    assert part.parameters == vision < sum(p.numel() for p in full.model.parameters())
    prompt = one_image_prompt(full, noise(200, 150, 3))
    with torch.inference_mode():
        ours = part.adapter.vision_forward(part)(prompt.images)[0]
        theirs = full.adapter.vision_forward(full)(prompt.images)[0]
    assert torch.equal(ours, theirs)


def test_a_checkpoint_without_its_vision_weights_is_refused(qwen, tmp_path):  # noqa: F811
    copy = tmp_path / "no-vision"
    shutil.copytree(qwen.path, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    (file,) = set(index["weight_map"].values())
    tensors = {k: v for k, v in load_file(copy / file).items() if "blocks.0.attn" not in k}
    save_file(tensors, copy / file, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="no weights for"):
        load_vision_part(copy, "cpu", "float32")


def test_no_language_model_tensor_is_read(qwen, tensor_reads):  # noqa: F811
    """What an encode worker needs of the checkpoint: the tower's tensors, nothing else."""
    read = tensor_reads
    part = load_vision_part(qwen.path, "cpu", "float32")
    assert read and all(name.startswith("model.visual.") for name in read)
    assert len(read) == len(part.model.state_dict())
