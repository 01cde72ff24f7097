"""The front's /metrics: its own counters, then the PD workers' metrics added up.

The PD workers' series are summed by metric name and labels, so ``fovea_requests_total``,
``fovea_embedding_handoff_seconds`` and the rest count the whole server as one process's
would. Gauges are not summed (two canary statuses or two KL readings do not add): each
worker's is kept with a ``pd_worker`` label. ``*_created`` timestamps are left out.
The front's own series are named ``fovea_front_*`` so that nothing is counted twice; its
per-worker gauges (the load its routing sees) carry ``pd_worker`` too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from fovea.front.routing import OUTCOMES

if TYPE_CHECKING:
    from fovea.front.pd_fleet import PdWorker


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("fovea_front_requests", "HTTP requests the front answered, by route and status",
                                ["route", "status"], registry=r)
        self.routed = Counter("fovea_front_routed", "requests the front sent to a PD worker, by worker, route and "
                              "the status its client got", ["pd_worker", "route", "status"], registry=r)
        self.lost = Counter("fovea_front_pd_worker_lost", "requests that failed because their PD worker died "
                            "(or stopped answering) while it held them", ["pd_worker"], registry=r)
        self.pd_restarts = Counter("fovea_front_pd_worker_restarts", "PD worker processes started again after "
                                   "they exited", ["pd_worker"], registry=r)
        self.pd_ready = Gauge("fovea_front_pd_workers_ready", "PD workers ready to take requests", registry=r)
        self.encode_ready = Gauge("fovea_front_encode_workers_ready", "shared encode workers ready", registry=r)
        self.affinity = Counter("fovea_front_affinity", "requests the front routed by its rule, by affinity "
                                "outcome: hit (to the worker holding its images), overloaded (that worker was too "
                                "loaded), miss (no ready worker holds them), none (no image)", ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every outcome's series from the start, at 0
            self.affinity.labels(outcome=outcome)
        self.pd_in_flight = Gauge("fovea_front_pd_in_flight", "requests the front has in flight at each PD worker",
                                  ["pd_worker"], registry=r)
        self.pd_waiting = Gauge("fovea_front_pd_waiting", "each PD worker's engine's waiting requests, as its "
                                "/health last told the front", ["pd_worker"], registry=r)
        self.pd_kv_free = Gauge("fovea_front_pd_kv_free_share", "each PD worker's KV-cache free share, as its "
                                "/health last told the front (absent: not reported)", ["pd_worker"], registry=r)

    def observe_pd_workers(self, workers: Iterable[PdWorker]) -> None:
        """The load the routing sees, per worker (set when /metrics is read)."""
        for worker in workers:
            index = str(worker.index)
            self.pd_in_flight.labels(pd_worker=index).set(worker.in_flight)
            self.pd_waiting.labels(pd_worker=index).set(worker.waiting)
            if worker.kv_free is not None:
                self.pd_kv_free.labels(pd_worker=index).set(worker.kv_free)
            else:
                with contextlib.suppress(KeyError):
                    self.pd_kv_free.remove(index)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        yield from self.families


def merge(texts: dict[int, str]) -> bytes:
    """Each PD worker's exposition text (by worker index) as one, summed as the module says."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for index, text in texts.items():
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):
                continue
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                sums[family.name] = {}
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = dict(sample.labels)
                if family.type == "gauge":
                    labels["pd_worker"] = str(index)
                key = (sample.name, tuple(sorted(labels.items())))
                sums[family.name][key] = sums[family.name].get(key, 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in sums[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
