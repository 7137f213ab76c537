"""What each page shows, read from the control plane with the viewer's eyes.

No I/O of its own and no HTML: every read is a control-plane call given the
signed-in viewer (a job it may not see is a JobNotFoundError, as in the
API), shaped into plain values for the templates to escape.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from ...access import Viewer, sees_all
from ...errors import GPUlayerError
from ...jobs import STAGES, STATES, JobInfo, LogChunk, WorkerInfo
from ...service import ControlPlane
from ...transport import check_job_filter, label_pairs
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


def overview(plane: ControlPlane, viewer: Viewer) -> dict[str, Any]:
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
    gpus = sum(len({g for g in w.slot_gpus if g is not None}) for w in workers)
    return {
        "states": [(state, counts.get(state, 0)) for state in STATES],
        "all_jobs": sees_all(viewer),
        "queued": snapshot.queued,
        "workers": snapshot.workers,
        "connected": snapshot.connected_workers,
        "slots": sum(len(w.slot_gpus) for w in workers),
        "free_slots": snapshot.free_slots,
        "gpus": gpus,
        "gpus_held": sum(row.gpus_held for row in usage),
        "usage": usage,
    }


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
