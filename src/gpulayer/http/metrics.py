"""``/metrics`` in Prometheus's text format."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ..jobs import STATES, Instruction, RunTask
from ..service import ControlPlane


class _PlaneCollector(Collector):
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self.plane.store.count_by_state()
        jobs = GaugeMetricFamily("gpulayer_jobs", "Jobs in the store, by state", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        snapshot = self.plane.snapshot()
        yield GaugeMetricFamily(
            "gpulayer_queue_length", "Jobs waiting for capacity", value=snapshot.queued
        )
        workers = GaugeMetricFamily(
            "gpulayer_workers", "Workers known to the server", labels=["connected"]
        )
        workers.add_metric(["true"], snapshot.connected_workers)
        workers.add_metric(["false"], snapshot.workers - snapshot.connected_workers)
        yield workers
        yield GaugeMetricFamily(
            "gpulayer_free_slots", "Free slots on connected workers", value=snapshot.free_slots
        )


class Metrics:
    def __init__(self, plane: ControlPlane) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PlaneCollector(plane))
        self.dispatch = Histogram(
            "gpulayer_dispatch_seconds",
            "From placement to the worker receiving the task",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )

    def observe_dispatch(self, items: list[Instruction], now: float) -> None:
        for item in items:
            if isinstance(item, RunTask) and item.placed:
                self.dispatch.observe(max(0.0, now - item.placed))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
