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
from ...jobs import STAGES, STATES, JobInfo, LogChunk
from ...projects import DEFAULT_PROJECT
from ...service import ControlPlane
from ...transport import check_job_filter, label_pairs
from ..routing import Request
from .session import Refused

PAGE = 50  # jobs a page
MAX_PAGE = 200  # the deepest page (10,000 jobs in); past it, narrow the filter
# Jobs looked through, newest first, for the filters the store does not
# apply itself (user, project, text); the page says when it stopped there.
SCAN = 5000
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

    @property
    def in_store(self) -> bool:
        """Whether the store applies every filter (and a page is one bounded read)."""
        return not (self.user or self.project or self.q)

    def link(self, page: int) -> str:
        """The query string of this filter's page ``page``."""
        pairs: list[tuple[str, str]] = [("state", s) for s in self.states]
        pairs += [(name, value) for name, value in (("user", self.user), ("project", self.project))]
        pairs += [("label", f"{k}={v}") for k, v in self.labels.items()]
        pairs += [("q", self.q), ("page", str(page))]
        return urllib.parse.urlencode([(k, v) for k, v in pairs if v])

    def matches(self, job: JobInfo) -> bool:
        if self.user and job.user != self.user:
            return False
        if self.project and (job.spec.project or DEFAULT_PROJECT) != self.project:
            return False
        if self.q:
            text = " ".join([job.spec.name or "", *(job.spec.command or []), job.spec.script or ""])
            return self.q.casefold() in text.casefold()
        return True


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
    scanned: int | None  # the filter looked through only this many of the newest jobs


def jobs_page(plane: ControlPlane, viewer: Viewer, f: JobFilter) -> JobPage:
    """One page of the jobs ``viewer`` sees, newest first: at most
    ``page * PAGE + 1`` rows read when the store applies every filter."""
    start, end = (f.page - 1) * PAGE, f.page * PAGE
    if f.in_store:
        rows = plane.list_jobs(states=f.states, labels=f.labels, limit=end + 1, viewer=viewer)
        return JobPage(rows[start:end], len(rows) > end, None)
    rows = plane.list_jobs(states=f.states, labels=f.labels, limit=SCAN, viewer=viewer)
    matched = [job for job in rows if f.matches(job)]
    return JobPage(matched[start:end], len(matched) > end, SCAN if len(rows) == SCAN else None)


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
