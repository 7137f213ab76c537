"""``/metrics`` in Prometheus's text format."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ..access import Viewer
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


# Each GPU's latest figures: (name, help, the GpuStats field).
_GPU_GAUGES = (
    (
        "gpulayer_gpu_utilization_percent",
        "Of the last sample period the GPU was busy",
        "utilization",
    ),
    ("gpulayer_gpu_memory_used_bytes", "GPU memory in use", "memory_used"),
    ("gpulayer_gpu_memory_total_bytes", "GPU memory in all", "memory_total"),
    ("gpulayer_gpu_temperature_celsius", "GPU temperature", "temperature"),
    ("gpulayer_gpu_power_watts", "GPU power draw", "power"),
)


class _GpuCollector(Collector):
    """Each live worker's GPUs' latest figures (see worker/telemetry.py):
    a GPU whose figures are not fresh, or that does not report one, has no
    sample of that gauge."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker", "gpu", "uuid"]
        gauges = [GaugeMetricFamily(name, text, labels=labels) for name, text, _ in _GPU_GAUGES]
        # prometheus_client escapes label values as the text format asks: a
        # uuid is the worker's word (at most 128 characters, see GpuStats).
        for worker_id, found in sorted(self.plane.gpu_stats().items()):
            for stats in found:
                values = [worker_id, str(stats.index), stats.uuid or ""]
                for gauge, (_, _, field) in zip(gauges, _GPU_GAUGES, strict=True):
                    value = getattr(stats, field)
                    if value is not None:
                        gauge.add_metric(values, value)
        yield from gauges


class _ProjectCollector(Collector):
    """Each project's figures, as ``gpulayer usage`` shows them to ``viewer``:
    collected per request, since who asks decides which projects appear."""

    def __init__(self, plane: ControlPlane, viewer: Viewer) -> None:
        self.plane = plane
        self.viewer = viewer

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = self.plane.usage(self.viewer)
        held = GaugeMetricFamily(
            "gpulayer_project_gpus_held", "GPUs its running jobs hold now", labels=["project"]
        )
        jobs = GaugeMetricFamily(
            "gpulayer_project_jobs", "Its jobs running and queued now", labels=["project", "state"]
        )
        hours = GaugeMetricFamily(
            "gpulayer_project_gpu_hours",
            "GPU-hours its jobs held over the last 24 hours (window 24h) and 7 days (7d)",
            labels=["project", "window"],
        )
        fair = GaugeMetricFamily(
            "gpulayer_project_fair_share_usage_gpu_seconds",
            "Its recent usage for fair share: weighted GPU-seconds halved every half-life",
            labels=["project"],
        )
        quota = GaugeMetricFamily(
            "gpulayer_project_gpu_quota",
            "The most GPUs its running jobs may hold (only projects with a quota)",
            labels=["project"],
        )
        # prometheus_client escapes label values (\\, \", \n) as the text
        # format asks; a project name holds none of them anyway.
        for row in rows:
            held.add_metric([row.project], row.gpus_held)
            jobs.add_metric([row.project, "running"], row.running)
            jobs.add_metric([row.project, "queued"], row.waiting)
            hours.add_metric([row.project, "24h"], row.gpu_hours_day)
            hours.add_metric([row.project, "7d"], row.gpu_hours_week)
            if row.fair_share_usage is not None:
                fair.add_metric([row.project], row.fair_share_usage)
            if row.gpu_quota is not None:
                quota.add_metric([row.project], row.gpu_quota)
        yield from (held, jobs, hours, fair, quota)


RECENT_DISPATCHES = 1000


@dataclass(frozen=True)
class DispatchFigures:
    count: int  # dispatches these figures are of
    median: float  # seconds, from placement to the worker receiving the task
    p99: float


class Metrics:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.registry = CollectorRegistry()
        self.registry.register(_PlaneCollector(plane))
        self.registry.register(_GpuCollector(plane))
        self.dispatch = Histogram(
            "gpulayer_dispatch_seconds",
            "From placement to the worker receiving the task",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        # The last dispatches' latencies, for the dashboard's median and 99th
        # percentile (the histogram's buckets only bound them).
        self._recent: deque[float] = deque(maxlen=RECENT_DISPATCHES)

    def observe_dispatch(self, items: list[Instruction], now: float) -> None:
        for item in items:
            if isinstance(item, RunTask) and item.placed:
                seconds = max(0.0, now - item.placed)
                self.dispatch.observe(seconds)
                self._recent.append(seconds)

    def recent_dispatch(self) -> DispatchFigures | None:
        """The median and 99th percentile of the last dispatches' latencies
        (at most RECENT_DISPATCHES), or None before the first."""
        found = list(self._recent)
        if not found:
            return None
        if len(found) == 1:
            return DispatchFigures(len(found), found[0], found[0])
        cuts = statistics.quantiles(found, n=100, method="inclusive")
        return DispatchFigures(len(found), statistics.median(found), cuts[98])

    def render(self, viewer: Viewer) -> tuple[bytes, str]:
        """The text for ``viewer``: the fleet's figures, then the projects it may see."""
        projects = CollectorRegistry()
        projects.register(_ProjectCollector(self.plane, viewer))
        return generate_latest(self.registry) + generate_latest(projects), CONTENT_TYPE_LATEST
