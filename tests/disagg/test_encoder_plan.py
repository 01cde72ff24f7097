"""An encode worker's memory plan: its vision weights from the headers, and a refusal with need vs free."""

from __future__ import annotations

import pytest
import torch

from fovea.disagg.encoder_plan import EncoderMemoryError, EncoderPlan, header_bytes, refuse_unless_fits
from fovea.engine.memory.profile import tensor_bytes
from fovea.loading.vision_part import checkpoint_files, checkpoint_name, load_vision_part


def vision_names(model, files):
    return [checkpoint_name(path, key, files) for path, module in
            model.adapter.build_vision_modules(model.model.config).items() for key in module.state_dict()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_headers_give_the_vision_weights_bytes_before_loading(demo_model, dtype):
    files = checkpoint_files(demo_model.path)
    loaded = load_vision_part(demo_model.path, "cpu", str(dtype).removeprefix("torch."))
    stored = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    assert header_bytes(files, vision_names(demo_model, files), dtype) == stored
    # What the worker then holds adds only the buffers that are computed, not stored (positions).
    assert 0 <= tensor_bytes(loaded.model) - stored < 4096


def test_a_worker_that_does_not_fit_is_refused_with_need_and_free():
    with pytest.raises(EncoderMemoryError) as info:
        refuse_unless_fits(3 * 2**30, 2**30, "its vision weights plus the margin")
    assert "needs 3.00 GiB and only 1.00 GiB is free" in info.value.message
    refuse_unless_fits(2**30, 2**30, "exactly what is free")  # fits: no error


def test_the_plan_says_what_it_needs_and_why():
    plan = EncoderPlan("cuda:0", 650 * 2**20, 300 * 2**20, 256 * 2**20, 32, 10 * 2**30)
    assert plan.need_bytes == (650 + 300 + 256) * 2**20
    assert "vision weights 0.63" in plan.render() and "32 largest image(s)" in plan.render()
    assert EncoderPlan("cpu", 10, None, 0, 8, None).render().count("not measured") == 1
