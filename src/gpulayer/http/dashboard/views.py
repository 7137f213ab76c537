"""What each page shows, read from the control plane with the viewer's eyes.

No I/O of its own and no HTML: every read is a control-plane call given the
signed-in viewer (a job it may not see is a JobNotFoundError, as in the
API), shaped into plain values for the templates to escape.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...access import Viewer, sees_all
from ...errors import GPUlayerError
from ...jobs import STAGES, STATES, GpuStats, JobInfo, LogChunk, WorkerInfo
from ...projects import DEFAULT_PROJECT
from ...service import ControlPlane
from ...transport import check_job_filter, label_pairs
from ..metrics import DispatchFigures
from ..routing import Request
from .session import Refused

PAGE = 50  # jobs a page
MAX_PAGE = 200  # the deepest page (10,000 jobs in); past it, narrow the filter
MAX_TEXT = 200  # characters of a filter field
FILTER_FIELDS = ("state", "user", "project", "label", "q", "page")
TIMELINE_WIDTH = 600  # the timeline's SVG user units


@dataclass(frozen=True)
class JobFilter:
    states: tuple[str, ...] = ()
    user: str = ""
    project: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    q: str = ""
    page: int = 1

    def link(self, page: int) -> str:
        """The query string of this filter's page ``page``."""
        pairs: list[tuple[str, str]] = [("state", s) for s in self.states]
        pairs += [(name, value) for name, value in (("user", self.user), ("project", self.project))]
        pairs += [("label", f"{k}={v}") for k, v in self.labels.items()]
        pairs += [("q", self.q), ("page", str(page))]
        return urllib.parse.urlencode([(k, v) for k, v in pairs if v])


def job_filter(request: Request) -> JobFilter:
    """The jobs page's filter from its query string; Refused(400) naming what is wrong."""
    query = request.query
    states = tuple(s for s in query.get("state", []) if s)
    try:
        labels = label_pairs([v for v in query.get("label", []) if v], "label")
        check_job_filter(states, labels)
    except GPUlayerError as exc:
        raise Refused(400, str(exc)) from None
    texts = {}
    for name in ("user", "project", "q"):
        value = (request.query_value(name) or "").strip()
        if len(value) > MAX_TEXT:
            raise Refused(400, f"the {name} filter is over {MAX_TEXT} characters")
        texts[name] = value
    raw = request.query_value("page") or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise Refused(
            400, f"page must be a number from 1 to {MAX_PAGE}, got {raw[:20]!r}; narrow the filter"
        )
    return JobFilter(states, texts["user"], texts["project"], labels, texts["q"], int(raw))


@dataclass
class JobPage:
    jobs: list[JobInfo]
    more: bool  # there is a next page


def jobs_page(plane: ControlPlane, viewer: Viewer, f: JobFilter) -> JobPage:
    """One page of the jobs ``viewer`` sees, newest first: the store applies
    every filter and passes over the pages before (never decoding them), so
    a page is one read of ``PAGE + 1`` rows."""
    rows = plane.list_jobs(
        states=f.states,
        labels=f.labels,
        submitter=f.user or None,
        project=f.project or None,
        text=f.q or None,
        limit=PAGE + 1,
        offset=(f.page - 1) * PAGE,
        viewer=viewer,
    )
    return JobPage(rows[:PAGE], len(rows) > PAGE)


def timeline(job: JobInfo) -> list[dict[str, Any]]:
    """The job's stages as bars along one axis from its submission: each
    one's x and width in TIMELINE_WIDTH units, and its seconds."""
    marks = job.marks
    origin = marks.get("submitted")
    if origin is None:
        return []
    spans = [
        (stage, marks[a] - origin, marks[b] - marks[a])
        for stage, (a, b) in STAGES.items()
        if stage != "total" and a in marks and b in marks
    ]
    end = max((offset + length for _, offset, length in spans), default=0.0)
    if end <= 0:
        return [{"stage": s, "x": 0, "width": 1, "seconds": n} for s, _, n in spans]
    scale = TIMELINE_WIDTH / end
    return [
        {
            "stage": stage,
            "x": round(offset * scale, 1),
            "width": max(1.0, round(length * scale, 1)),
            "seconds": length,
        }
        for stage, offset, length in spans
    ]


def overview(
    plane: ControlPlane,
    viewer: Viewer,
    *,
    detached: bool = False,
    dispatch: DispatchFigures | None = None,
) -> dict[str, Any]:
    """The overview's figures. ``detached``: this process runs no job (the
    dashboard of an embedded home), so what runs and waits is read from the
    store, where every process on the home records it; a server's are in
    its memory. ``dispatch``: the server's recent dispatch latencies."""
    if detached:
        return _overview_from_store(plane, viewer)
    snapshot = plane.snapshot()  # the server's totals, as /metrics gives any user
    workers = plane.list_workers(viewer)
    usage = plane.usage(viewer)
    if sees_all(viewer):
        counts = plane.store.count_by_state()
    else:  # only the jobs it sees: what runs and waits now, from memory
        counts = {
            "running": sum(row.running for row in usage),
            "queued": sum(row.waiting for row in usage),
        }
    return {
        "states": [(state, counts.get(state, 0)) for state in STATES],
        "all_jobs": sees_all(viewer),
        "queued": snapshot.queued,
        "workers": snapshot.workers,
        "connected": snapshot.connected_workers,
        "busy": None,
        "slots": sum(len(w.slot_gpus) for w in workers),
        "free_slots": snapshot.free_slots,
        "gpus": _gpus_of(workers),
        "gpus_held": sum(row.gpus_held for row in usage),
        "usage": usage,
        "dispatch": dispatch,
    }


MAX_LIVE = 10_000  # running (and queued) jobs an embedded home's overview reads


def _overview_from_store(plane: ControlPlane, viewer: Viewer) -> dict[str, Any]:
    counts = plane.store.count_by_state()
    running, queued = live_jobs(plane, viewer)
    workers = store_workers(plane, viewer, running)
    held: dict[str, list[int]] = {}  # project -> [running, waiting, gpus, slots]
    for job in running:
        counted = held.setdefault(job.spec.project or DEFAULT_PROJECT, [0, 0, 0, 0])
        counted[0] += 1
        if job.spec.gpus:  # a GPU job's slots count as GPUs, as quotas count them
            counted[2] += job.spec.gpus * job.spec.nodes
        else:
            counted[3] += sum(len(slots) for _, slots in _placed(job))
    for job in queued:
        held.setdefault(job.spec.project or DEFAULT_PROJECT, [0, 0, 0, 0])[1] += 1
    usage = []
    for row in plane.usage(viewer):
        n = held.get(row.project, [0, 0, 0, 0])
        usage.append(
            msgspec.structs.replace(
                row, running=n[0], waiting=n[1], gpus_held=n[2], slots_held=n[3]
            )
        )
    slots = sum(len(w.slot_gpus) for w in workers)
    return {
        "states": [(state, counts.get(state, 0)) for state in STATES],
        "all_jobs": True,
        "queued": counts.get("queued", 0),
        "workers": len(workers),
        "connected": None,
        "busy": sum(1 for w in workers if w.running),
        "slots": slots,
        "free_slots": max(0, slots - sum(len(s) for j in running for _, s in _placed(j))),
        "gpus": _gpus_of(workers),
        "gpus_held": sum(row.gpus_held for row in usage),
        "usage": usage,
        "dispatch": None,
    }


def live_jobs(plane: ControlPlane, viewer: Viewer) -> tuple[list[JobInfo], list[JobInfo]]:
    """The running and the queued jobs the store holds, an array's tasks
    each in its own state (an array's row stands for them, never runs)."""
    found: dict[str, list[JobInfo]] = {"running": [], "queued": []}
    for job in plane.list_jobs(states=list(found), limit=MAX_LIVE, viewer=viewer):
        if not job.array_states:
            found[job.state].append(job)
            continue
        for task in plane.list_jobs(
            array=job.id, states=list(found), limit=MAX_LIVE, viewer=viewer
        ):
            found[task.state].append(task)
    return found["running"][:MAX_LIVE], found["queued"][:MAX_LIVE]


def store_workers(
    plane: ControlPlane, viewer: Viewer, running: list[JobInfo] | None = None
) -> list[WorkerInfo]:
    """The workers the store records, each with the running jobs whose
    tasks it holds: what an embedded home's processes recorded."""
    if running is None:
        running = live_jobs(plane, viewer)[0]
    on: dict[str, list[str]] = {}
    for job in running:
        for worker_id, _ in _placed(job):
            on.setdefault(worker_id, []).append(job.id)
    workers = plane.list_workers(viewer)
    for worker in workers:
        worker.running = sorted(set(on.get(worker.id, [])))
    return workers


def _placed(job: JobInfo) -> list[tuple[str, list[int]]]:
    """Each (worker, slots) a running job holds: its tasks' (a job of
    several nodes), else its one task's."""
    if job.tasks:
        return [(t.worker, t.slots) for t in job.tasks]
    return [] if job.worker is None else [(job.worker, job.slots)]


def _gpus_of(workers: list[WorkerInfo]) -> int:
    return sum(len({g for g in w.slot_gpus if g is not None}) for w in workers)


def log_lines(chunk: LogChunk) -> dict[str, Any]:
    """A chunk of log lines for the script (which shows each as text)."""
    return {
        "lines": [
            {"seq": line.seq, "stream": line.stream, "text": line.text, "rank": line.rank}
            for line in chunk.lines
        ],
        "attempt": chunk.cursor[0],
        "seq": chunk.cursor[1],
        "done": chunk.done,
    }


def title_of(job: JobInfo) -> str:
    """What a person calls the job: its name, else its command or script."""
    if job.spec.name:
        return job.spec.name
    words = job.spec.command or [job.spec.script or ""]
    text = " ".join(words)
    return text if len(text) <= 80 else text[:77] + "..."


def gpu_figures(stats: GpuStats) -> str:
    """A GPU's latest figures in a line: ``42% 20.0/80.0 GiB 55 °C 250 W``
    (a figure it did not report is left out; no figure at all: ``-``)."""
    parts = []
    if stats.utilization is not None:
        parts.append(f"{stats.utilization:.0f}%")
    if stats.memory_used is not None and stats.memory_total is not None:
        parts.append(f"{stats.memory_used / 2**30:.1f}/{stats.memory_total / 2**30:.1f} GiB")
    if stats.temperature is not None:
        parts.append(f"{stats.temperature:.0f} °C")
    if stats.power is not None:
        parts.append(f"{stats.power:.0f} W")
    return " ".join(parts) or "-"


SPARK_WIDTH, SPARK_HEIGHT = 120, 24  # a GPU's utilisation chart, in SVG user units


def gpu_charts(plane: ControlPlane, workers: list[WorkerInfo]) -> dict[str, dict[int, str]]:
    """Each worker's GPUs' utilisation over the last hour, as the ``points``
    of an SVG polyline (SPARK_WIDTH by SPARK_HEIGHT, time along x; numbers
    only, nothing of the worker's text): by worker id, then GPU index."""
    charts: dict[str, dict[int, str]] = {}
    for worker in workers:
        if not worker.gpu_stats:
            continue
        found = {}
        for index, samples in plane.gpu_history(worker.id).items():
            marks = [(s.time, s.utilization) for s in samples if s.utilization is not None]
            if len(marks) < 2:
                continue
            start, span = marks[0][0], (marks[-1][0] - marks[0][0]) or 1.0
            found[index] = " ".join(
                f"{(t - start) / span * SPARK_WIDTH:.1f},{SPARK_HEIGHT - u / 100 * SPARK_HEIGHT:.1f}"
                for t, u in marks
            )
        charts[worker.id] = found
    return charts
