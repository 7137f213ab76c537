"""Fuzz the HTTP API from its own OpenAPI document (schemathesis), against a real server.

Every operation the document lists gets a bounded number of generated
requests, schema-valid ones and malformed ones, sent with the admin token to
a real server process. What is checked, per response:

- ``not_a_server_error``: never a 5xx, whatever was sent;
- ``status_code_conformance``, ``content_type_conformance``,
  ``response_schema_conformance``: the answer is one the document lists,
  with the documented body (the JSON error body included);
- ``negative_data_rejection``: a request the document says is malformed gets
  a 4xx, never a 2xx;
- ``positive_data_acceptance``: a request the document says is valid is not
  refused as malformed (400/422) -- except where the API validates more
  than JSON Schema can say (see ``SEMANTIC``);
- ``ignored_auth``: an operation that succeeded with the token refuses the
  same request without one;
- ``error_names_the_problem`` (ours): a 4xx comes with a JSON ``error``
  message, never an empty or plain-text body.

Long polls answer at once here: a valid ``timeout`` is cut to a few
milliseconds before the request is sent (``_short_polls``), so the fuzz
exercises them without waiting out generated timeouts of up to a minute.

The hand-written cases at the end name the malformed requests of the
issue one by one and check that the message names the problem.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import CheckContext

from server.conftest import ServerProc
from server.rawhttp import request

MAX_EXAMPLES = 25  # per operation and generation mode; CI-sized
POLL_CAP_S = 0.005  # long polls wait at most this long during the fuzz

# Operations whose request is checked beyond what JSON Schema can say, so a
# schema-valid one may be refused with a 4xx naming the problem: POST /jobs
# validates the job spec (exactly one of command/script, relative paths inside
# the workspace, environment variable names, single-node only, ...); a blob
# upload must hash to the digest in its path.
SEMANTIC = {"POST /api/v1/jobs", "PUT /api/v1/blobs/{digest}"}
# They take a timeout (0-60 s) and, on a worker or job the fuzz made, wait it out.
LONG_POLLS = {
    "POST /api/v1/jobs/{job_id}/wait",
    "POST /api/v1/jobs/wait",
    "GET /api/v1/jobs/{job_id}/logs",
    "POST /api/v1/workers/{worker_id}/acquire",
}
# Nothing to make malformed: no parameters, no body, no token.
UNMALFORMABLE = {"GET /healthz"}

_CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "ignored_auth",
]


def error_names_the_problem(ctx: CheckContext, response: schemathesis.Response, case: Any) -> None:
    """A 4xx carries a JSON body whose ``error`` is a non-empty message."""
    if not 400 <= response.status_code < 500:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} without a JSON error body: {response.content[:200]!r}"
        ) from None
    message = body.get("error") if isinstance(body, dict) else None
    assert isinstance(message, str) and message.strip(), (
        f"{response.status_code} without an error message: {body!r}"
    )


def _short_polls(case: schemathesis.Case) -> None:
    """Make a long poll answer within POLL_CAP_S: a timeout the server would honour is
    cut to it, a missing one (the server's default is 30 s) set to it; invalid ones stay."""
    if case.operation.label not in LONG_POLLS:
        return
    if case.query is None:
        case.query = {}
    raw = case.query.setdefault("timeout", POLL_CAP_S)
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        return
    try:
        value = float(raw)
    except ValueError:
        return
    if math.isfinite(value) and 0 < value <= 60:
        case.query["timeout"] = min(value, POLL_CAP_S)


# Headers that frame the message rather than carry API data: a generated value
# for one makes the request invalid HTTP, which the HTTP layer (uvicorn's parser)
# refuses with its own plain-text 400 before the API sees anything.
_FRAMING = {"transfer-encoding", "content-length", "host", "connection", "expect", "upgrade"}
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _valid_http(case: schemathesis.Case) -> None:
    """Drop generated headers that no HTTP/1.1 request can carry (a name that is
    not a token, or a framing header): the fuzz is of the API, not of HTTP."""
    if case.headers:
        for name in list(case.headers):
            if name.lower() in _FRAMING or not _TOKEN.fullmatch(name):
                del case.headers[name]


def _checks(label: str) -> list[Any]:
    names = _CHECKS if label in SEMANTIC else [*_CHECKS, "positive_data_acceptance"]
    return [getattr(schemathesis.checks, n) for n in names] + [error_names_the_problem]


def _fuzz(
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    session: requests.Session,
) -> None:
    checks = _checks(operation.label)

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        _short_polls(case)
        _valid_http(case)
        case.call_and_validate(session=session, checks=checks, timeout=10)

    fuzz()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_fuzz(server: ServerProc, mode: GenerationMode) -> None:
    # The token goes in through the document's security scheme, not as a fixed
    # header: a malformed case that leaves the token out is then sent without it.
    config = schemathesis.Config.from_dict(
        {"auth": {"openapi": {"bearer": {"bearer": server.admin}}}}
    )
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config, timeout=10)
    failures: list[str] = []
    labels = []
    started = time.monotonic()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            labels.append(operation.label)
            if mode is GenerationMode.NEGATIVE and operation.label in UNMALFORMABLE:
                continue
            try:
                _fuzz(operation, mode, session)
            except (Exception, BaseExceptionGroup) as exc:  # fuzz every one; report all
                failures.append(f"{operation.label} ({mode.value}):\n{exc}")
    assert len(labels) == 30, labels
    assert not failures, "\n\n".join(failures)
    assert time.monotonic() - started < 60


_BIG = 10**20  # past 64 bits
_SPEC = {"command": ["true"]}
# (method, path, body, expected status, words the error message must contain)
MALFORMED: list[tuple[str, str, object, int, list[str]]] = [
    ("POST", "/api/v1/jobs", b"{not json", 400, ["not valid JSON"]),
    ("POST", "/api/v1/jobs", [], 422, ["Expected `object`"]),
    ("POST", "/api/v1/jobs", {"spec": {"command": "true"}}, 422, ["$.spec.command"]),
    ("POST", "/api/v1/jobs", {"spec": _SPEC, "extra": 1}, 422, ["extra"]),
    ("POST", "/api/v1/jobs", {"spec": {}}, 422, ["script or a command"]),
    ("POST", "/api/v1/jobs", {"spec": {**_SPEC, "priority": _BIG}}, 422, ["$.spec.priority"]),
    ("POST", "/api/v1/jobs", {"spec": {**_SPEC, "gpus": -1}}, 422, ["$.spec.gpus"]),
    ("GET", "/api/v1/jobs?state=bogus", None, 422, ["unknown state 'bogus'"]),
    ("GET", "/api/v1/jobs?limit=0", None, 422, ["limit", "between 1 and 1000"]),
    ("GET", "/api/v1/jobs?limt=5", None, 422, ["unknown query parameter 'limt'"]),
    ("GET", "/api/v1/jobs/nosuchjob", None, 404, ["nosuchjob"]),
    ("POST", "/api/v1/workers/w/acquire?timeout=soon", None, 422, ["timeout", "'soon'"]),
    ("POST", "/api/v1/workers/w/acquire?timeout=61", None, 422, ["between 0 and 60"]),
    ("POST", "/api/v1/workers/w/acquire?timeout=0", None, 409, ["worker w is not registered"]),
    ("POST", "/api/v1/workers/w/heartbeat", {"running": 1}, 422, ["$.running"]),
    (
        "POST",
        "/api/v1/tasks/logs",
        {"job_id": "j", "attempt": _BIG, "lines": []},
        422,
        ["out of range", "$.attempt"],
    ),
    ("POST", "/api/v1/tasks/started", {"job_id": "j", "attempt": 1.5}, 422, ["$.attempt"]),
    ("POST", "/api/v1/blobs/missing", {"digests": ["abc"]}, 400, ["digest 'abc'"]),
    ("GET", "/api/v1/blobs/abc", None, 400, ["invalid artifact digest 'abc'"]),
    ("GET", f"/api/v1/blobs/{'0' * 64}", None, 404, ["no blob"]),
    ("POST", "/api/v1/tokens", {"role": "root"}, 422, ["$.role"]),
    ("OPTIONS", "/api/v1/jobs", None, 405, ["OPTIONS is not allowed on /api/v1/jobs"]),
    ("DELETE", "/api/v1/jobs/x", None, 405, ["DELETE is not allowed"]),
    ("GET", "/api/v2/jobs", None, 404, ["no endpoint at /api/v2/jobs"]),
]


def test_malformed_requests_get_4xx_naming_the_problem(server: ServerProc) -> None:
    wrong = []
    for method, path, body, status, words in MALFORMED:
        raw = body if isinstance(body, bytes) else None
        got, answer, _ = request(server, method, path, None if raw else body, raw=raw)
        message = answer.get("error", "")
        if got != status or not all(word in message for word in words):
            wrong.append(f"{method} {path} {body!r}: {got} {answer!r}, wanted {status} {words}")
    assert not wrong, "\n".join(wrong)


def test_no_token_401_and_wrong_method_lists_allowed_ones(server: ServerProc) -> None:
    status, answer, _ = request(server, "GET", "/api/v1/jobs", token=None)
    assert (status, answer["error"].startswith("this endpoint needs a token")) == (401, True)
    status, answer, _ = request(server, "GET", "/api/v1/jobs", token="glt_u_forged")
    assert (status, answer) == (401, {"error": "the token is not valid on this server"})
    # One route per path: 405's Allow names every method of the path, not one route's.
    for path, methods in [
        ("/api/v1/jobs", {"GET", "HEAD", "POST"}),
        ("/api/v1/workers", {"GET", "HEAD", "POST"}),
        (f"/api/v1/blobs/{'0' * 64}", {"GET", "HEAD", "PUT"}),
    ]:
        status, answer, headers = request(server, "PATCH", path)
        assert status == 405, answer
        assert set(headers["allow"].replace(" ", "").split(",")) == methods, headers
        assert answer["error"].startswith(f"PATCH is not allowed on {path}")


def test_whole_floats_are_integers(server: ServerProc) -> None:
    """JSON Schema (and so the document) counts 2.0 as an integer: so does the server."""
    report = {"job_id": "j", "attempt": 1.0, "worker_id": "w", "outcome": "exited"}
    report["exit_code"] = 0.0
    assert request(server, "POST", "/api/v1/tasks/finished", report)[0] == 200
    report["exit_code"] = 0.5
    status, answer, _ = request(server, "POST", "/api/v1/tasks/finished", report)
    assert status == 422 and "$.exit_code" in answer["error"], answer


def test_reregistering_with_fewer_slots_keeps_scheduling(server: ServerProc) -> None:
    def register(slots: int) -> int:
        worker = {"id": "w-fixed", "name": "w", "host": "h", "slot_gpus": [None] * slots}
        return request(server, "POST", "/api/v1/workers", {"worker": worker})[0]

    assert register(3) == 201
    assert register(1) == 201  # the same worker, back with one slot
    status, body, _ = request(server, "POST", "/api/v1/jobs", {"spec": {"command": ["true"]}})
    assert status == 201, (status, body)
