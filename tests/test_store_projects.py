"""The store's projects (schema 12): the projects, their members and usage,
and the job filters a member's look at jobs goes through."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from msgspec import UNSET

from gpulayer.errors import InvalidStateError
from gpulayer.jobs import JobInfo
from gpulayer.projects import ProjectInfo
from gpulayer.spec import JobSpec
from gpulayer.store.migrations import LATEST, MIGRATIONS
from gpulayer.store.sqlite import SqliteStore

BEFORE_PROJECTS = 11


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    db = SqliteStore(tmp_path / "db.sqlite")
    try:
        yield db
    finally:
        db.close()


def _job(
    job_id: str, seq: int, user: str | None, project: str | None, state: str = "queued"
) -> JobInfo:
    return JobInfo(
        id=job_id,
        seq=seq,
        state=state,
        user=user,
        spec=JobSpec(command=["x"], project=project),
    )


def _insert(store: SqliteStore, *jobs: JobInfo) -> None:
    with store.transaction() as tx:
        for job in jobs:
            assert tx.insert_job(job)


def _ids(jobs: list[JobInfo]) -> list[str]:
    return [j.id for j in jobs]


def test_a_project_is_made_once_with_its_members_in_the_order_added(store: SqliteStore) -> None:
    assert store.create_project(ProjectInfo(name="vision", gpus=8, created=1.0))
    assert store.create_project(ProjectInfo(name="nlp", slots=4, members=["ann"], created=2.0))
    # A second of the same name changes nothing, not even the quota.
    assert not store.create_project(
        ProjectInfo(name="vision", gpus=1, members=["eve"], created=3.0)
    )
    assert store.add_project_member("vision", "bob", 5.0)
    assert store.add_project_member("vision", "alice", 6.0)
    assert store.add_project_member("nlp", "bob", 7.0)
    assert store.add_project_member("vision", "bob", 8.0)  # already in: stays first
    assert not store.add_project_member("nosuch", "bob", 9.0)
    assert store.project_members() == [
        ("nlp", "ann"),
        ("vision", "bob"),
        ("vision", "alice"),
        ("nlp", "bob"),
    ]
    assert store.list_projects() == [
        ProjectInfo(name="vision", gpus=8, slots=None, members=["bob", "alice"], created=1.0),
        ProjectInfo(name="nlp", gpus=None, slots=4, members=["ann", "bob"], created=2.0),
    ]


def test_a_quota_is_set_cleared_or_left_as_it_is(store: SqliteStore) -> None:
    assert store.create_project(ProjectInfo(name="vision", gpus=8, slots=2, created=1.0))

    def quotas() -> tuple[int | None, int | None]:
        (info,) = store.list_projects()
        return info.gpus, info.slots

    assert store.set_project_quota("vision", gpus=4)  # slots left as they are
    assert quotas() == (4, 2)
    assert store.set_project_quota("vision", slots=None)  # no limit
    assert quotas() == (4, None)
    assert store.set_project_quota("vision", gpus=UNSET, slots=UNSET)  # nothing asked
    assert quotas() == (4, None)
    assert store.set_project_quota("vision", gpus=None, slots=0)
    assert quotas() == (None, 0)
    assert not store.set_project_quota("nosuch", gpus=1)
    assert not store.set_project_quota("nosuch")
    assert [p.name for p in store.list_projects()] == ["vision"]


def test_a_member_is_removed_once(store: SqliteStore) -> None:
    store.create_project(ProjectInfo(name="vision", members=["bob", "alice"], created=1.0))
    assert store.remove_project_member("vision", "bob")
    assert not store.remove_project_member("vision", "bob")
    assert not store.remove_project_member("nosuch", "alice")
    assert store.project_members() == [("vision", "alice")]


def test_a_project_with_a_job_not_final_is_not_deleted(store: SqliteStore) -> None:
    store.create_project(ProjectInfo(name="vision", gpus=8, members=["alice"], created=1.0))
    store.save_usage("vision", 3600.0, 10.0)
    _insert(
        store,
        _job("q", 1, "alice", "vision"),
        _job("r", 2, "alice", "vision", "running"),
        _job("s", 3, "alice", "vision", "succeeded"),
        _job("o", 4, "alice", "other"),  # another project's does not count
    )
    with pytest.raises(InvalidStateError, match=r"project vision has 2 jobs that are not final"):
        store.delete_project("vision")
    assert [p.name for p in store.list_projects()] == ["vision"]  # nothing changed
    assert store.project_members() == [("vision", "alice")]
    assert store.load_usage() == {"vision": (3600.0, 10.0)}
    with store.transaction() as tx:
        tx.cancel_queued("q", 11.0)
    with pytest.raises(InvalidStateError, match=r"has 1 job that is not final"):
        store.delete_project("vision")
    with store.transaction() as tx:
        tx.finish("r", state="failed", exit_code=1, reason=None, marks={}, outputs={}, starts=None)
    assert store.delete_project("vision")
    assert not store.delete_project("vision")
    assert store.list_projects() == [] and store.project_members() == []
    assert store.load_usage() == {}
    # Its final jobs stay, their submitters' alone: not in a project made
    # later under its name, whose members must not see them.
    store.create_project(ProjectInfo(name="vision", members=["bob"], created=20.0))
    assert _ids(store.list_jobs(user="bob", projects=["vision"])) == []
    assert _ids(store.list_jobs(project="vision")) == []
    assert store.get_job("s", user="bob", projects=["vision"]) is None
    kept = store.get_job("s", user="alice")
    assert kept is not None and kept.spec.project == "~vision"  # read as the deleted one's
    assert _ids(store.list_jobs(project="other")) == ["o"]


def test_usage_is_upserted_alone_or_in_a_step(store: SqliteStore) -> None:
    assert store.load_usage() == {}
    store.save_usage("vision", 10.0, 1.0)
    store.save_usage("vision", 7.5, 2.0)
    with store.transaction() as tx:
        tx.save_usage("nlp", 0.25, 3.0)
    assert store.load_usage() == {"vision": (7.5, 2.0), "nlp": (0.25, 3.0)}
    with pytest.raises(RuntimeError), store.transaction() as tx:  # rolled back with its step
        tx.save_usage("nlp", 99.0, 4.0)
        raise RuntimeError
    assert store.load_usage()["nlp"] == (0.25, 3.0)


@pytest.fixture
def teams(store: SqliteStore) -> SqliteStore:
    """alice and bob in vision; carol in nlp; jobs in each, in none (NULL) and
    in the default project by its name."""
    _insert(
        store,
        _job("a1", 1, "alice", "vision"),
        _job("b1", 2, "bob", "vision"),
        _job("b2", 3, "bob", None),
        _job("b3", 4, "bob", "default"),
        _job("c1", 5, "carol", "nlp"),
        _job("x1", 6, None, "vision"),  # an admin's without a user, in vision
        _job("a2", 7, "alice", None, "succeeded"),
    )
    return store


def test_a_member_sees_its_own_jobs_and_its_projects(teams: SqliteStore) -> None:
    assert _ids(teams.list_jobs(user="alice")) == ["a2", "a1"]
    assert _ids(teams.list_jobs(user="alice", projects=["vision"])) == ["a2", "x1", "b1", "a1"]
    assert _ids(teams.list_jobs(user="alice", projects=["vision", "nlp"])) == [
        "a2",
        "x1",
        "c1",
        "b1",
        "a1",
    ]
    assert _ids(teams.list_jobs(user="carol", projects=["nlp"])) == ["c1"]
    # With other filters, and a limit: newest first still.
    assert _ids(teams.list_jobs(user="alice", projects=["vision"], states=["queued"], limit=2)) == [
        "x1",
        "b1",
    ]
    # An admin (no user) sees every job; projects then change nothing.
    assert len(teams.list_jobs(projects=["nlp"])) == 7


def test_the_default_project_shows_no_one_anothers_jobs(teams: SqliteStore) -> None:
    """Whoever passes it (the control plane never does): neither a NULL
    project nor one named "default" is matched by membership."""
    for projects in (["default"], ["default", "default"], ["nlp", "default"]):
        seen = _ids(teams.list_jobs(user="alice", projects=projects))
        assert "b2" not in seen and "b3" not in seen, projects
        assert teams.get_job("b2", user="alice", projects=projects) is None
        assert teams.get_job("b3", user="alice", projects=projects) is None
        assert teams.find_job("b", user="alice", projects=projects) == []
    assert _ids(teams.list_jobs(user="bob", projects=["default"])) == ["b3", "b2", "b1"]


def test_one_job_or_a_prefix_resolves_among_what_the_member_sees(teams: SqliteStore) -> None:
    found = teams.get_job("b1", user="alice", projects=["vision"])
    assert found is not None and found.user == "bob"
    assert teams.get_job("b1", user="alice") is None
    assert teams.get_job("c1", user="alice", projects=["vision"]) is None
    assert teams.get_job("nosuch", user="alice", projects=["vision"]) is None
    assert teams.find_job("b", user="alice", projects=["vision"]) == ["b1"]  # unique for her
    assert teams.find_job("b", user="bob", projects=["vision"]) == ["b1", "b2"]  # 2 at most
    assert teams.find_job("c", user="alice", projects=["vision"]) == []
    assert teams.find_job("c", user="carol", projects=["nlp"]) == ["c1"]


def test_a_hostile_project_name_is_only_ever_a_value(teams: SqliteStore) -> None:
    for name in ("' OR 1=1 --", "vision' OR '1'='1", "%", "vision%", "*", ""):
        assert _ids(teams.list_jobs(user="alice", projects=[name])) == ["a2", "a1"], name
        assert _ids(teams.list_jobs(project=name)) == [], name
        assert teams.get_job("b1", user="alice", projects=[name]) is None


def test_one_projects_jobs(teams: SqliteStore) -> None:
    assert _ids(teams.list_jobs(project="vision")) == ["x1", "b1", "a1"]
    assert _ids(teams.list_jobs(project="default")) == ["a2", "b3", "b2"]  # NULL or by name
    assert _ids(teams.list_jobs(project="default", states=["succeeded"])) == ["a2"]
    assert _ids(teams.list_jobs(project="nosuch")) == []
    # With a user: that user's jobs and its projects', of that one project.
    assert _ids(teams.list_jobs(user="alice", projects=["vision"], project="vision")) == [
        "x1",
        "b1",
        "a1",
    ]
    assert _ids(teams.list_jobs(user="alice", projects=["vision"], project="nlp")) == []


def test_a_members_listing_reads_the_jobs_through_indexes(teams: SqliteStore) -> None:
    """Its own jobs through jobs_by_user, its projects' through jobs_by_project:
    not a scan of every job on the server."""
    statements: list[str] = []
    teams._db.set_trace_callback(statements.append)  # expanded: the values bound in
    try:
        teams.list_jobs(user="alice", projects=["vision", "nlp"], limit=50)
    finally:
        teams._db.set_trace_callback(None)
    (listing,) = [s for s in statements if s.lstrip().startswith("SELECT") and "FROM jobs" in s]
    plan = " | ".join(str(row[3]) for row in teams._db.execute("EXPLAIN QUERY PLAN " + listing))
    assert "jobs_by_user" in plan and "jobs_by_project" in plan, plan
    assert "SCAN jobs" not in plan, plan


def test_a_store_from_before_projects_is_migrated_with_its_jobs_in_none(tmp_path: Path) -> None:
    assert LATEST > BEFORE_PROJECTS
    path = tmp_path / "db.sqlite"
    db = sqlite3.connect(path)
    for statements in MIGRATIONS[:BEFORE_PROJECTS]:  # as GPUlayer before projects left it
        for statement in statements:
            db.execute(statement)
    db.execute(f"PRAGMA user_version = {BEFORE_PROJECTS}")
    db.execute(
        "INSERT INTO jobs (id, seq, state, priority, spec, attempt, user_name) "
        "VALUES (?,?,?,?,?,?,?)",
        ("old", 1, "queued", 0, b'{"command":["x"]}', 0, "bob"),
    )
    db.commit()
    db.close()
    store = SqliteStore(path)
    try:
        assert store.schema_version == LATEST
        assert store.list_projects() == [] and store.load_usage() == {}
        assert _ids(store.list_jobs(project="default")) == ["old"]
        assert store.get_job("old", user="alice", projects=["vision"]) is None
        assert store.create_project(ProjectInfo(name="vision", members=["alice"], created=1.0))
        _insert(store, _job("new", 2, "bob", "vision"))
        assert _ids(store.list_jobs(user="alice", projects=["vision"])) == ["new"]
    finally:
        store.close()
