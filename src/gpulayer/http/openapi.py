"""The OpenAPI document of the HTTP API, built from the same types the
handlers decode with (msgspec generates their JSON Schema)."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from .. import __version__, defaults
from ..access import USER_PATTERN
from ..jobs import STATES, Instruction, JobInfo, LogChunk, TaskResult, TaskStarted, WorkerInfo
from ..projects import DEFAULT_PROJECT, PROJECT_PATTERN, ProjectInfo, ProjectUsage
from ..spec import Digest
from .auth import ID_LENGTH
from .schemas import (
    BlobList,
    HeartbeatRequest,
    LogBatch,
    ProjectQuotaRequest,
    ProjectRequest,
    RegisterRequest,
    RendezvousReport,
    SubmitRequest,
    TokenInfo,
    TokenRequest,
    TokenResponse,
    WaitReply,
    WaitRequest,
)

# What the handlers accept (app.py: _query_float, _query_int, _body; artifacts: digests).
INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}  # JSON bodies: integers fit in 64 bits
_TIMEOUT = {"type": "number", "minimum": 0, "maximum": 60}
_CURSOR = {"type": "integer", "minimum": 0, "maximum": 1 << 62}
_GEN = {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1}
_DIGEST = msgspec.json.schema(Digest)
_TOKEN_ID = {"type": "string", "pattern": f"^[0-9a-f]{{{ID_LENGTH}}}$"}
_PATH_PARAMS = {  # the others: any string
    "{digest}": _DIGEST,
    "{token_id}": _TOKEN_ID,
    # A project's: any but the implicit one's, which is reserved (422).
    "{name}": {"type": "string", "pattern": PROJECT_PATTERN, "not": {"const": DEFAULT_PROJECT}},
    "{user}": {"type": "string", "pattern": USER_PATTERN},
}
_MIB = 2**20

# (method, path, summary, request body type, response type, query parameters)
_Q = dict[str, tuple[dict[str, Any], str]]  # name -> (JSON Schema, description)
_ROUTES: list[tuple[str, str, str, Any, Any, _Q]] = [
    ("post", "/api/v1/jobs", "Submit a job (it is the token's user's)", SubmitRequest, JobInfo, {}),
    (
        "get",
        "/api/v1/jobs",
        "List jobs, newest first: a user token's user's, every job for an admin",
        None,
        list[JobInfo],
        {
            "state": (
                {"type": "array", "items": {"enum": list(STATES)}},
                "only jobs in these states (repeat the parameter)",
            ),
            "limit": (
                {"type": "integer", "minimum": 1, "maximum": defaults.LIST_JOBS_MAX},
                "at most this many (1-10000)",
            ),
        },
    ),
    (
        "post",
        "/api/v1/jobs/wait",
        "Long poll until one job is final or the timeout passes; the reply also "
        "brings those of the other jobs listed that are final by then (a job the "
        "token may not see is unknown, as one that does not exist)",
        WaitRequest,
        WaitReply,
        {"timeout": (_TIMEOUT, "seconds to wait, 0-60")},
    ),
    (
        "get",
        "/api/v1/jobs/{job_id}",
        "One job (by id or unique prefix among the token's user's jobs); another user's "
        "job is a 404, as one that does not exist",
        None,
        JobInfo,
        {},
    ),
    (
        "post",
        "/api/v1/jobs/{job_id}/wait",
        "Long poll until the job is final or the timeout passes",
        None,
        JobInfo,
        {"timeout": (_TIMEOUT, "seconds to wait, 0-60")},
    ),
    ("post", "/api/v1/jobs/{job_id}/cancel", "Cancel a job", None, JobInfo, {}),
    (
        "get",
        "/api/v1/jobs/{job_id}/logs",
        "Log lines after a cursor; long polls when timeout is given",
        None,
        LogChunk,
        {
            "attempt": (_CURSOR, "cursor: attempt"),
            "seq": (_CURSOR, "cursor: line number"),
            "timeout": (_TIMEOUT, "seconds to wait for new lines, 0-60"),
        },
    ),
    ("get", "/api/v1/workers", "List workers", None, list[WorkerInfo], {}),
    (
        "post",
        "/api/v1/workers",
        "Register (or re-attach) a worker",
        RegisterRequest,
        WorkerInfo,
        {},
    ),
    (
        "delete",
        "/api/v1/workers/{worker_id}",
        "Unregister a worker",
        None,
        None,
        {
            "died": (
                {"type": "integer", "minimum": 0, "maximum": 1},
                "1: the worker process died and its warden ended its tasks (the reason "
                "their jobs are given)",
            ),
            "gen": (
                _GEN,
                "the registration the goodbye is for (the X-GPUlayer-Generation header of the "
                "register reply); one registered since stays",
            ),
        },
    ),
    (
        "post",
        "/api/v1/workers/{worker_id}/heartbeat",
        "A worker is alive",
        HeartbeatRequest,
        None,
        {},
    ),
    (
        "post",
        "/api/v1/workers/{worker_id}/acquire",
        "Long poll for the worker's next instructions",
        None,
        list[Instruction],
        {
            "timeout": (_TIMEOUT, "seconds to wait, 0-60"),
            "ack": (
                _CURSOR,
                "number the deliveries: the worker got every instruction up to this one; "
                "later ones are sent again, and the X-GPUlayer-Seq header numbers the first",
            ),
            "gen": (
                _GEN,
                "the registration the numbers belong to (the X-GPUlayer-Generation header of "
                "the register reply); a poll of an earlier one gets nothing",
            ),
        },
    ),
    (
        "post",
        "/api/v1/tasks/started",
        f"A task's process started (at most {defaults.REPORT_MAX_BYTES // _MIB} MiB, as "
        "register, heartbeat and rendezvous)",
        TaskStarted,
        None,
        {},
    ),
    (
        "post",
        "/api/v1/tasks/logs",
        f"A batch of a task's log lines (at most {defaults.LOG_REPORT_MAX_BYTES // _MIB} MiB)",
        LogBatch,
        None,
        {},
    ),
    (
        "post",
        "/api/v1/tasks/rendezvous",
        "Node 0 of a distributed job reserved its master port",
        RendezvousReport,
        None,
        {},
    ),
    (
        "post",
        "/api/v1/tasks/finished",
        f"A task ended (at most {defaults.RESULT_REPORT_MAX_BYTES // _MIB} MiB); with take=1 "
        "the reply carries the worker's next "
        "instructions",
        TaskResult,
        list[Instruction],
        {
            "take": (
                {"type": "integer", "minimum": 0, "maximum": 1},
                "1: reply with what waits for the reporting worker, numbered as acquire's "
                "reply is (X-GPUlayer-Seq); else an empty list",
            ),
            "ack": (_CURSOR, "with take=1: as acquire's ack"),
            "gen": (_GEN, "with take=1: as acquire's gen"),
        },
    ),
    (
        "post",
        "/api/v1/blobs/missing",
        "Which of these blobs the server lacks",
        BlobList,
        BlobList,
        {},
    ),
    ("put", "/api/v1/blobs/{digest}", "Upload a blob (sha256 of its bytes)", bytes, None, {}),
    ("get", "/api/v1/blobs/{digest}", "Download a blob", None, bytes, {}),
    ("post", "/api/v1/tokens", "Create an API token (admin)", TokenRequest, TokenResponse, {}),
    (
        "get",
        "/api/v1/tokens",
        "List API tokens: id, role, user, name, creation time, never the token (admin)",
        None,
        list[TokenInfo],
        {},
    ),
    (
        "delete",
        "/api/v1/tokens/{token_id}",
        "Revoke an API token (admin); 409 for the last admin token that does not expire",
        None,
        None,
        {},
    ),
    (
        "post",
        "/api/v1/projects",
        "Create a project, with quotas of GPUs and CPU slots (null or absent: no limit); "
        "409 if one has that name (admin)",
        ProjectRequest,
        ProjectInfo,
        {},
    ),
    (
        "get",
        "/api/v1/projects",
        "List projects, oldest first, with their quotas and members (admin)",
        None,
        list[ProjectInfo],
        {},
    ),
    (
        "patch",
        "/api/v1/projects/{name}",
        "Change a project's quotas: a number, null for no limit; one left out stays "
        "(admin). It takes effect at the next placement; no running job is stopped",
        ProjectQuotaRequest,
        ProjectInfo,
        {},
    ),
    (
        "delete",
        "/api/v1/projects/{name}",
        "Delete a project; 409 while a job in it is queued or running (admin)",
        None,
        None,
        {},
    ),
    (
        "put",
        "/api/v1/projects/{name}/members/{user}",
        "Add a user to a project; one already in it stays (admin)",
        None,
        ProjectInfo,
        {},
    ),
    (
        "delete",
        "/api/v1/projects/{name}/members/{user}",
        "Take a user out of a project; 404 if not in it (admin)",
        None,
        ProjectInfo,
        {},
    ),
    (
        "get",
        "/api/v1/usage",
        "Usage by project: GPU-hours over the last day and week, jobs running and waiting, "
        "GPUs held, quotas (a user: their projects', and their own jobs in the default one)",
        None,
        list[ProjectUsage],
        {},
    ),
    ("get", "/healthz", "Liveness", None, None, {}),
]


def _bound_integers(schema: Any) -> None:
    """Declare the 64-bit range on every integer the document has no narrower range for."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            for key, bound in INT64.items():
                schema.setdefault(key, bound)
        for value in schema.values():
            _bound_integers(value)
    elif isinstance(schema, list):
        for value in schema:
            _bound_integers(value)


@cache
def document() -> dict[str, Any]:
    types = [
        t for _, _, _, body, resp, _ in _ROUTES for t in (body, resp) if t not in (None, bytes)
    ]
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    refs = iter(schemas)
    components["BlobList"]["properties"]["digests"]["items"] = _DIGEST
    # Who a token may act as, by role (auth.check_user): a user token needs
    # a user, a worker token has none.
    components["TokenRequest"]["allOf"] = [
        {
            "if": {"properties": {"role": {"const": role}}},
            "then": {"required": ["user"], "properties": {"user": {"type": "string"}}}
            if role == "user"
            else {"properties": {"user": {"type": "null"}}},
        }
        for role in ("user", "worker")
    ]
    components["ProjectRequest"]["properties"]["name"]["not"] = {"const": DEFAULT_PROJECT}
    for component in components.values():
        _bound_integers(component)
    paths: dict[str, dict[str, Any]] = {}
    error = {
        "description": "error",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}},
                    "required": ["error"],
                }
            }
        },
    }
    for method, path, summary, body, resp, query in _ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {}}
        params = [
            {
                "name": p.strip("{}"),
                "in": "path",
                "required": True,
                "schema": _PATH_PARAMS.get(p, {"type": "string"}),
            }
            for p in path.split("/")
            if p.startswith("{")
        ]
        params += [
            {"name": n, "in": "query", "required": False, "schema": t, "description": d}
            for n, (t, d) in query.items()
        ]
        if params:
            op["parameters"] = params
        if body is bytes:
            op["requestBody"] = {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        elif body is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": next(refs)}},
            }
        ok = (
            "201"
            if method in ("post", "put")
            and resp in (SubmitRequest, JobInfo, WorkerInfo, TokenResponse, ProjectInfo)
            and path in ("/api/v1/jobs", "/api/v1/workers", "/api/v1/tokens", "/api/v1/projects")
            else "200"
        )
        if resp is bytes:
            op["responses"][ok] = {
                "description": "the blob",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        elif resp is not None:
            op["responses"][ok] = {
                "description": "ok",
                "content": {"application/json": {"schema": next(refs)}},
            }
        else:
            op["responses"]["204" if path != "/healthz" else "200"] = {"description": "ok"}
        # 413: a JSON body over its endpoint's limit, refused unread. 503: the job
        # store failed (a full disk); nothing changed, send it again.
        for status in ("400", "401", "403", "404", "409", "413", "422", "503"):
            op["responses"][status] = error
        if path not in ("/healthz",):
            op["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "GPUlayer", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
