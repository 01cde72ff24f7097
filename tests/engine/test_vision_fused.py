"""The fused vision stage (``fovea.engine.vision.vision_fused``): its Triton kernels against the torch
ops they replace, the whole stage against ``encode_images``, what it refuses, its start-up
check, and the hooks that let the engines run it. Kernel tests run where triton imports and
either CUDA is present or TRITON_INTERPRET=1 (``test_kernels_interpreted.py`` runs this file
that way on CPU); the rest run everywhere."""

import contextlib
import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEVICE, needs_triton

from fovea.engine.vision import vision_fused
from fovea.engine.vision.vision_fused import (
    GELU,
    QUICK_GELU,
    FusedVision,
    activation,
    add_layer_norm,
    choose_vision_encoder,
    layer_norm,
    sample_pixels,
    startup_problem,
    supports,
)
from fovea.models.clip_vision import encode_images
from fovea.testing.kernel_cases import random_llava, tiny_vision
from fovea.testing.tolerance import K, assert_close_for, eps, reduction_atol, vision_path_len

# float16, not bfloat16, as the half dtype: triton's CPU interpreter truncates float32 ->
# bfloat16 where the GPU (and torch) round to nearest, but rounds float16 to nearest.
DTYPES = [torch.float32, torch.float16]


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def close(got, ref, dtype, reduction_len=1):
    """Equal up to float32 reductions of ``reduction_len`` (at the result's scale) and one rounding
    of each element to ``dtype`` (relative to that element: the kernels round where torch rounds)."""
    ref = ref.float()
    atol = reduction_atol(torch.float32, reduction_len, float(ref.abs().max()))
    return torch.allclose(got.float(), ref, rtol=K * eps(dtype), atol=atol)


@pytest.fixture(scope="module")
def demo(demo_model):
    """The shipped demo model (CLIP, 4 layers, exact-GELU MLP) on the device the kernels run on."""
    from fovea.loading.loader import load_model

    return demo_model if DEVICE.type == "cpu" else load_model(None, DEVICE.type, "float32")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_writes_the_sum_and_its_layer_norm(dtype):
    rows, cols = 5, 100  # a width that is not a power of two: the masked tail must not count
    x, residual = rand(rows, cols, seed=1, dtype=dtype), rand(rows, cols, seed=2, dtype=dtype)
    weight, bias = 1 + rand(cols, seed=3, scale=0.1, dtype=dtype), rand(cols, seed=4, scale=0.5, dtype=dtype)
    before = residual.clone()
    summed, normed = add_layer_norm(x, residual, weight, bias, 1e-5)
    assert torch.equal(residual, before)  # the old residual (maybe a kept hidden state) is intact
    assert torch.equal(summed, before + x)  # rounded once, as torch's add
    assert close(normed, F.layer_norm(before + x, (cols,), weight, bias, 1e-5), dtype, cols)
    assert close(layer_norm(x, weight, bias, 1e-6), F.layer_norm(x, (cols,), weight, bias, 1e-6), dtype, cols)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_activation_kernel_matches_transformers_eager_ops(dtype):
    x = rand(3 * 4096 + 17, seed=5, scale=3.0, dtype=dtype)  # several programs and a ragged end
    assert close(activation(x, QUICK_GELU), x * torch.sigmoid(1.702 * x), dtype)
    assert close(activation(x, GELU), F.gelu(x), dtype)
    assert not close(activation(x, GELU), x * torch.sigmoid(1.702 * x), dtype)  # the kinds differ
    in_place = x.clone()
    assert activation(in_place, QUICK_GELU, out=in_place) is in_place
    assert torch.equal(in_place, activation(x, QUICK_GELU))


@needs_triton
def test_the_fused_stage_equals_encode_images_on_the_demo_model(demo):
    pixels = sample_pixels(demo, 2, seed=3)
    got = FusedVision(demo)(pixels)
    ref = encode_images(demo, pixels)
    assert got.shape == ref.shape == (2, 64, demo.model.config.text_config.hidden_size)
    assert got.dtype == ref.dtype and got.device == ref.device
    assert_close_for(got, ref, torch.float32, vision_path_len(demo.model.config))


@needs_triton
@pytest.mark.parametrize("layer,strategy", [(-2, "default"), ([0, -3, -1], "full")])
def test_the_fused_stage_runs_quick_gelu_towers_and_lists_of_feature_layers(layer, strategy):
    loaded = random_llava(tiny_vision("quick_gelu"), 64, DEVICE, torch.float32, layer, strategy)
    pixels = sample_pixels(loaded, 3, seed=4)
    got = FusedVision(loaded)(pixels)
    ref = encode_images(loaded, pixels)
    tokens = 17 if strategy == "full" else 16
    assert got.shape == ref.shape == (3, tokens, 64)
    assert_close_for(got, ref, torch.float32, vision_path_len(loaded.model.config))


def test_fusing_makes_q_k_v_views_of_one_tensor_and_keeps_transformers_forward(demo_model):
    pixels = sample_pixels(demo_model, 1, seed=6)
    before = encode_images(demo_model, pixels)
    fused = FusedVision(demo_model)
    attn = demo_model.model.model.vision_tower.encoder.layers[0].self_attn
    qkv = fused.layers[0].qkv
    width = attn.q_proj.out_features
    assert qkv.shape == (3 * width, attn.q_proj.in_features)
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()  # views, not copies
    assert attn.v_proj.weight.data_ptr() == qkv[2 * width:].data_ptr()
    assert fused.layers[0].qkv_bias.data_ptr() == attn.q_proj.bias.data_ptr()
    assert torch.equal(encode_images(demo_model, pixels), before)
    assert FusedVision(demo_model).layers[0].qkv.data_ptr() == qkv.data_ptr()  # fused once only


def test_supports_names_what_it_cannot_run(monkeypatch):
    loaded = random_llava(tiny_vision("quick_gelu"), 64, "cpu", torch.float32)
    tower = loaded.model.model.vision_tower
    config = loaded.model.config
    assert supports(loaded) is None
    # The last layer is never run for feature layer -2: what it is does not matter.
    monkeypatch.setattr(tower.encoder.layers, "2", torch.nn.Identity())
    assert supports(loaded) is None
    monkeypatch.setattr(tower.encoder.layers, "1", torch.nn.Identity())
    assert "vision layer 1: Identity is not a CLIP encoder layer" in supports(loaded)
    with pytest.raises(ValueError, match="cannot run"):
        FusedVision(loaded)
    monkeypatch.setattr(config, "vision_feature_layer", 7)
    assert "outside" in supports(loaded)
    monkeypatch.delattr(tower, "pre_layrnorm")
    assert "not a CLIP-style tower" in supports(loaded)
    relu = random_llava(tiny_vision("relu", layers=2), 64, "cpu", torch.float32)
    assert "activation ReLU is not quick_gelu or exact GELU" in supports(relu)
    assert "ReLU" in startup_problem(relu)


@needs_triton
def test_the_startup_check_passes_and_names_a_broken_kernel(demo, monkeypatch):
    """The engine runs this before trusting the fused stage; a wrong kernel must fail it."""
    assert startup_problem(demo) is None
    monkeypatch.setattr(vision_fused, "activation", lambda x, kind, out=None: torch.zeros_like(x))
    problem = startup_problem(demo)
    assert problem is not None and "relative error" in problem


@needs_triton
def test_choose_vision_encoder_falls_back_when_the_check_fails(demo, monkeypatch, caplog):
    monkeypatch.setattr(vision_fused, "platform_problem", lambda loaded: None)  # as on a GPU
    encode, label = choose_vision_encoder(demo)
    assert isinstance(encode, FusedVision) and label.startswith("fused")
    monkeypatch.setattr(vision_fused, "activation", lambda x, kind, out=None: x)  # identity: wrong
    with caplog.at_level(logging.WARNING, logger="fovea.engine"):
        encode, label = choose_vision_encoder(demo)
    assert isinstance(encode, functools.partial) and encode.func is encode_images
    assert "relative error" in label and "relative error" in caplog.text


def test_choose_vision_encoder_keeps_transformers_modules_off_cuda(demo_model):
    if demo_model.device.type == "cuda":
        pytest.skip("what a model off CUDA is given; FOVEA_TEST_DEVICE=cuda loads it on the GPU")
    encode, label = choose_vision_encoder(demo_model)
    assert isinstance(encode, functools.partial) and encode.func is encode_images and encode.args == (demo_model,)
    assert "not CUDA" in label
    assert "not enabled" in choose_vision_encoder(demo_model, enabled=False)[1]


def test_the_image_encoder_runs_the_encode_it_is_given(demo_model):
    from fovea.engine.vision.encoder_cache import EncoderCache
    from fovea.engine.vision.image_encoder import ImageEncoder
    from fovea.loading.prompt import EncodedPrompt, ImageInput
    from fovea.models.llava import stacked

    calls = []

    def encode(pixels):
        calls.append(pixels.shape[0])
        return encode_images(demo_model, pixels) + 1

    def prompt(seed):
        pixels = torch.randn(3, 128, 128, generator=torch.Generator().manual_seed(seed))
        return EncodedPrompt([demo_model.image_token_id] * 64, [ImageInput(pixels, 64, f"h{seed}")], "")

    prompts = [prompt(s) for s in range(3)]
    rows = ImageEncoder(demo_model, EncoderCache(), batch_size=2, encode=stacked(encode)).rows_for(prompts)
    assert calls == [2, 1]
    plain = ImageEncoder(demo_model, EncoderCache(), batch_size=2).rows_for(prompts)  # default: the adapter's
    path = vision_path_len(demo_model.model.config)
    assert_close_for(rows["h2"], plain["h2"] + 1, torch.float32, path)
    alone = encode_images(demo_model, prompts[2].images[0].pixels[None])[0]
    assert_close_for(plain["h2"], alone, torch.float32, path)


def test_the_vision_graphs_capture_the_encode_they_are_given(demo_model, monkeypatch):
    """What GraphedVision captures is ``encode``, warmed up first, largest batch first (CUDA's
    graph API stubbed: only which function is captured is checked here)."""
    from fovea.engine.vision import vision_graphs

    class FakeGraph:
        replays = 0

        def replay(self):
            FakeGraph.replays += 1

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    calls = []

    def encode(pixels):
        calls.append(pixels.shape[0])
        return torch.full((pixels.shape[0], 64, 256), float(len(calls)))

    graphs = vision_graphs.try_graphed_vision(demo_model, 4, encode=encode)
    assert graphs is not None and graphs.encode is encode
    assert calls == [4, 4, 2, 2, 1, 1]  # warm-up, then capture, per size
    out = graphs(torch.zeros(3, 3, 128, 128))
    assert out.shape == (3, 64, 256) and FakeGraph.replays == 1
    assert (out == 2.0).all()  # the size-4 graph's output: its capture was the second call
    default = vision_graphs.GraphedVision(demo_model, 2)
    assert default.encode.func is encode_images and default.encode.args == (demo_model,)
