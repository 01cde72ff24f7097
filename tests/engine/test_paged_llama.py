"""fovea's own Llama forward over the paged cache against transformers' logits."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from scene_helpers import fresh_scene
from test_paged_helpers import prompt_for

from fovea.demo import scenes
from fovea.engine.config import PagedEngineConfig
from fovea.engine.core.block_manager import BlockManager
from fovea.engine.core.request import EngineRequest
from fovea.engine.core.scheduler import Scheduler
from fovea.engine.core.sequence import Sequence
from fovea.engine.model.llama import PagedLlama, inverse_frequencies
from fovea.engine.runner.model_runner import ModelRunner
from fovea.engine.sampling.params import SamplingParams
from fovea.engine.vision.encoder_cache import EncoderCache
from fovea.errors import ModelLoadError
from fovea.testing.tolerance import assert_close_to_model


@pytest.fixture(scope="module")
def runner(demo_model):
    config = PagedEngineConfig(num_blocks=64).resolved(demo_model.device, demo_model.context_length)
    return ModelRunner(demo_model, config, EncoderCache())


@pytest.fixture(scope="module")
def image_prompt(demo_model):
    return prompt_for(demo_model, scenes.render(fresh_scene(7)))


def hf_logits(model, prompt):
    ids = torch.tensor([prompt.input_ids])
    extra = model.adapter.reference_inputs(prompt, model.device, model.image_token_id)
    with torch.no_grad():
        return model.model(input_ids=ids, **extra).logits[0].float()


def new_seq(model, prompt, seq_id=1):
    request = EngineRequest(f"r{seq_id}", prompt, SamplingParams(temperature=0), emit=lambda e: None)
    return Sequence(seq_id, request, model.image_token_id, model.device, model.tokenizer)


def test_weights_are_the_loaded_models_tensors(demo_model, runner):
    llama, lm = runner.llama, demo_model.model.model.language_model
    assert llama.embed.data_ptr() == lm.embed_tokens.weight.data_ptr()
    assert llama.layers[0].q.data_ptr() == lm.layers[0].self_attn.q_proj.weight.data_ptr()
    assert llama.lm_head.data_ptr() == demo_model.model.lm_head.weight.data_ptr()


def test_prompt_logits_equal_transformers(demo_model, runner, image_prompt):
    """One prefill chunk over the whole image prompt: every position's logits."""
    seq = new_seq(demo_model, image_prompt)
    bm = BlockManager(runner.kv_plan.num_blocks, runner.block_size)
    sched = Scheduler(bm, 512, 4)
    sched.add(seq)
    plan = sched.schedule()
    runner.embedder.fill([seq])
    from fovea.engine.model.attention import AttnMeta, PrefillSpan

    n = seq.prompt_len
    meta = AttnMeta(slot_mapping=torch.tensor(runner._slots(seq.block_table, 0, n)),
                    prefills=[PrefillSpan(0, n, 0, torch.tensor(seq.block_table))])
    with torch.inference_mode():
        ours = runner.llama.forward(seq.prompt_embeds, torch.arange(n), meta, runner.cache).float()
    ref = hf_logits(demo_model, image_prompt)
    assert_close_to_model(ours, ref, demo_model.model.config, n)
    assert plan.chunks[0].sample


def test_chunked_prefill_and_decode_logits_equal_transformers(demo_model, runner, image_prompt):
    """Chunks of 24 split the 64-token image run; then two decode steps."""
    seq = new_seq(demo_model, image_prompt)
    bm = BlockManager(runner.kv_plan.num_blocks, runner.block_size)
    sched = Scheduler(bm, max_num_batched_tokens=24, max_num_seqs=4)
    sched.add(seq)
    ref_ids = list(image_prompt.input_ids)
    for step in range(8):
        plan = sched.schedule()
        (chunk,) = plan.chunks
        if seq.prompt_embeds is None and chunk.start < seq.prompt_len:
            runner.embedder.fill([seq])
        logits = runner.execute(plan)
        sched.on_computed(plan)
        if chunk.sample:
            ref = hf_logits(demo_model, dataclasses.replace(image_prompt, input_ids=list(ref_ids)))[-1]
            assert_close_to_model(logits[0], ref, demo_model.model.config, len(ref_ids))
            token = int(ref.argmax())
            seq.token_ids.append(token)
            ref_ids.append(token)
        else:
            assert logits.shape[0] == 0
    assert seq.num_computed == seq.prompt_len + 4  # 4 prefill steps (24+24+24+1), then decodes


def test_rope_matches_transformers_and_refuses_unknown_scaling(demo_model):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # Elementwise powers and quotients, a few roundings each: allclose's relative 1e-5 (84 float32
    # ulps) holds on any machine.
    ours = inverse_frequencies(demo_model.model.config.text_config, 64)
    assert torch.allclose(ours, demo_model.model.model.language_model.rotary_emb.inv_freq.float())
    linear = SimpleNamespace(rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0})
    assert torch.allclose(inverse_frequencies(linear, 64), ours / 2)
    llama3 = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(head_dim=128, hidden_size=4096, num_attention_heads=32,
                                                       rope_parameters=dict(llama3)))
    assert torch.allclose(inverse_frequencies(SimpleNamespace(rope_parameters=llama3), 128), ref)
    old_style = SimpleNamespace(rope_theta=10000.0, rope_scaling=None)  # transformers 4.x field names
    assert torch.allclose(inverse_frequencies(old_style, 64), ours)
    yarn = SimpleNamespace(rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="yarn"):
        inverse_frequencies(yarn, 64)


def test_a_non_llama_language_model_is_refused(demo_model, monkeypatch):
    monkeypatch.setattr(demo_model.model.config.text_config, "model_type", "gemma2")
    with pytest.raises(ModelLoadError, match="gemma2"):
        PagedLlama(demo_model.adapter.lm_spec(demo_model.model), 64, None)
