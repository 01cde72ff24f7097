"""fovea's vision stage against transformers' own image features."""

import pytest
import torch

from fovea.models.clip_vision import encode_images, tower_hidden_states
from fovea.testing.tolerance import assert_close_for, vision_path_len


@pytest.mark.parametrize("layer", [-1, -2, -4, 2, [-3, -1]])
def test_image_embeddings_equal_transformers(demo_model, monkeypatch, layer):
    """Whatever the feature layer, the early-stopping tower gives transformers' features
    (the projector of a concatenated multi-layer feature needs a wider input, so a list is
    checked on the hidden states only)."""
    config = demo_model.model.config
    monkeypatch.setattr(config, "vision_feature_layer", layer)
    pixels = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    tower = demo_model.model.model.vision_tower
    with torch.inference_mode():
        ref_states = tower(pixels, output_hidden_states=True).hidden_states
        wanted = [layer] if isinstance(layer, int) else layer
        ours = tower_hidden_states(tower, pixels, layer)
        for got, index in zip(ours, wanted):
            depth = index % len(ref_states)
            assert_close_for(got, ref_states[index], torch.float32, vision_path_len(config, layers=depth),
                             what=f"layer {depth}")
        if isinstance(layer, int):
            ref = demo_model.model.model.get_image_features(pixel_values=pixels, vision_feature_layer=layer,
                                                            vision_feature_select_strategy="default")
            ref = ref.pooler_output if hasattr(ref, "pooler_output") else ref
            ref = torch.stack(list(ref)) if isinstance(ref, (list, tuple)) else ref
            got = encode_images(demo_model, pixels)
            assert got.shape == (2, 64, config.text_config.hidden_size)
            assert_close_for(got, ref.view(got.shape), torch.float32, vision_path_len(config))


def test_a_feature_layer_outside_the_tower_is_refused(demo_model):
    tower = demo_model.model.model.vision_tower
    with pytest.raises(ValueError, match="outside"):
        tower_hidden_states(tower, torch.zeros(1, 3, 128, 128), -9)


class FakeGraphs:
    """Stands in for GraphedVision: runs batches of up to two images, records each call."""

    def __init__(self, loaded):
        self.loaded, self.calls = loaded, []

    def can_run(self, pixels):
        return pixels.shape[0] <= 2

    def __call__(self, pixels):
        self.calls.append(pixels.shape[0])
        return encode_images(self.loaded, pixels)


def test_the_image_encoder_uses_graphs_for_the_batches_they_hold(demo_model):
    from fovea.engine.vision.encoder_cache import EncoderCache
    from fovea.engine.vision.image_encoder import ImageEncoder
    from fovea.loading.prompt import EncodedPrompt, ImageInput

    def prompt(seed):
        pixels = torch.randn(3, 128, 128, generator=torch.Generator().manual_seed(seed))
        return EncodedPrompt([demo_model.image_token_id] * 64, [ImageInput(pixels, 64, f"h{seed}")], "")

    graphs = FakeGraphs(demo_model)
    encoder = ImageEncoder(demo_model, EncoderCache(), batch_size=2, graphs=graphs)
    rows = encoder.rows_for([prompt(s) for s in range(3)])  # batches of 2 and 1: both graphed
    assert graphs.calls == [2, 1] and set(rows) == {"h0", "h1", "h2"}
    alone = encode_images(demo_model, prompt(2).images[0].pixels[None])[0]
    assert_close_for(rows["h2"], alone, torch.float32, vision_path_len(demo_model.model.config))
    wide = ImageEncoder(demo_model, EncoderCache(), batch_size=3, graphs=graphs)
    wide.rows_for([prompt(s) for s in range(10, 13)])  # a batch of 3 is beyond the graphs: eager
    assert graphs.calls == [2, 1]
