"""Request and response bodies of the HTTP API that are not records already."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .. import defaults
from ..access import USER_PATTERN
from ..jobs import MAX_TELEMETRY_GPUS, GpuStats, JobInfo, LogLine, WorkerInfo
from ..projects import MAX_QUOTA, PROJECT_PATTERN
from ..spec import JobSpec


class SubmitRequest(msgspec.Struct, forbid_unknown_fields=True):
    spec: JobSpec
    # Made by the client so that a submit retried after a lost reply is not
    # stored twice: the same id and spec return the job already stored.
    id: str | None = None


class WaitRequest(msgspec.Struct, forbid_unknown_fields=True):
    id: str  # the job to wait for (its full id or a unique prefix)
    # Other jobs the caller waits on (full ids): those final by the reply
    # come with it, so a client waiting on a batch asks once per batch of
    # ends rather than once per job.
    also: Annotated[list[str], msgspec.Meta(max_length=1000)] = []


class WaitReply(msgspec.Struct):
    job: JobInfo  # final, or as it is when the timeout passed
    also: list[JobInfo]  # those of the request's ``also`` that are final
    # Those of ``also`` that name no job (from another server, say): hints
    # that were wrong, not an error of the wait.
    unknown: list[str] = []


class BlobList(msgspec.Struct, forbid_unknown_fields=True):
    digests: Annotated[list[str], msgspec.Meta(max_length=defaults.MISSING_BLOBS_PER_REQUEST)]


class RegisterRequest(msgspec.Struct, forbid_unknown_fields=True):
    worker: WorkerInfo
    running: list[tuple[str, int]] = []  # (job id, attempt) a returning worker still runs
    # A new worker process taking the id of one that died: what that one took
    # may have run, even where the server cannot know it took it.
    adopted: bool = False


class HeartbeatRequest(msgspec.Struct, forbid_unknown_fields=True):
    running: list[tuple[str, int]] = []
    stopping: bool = False  # the worker is stopping: place nothing more on it
    # Its GPUs' latest figures (see worker/telemetry.py); left out when it has none.
    gpus: Annotated[list[GpuStats], msgspec.Meta(max_length=MAX_TELEMETRY_GPUS)] = []


class LogBatch(msgspec.Struct, forbid_unknown_fields=True):
    job_id: str
    attempt: int
    lines: list[LogLine]
    node: Annotated[int, msgspec.Meta(ge=0)] = 0


class RendezvousReport(msgspec.Struct, forbid_unknown_fields=True):
    job_id: str
    attempt: int
    worker_id: str
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]


class TokenRequest(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["admin", "user", "worker"]
    name: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # The user it acts as: needed for a user token, refused for a worker
    # token (see auth.check_user). Checked there, to say what is wrong.
    user: (
        Annotated[str, msgspec.Meta(max_length=256, extra_json_schema={"pattern": USER_PATTERN})]
        | None
    ) = None
    # Seconds from now until it is refused (None: never); at most ten years.
    expires_in: Annotated[float, msgspec.Meta(gt=0, le=10 * 365 * 86400)] | None = None


# A quota as a body gives it: a whole number of GPUs or slots, or null for no limit.
Quota = Annotated[int, msgspec.Meta(ge=0, le=MAX_QUOTA)] | None


class ProjectRequest(msgspec.Struct, forbid_unknown_fields=True):
    # Checked by projects.check_project_name, to say what is wrong in words.
    name: Annotated[str, msgspec.Meta(extra_json_schema={"pattern": PROJECT_PATTERN})]
    gpus: Quota = None
    slots: Quota = None


class ProjectQuotaRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A quota left out stays as it is; null: no limit."""

    gpus: Quota | msgspec.UnsetType = msgspec.UNSET
    slots: Quota | msgspec.UnsetType = msgspec.UNSET


class TokenResponse(msgspec.Struct):
    token: str
    role: str
    expires: float | None = None  # seconds since the epoch; None: never
    user: str | None = None  # the user it acts as


class TokenInfo(msgspec.Struct, kw_only=True):
    """A token as the server shows it: never the token, nor anything it can be
    recovered from."""

    id: str  # the start of its sha256 (see auth.py)
    role: str
    name: str | None
    created: float  # seconds since the epoch
    user: str | None = None  # the user it acts as (see auth.py)
    expires: float | None = None  # seconds since the epoch; None: never
