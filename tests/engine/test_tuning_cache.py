"""The kernel tuning cache: used only when its key and every entry check out, saved atomically."""

from __future__ import annotations

import json

import pytest
import torch

from fovea.engine.kernels import quant_gemv, quant_matmul, triton_ops
from fovea.engine.memory import tuning_cache
from fovea.engine.memory.tuning_cache import TuningCache, model_fingerprint

KEY = {"gpu": "NVIDIA H200", "capability": "9.0", "cuda": "13.0", "torch": "2.11.0", "triton": "3.6.0",
       "fovea": "0", "model": "abc"}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FOVEA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_ops, "_GEMV_CONFIG", {})
    monkeypatch.setattr(triton_ops, "_GEMV_CHOICE", {})
    monkeypatch.setattr(quant_matmul, "_CHOSEN", {})


def test_choices_round_trip_through_the_file() -> None:
    triton_ops._GEMV_CONFIG[(1, 4096, 4096, "bfloat16")] = triton_ops.GEMV_CONFIGS[3]
    triton_ops._GEMV_CHOICE[(1, 4096, 4096, "bfloat16")] = True
    triton_ops._GEMV_CHOICE[(4, 32064, 4096, "bfloat16")] = False
    writer = TuningCache(KEY)
    assert writer.save()
    triton_ops._GEMV_CONFIG.clear()
    triton_ops._GEMV_CHOICE.clear()
    reader = TuningCache(KEY)
    assert reader.load() == 3
    assert triton_ops._GEMV_CONFIG == {(1, 4096, 4096, "bfloat16"): triton_ops.GEMV_CONFIGS[3]}
    assert triton_ops._GEMV_CHOICE == {(1, 4096, 4096, "bfloat16"): True, (4, 32064, 4096, "bfloat16"): False}
    assert not reader.save()  # nothing new since the load: the file is not rewritten


def test_another_key_gets_another_file_and_none_of_its_choices() -> None:
    triton_ops._GEMV_CHOICE[(1, 8, 8, "float16")] = True
    TuningCache(KEY).save()
    triton_ops._GEMV_CHOICE.clear()
    other = TuningCache({**KEY, "gpu": "NVIDIA H100 80GB HBM3"})
    assert other.path != TuningCache(KEY).path
    assert other.load() == 0 and not triton_ops._GEMV_CHOICE


FP8_KEY = ("fp8", 1, 4608, 3584, "torch.bfloat16")
BLOCK_KEY = ("fp8-block", 8, 4608, 3584, "torch.bfloat16", 128, 128)
INT4_KEY = ("int4", 256, 37888, 3584, 128, "torch.bfloat16", True)
INT4_GEMV_KEY = ("int4", 2, 4608, 3584, 128, "torch.bfloat16", False)


@pytest.mark.parametrize("tamper, why", [
    (lambda d: d.update(key={**KEY, "triton": "9.9"}), "a different key"),
    (lambda d: d.update(format=99), "an unknown format"),
    (lambda d: d["gemv_config"].update({"1,8,8,float16": [3, 3, 3]}), "is not one the kernel is timed in"),
    (lambda d: d["gemv_choice"].update({"1,8,8,float16": "yes"}), "is not true or false"),
    (lambda d: d["gemv_choice"].update({"1,8,float16": True}), "a malformed entry"),
    (lambda d: d.pop("gemv_config"), "a malformed entry"),
    (lambda d: d.update(format=1), "an unknown format"),  # written before the quantized choices were kept
    (lambda d: d.update(format=3), "an unknown format"),  # written with the first matrix-vector kernels
    (lambda d: d.update(format=4), "an unknown format"),  # written before the prefetching candidates
    (lambda d: d["quant_choice"].update({json.dumps(list(FP8_KEY)): {**d["quant_choice"][json.dumps(list(FP8_KEY))],
                                                                     "block_n": 48}}),
     "is not one the kernel is timed in"),
    (lambda d: d["quant_choice"].update({json.dumps(["fp4", 1, 8, 8, "torch.bfloat16"]): {"block_m": 16}}),
     "a malformed entry"),
    (lambda d: d["quant_choice"].update({"[1, 2": {"block_m": 16}}), "a malformed entry"),
    (lambda d: d["quant_choice"].update({json.dumps(list(FP8_KEY)): {"block_m": 16, "tiles": 3}}),
     "a malformed entry"),
])
def test_a_file_that_does_not_check_out_is_ignored_whole(tamper, why, caplog) -> None:
    triton_ops._GEMV_CONFIG[(2, 16, 16, "bfloat16")] = triton_ops.GEMV_CONFIGS[1]
    triton_ops._GEMV_CHOICE[(2, 16, 16, "bfloat16")] = True
    quant_matmul._CHOSEN[FP8_KEY] = quant_matmul.fp8_candidates(1)[0]
    cache = TuningCache(KEY)
    cache.save()
    data = json.loads(cache.path.read_text())
    tamper(data)
    cache.path.write_text(json.dumps(data))
    triton_ops._GEMV_CONFIG.clear()
    triton_ops._GEMV_CHOICE.clear()
    quant_matmul._CHOSEN.clear()
    with caplog.at_level("WARNING", logger="fovea.engine.paged"):
        assert TuningCache(KEY).load() == 0
    # not even the good entries
    assert not triton_ops._GEMV_CONFIG and not triton_ops._GEMV_CHOICE and not quant_matmul._CHOSEN
    assert why in caplog.text


def test_an_unreadable_file_is_ignored(caplog) -> None:
    cache = TuningCache(KEY)
    cache.path.parent.mkdir(parents=True, exist_ok=True)
    cache.path.write_text("{not json")
    with caplog.at_level("WARNING", logger="fovea.engine.paged"):
        assert cache.load() == 0
    assert "unreadable" in caplog.text


def test_the_fingerprint_follows_shapes_and_dtypes_not_values() -> None:
    a = {"w": torch.zeros(4, 8), "b": torch.zeros(8)}
    assert model_fingerprint(a) == model_fingerprint({"b": torch.ones(8), "w": torch.randn(4, 8)})
    assert model_fingerprint(a) != model_fingerprint({"w": torch.zeros(4, 9), "b": torch.zeros(8)})
    assert model_fingerprint(a) != model_fingerprint({"w": torch.zeros(4, 8, dtype=torch.bfloat16),
                                                      "b": torch.zeros(8)})


def test_it_can_be_switched_off(monkeypatch) -> None:
    assert tuning_cache.enabled()
    monkeypatch.setenv("FOVEA_TUNING_CACHE", "0")
    assert not tuning_cache.enabled()


def test_a_shape_met_where_nothing_can_be_timed_keeps_no_choice(monkeypatch) -> None:
    """Inside a graph capture (or interpreted) a new shape runs the default configuration, and
    that untimed default is neither kept nor written to the cache: a later use times it."""
    launched = []
    monkeypatch.setattr(triton_ops, "_cannot_time", lambda: True)
    monkeypatch.setattr(triton_ops, "gemv_launch", lambda x, w, *config: launched.append(config) or x)
    triton_ops.gemv(torch.zeros(2, 8), torch.zeros(4, 8))
    assert launched == [(*triton_ops.GEMV_CONFIGS[0], triton_ops.GEMV_STAGES)]
    assert triton_ops._GEMV_CONFIG == {}
    assert not TuningCache(KEY).save()  # nothing timed: no file


def test_quantized_kernel_choices_round_trip_and_a_benchmarks_own_keys_stay_out() -> None:
    chosen = {FP8_KEY: quant_matmul.fp8_candidates(1)[2], BLOCK_KEY: quant_matmul.fp8_candidates(8)[1],
              INT4_KEY: quant_matmul.int4_candidates(256, 128)[1],
              # a matrix-vector kernel's choice comes back as its own kind of configuration
              INT4_GEMV_KEY: quant_gemv.int4_gemv_candidates(2, 128)[3]}
    quant_matmul._CHOSEN.update(chosen)
    quant_matmul._CHOSEN[("int4-shift", 1, 8, 8, 128, "torch.bfloat16", True)] = quant_matmul.int4_candidates(1, 128)[0]
    triton_ops._GEMV_CHOICE[(1, 8, 8, "bfloat16")] = True
    writer = TuningCache(KEY)
    assert writer.save()
    assert not writer.save()  # saved once: a second save (after the decode graphs) only writes what is new
    quant_matmul._CHOSEN.clear()
    triton_ops._GEMV_CHOICE.clear()
    assert TuningCache(KEY).load() == 5
    assert quant_matmul._CHOSEN == chosen


def test_every_key_the_kernels_make_has_its_candidates() -> None:
    # at most GEMV_MAX_ROWS rows the matrix-vector kernel's configurations are timed beside the tensor-core one's
    assert quant_matmul.candidates_for(FP8_KEY) == quant_matmul.fp8_candidates(1) + quant_gemv.fp8_gemv_candidates(1)
    assert quant_matmul.candidates_for(("fp8-mma", *FP8_KEY[1:])) == quant_matmul.fp8_candidates(1)
    assert quant_matmul.candidates_for(INT4_GEMV_KEY) == (quant_matmul.int4_candidates(2, 128)
                                                          + quant_gemv.int4_gemv_candidates(2, 128))
    assert quant_matmul.candidates_for(("fp8", 8, 4608, 3584, "torch.bfloat16")) == quant_matmul.fp8_candidates(8)
    assert quant_matmul.candidates_for(BLOCK_KEY) == quant_matmul.fp8_candidates(8, 128)
    assert quant_matmul.candidates_for(("fp8-block", 1, 8, 8, "torch.bfloat16", 128, 96))[0].block_k == 32
    assert quant_matmul.candidates_for(INT4_KEY) == quant_matmul.int4_candidates(256, 128)
    with pytest.raises(ValueError, match="not a quantized kernel's choice"):
        quant_matmul.candidates_for(("int4-shift", 1, 8, 8, 128, "torch.bfloat16", True))
