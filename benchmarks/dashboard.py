"""The dashboard's jobs page with 100,000 jobs in the store: server time of
its first page, target under 200 ms.

The server's ASGI app is called in-process (no socket, no browser), so what
is timed is the server's own work: the session's check, the store's read of
one page, and rendering it. Baseline, in the same run: the JSON API's
listing of as many jobs (``GET /api/v1/jobs?limit=50``), the same read
without the HTML. Runs alternate (page, API, page, ...); each prints its own
quartiles, and the summary is the median of the runs' medians. Also timed
once each run, not alternated: the overview, and the jobs page filtered by
state, by a label, and on its 200th page.

    python benchmarks/dashboard.py [--jobs 100000] [--repeat 3] [--requests 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gpulayer.artifacts import ArtifactStore
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.ids import new_id
from gpulayer.jobs import JobInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore
from server.test_dashboard import Browser


def fill(store: SqliteStore, jobs: int) -> None:
    """``jobs`` ended jobs of two users, in one transaction."""
    spec = parse_spec({"command": ["python", "train.py"], "name": "sweep", "labels": {"team": "v"}})
    rows = []
    for i in range(jobs):
        at = 1.7e9 + i
        marks = {"submitted": at, "placed": at + 0.1, "started": at + 0.2, "finished": at + 1.1}
        rows.append(
            JobInfo(
                id=new_id(),
                spec=spec,
                state="succeeded" if i % 10 else "failed",
                seq=i + 1,
                user="ada" if i % 2 else "bob",
                marks=marks,
                exit_code=0 if i % 10 else 1,
            )
        )
    with store.transaction() as tx:
        tx.insert_tasks(rows)  # (new ids: one statement for all)


def timed(call: object, requests: int) -> list[float]:
    took = []
    for _ in range(requests):
        started = time.perf_counter()
        reply = call()  # type: ignore[operator]
        took.append(time.perf_counter() - started)
        assert reply.status == 200, reply.text[:300]
    return took


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"median {q[1] * 1e3:.2f} ms (p25 {q[0] * 1e3:.2f}, p75 {q[2] * 1e3:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, alternated")
    parser.add_argument("--requests", type=int, default=30, help="requests per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpulayer-bench-") as tmp:
        store = SqliteStore(Path(tmp) / "db.sqlite")
        started = time.perf_counter()
        fill(store, args.jobs)
        print(f"stored {args.jobs} jobs in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        plane = ControlPlane(store, instance_id="bench")
        app = create_app(plane, ArtifactStore(Path(tmp) / "blobs"))
        token = auth.create_token(store, "user", user="ada")
        browser = Browser(app)
        browser.sign_in(token)
        bearer = [("authorization", f"Bearer {token}")]

        def page() -> object:
            return browser.get("/jobs")

        def api() -> object:
            return browser.request("GET", "/api/v1/jobs", "limit=50", headers=bearer)

        pages, apis = [], []
        for run in range(args.repeat):
            took = timed(page, args.requests)
            pages.append(statistics.median(took))
            print(f"run {run + 1}: jobs page, first page: {quartiles(took)}", file=sys.stderr)
            took = timed(api, args.requests)
            apis.append(statistics.median(took))
            print(f"run {run + 1}: API, 50 jobs: {quartiles(took)}", file=sys.stderr)
            for what, path, query in (
                ("overview", "/", ""),
                ("jobs page, state=failed", "/jobs", "state=failed"),
                ("jobs page, label team=v", "/jobs", "label=team%3Dv"),
                ("jobs page, page 200", "/jobs", "page=200"),
            ):
                took = timed(lambda p=path, q=query: browser.get(p, q), 5)
                print(f"run {run + 1}: {what}: {quartiles(took)}", file=sys.stderr)
        store.close()
    page_s, api_s = statistics.median(pages), statistics.median(apis)
    print(
        f"jobs page, first page, {args.jobs} jobs stored: {page_s * 1e3:.2f} ms "
        f"(runs: {', '.join(f'{p * 1e3:.2f}' for p in pages)} ms; target < 200 ms)"
    )
    print(
        f"API listing of 50: {api_s * 1e3:.2f} ms "
        f"(runs: {', '.join(f'{a * 1e3:.2f}' for a in apis)} ms); page / API: {page_s / api_s:.2f}x"
    )


if __name__ == "__main__":
    main()
