"""AWQ GEMM packing, pinned to AutoAWQ's own code so fovea's layout is the real one and not a mirror of itself.

The known-answer vectors below were produced once, offline, with AutoAWQ 0.2.9 (``pip download --no-deps
autoawq==0.2.9``, the sdist): ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear(linear, 4, 8,
scales=s, zeros=z)`` packed a 32x16 linear whose weight was exactly ``(q - z) * s`` (codes and zeros from
``torch.Generator().manual_seed(26)``, scales drawn from {1, 1/2, 1/4, 1/8}), and ``awq/utils/packing_utils.py``
``dequantize_gemm(qweight, qzeros, scales, 4, 8)`` gave the expected ``[K, N]`` matrix (recorded times 8, so
integers). AutoAWQ cannot be a test dependency (deprecated, pins old torch/transformers, wants CUDA kernels).
"""

import pytest
import torch

from fovea.quant.awq import (
    AWQ_ORDER,
    awq_to_int4,
    pack_awq,
    pack_awq_columns,
    quantize_awq,
    unpack_awq_columns,
)
from fovea.quant.weights import Int4Weight

QWEIGHT = [
    [-703240971, -1848016496, -126521655, -1478336928],
    [1623818078, -824816506, -1946710916, -2041689567],
    [-2011951930, -235324828, 938380232, 1243157812],
    [-708954128, 961194943, 21820255, -2015643323],
    [-582431743, 1749559483, -1446560551, 206308497],
    [2131058854, 431757085, -2111395669, -254812063],
    [946761411, 375781991, 259608671, -1830899484],
    [110061773, -1448549735, 1141565483, 1739314815],
    [151694378, -1058860523, -1403202253, 418325448],
    [1810790080, 1440592602, 1659200695, -375000471],
    [1091025460, -630732098, 666328261, 1698676057],
    [58069810, -333992623, 1125969408, -2015006684],
    [918540253, 700829579, -862772800, -641855750],
    [1775970865, -748089858, -1828977457, -246261663],
    [-1066886857, 1885352103, 424108327, 29769318],
    [2079459011, 287631312, -275679798, -2093693165],
]
QZEROS = [
    [-1918646006, 554407272, -1431903996, -1394579717],
    [1777627909, -725367400, 1181147008, -634552920],
]
SCALES = [
    [1.0, 0.5, 0.125, 0.125, 1.0, 0.5, 0.125, 0.25, 0.5, 0.5, 0.25, 0.5, 0.125, 0.125, 0.25, 0.5, 1.0, 0.5,
     1.0, 0.125, 0.25, 0.25, 0.25, 0.125, 0.25, 0.25, 0.5, 0.25, 0.125, 0.125, 0.25, 0.125],
    [1.0, 1.0, 0.25, 0.125, 0.5, 0.125, 0.125, 0.125, 0.125, 0.5, 0.5, 0.125, 0.125, 0.25, 0.125, 1.0, 0.25,
     1.0, 0.25, 0.5, 0.125, 0.25, 0.5, 0.125, 1.0, 1.0, 0.25, 0.5, 0.5, 0.25, 0.25, 0.25],
]
DEQ_X8 = [
    [-40, 8, 15, -9, -40, -28, -6, 10, -32, -8, 6, 52, -4, 0, -2, 28, 40, -4, 96, -3, 26, -4, -16, 5, -22, 4,
     -36, 0, 8, -5, -2, 0],
    [32, 24, 5, 2, 48, -52, -5, -4, -8, -20, 4, 52, 7, 13, -10, 40, 64, 4, 56, 5, 22, 2, -12, -2, -20, 28,
     -52, -20, 4, -6, -4, -2],
    [-32, 4, 12, -9, 24, -20, -12, 0, -16, -8, 0, 60, 5, 0, -12, 52, 32, 32, 96, 4, 20, -6, -12, -7, -14, 18,
     -48, -26, -1, -2, -10, -6],
    [-80, 44, 15, 1, -16, -32, -9, 10, 28, -4, 10, 16, 6, 8, 2, 4, 88, 24, 40, -6, 4, -18, 2, -10, -12, 22,
     -44, -2, 3, -5, 10, -2],
    [-72, 20, 0, -6, 24, 0, 0, 10, 12, -12, 10, 16, 3, 7, -14, 16, 40, 4, 104, 2, 22, -2, -22, 0, -20, 24,
     -24, -20, -2, 0, -12, -10],
    [-32, 8, 10, -10, -72, 8, -6, -2, 20, 4, -10, 44, 2, 8, -16, -4, 56, 0, 80, -8, 14, -16, -8, -2, -20, 30,
     -36, -4, -6, -12, 16, 5],
    [-56, 44, 12, -4, 40, -20, -6, -10, -4, -24, 0, 24, 5, 5, 12, -4, 88, 12, 40, -3, -2, 10, -18, -10, -14,
     28, -4, -2, -6, -10, 10, -1],
    [24, 48, 12, -2, -8, -28, -6, -16, 4, -12, 6, 40, -3, 8, 10, 32, 56, 16, 16, -10, 14, -12, 0, -6, 8, 22,
     -32, -8, 0, -5, 14, -4],
    [40, 48, 4, -15, 36, 0, 3, -6, -3, 0, -32, 2, -3, -8, -11, -8, 6, 48, -10, -4, -10, 12, 0, 6, 0, 16, 4,
     48, -40, -4, -10, -24],
    [-40, 80, 24, -1, 12, 2, 0, 0, 2, 40, 16, 1, -3, 2, -1, -64, 14, -8, 6, 32, -11, -8, -28, 2, 8, -64, -8,
     32, -44, -2, 16, 2],
    [-8, 24, 6, -15, 28, -8, 4, -2, 6, 16, 8, -6, 5, 12, 0, 0, 10, 8, 8, 20, -3, 2, -32, -2, 8, 16, -10, 4,
     0, -10, 8, -14],
    [-24, 16, 6, -8, 0, -6, -6, -6, -7, 16, -16, -11, 8, 16, -2, 8, 0, 48, -16, -20, -1, -6, 4, 0, -32, -64,
     -16, 48, -52, -6, 0, -10],
    [64, 88, 26, -4, 48, -3, 5, -3, 3, 8, -4, 0, 10, 10, 0, -88, 0, -24, 8, 12, -14, 12, -44, 8, 16, 8, 10,
     36, 4, -2, -14, 0],
    [-32, 56, 6, -2, 28, 0, -5, 0, 6, 24, 24, -6, 8, -2, -12, 0, 30, 48, 8, 36, -11, -8, -52, 5, -56, -88,
     -8, 12, -20, -18, -4, 4],
    [16, 32, 6, -9, 24, -9, 2, 6, -1, -12, 4, -6, -5, -8, -9, -48, 14, 8, -12, -8, -14, 6, -28, -3, -16, -56,
     -8, 40, 4, -18, -8, -26],
    [-16, -16, 24, 0, 12, 2, -7, 1, -8, 4, 16, -10, 2, -6, 2, -96, 20, -40, 8, 12, -10, 18, -24, 10, -40,
     -72, -18, 4, -24, -14, 10, -10],
]
K, N, GROUP = 16, 32, 8


def _reference() -> dict[str, torch.Tensor]:
    return {"qweight": torch.tensor(QWEIGHT, dtype=torch.int32), "qzeros": torch.tensor(QZEROS, dtype=torch.int32),
            "scales": torch.tensor(SCALES, dtype=torch.float16)}


def test_known_answer_dequantizes_like_autoawq():
    w = awq_to_int4(**_reference())
    assert (w.out_features, w.in_features, w.group) == (N, K, GROUP)
    expected = torch.tensor(DEQ_X8, dtype=torch.float32).t() / 8  # AutoAWQ's [K, N] -> fovea's W [N, K]
    assert torch.equal(w.dequantize(torch.float32), expected)


def test_known_answer_packs_like_autoawq():
    """pack_awq (the test-checkpoint writer) reproduces AutoAWQ's words bit for bit."""
    packed = pack_awq(awq_to_int4(**_reference()))
    ref = _reference()
    assert torch.equal(packed["qweight"], ref["qweight"])
    assert torch.equal(packed["qzeros"], ref["qzeros"])
    assert torch.equal(packed["scales"], ref["scales"])


def test_nibble_order_within_a_word():
    # Nibble i holds value i: AutoAWQ puts column AWQ_ORDER[i] in nibble i, so column j reads its nibble's index.
    word = sum(i << (4 * i) for i in range(8))
    word = word - 2**32 if word >= 2**31 else word
    codes = unpack_awq_columns(torch.tensor([[word]], dtype=torch.int32))
    assert codes.tolist() == [[AWQ_ORDER.index(j) for j in range(8)]] == [[0, 4, 1, 5, 2, 6, 3, 7]]


@pytest.mark.parametrize("n,k,group", [(8, 16, 8), (24, 64, 32), (64, 256, 128)])
def test_round_trip(n, k, group):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen) * 0.05
    w = quantize_awq(weight, group)
    back = awq_to_int4(**pack_awq(w))
    assert torch.equal(back.packed, w.packed) and torch.equal(back.zeros, w.zeros)
    assert torch.equal(back.dequantize(torch.float32), w.dequantize(torch.float32))
    # Round to nearest: each value within half a step of its group's scale (fp16 scale rounding aside).
    step = w.scales.to(torch.float32).repeat_interleave(group, 0).t()
    err = (w.dequantize(torch.float32) - weight).abs()
    assert bool((err <= step * 0.5 + step * 2**-10 + 1e-6).all())


def test_columns_pack_and_unpack_are_inverse():
    codes = torch.randint(0, 16, (5, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_awq_columns(pack_awq_columns(codes)), codes.to(torch.uint8))


def test_scales_and_zeros_cast_to_the_model_dtype():
    w = awq_to_int4(**_reference(), dtype=torch.bfloat16)
    assert w.scales.dtype == w.zeros.dtype == torch.bfloat16
    expected = torch.tensor(DEQ_X8, dtype=torch.float32).t() / 8
    assert torch.equal(w.dequantize(torch.float32), expected)  # powers of two: exact in bf16 too


def test_symmetric_weight_is_written_with_zero_eight():
    w = Int4Weight.random(16, 32, 16, symmetric=True, dtype=torch.float16)
    back = awq_to_int4(**pack_awq(w))
    assert torch.equal(back.dequantize(torch.float32), w.dequantize(torch.float32))
    assert bool((back.zeros == 8).all())


def test_mismatched_shapes_are_refused():
    ref = _reference()
    with pytest.raises(ValueError, match="qzeros"):
        awq_to_int4(ref["qweight"], ref["qzeros"][:1], ref["scales"])
    with pytest.raises(ValueError, match="scales"):
        awq_to_int4(ref["qweight"], ref["qzeros"], ref["scales"][:, :16])
    with pytest.raises(ValueError, match="multiple of the group"):
        quantize_awq(torch.zeros(8, 20), 8)
