"""Where a decode step's GPU time goes: the kernels of a few decode steps recorded by torch's
profiler (CUPTI sees the kernels a CUDA graph launches), summed per kernel name and per token.

``kernel_table(prof, tokens)`` turns a finished ``torch.profiler.profile`` into rows of (name,
launches a token, us each, us a token), the largest first; ``print_table`` prints them with the
kernels' total beside the measured time a token, whose difference is the time no kernel ran
(launch gaps, the host). Used by ``gpu_quantized.py --profile``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelRow:
    name: str
    per_token: float  # launches a token
    each_us: float
    us_per_token: float


def kernel_table(prof, tokens: int) -> list[KernelRow]:
    rows = []
    for avg in prof.key_averages():
        device_us = getattr(avg, "self_device_time_total", None)
        if device_us is None:  # (older torch)
            device_us = avg.self_cuda_time_total
        if device_us <= 0 or avg.count <= 0:
            continue
        rows.append(KernelRow(avg.key, avg.count / tokens, device_us / avg.count, device_us / tokens))
    return sorted(rows, key=lambda r: -r.us_per_token)


def print_table(rows: list[KernelRow], measured_ms_per_token: float, top: int = 30) -> None:
    total = sum(r.us_per_token for r in rows)
    print(f"\n{'kernel':<72}{'a token':>8}{'us each':>9}{'us/token':>10}")
    for r in rows[:top]:
        print(f"{r.name[:71]:<72}{r.per_token:>8.1f}{r.each_us:>9.2f}{r.us_per_token:>10.1f}")
    launches = sum(r.per_token for r in rows)
    print(f"kernels: {launches:.0f} launches and {total / 1e3:.3f} ms a token; measured "
          f"{measured_ms_per_token:.3f} ms a token: {measured_ms_per_token - total / 1e3:.3f} ms with no kernel "
          f"running ({(measured_ms_per_token - total / 1e3) / max(launches, 1) * 1e3:.2f} us a launch)")
