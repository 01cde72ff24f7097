"""Each fault from the field, injected into the demo model or its serving path, is caught by name.

Contract faults stop start-up (``check_contract`` raises with the part, expected and actual
values, and the fix); faults that leave every shape right but blind the model are caught by
the grounding canary.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.errors import ModelLoadError
from fovea.guard.canary import Canary
from fovea.loading.contract import ContractError, check_contract
from fovea.loading.loader import default_model_dir, load_model
from fovea.models.clip_vision import vision_modules

IMAGENET = {"image_mean": list(IMAGENET_DEFAULT_MEAN), "image_std": list(IMAGENET_DEFAULT_STD)}


def fresh(dtype: str = "float32"):
    return load_model(None, device="cpu", dtype=dtype)


def violated_parts(loaded, **kwargs) -> dict[str, str]:
    with pytest.raises(ContractError) as info:
        check_contract(loaded, **kwargs)
    assert "refusing to serve" in info.value.message
    return {v.part: str(v) for v in info.value.violations}


def run_canary(loaded):
    async def main():
        engine = PagedEngine(loaded, PagedEngineConfig(num_blocks=128))
        engine.start()
        try:
            return await Canary(loaded, engine).run()
        finally:
            engine.stop()
    return asyncio.run(main())


def test_the_healthy_demo_model_passes_the_contract_and_the_canary():
    loaded = fresh()
    contract = check_contract(loaded)
    assert (contract.vision_width, contract.projector_in) == (192, 192)
    assert (contract.projector_out, contract.lm_hidden) == (256, 256)
    assert contract.probe_image_tokens == [64, 64] and contract.processor_override == {}
    result = run_canary(loaded)
    assert result.ok, result.reasons
    assert result.min_ablation_kl > result.threshold
    assert [c.answer for c in result.cases] == ["red", "blue", "green"]


def test_imagenet_normalisation_override_is_refused_unless_forced():
    parts = violated_parts(fresh(), override=IMAGENET)
    assert "0.485" in parts["preprocessing recipe"] and "0.4814" in parts["preprocessing recipe"]
    assert "--force-processor-override" in parts["preprocessing recipe"]
    forced = check_contract(fresh(), override=IMAGENET, force_override=True)
    assert forced.override_forced and forced.processor_override["image_mean"] == list(IMAGENET_DEFAULT_MEAN)


def test_imagenet_normalisation_patched_in_behind_the_contract_is_caught():
    loaded = fresh()
    loaded.processor.image_processor.image_mean = list(IMAGENET_DEFAULT_MEAN)  # no override declared
    parts = violated_parts(loaded)
    assert "image_mean" in parts["preprocessing recipe"]


def test_a_harmless_override_passes_without_force():
    contract = check_contract(fresh(), override={"resample": 2})
    assert contract.processor_override == {"resample": 2} and not contract.override_forced


def test_zeroed_projector_is_caught_by_the_canary():
    loaded = fresh()
    with torch.no_grad():
        for p in vision_modules(loaded)[1].parameters():
            if p.ndim == 2:
                p.zero_()
    check_contract(loaded)  # widths, dtypes and finiteness are all still fine ...
    result = run_canary(loaded)  # ... but the answers no longer depend on the image
    assert not result.ok
    assert any("image ignored" in r for r in result.reasons)
    assert result.min_ablation_kl <= result.threshold


def test_constant_vision_output_is_caught_by_the_canary():
    loaded = fresh()
    projector = vision_modules(loaded)[1]
    projector.register_forward_hook(lambda module, args, out: torch.full_like(out, 0.5))
    result = run_canary(loaded)
    assert not result.ok and any("image ignored" in r for r in result.reasons)


def test_chat_template_without_the_placeholder_is_caught():
    loaded = fresh()
    template = loaded.processor.chat_template.replace("' <image>'", "''")
    assert template != loaded.processor.chat_template
    loaded.processor.chat_template = template
    parts = violated_parts(loaded)
    assert "expected 1 '<image>' placeholder(s) for 1 image(s), got 0" in parts["chat template"]


def test_vision_tower_in_another_dtype_is_caught():
    loaded = fresh()
    vision_modules(loaded)[0].to(torch.bfloat16)
    parts = violated_parts(loaded)
    assert "vision_tower" in parts["parameter placement"] and "bfloat16" in parts["parameter placement"]


def test_projector_on_another_device_is_caught():
    loaded = fresh()
    vision_modules(loaded)[1].to("meta")  # stands in for cuda:1 on a machine without GPUs
    parts = violated_parts(loaded)
    assert "multi_modal_projector" in parts["parameter placement"] and "meta" in parts["parameter placement"]


def test_projector_of_the_wrong_width_is_caught():
    loaded = fresh()
    projector = vision_modules(loaded)[1]
    projector.linear_1 = torch.nn.Linear(128, projector.linear_1.out_features)
    parts = violated_parts(loaded)
    assert "expected 192" in parts["projector input width"] and "got 128" in parts["projector input width"]


def test_projector_weights_that_do_not_fit_the_config_are_refused_at_load(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(default_model_dir(), path)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["hidden_size"] = 256  # the tower now claims 256-wide features
    config["vision_config"]["num_attention_heads"] = 4
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="could not load"):
        load_model(path, device="cpu")


def test_wrong_image_token_expansion_is_caught():
    loaded = fresh()
    loaded.processor.num_additional_image_tokens = 0  # would insert 63 tokens for 64 features
    parts = violated_parts(loaded)
    assert "expected [64, 64] image tokens" in parts["image token expansion"]
    assert "got [63, 63]" in parts["image token expansion"]


def test_float16_vision_overflow_falls_back_to_bfloat16_with_a_note():
    loaded = fresh("float16")
    tower = vision_modules(loaded)[0]
    with torch.no_grad():  # huge intermediate activations, same function in exact arithmetic
        for name, p in tower.named_parameters():
            if "layers.2.mlp.fc1" in name:
                p.mul_(100_000)
            elif "layers.2.mlp.fc2.weight" in name:
                p.div_(100_000)
    contract = check_contract(loaded)
    assert contract.vision_dtype == "bfloat16" and contract.dtype == "float16"
    assert any("overflowed in float16" in note for note in contract.notes)
    assert next(loaded.model.get_input_embeddings().parameters()).dtype == torch.float16
