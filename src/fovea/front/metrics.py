"""The front's /metrics: its own counters, then the PD workers' metrics added up.

The PD workers' series are summed by metric name and labels, so ``fovea_requests_total``,
``fovea_embedding_handoff_seconds`` and the rest count the whole server as one process's
would. Gauges are not summed (two canary statuses or two KL readings do not add): each
worker's is kept with a ``pd_worker`` label. ``*_created`` timestamps are left out.
The front's own series are named ``fovea_front_*`` so that nothing is counted twice.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families


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
