"""Review: what a submit's new fields say when refused over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server.test_projects import Api

JOBS = "/api/v1/jobs"


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULAYER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPULAYER_PRELOAD", "")


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    made = Api(tmp_path)
    try:
        yield made
    finally:
        made.store.close()


def test_too_many_after_any_names_after_any(api: Api) -> None:
    status, answer = api("POST", JOBS, {"spec": {"command": ["true"], "after_any": ["0"] * 101}})
    assert status == 422
    assert answer["field"] == "after_any", answer


def test_an_unknown_job_to_wait_for_is_named_as_the_dependency(api: Api) -> None:
    """A 404 "no job with id 'zzz…'" for a submit reads as if the job being
    submitted were missing: say it is the job named in after (a 422 with
    field after[0], or words that name --after)."""
    status, answer = api("POST", JOBS, {"spec": {"command": ["true"], "after": ["zzzzzzzzzzzzzz"]}})
    assert status in (404, 422)
    assert "after" in answer["error"], answer
    assert api("GET", JOBS)[1] == []
