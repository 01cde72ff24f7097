"""The fused Qwen vision stage (``fovea.engine.vision.qwen_vision_fused``): its Triton kernels against
their torch twins, the whole stage against the adapter's eager forward (transformers' modules)
on the tiny random Qwen2.5-VL and Qwen3-VL checkpoints, images of several sizes and aspect
ratios packed in one call, and the start-up check catching a wrong stage.

Kernel tests run where triton imports and either CUDA is present or TRITON_INTERPRET=1
(``test_kernels_interpreted.py`` runs this file that way on CPU); the rest run everywhere, with
the torch twins off CUDA. FOVEA_TEST_DEVICE=cuda loads the models on the GPU (Triton kernels,
flash variable-length attention in half precision)."""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEVICE, needs_triton
from scene_helpers import TEST_DEVICE

from fovea.engine.kernels.qwen_vision_kernels import TorchOps, TritonOps
from fovea.engine.vision import qwen_vision_layout
from fovea.engine.vision.qwen_vision_fused import (
    QWEN2_5,
    QWEN3,
    QwenFusedVision,
    mlp_width_multiple,
    sample_images,
    startup_problem,
    supports,
)
from fovea.engine.vision.varlen_attention import GROUPED, varlen_attention, varlen_backend
from fovea.engine.vision.vision_fused import MODEL_TOLERANCE, relative_error
from fovea.loading.loader import load_model
from fovea.models.base import ImageInput
from fovea.testing import random_qwen2_5_vl, random_qwen3_vl
from fovea.testing.tolerance import K, assert_close_for, eps, reduction_atol, tower_path_len

# float16, not bfloat16, for the kernels: triton's CPU interpreter truncates float32 -> bfloat16
# where the GPU (and torch) round to nearest, but rounds float16 to nearest.
DTYPES = [torch.float32, torch.float16]
WRITERS = {QWEN2_5: random_qwen2_5_vl.write_model_dir, QWEN3: random_qwen3_vl.write_model_dir}


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def close(got, ref, dtype, reduction_len=1):
    """Equal up to float32 reductions of ``reduction_len`` and one rounding to ``dtype``."""
    ref = ref.float()
    atol = reduction_atol(torch.float32, reduction_len, float(ref.abs().max()))
    return torch.allclose(got.float(), ref, rtol=K * eps(dtype), atol=atol)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-fused")
    return {kind: write(root / kind, arch="tiny", seed=5) for kind, write in WRITERS.items()}


SHARPEN = 20.0


def sharpened(loaded):
    """The model with its tower's q/k/v weights scaled up: random weights of std 0.02 give
    near-uniform attention, which no rotary or window error would change; these give scores of
    several units, so a wrong position or chunk shows in the rows."""
    with torch.no_grad():
        for block in loaded.adapter.vision_modules(loaded.model)[0].blocks:
            block.attn.qkv.weight.mul_(SHARPEN)
    return loaded


@pytest.fixture(scope="module")
def models(model_dirs):
    """(kind, dtype) -> the tiny model (sharpened) on the test device, loaded once per module."""
    cache = {}

    def get(kind, dtype):
        if (kind, dtype) not in cache:
            cache[kind, dtype] = sharpened(load_model(model_dirs[kind], TEST_DEVICE, dtype))
        return cache[kind, dtype]

    return get


# ---- kernels -----------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rms_norm_kernel_rounds_as_transformers_rmsnorm(dtype):
    rows, cols = 9, 100  # not a power of two: the masked tail must not count
    x, residual = rand(rows, cols, seed=1, dtype=dtype), rand(rows, cols, seed=2, dtype=dtype)
    weight = 1 + rand(cols, seed=3, scale=0.1, dtype=dtype)
    assert close(TritonOps.rms_norm(x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6), dtype, cols)
    before = residual.clone()
    summed, normed = TritonOps.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, before)  # the old residual is intact
    assert torch.equal(summed, before + x)  # rounded once, as torch's add
    assert close(normed, TorchOps.rms_norm(before + x, weight, 1e-6), dtype, cols)
    assert not close(normed, TorchOps.rms_norm(x, weight, 1e-6), dtype, cols)  # the sum, not x, is normed


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_activation_kernels_match_the_eager_ops(dtype):
    gate_up = rand(5, 2 * 37, seed=4, scale=3.0, dtype=dtype)
    got = TritonOps.silu_and_mul(gate_up)
    assert got.shape == (5, 37) and close(got, F.silu(gate_up[:, :37]) * gate_up[:, 37:], dtype)
    assert not close(got, F.silu(gate_up[:, 37:]) * gate_up[:, :37], dtype)  # gate first, then up
    x = rand(3 * 2048 + 17, seed=5, scale=4.0, dtype=dtype)  # several programs and a ragged end
    assert close(TritonOps.gelu_tanh(x.clone()), F.gelu(x, approximate="tanh"), dtype)
    assert close(TritonOps.gelu(x.clone()), F.gelu(x), dtype)
    big = torch.tensor([-1e4, -30.0, 30.0, 1e4], device=DEVICE, dtype=dtype)  # tanh saturates, no NaN
    assert torch.equal(TritonOps.gelu_tanh(big.clone()), F.gelu(big, approximate="tanh"))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim", [(2, 16), (16, 80), (16, 72)])  # tiny, Qwen2.5-VL-7B, Qwen3-VL-8B
def test_the_rotary_kernel_rotates_q_and_k_and_copies_v(dtype, heads, dim):
    tokens = 37
    qkv = rand(tokens, 3 * heads * dim, seed=6, dtype=dtype)
    angles = rand(tokens, dim // 2, seed=7, scale=20.0)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    got, ref = TritonOps.rotary(qkv, cos, sin, heads), TorchOps.rotary(qkv, cos, sin, heads)
    assert got.shape == (3, tokens, heads, dim) and got.is_contiguous()
    assert close(got[:2], ref[:2], dtype, 2)
    assert torch.equal(got[2], qkv.view(tokens, 3, heads, dim)[:, 2])  # v: a copy
    assert not close(got[0], qkv.view(tokens, 3, heads, dim)[:, 0], dtype, 2)  # q really rotated


def test_the_torch_rotary_is_transformers_apply_rotary_pos_emb_vision():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    tokens, heads, dim = 11, 3, 16
    qkv = torch.randn(tokens, 3 * heads * dim, generator=torch.Generator().manual_seed(8)).bfloat16()
    angles = torch.randn(tokens, dim // 2, generator=torch.Generator().manual_seed(9)) * 10
    emb = torch.cat([angles, angles], dim=-1)
    q, k, v = qkv.view(tokens, 3, heads, dim).unbind(1)
    ref_q, ref_k = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
    got = TorchOps.rotary(qkv, emb.cos(), emb.sin(), heads)
    assert torch.equal(got[0], ref_q) and torch.equal(got[1], ref_k) and torch.equal(got[2], v)


def test_grouped_varlen_attention_keeps_each_token_in_its_chunk():
    tokens, heads, dim = 30, 2, 8
    q, k, v = (rand(tokens, heads, dim, seed=s) for s in (10, 11, 12))
    bounds = [0, 7, 16, 30]
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    got = varlen_attention(q, k, v, cu, bounds, 14, dim ** -0.5, GROUPED)
    for a, b in itertools.pairwise(bounds):
        ref = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
        assert_close_for(got[a:b], ref, torch.float32, 2 * tokens + dim)
    assert varlen_backend(torch.device("cpu"), torch.bfloat16, 80) == GROUPED  # no flash off CUDA


# ---- the stage against transformers' modules ----------------------------------------------------

def images_of(loaded, grids, seed=0):
    vision = loaded.model.config.vision_config
    width = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    unit = vision.spatial_merge_size ** 2
    gen = torch.Generator().manual_seed(seed)
    return [ImageInput(torch.randn(t * h * w, width, generator=gen).to(loaded.device, loaded.dtype),
                       t * h * w // unit, f"img-{i}", (t, h, w)) for i, (t, h, w) in enumerate(grids)]


# Merged units of 2x2 patches: a square over several windows, wide and tall ones, one of a single
# merged token, and a video's two temporal patches.
GRIDS = [(1, 10, 10), (1, 4, 22), (1, 18, 6), (1, 2, 2), (2, 6, 8)]


def check_stage(loaded, fused, grids, seed=0):
    images = images_of(loaded, grids, seed)
    got, ref = fused(images), loaded.adapter.vision_forward(loaded)(images)
    assert len(got) == len(ref) == len(images)
    vision = loaded.model.config.vision_config
    for image, a, b in zip(images, got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype == loaded.dtype and a.device == b.device
        if fused.dtype == torch.float32:
            patches = image.grid[1] * image.grid[2]  # one temporal patch attends within itself
            path = tower_path_len(vision, patches) + 9 * vision.hidden_size  # and the merger's norm, fc1, fc2
            assert_close_for(a, b, torch.float32, path, what=f"grid {image.grid}")
        else:
            err = relative_error(a, b)
            assert err <= MODEL_TOLERANCE[fused.dtype], f"grid {image.grid}: relative error {err:.2e}"


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    """Float32 means float32 on a GPU too: cuDNN runs the eager patch embedding (a Conv3d) in TF32
    by default (a 10-bit mantissa), which the float32 tolerance is not derived for."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # (cuBLAS's float32 products are float32 already)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", [QWEN2_5, QWEN3])
def test_the_fused_stage_equals_the_eager_forward_on_packed_images(models, kind, dtype):
    loaded = models(kind, dtype)
    assert loaded.adapter.fused_vision == kind
    fused = QwenFusedVision(loaded)  # Triton kernels on CUDA, torch ops here
    check_stage(loaded, fused, GRIDS)
    check_stage(loaded, fused, GRIDS[::-1], seed=1)  # another order: the per-grid layouts compose
    assert startup_problem(loaded, fused) is None


@pytest.mark.parametrize("kind", [QWEN2_5, QWEN3])
def test_the_fused_stage_patches_resized_images_as_the_eager_forward_does(models, kind):
    """Images as the API process sends them (resized uint8 [H, W, 3]) beside a video's patches:
    the fused stage patches them on its device as the eager forward does, and an image's rows are
    those of its processor patches."""
    loaded = models(kind, "float32")
    fused = QwenFusedVision(loaded)
    vision = loaded.model.config.vision_config
    merge, side = vision.spatial_merge_size, vision.patch_size * vision.spatial_merge_size
    gen = torch.Generator().manual_seed(3)
    resized = [ImageInput(torch.randint(0, 256, (h * side, w * side, 3), dtype=torch.uint8, generator=gen)
                          .to(loaded.device), h * w, f"resized-{i}", (1, h * merge, w * merge))
               for i, (h, w) in enumerate([(5, 5), (2, 11), (1, 1)])]
    images = [*resized, *images_of(loaded, [(2, 6, 8)])]
    got, ref = fused(images), loaded.adapter.vision_forward(loaded)(images)
    for image, a, b in zip(images, got, ref, strict=True):
        assert a.shape == b.shape == (image.num_tokens, a.shape[1])
        path = tower_path_len(vision, image.grid[1] * image.grid[2]) + 9 * vision.hidden_size
        assert_close_for(a, b, torch.float32, path, what=f"grid {image.grid}")
    recipe = loaded.adapter.patch_recipe(loaded)
    as_patches = [dataclasses.replace(image, pixels=recipe.patches(image.pixels)) for image in resized]
    assert all(torch.equal(a, b) for a, b in zip(fused([*as_patches, images[3]]), got, strict=True))


@needs_triton
@pytest.mark.parametrize("kind", [QWEN2_5, QWEN3])
def test_the_fused_stage_with_the_triton_kernels_equals_the_eager_forward(model_dirs, kind):
    loaded = sharpened(load_model(model_dirs[kind], DEVICE.type, "float32"))
    fused = QwenFusedVision(loaded, kernels=True)
    assert fused.ops is TritonOps
    check_stage(loaded, fused, GRIDS[:3] + GRIDS[4:])


def test_the_rows_are_deepstack_wide_for_qwen3(models):
    loaded = models(QWEN3, "float32")
    levels = len(loaded.model.config.vision_config.deepstack_visual_indexes)
    rows = QwenFusedVision(loaded)(images_of(loaded, [(1, 4, 6)]))
    assert levels >= 1 and rows[0].shape == (6, (1 + levels) * loaded.model.config.text_config.hidden_size)


def test_gate_and_up_become_views_of_one_tensor(models):
    loaded = models(QWEN2_5, "float32")
    images = images_of(loaded, [(1, 8, 8)])
    before = loaded.adapter.vision_forward(loaded)(images)[0]
    fused = QwenFusedVision(loaded)
    mlp = loaded.model.model.visual.blocks[0].mlp
    stacked = fused.blocks[0].fc1_weight
    assert stacked.shape == (2 * mlp.gate_proj.out_features, mlp.gate_proj.in_features)
    assert mlp.gate_proj.weight.data_ptr() == stacked.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == stacked[mlp.gate_proj.out_features:].data_ptr()
    assert torch.equal(loaded.adapter.vision_forward(loaded)(images)[0], before)  # transformers' forward intact
    assert QwenFusedVision(loaded).blocks[0].fc1_weight.data_ptr() == stacked.data_ptr()  # fused once only


def test_an_mlp_width_the_products_take_slowly_is_padded_with_zeros(tmp_path, monkeypatch):
    """Qwen2.5-VL-7B's 3,420-wide MLP (rows not a multiple of 16 bytes) runs padded to 3,456:
    gate/up gain zero rows, down zero columns, transformers' parameters stay views of the real
    part, and the rows equal the eager forward's."""
    odd = dataclasses.replace(random_qwen2_5_vl.ARCHITECTURES["tiny"], vision_intermediate=60)
    monkeypatch.setitem(random_qwen2_5_vl.ARCHITECTURES, "tiny-odd-mlp", odd)
    loaded = sharpened(load_model(random_qwen2_5_vl.write_model_dir(tmp_path, arch="tiny-odd-mlp", seed=5),
                                  TEST_DEVICE, "float32"))
    fused = QwenFusedVision(loaded)
    mlp, block = loaded.model.model.visual.blocks[0].mlp, fused.blocks[0]
    assert mlp_width_multiple(60) == 128 and mlp_width_multiple(64) == 1
    assert block.fc1_weight.shape[0] == 2 * 128 and block.fc2_weight.shape[1] == 128
    assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (60, mlp.gate_proj.in_features)
    assert mlp.up_proj.weight.data_ptr() == block.fc1_weight[128:].data_ptr()
    assert mlp.down_proj.weight.shape[1] == 60 and mlp.down_proj.weight.data_ptr() == block.fc2_weight.data_ptr()
    assert not block.fc1_weight[60:128].any() and not block.fc2_weight[:, 60:].any()
    check_stage(loaded, fused, GRIDS)
    assert QwenFusedVision(loaded).blocks[0].fc2_weight.data_ptr() == block.fc2_weight.data_ptr()  # padded once


def test_the_startup_check_catches_a_wrong_window_order(models, monkeypatch):
    loaded = models(QWEN2_5, "float32")
    real = qwen_vision_layout.window_index

    def unordered(visual, grid):
        order, lengths = real(visual, grid)
        return torch.arange(order.numel()), lengths  # the windows' lengths, but raster order

    monkeypatch.setattr(qwen_vision_layout, "window_index", unordered)
    problem = startup_problem(loaded, QwenFusedVision(loaded))
    assert problem is not None and "relative error" in problem


@pytest.mark.parametrize("kind", [QWEN2_5, QWEN3])
def test_the_startup_check_catches_a_missing_rotary(models, monkeypatch, kind):
    """In float32: in a random tower the residual path carries most of the rows, so a position
    error moves them by about 1%, far past float32's tolerance (bfloat16's is wider)."""
    loaded = models(kind, "float32")
    fused = QwenFusedVision(loaded)
    unrotated = staticmethod(lambda qkv, cos, sin, heads: qkv.view(qkv.shape[0], 3, heads, -1).transpose(0, 1)
                             .contiguous())
    monkeypatch.setattr(fused, "ops", type("Unrotated", (fused.ops,), {"rotary": unrotated}))
    problem = startup_problem(loaded, fused)
    assert problem is not None and "relative error" in problem
    with pytest.raises(AssertionError, match="max error"):
        check_stage(loaded, fused, GRIDS[:2])


def test_the_sample_images_follow_the_towers_windows(models):
    loaded = models(QWEN2_5, "float32")
    images = sample_images(loaded)
    vision = loaded.model.config.vision_config
    window = vision.window_size // vision.patch_size  # patches per window side
    grids = [image.grid for image in images]
    assert len({h / w for _, h, w in grids}) == 3 and any(t > 1 for t, _, _ in grids)
    assert all(h % window or w % window for _, h, w in grids)  # each has partial windows at an edge
    assert max(h for _, h, _ in grids) > window and max(w for _, _, w in grids) > window


def test_supports_names_what_it_cannot_run(models):
    visual = models(QWEN2_5, "float32").model.model.visual
    assert supports(visual, QWEN2_5) is None
    assert "has no" in supports(visual, QWEN3)
    mlp = visual.blocks[1].mlp
    silu, mlp.act_fn = mlp.act_fn, torch.nn.ReLU()  # a submodule: put back by hand (monkeypatch would delete it)
    try:
        assert "vision block 1" in supports(visual, QWEN2_5) and "not SiLU" in supports(visual, QWEN2_5)
        with pytest.raises(ValueError, match="cannot run"):
            QwenFusedVision(models(QWEN2_5, "float32"))
    finally:
        mlp.act_fn = silu
    assert supports(visual, QWEN2_5) is None


def test_the_grid_layouts_are_kept_within_their_byte_budget(models, monkeypatch):
    loaded = models(QWEN2_5, "float32")
    fused = QwenFusedVision(loaded)
    one = fused.layouts.get((1, 8, 8)).nbytes
    monkeypatch.setattr(qwen_vision_layout, "MAX_LAYOUT_BYTES", 2 * one)
    for grid in [(1, 8, 8), (1, 4, 16), (1, 16, 4), (1, 8, 8)]:
        fused.layouts.get(grid)
    assert fused.layouts._bytes <= 2 * one and len(fused.layouts._cache) == 2
    assert list(fused.layouts._cache) == [(1, 16, 4), (1, 8, 8)]  # the least recently used went first
    check_stage(loaded, fused, GRIDS)  # recomputed layouts are the same
