"""Listing jobs by who submitted them, their project, a text and a page, in
the store (one bounded read for the dashboard's jobs page); hostile text is
matched as text, never as a pattern or SQL."""

from __future__ import annotations

from pathlib import Path

from teams_kit import ADA, ADMIN, BOB, EVE, Clock, job, make_lab


def test_filters_by_submitter_project_and_text_apply_in_the_store(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    a = plane.submit(job(0, name="resnet sweep"), viewer=ADA)
    b = plane.submit(job(0, command=["python", "Train.py"]), viewer=BOB)
    e = plane.submit(job(0, name="bert"), viewer=EVE)

    def ids(**kw: object) -> list[str]:
        return [j.id for j in plane.list_jobs(viewer=ADMIN, **kw)]  # type: ignore[arg-type]

    assert ids(submitter="ada") == [a.id]
    assert ids(project="vision") == [b.id, a.id]
    assert ids(project="nlp") == [e.id]
    assert ids(text="SWEEP") == [a.id]  # case aside
    assert ids(text="train.py") == [b.id]  # the command
    assert ids(text="nothing like it") == []
    # Visibility first: ada sees bob's (same project), never eve's.
    assert [j.id for j in plane.list_jobs(viewer=ADA, text="bert")] == []
    assert [j.id for j in plane.list_jobs(viewer=ADA, submitter="eve")] == []


def test_pages_are_read_by_offset_newest_first(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    made = [plane.submit(job(0, name=f"j{i}"), viewer=ADA).id for i in range(7)]
    newest = made[::-1]
    pages = [[j.id for j in plane.list_jobs(viewer=ADA, limit=3, offset=o)] for o in (0, 3, 6)]
    assert pages == [newest[:3], newest[3:6], newest[6:]]
    assert plane.list_jobs(viewer=ADA, limit=3, offset=9) == []


def test_hostile_text_is_matched_as_text(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    plain = plane.submit(job(0, name="plain"), viewer=ADA)
    odd = plane.submit(job(0, name="100%_done' OR '1'='1"), viewer=ADA)
    for text in ("%", "_", "100%_", "' OR '1'='1", "\\"):
        found = [j.id for j in plane.list_jobs(viewer=ADA, text=text)]
        assert found == ([] if text == "\\" else [odd.id]), text
    assert [j.id for j in plane.list_jobs(viewer=ADA, text="plain")] == [plain.id]
