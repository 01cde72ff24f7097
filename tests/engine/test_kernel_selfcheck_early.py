"""The kernel self-check started before the weights load: its answer is taken once, failures included."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from fovea.engine.runner import kernel_selfcheck


def _done(result=None, exc: BaseException | None = None) -> Future:
    future: Future = Future()
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
    return future


def test_the_early_answer_is_used_once_then_the_check_runs_again(monkeypatch) -> None:
    device = torch.device("cuda:0")  # only a key here: nothing runs on it
    calls = []
    monkeypatch.setattr(kernel_selfcheck, "triton_self_check", lambda d, t: calls.append((d, t)) or "checked now")
    monkeypatch.setitem(kernel_selfcheck._EARLY, (str(device), str(torch.bfloat16)), _done("silu_mul: max error"))
    assert kernel_selfcheck.self_check(device, torch.bfloat16) == "silu_mul: max error"
    assert not calls
    assert kernel_selfcheck.self_check(device, torch.bfloat16) == "checked now"  # taken: not reused
    assert calls == [(device, torch.bfloat16)]


def test_an_early_check_that_raised_means_the_torch_path(monkeypatch) -> None:
    device = torch.device("cuda:0")
    monkeypatch.setitem(kernel_selfcheck._EARLY, (str(device), str(torch.float16)),
                        _done(exc=RuntimeError("ptxas failed")))
    assert kernel_selfcheck.self_check(device, torch.float16) == "RuntimeError: ptxas failed"


def test_another_dtype_does_not_take_the_early_answer(monkeypatch) -> None:
    device = torch.device("cuda:0")
    monkeypatch.setattr(kernel_selfcheck, "triton_self_check", lambda d, t: None)
    monkeypatch.setitem(kernel_selfcheck._EARLY, (str(device), str(torch.bfloat16)), _done("bf16 problem"))
    assert kernel_selfcheck.self_check(device, torch.float32) is None


def test_no_early_check_on_a_cpu() -> None:
    kernel_selfcheck.start_early(torch.device("cpu"), torch.float32)
    assert ("cpu", str(torch.float32)) not in kernel_selfcheck._EARLY
