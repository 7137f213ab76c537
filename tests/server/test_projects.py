"""Projects as an admin manages them: the API in-process (every route, who
may, hostile bodies and names), then a real server (the command line, a
restart)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from gpulayer.artifacts import ArtifactStore
from gpulayer.errors import AccessDenied, GPUlayerError, InvalidStateError
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.http.openapi import document
from gpulayer.projects import MAX_QUOTA, ProjectInfo, ProjectNotFound
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore
from gpulayer.transport.http import HttpTransport
from server.conftest import ServerProc
from server.rawhttp import asgi_request

from helpers import PY, refuse_commits

V1 = "/api/v1/projects"
ADMIN_ONLY = "cannot do this (needs: admin)"


class Api:
    """The app of a plane on a fresh store, no server process: a request is
    a call (status, JSON body)."""

    def __init__(self, tmp_path: Path, *, auth_enabled: bool = True) -> None:
        self.store = SqliteStore(tmp_path / "db.sqlite")
        self.plane = ControlPlane(self.store, instance_id="s1")
        self.app = create_app(
            self.plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=auth_enabled
        )
        self.admin = auth.create_token(self.store, "admin")
        self.user = auth.create_token(self.store, "user", user="carol")
        self.worker = auth.create_token(self.store, "worker")

    def __call__(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        raw: bytes | None = None,
        token: str | None = "admin",
    ) -> tuple[int, Any]:
        sent = self.admin if token == "admin" else token
        status, _, answer = asyncio.run(
            asgi_request(self.app, method, path, body=body, raw=raw, token=sent)
        )
        return status, answer

    def listed(self) -> list[dict[str, Any]]:
        status, answer = self("GET", V1)
        assert status == 200, answer
        assert isinstance(answer, list)
        return answer

    def stored(self) -> list[ProjectInfo]:
        """What the store holds (the record) beside what the plane says."""
        return self.store.list_projects()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    made = Api(tmp_path)
    try:
        yield made
    finally:
        made.store.close()


def _view(answer: dict[str, Any]) -> tuple[str, Any, Any, list[str]]:
    return answer["name"], answer["gpus"], answer["slots"], answer["members"]


# ---- the API, in-process ----


def test_an_admin_makes_sets_fills_and_deletes_a_project(api: Api) -> None:
    status, made = api("POST", V1, {"name": "vision", "gpus": 8})
    assert status == 201, made
    assert set(made) == {"name", "gpus", "slots", "members", "created"}
    assert _view(made) == ("vision", 8, None, [])
    assert api("POST", V1, {"name": "nlp", "slots": 4})[0] == 201
    assert [_view(p) for p in api.listed()] == [
        ("vision", 8, None, []),
        ("nlp", None, 4, []),
    ]
    # A quota left out stays; null is no limit; {} changes nothing.
    status, changed = api("PATCH", f"{V1}/vision", {"slots": 2})
    assert (status, _view(changed)) == (200, ("vision", 8, 2, []))
    assert _view(api("PATCH", f"{V1}/vision", {"gpus": None})[1]) == ("vision", None, 2, [])
    assert _view(api("PATCH", f"{V1}/vision", {})[1]) == ("vision", None, 2, [])
    # Members, in the order added; adding one twice changes nothing.
    for user in ("bob", "alice@example.com", "bob"):
        status, filled = api("PUT", f"{V1}/vision/members/{user}")
        assert status == 200, filled
    assert filled["members"] == ["bob", "alice@example.com"]
    status, emptied = api("DELETE", f"{V1}/vision/members/bob")
    assert (status, emptied["members"]) == (200, ["alice@example.com"])
    status, again = api("DELETE", f"{V1}/vision/members/bob")
    assert (status, again) == (404, {"error": "user bob is not a member of project vision"})
    assert [(p.name, p.gpus, p.slots, p.members) for p in api.stored()] == [
        ("vision", None, 2, ["alice@example.com"]),
        ("nlp", None, 4, []),
    ]
    assert api("DELETE", f"{V1}/vision") == (204, None)
    assert [p["name"] for p in api.listed()] == ["nlp"]
    assert [p.name for p in api.stored()] == ["nlp"]


def test_a_project_named_twice_is_refused_unchanged(api: Api) -> None:
    assert api("POST", V1, {"name": "vision", "gpus": 8})[0] == 201
    status, answer = api("POST", V1, {"name": "vision", "gpus": 1})
    assert (status, answer) == (409, {"error": "project vision exists already"})
    assert [_view(p) for p in api.listed()] == [("vision", 8, None, [])]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PATCH", f"{V1}/nosuch", {"gpus": 1}),
        ("PATCH", f"{V1}/nosuch", {}),
        ("PUT", f"{V1}/nosuch/members/bob", None),
        ("DELETE", f"{V1}/nosuch/members/bob", None),
        ("DELETE", f"{V1}/nosuch", None),
    ],
)
def test_an_unknown_project_is_a_404_naming_it(
    api: Api, method: str, path: str, body: object
) -> None:
    status, answer = api(method, path, body)
    assert (status, answer) == (
        404,
        {"error": "no project nosuch on this server (see gpulayer project list)"},
    )
    assert api.listed() == [] and api.stored() == []


def test_a_project_with_a_job_waiting_is_not_deleted(api: Api) -> None:
    assert api("POST", V1, {"name": "vision"})[0] == 201
    spec = {"command": [PY, "-c", "pass"], "project": "vision"}
    status, job = asyncio.run(
        asgi_request(api.app, "POST", "/api/v1/jobs", body={"spec": spec}, token=api.admin)
    )[::2]
    assert status == 201, job
    assert job["state"] == "queued"  # no workers
    status, answer = api("DELETE", f"{V1}/vision")
    assert status == 409
    assert answer["error"] == (
        "project vision has 1 job that is not final (queued or running); cancel them, "
        "or wait for them to end, then delete it"
    )
    assert [p["name"] for p in api.listed()] == ["vision"]
    api.plane.cancel(job["id"])
    assert api("DELETE", f"{V1}/vision") == (204, None)
    assert api.listed() == []


@pytest.mark.parametrize("who", ["user", "worker"])
def test_only_an_admin_manages_projects(api: Api, who: str) -> None:
    assert api("POST", V1, {"name": "vision", "gpus": 8})[0] == 201
    assert api("PUT", f"{V1}/vision/members/carol")[0] == 200
    token = api.user if who == "user" else api.worker
    for method, path, body in [
        ("POST", V1, {"name": "mine"}),
        ("GET", V1, None),
        ("PATCH", f"{V1}/vision", {"gpus": None}),
        ("PUT", f"{V1}/vision/members/eve", None),
        ("DELETE", f"{V1}/vision/members/carol", None),
        ("DELETE", f"{V1}/vision", None),
    ]:
        status, answer = api(method, path, body, token=token)
        assert (status, answer) == (403, {"error": f"a {who} token cannot do this (needs: admin)"})
    for method, path in [("GET", V1), ("POST", V1), ("DELETE", f"{V1}/vision")]:
        status, answer = api(method, path, {"name": "x"}, token=None)  # no token at all
        assert status == 401, answer
    assert [_view(p) for p in api.listed()] == [("vision", 8, None, ["carol"])]


def test_without_auth_the_local_user_manages_projects(tmp_path: Path) -> None:
    """As with tokens: a server started with --no-auth has one user, an admin."""
    api = Api(tmp_path, auth_enabled=False)
    try:
        assert api("POST", V1, {"name": "vision"}, token=None)[0] == 201
        assert api("PUT", f"{V1}/vision/members/bob", token=None)[0] == 200
        assert [_view(p) for p in api.listed()] == [("vision", None, None, ["bob"])]
    finally:
        api.store.close()


_TOO_BIG = 10**20  # past 64 bits
HOSTILE_BODIES: list[tuple[bytes | object, int, str]] = [
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "not valid JSON"),
    ([], 422, "Expected `object`"),
    ({}, 422, "missing required field `name`"),
    ({"name": "vision", "extra": 1}, 422, "unknown field `extra`"),
    ({"name": "vision", "members": ["eve"]}, 422, "unknown field `members`"),
    ({"name": None}, 422, "$.name"),
    ({"name": 7}, 422, "$.name"),
    ({"name": "vision", "gpus": "8"}, 422, "$.gpus"),
    ({"name": "vision", "gpus": True}, 422, "got `bool` - at `$.gpus`"),
    ({"name": "vision", "gpus": 8.5}, 422, "$.gpus"),
    ({"name": "vision", "gpus": -1}, 422, "Expected `int` >= 0 - at `$.gpus`"),
    ({"name": "vision", "slots": MAX_QUOTA + 1}, 422, f"<= {MAX_QUOTA} - at `$.slots`"),
    ({"name": "vision", "gpus": _TOO_BIG}, 422, "$.gpus"),
    ({"name": "vision", "gpus": [8]}, 422, "$.gpus"),
    ({"name": "vision", "gpus": {"n": 8}}, 422, "$.gpus"),
    ({"name": "Vision"}, 422, "project name 'Vision' is not valid"),
    ({"name": ""}, 422, "project name '' is not valid"),
    ({"name": "a/b"}, 422, "project name 'a/b' is not valid"),
    ({"name": ".."}, 422, "project name '..' is not valid"),
    ({"name": "../etc"}, 422, "is not valid"),
    ({"name": "vision\n"}, 422, "project name 'vision\\n' is not valid"),
    ({"name": "vision "}, 422, "is not valid"),
    ({"name": "visi\u00f6n"}, 422, "is not valid"),
    ({"name": "v\u202eision"}, 422, "is not valid"),
    ({"name": "v\x00"}, 422, "is not valid"),
    ({"name": "9lives"}, 422, "starting with a letter"),
    ({"name": "a" * 41}, 422, "1 to 40 lower-case letters"),
    ({"name": "a" * 10_000}, 422, "...' is not valid"),
    ({"name": "default"}, 422, "project default is the implicit project"),
]


@pytest.mark.parametrize(("body", "status", "words"), HOSTILE_BODIES)
def test_a_hostile_create_is_refused_and_makes_nothing(
    api: Api, body: bytes | object, status: int, words: str
) -> None:
    raw = body if isinstance(body, bytes) else None
    got, answer = api("POST", V1, None if raw is not None else body, raw=raw)
    assert got == status, answer
    assert words in answer["error"], answer
    assert len(answer["error"]) < 400  # a 10 kB name is not echoed whole
    assert api.listed() == [] and api.stored() == []


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"gpus": -1}, "$.gpus"),
        ({"gpus": True}, "$.gpus"),
        ({"slots": "none"}, "$.slots"),
        ({"slots": 1.5}, "$.slots"),
        ({"gpus": _TOO_BIG}, "$.gpus"),
        ({"gpus": MAX_QUOTA + 1}, "$.gpus"),
        ({"gpus": 1, "name": "other"}, "unknown field `name`"),
        ({"members": []}, "unknown field `members`"),
        ([1], "Expected `object`"),
    ],
)
def test_a_hostile_quota_change_is_refused_and_changes_nothing(
    api: Api, body: object, words: str
) -> None:
    assert api("POST", V1, {"name": "vision", "gpus": 8, "slots": 2})[0] == 201
    status, answer = api("PATCH", f"{V1}/vision", body)
    assert status == 422, answer
    assert words in answer["error"], answer
    assert [_view(p) for p in api.listed()] == [("vision", 8, 2, [])]
    assert [(p.gpus, p.slots) for p in api.stored()] == [(8, 2)]


# Paths as the server gets them (ASGI's path is percent-decoded): a slash in a
# name makes another route, or none.
HOSTILE_PATHS: list[tuple[str, str, object, int]] = [
    ("PATCH", f"{V1}/..", {"gpus": 1}, 422),
    ("PATCH", f"{V1}/Vision", {"gpus": 1}, 422),
    ("PATCH", f"{V1}/visi\u00f6n", {"gpus": 1}, 422),
    ("PATCH", f"{V1}/{'v' * 10_000}", {"gpus": 1}, 422),
    ("PATCH", f"{V1}/vision/../nlp", {"gpus": 1}, 404),
    ("PATCH", f"{V1}/default", {"gpus": 1}, 422),
    ("DELETE", f"{V1}/default", None, 422),
    ("DELETE", f"{V1}/vision/", None, 404),
    ("DELETE", f"{V1}/vision%2Fx", None, 422),
    ("PUT", f"{V1}/default/members/bob", None, 422),
    ("PUT", f"{V1}/vision/members/..", None, 422),
    ("PUT", f"{V1}/vision/members/.bob", None, 422),
    ("PUT", f"{V1}/vision/members/bob\x00", None, 422),
    ("PUT", f"{V1}/vision/members/b\u00f6b", None, 422),
    ("PUT", f"{V1}/vision/members/bob smith", None, 422),
    ("PUT", f"{V1}/vision/members/{'b' * 10_000}", None, 422),
    ("PUT", f"{V1}/vision/members/a/b", None, 404),
    ("DELETE", f"{V1}/vision/members/..", None, 422),
    ("DELETE", f"{V1}/vision/members/*", None, 422),
    ("POST", f"{V1}/vision", {"name": "x"}, 405),
    ("PUT", f"{V1}/vision", None, 405),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), HOSTILE_PATHS)
def test_a_hostile_name_in_a_path_changes_nothing(
    api: Api, method: str, path: str, body: object, status: int
) -> None:
    assert api("POST", V1, {"name": "vision", "gpus": 8})[0] == 201
    assert api("POST", V1, {"name": "nlp", "gpus": 2})[0] == 201
    assert api("PUT", f"{V1}/vision/members/bob")[0] == 200
    got, answer = api(method, path, body)
    assert got == status, answer
    assert answer["error"] and len(answer["error"]) < 400
    assert [_view(p) for p in api.listed()] == [
        ("vision", 8, None, ["bob"]),
        ("nlp", 2, None, []),
    ]


def test_a_write_the_store_refuses_changes_nothing_in_memory(api: Api) -> None:
    """A 503 to send again; the plane's registry (what every look at a job
    asks) agrees with the store after, not with the request."""
    assert api("POST", V1, {"name": "vision"})[0] == 201
    refuse_commits(api.store, 2)
    status, answer = api("POST", V1, {"name": "nlp"})
    assert status == 503 and "nothing was changed, try again" in answer["error"], answer
    assert api("PUT", f"{V1}/vision/members/bob")[0] == 503
    assert [_view(p) for p in api.listed()] == [("vision", None, None, [])]
    assert [(p.name, p.members) for p in api.stored()] == [("vision", [])]
    assert api("PUT", f"{V1}/vision/members/bob")[0] == 200  # sent again, it goes through


def test_a_quota_change_asks_for_a_placement_pass_outside_the_lock(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A higher quota may let what waits run now: the plane places at once,
    not at the next submit or worker report."""
    passes: list[bool] = []
    monkeypatch.setattr(
        api.plane, "_quota_changed", lambda: passes.append(api.plane._lock.locked()), raising=False
    )
    assert api("POST", V1, {"name": "vision", "gpus": 1})[0] == 201
    assert passes == []
    assert api("PATCH", f"{V1}/vision", {"gpus": 2})[0] == 200
    assert passes == [False]
    assert api("PATCH", f"{V1}/vision", {})[0] == 200  # nothing changed: no pass
    assert api("PATCH", f"{V1}/vision", {"gpus": -1})[0] == 422
    assert api("PATCH", f"{V1}/nosuch", {"gpus": 1})[0] == 404
    assert passes == [False]


def test_the_plane_hands_out_copies_of_its_registry(api: Api) -> None:
    made = api.plane.create_project("vision", gpus=1)
    made.members.append("eve")
    made.gpus = 99
    api.plane.list_projects()[0].members.append("mallory")
    (info,) = api.plane.list_projects()
    assert (info.gpus, info.members) == (1, [])


def test_the_document_describes_the_routes() -> None:
    paths = document()["paths"]
    assert set(paths[V1]) == {"post", "get"}
    assert set(paths[f"{V1}/{{name}}"]) == {"patch", "delete"}
    assert set(paths[f"{V1}/{{name}}/members/{{user}}"]) == {"put", "delete"}
    assert "201" in paths[V1]["post"]["responses"]
    assert "204" in paths[f"{V1}/{{name}}"]["delete"]["responses"]
    name = paths[f"{V1}/{{name}}"]["patch"]["parameters"][0]["schema"]
    assert name["pattern"].startswith("^[a-z]") and name["not"] == {"const": "default"}
    quota = document()["components"]["schemas"]["ProjectQuotaRequest"]
    assert quota["required"] == [] and quota["additionalProperties"] is False


# ---- a real server ----


def _gl(
    server: ServerProc | None, *args: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``gpulayer project ARGS`` with the admin's token (or ``token``), in its
    environment rather than on the command line."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPULAYER_SERVER", "GPULAYER_TOKEN")}
    where = ["--server", server.url] if server else []
    if server is not None:
        env["GPULAYER_TOKEN"] = token or server.admin
    return subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", *where, "project", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_projects_from_the_command_line(server: ServerProc) -> None:
    made = _gl(server, "create", "vision", "--gpus", "8")
    assert made.returncode == 0, made.stderr
    assert made.stdout == "project vision: GPUs 8, slots none, no members (created)\n"
    assert _gl(server, "create", "nlp", "--slots", "4").returncode == 0
    added = _gl(server, "add-user", "vision", "alice")
    assert added.stdout == "project vision: GPUs 8, slots none, alice\n", added.stderr
    assert _gl(server, "add-user", "vision", "bob").returncode == 0
    changed = _gl(server, "set", "vision", "--slots", "2")  # the GPU quota stays
    assert changed.stdout == "project vision: GPUs 8, slots 2, alice, bob\n", changed.stderr
    changed = _gl(server, "set", "vision", "--gpus", "none")
    assert changed.stdout == "project vision: GPUs none, slots 2, alice, bob\n", changed.stderr

    listed = _gl(server, "list")  # piped: tab-separated, nothing cut
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [
        "NAME\tGPUS\tSLOTS\tMEMBERS",
        "vision\tnone\t2\talice, bob",
        "nlp\tnone\t4\t-",
    ]
    as_json = json.loads(_gl(server, "list", "--json").stdout)
    assert [{k: v for k, v in p.items() if k != "created"} for p in as_json] == [
        {"schema": 1, "name": "vision", "gpus": None, "slots": 2, "members": ["alice", "bob"]},
        {"schema": 1, "name": "nlp", "gpus": None, "slots": 4, "members": []},
    ]
    assert all(isinstance(p["created"], float) for p in as_json)

    removed = _gl(server, "remove-user", "vision", "alice")
    assert removed.stdout == "project vision: GPUs none, slots 2, bob\n", removed.stderr
    deleted = _gl(server, "delete", "nlp")
    assert (deleted.returncode, deleted.stdout) == (0, "project nlp deleted\n")

    # What is refused says why, and changes nothing.
    for args, words in [
        (["create", "vision"], "project vision exists already"),
        (["delete", "nlp"], "no project nlp on this server"),
        (["set", "nosuch", "--gpus", "1"], "no project nosuch on this server"),
        (["remove-user", "vision", "alice"], "user alice is not a member of project vision"),
        (["add-user", "default", "bob"], "project default is the implicit project"),
        (["create", "Bad/Name"], "project name 'Bad/Name' is not valid"),
        (["add-user", "vision", "../x"], "user name '../x' is not valid"),
    ]:
        refused = _gl(server, *args)
        assert refused.returncode == 2, (args, refused.stdout)
        assert "gpulayer: error: " in refused.stderr and words in refused.stderr, refused.stderr
    for args, words in [
        (["set", "vision"], "give --gpus N, --slots N or both"),
        (["set", "vision", "--gpus", "lots"], "'lots' is not a quota"),
        (["set", "vision", "--gpus", "-1"], "a quota of gpus must be a whole number"),
        (["create", "big", "--slots", str(MAX_QUOTA + 1)], "a quota of slots must be"),
    ]:
        refused = _gl(server, *args)
        assert refused.returncode == 2 and words in refused.stderr, (args, refused.stderr)
    denied = _gl(server, "list", token=server.token("user", "carol"))
    assert denied.returncode == 2
    assert f"a user token {ADMIN_ONLY}" in denied.stderr
    assert _gl(server, "list").stdout.splitlines()[1:] == ["vision\tnone\t2\tbob"]


@pytest.mark.parametrize("args", [["list"], ["create", "vision"], ["delete", "vision"]])
def test_project_commands_need_a_server(args: list[str]) -> None:
    done = _gl(None, *args)
    assert done.returncode == 2
    assert "projects belong to a server: --server URL or GPULAYER_SERVER" in done.stderr


def test_a_restarted_server_keeps_its_projects(server: ServerProc) -> None:
    with closing(HttpTransport(server.url, token=server.admin)) as admin:
        admin.create_project("vision", gpus=8, slots=3)
        admin.create_project("nlp")
        for user in ("bob", "alice"):
            admin.add_project_member("vision", user)
        admin.add_project_member("nlp", "alice")
        admin.set_project_quota("nlp", slots=1)
        before = admin.list_projects()
    server.kill()  # SIGKILL: nothing is saved on the way out
    server.start()
    with closing(HttpTransport(server.url, token=server.admin)) as admin:
        after = admin.list_projects()
        assert after == before
        assert [(p.name, p.gpus, p.slots, p.members) for p in after] == [
            ("vision", 8, 3, ["bob", "alice"]),
            ("nlp", None, 1, ["alice"]),
        ]
        # The registry in memory came back too: it answers as before.
        with pytest.raises(InvalidStateError, match="exists already"):
            admin.create_project("vision")
        with pytest.raises(ProjectNotFound, match="not a member of project nlp"):
            admin.remove_project_member("nlp", "bob")
        admin.delete_project("nlp")
        with pytest.raises(ProjectNotFound, match="no project nlp"):
            admin.set_project_quota("nlp", gpus=1)
        # A name that would reach another route is never sent (/projects/a%2Fb).
        with pytest.raises(GPUlayerError, match="project name 'a/b' is not valid"):
            admin.set_project_quota("a/b", gpus=1)
    user = HttpTransport(server.url, token=server.token("user", "carol"))
    with closing(user), pytest.raises(AccessDenied, match=re.escape(f"a user token {ADMIN_ONLY}")):
        user.list_projects()
