"""Prometheus metrics for one fovea server (its own registry, so apps never collide).

With ``--api-server-count N`` each request's figures are observed by the API process that took
it, so a scrape, which lands on one of them, would show a share of the traffic. There the
processes share their values through files (``share_between_processes``: prometheus_client's
multiprocess mode), and every process's /metrics shows the sums over all of them, including
processes that have died since. What the engine core reports (queue depth, cache, steps,
recoveries) is the same in every process and is rendered as it is; the core's vision and
hand-off timings are observed by the first API process only, so they are not counted N times.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

_SHARED_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own name for the directory

if TYPE_CHECKING:
    from fovea.engine.core.request import FinishEvent

# Refusals that mean "this request's image could not reach the model as sent".
MODALITY_CODES = frozenset({
    "invalid_image", "unsupported_image_format", "image_too_large", "image_placeholder_mismatch",
    "too_many_images", "media_fetch_failed", "media_source_forbidden", "image_not_found",
    "images_not_supported", "image_embedding_mismatch", "encoder_unavailable", "encoder_failed",
    "invalid_video", "video_too_large", "videos_not_supported",
})
_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_S_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_HANDOFF_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
_TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)


class _CacheCollector:
    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self.read = read

    def collect(self):
        hits, misses = self.read()
        yield CounterMetricFamily("fovea_encoder_cache_hits", "images whose embeddings came from the encoder cache",
                                  value=hits)
        yield CounterMetricFamily("fovea_encoder_cache_misses", "images that had to be encoded", value=misses)


class _RecoveryCollector:
    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read

    def collect(self):
        yield CounterMetricFamily("fovea_oom_recoveries", "engine steps that ran out of device memory and were "
                                  "retried smaller, losing no request", value=self.read())


class _QueueCollector:
    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read

    def collect(self):
        yield GaugeMetricFamily("fovea_queue_depth", "requests waiting for the engine", value=float(self.read()))


class _StepCollector:
    """Where the engine worker's wall time goes, summed over its steps (``PagedEngine.phase_seconds``):
    a burst's TTFT read against these says whether it waited on vision, the forward or the host."""

    def __init__(self, read: Callable[[], tuple[int, dict[str, float]]]) -> None:
        self.read = read

    def collect(self):
        steps, phases = self.read()
        yield CounterMetricFamily("fovea_engine_steps", "engine steps launched", value=steps)
        family = CounterMetricFamily(
            "fovea_engine_step_phase_seconds", "the engine worker's wall seconds per step phase: schedule (CPU), "
            "embed (vision and prompt embeddings), forward (launching it), sample_wait (waiting for the GPU), "
            "emit (tokens to the requests)", labels=["phase"])
        for phase, seconds in phases.items():
            family.add_metric([phase], seconds)
        yield family


class Metrics:
    def __init__(self, queue_depth: Callable[[], int], cache_counts: Callable[[], tuple[int, int]],
                 oom_recoveries: Callable[[], int] = lambda: 0,
                 engine_steps: Callable[[], tuple[int, dict[str, float]]] = lambda: (0, {})) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.vision_latency = Histogram("fovea_vision_encoder_latency_ms",
                                        "vision tower + projector time per encoded batch (ms; on a GPU, its GPU time)",
                                        buckets=_MS_BUCKETS, registry=r)
        self.modality_errors = Counter("fovea_modality_mismatch_errors",
                                       "requests refused because an image could not reach the model",
                                       ["reason"], registry=r)
        self.requests = Counter("fovea_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.ttft = Histogram("fovea_time_to_first_token_seconds", "the engine's arrival of a request to its "
                              "first generated token (queue + prefill)", buckets=_S_BUCKETS, registry=r)
        # A request's first token, phase by phase: what the API process spent preparing it, then
        # the engine's wait and prefill. What the client sees beyond their sum is HTTP and the hops.
        self.prepare = Histogram("fovea_request_prepare_seconds",
                                 "the API process's preparation of a prompt (for generation, /tokenize and the "
                                 "canary): media decoding, the processor, the chat template and tokenisation", buckets=_S_BUCKETS, registry=r)
        self.queue_time = Histogram("fovea_request_queue_seconds", "the engine's arrival of a request to the "
                                    "first step that took it", buckets=_S_BUCKETS, registry=r)
        self.prefill = Histogram("fovea_request_prefill_seconds", "the first step that took a request to its first "
                                 "token: vision, the prompt's prefill chunks and the first sample",
                                 buckets=_S_BUCKETS, registry=r)
        self.tpot = Histogram("fovea_time_per_output_token_seconds", "mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.handoff = Histogram("fovea_embedding_handoff_seconds",
                                 "e_pd: per image, an encode worker's round trip less its vision forward (pixels "
                                 "out, embeddings sealed, back, landed on the device and verified)",
                                 buckets=_HANDOFF_BUCKETS, registry=r)
        # Each API process runs its own canary: shared, the worst of the live ones is shown.
        self.canary_ok = Gauge("fovea_canary_status", "1 when the grounding canary last passed, 0 when it failed, "
                               "-1 before it has run (several API processes: the lowest)", registry=r,
                               multiprocess_mode="livemin")
        self.canary_ok.set(-1)
        self.canary_kl = Gauge("fovea_canary_last_ablation_kl", "smallest image-vs-blank KL divergence (nats) in "
                               "the last canary run (several API processes: the smallest)", registry=r,
                               multiprocess_mode="livemin")
        # What is rendered: this registry, or with shared values the files' sums, and the engine's own figures.
        directory = shared_directory()
        self.exposed = r if directory is None else CollectorRegistry()
        if directory is not None:
            MultiProcessCollector(self.exposed, path=directory)
        for collector in (_QueueCollector(queue_depth), _CacheCollector(cache_counts),
                          _RecoveryCollector(oom_recoveries), _StepCollector(engine_steps)):
            self.exposed.register(collector)

    def observe_finish(self, finish: FinishEvent) -> None:
        first = finish.first_token_s
        if first is not None:
            self.ttft.observe(first)
            if finish.queue_s is not None:
                self.queue_time.observe(finish.queue_s)
                self.prefill.observe(max(0.0, first - finish.queue_s))
            if finish.completion_tokens > 1:
                self.tpot.observe((finish.total_s - first) / (finish.completion_tokens - 1))

    def observe_handoff(self, seconds_per_image: float, images: int) -> None:
        for _ in range(images):
            self.handoff.observe(seconds_per_image)

    def observe_error_code(self, code: str) -> None:
        if code in MODALITY_CODES:
            self.modality_errors.labels(reason=code).inc()

    def render(self) -> bytes:
        return generate_latest(self.exposed)


def share_between_processes(directory: str) -> None:
    """From now on, in this process and the processes it starts, every metric keeps its values in
    files in ``directory`` (which must exist and hold no other server's files), and ``Metrics``
    renders the sums over all processes. Set before any ``Metrics`` is made."""
    os.environ[_SHARED_ENV] = directory
    values.ValueClass = values.MultiProcessValue()  # prometheus_client reads the variable only at import


def shared_directory() -> str | None:
    return os.environ.get(_SHARED_ENV) if values.ValueClass is not values.MutexValue else None


def process_gone(pid: int) -> None:
    """Drop a dead API process's live gauges (its canary) from the shared values; its counts stay."""
    directory = shared_directory()
    if directory is not None:
        mark_process_dead(pid, directory)
