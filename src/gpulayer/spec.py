"""The job spec: what a user submits, validated before anything is stored.

A spec arrives as keyword arguments (Python), flags (CLI), YAML or JSON (HTTP).
All of them go through :func:`parse_spec`, which either returns a
:class:`JobSpec` or raises :class:`~gpulayer.errors.SpecError` naming the field
and the reason. Paths in a spec are already resolved to artifacts: the client
packs the source directory and inputs first (see ``client.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from .errors import GPUlayerError, SpecError
from .ids import check_id_or_prefix

Digest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
LAUNCHERS = ("direct", "torchrun")
MAX_NODES = 1024
MAX_PROCS_PER_NODE = 256
# Sizes a spec may not pass, so that no job record (stored, listed, sent to
# every worker that runs it) can take a server's memory. Each is far above
# any real job's, and within what the kernel itself allows a process.
MAX_NAME_CHARS = 256  # a job's name
MAX_ARGV_ITEMS = 4096  # command and args together
MAX_ARG_BYTES = 128 * 1024  # one argument or env value: Linux's MAX_ARG_STRLEN
# command, args and env together: well under the 2 MiB that execve() takes
# with the default 8 MiB stack, leaving room for the worker's own variables.
MAX_LAUNCH_BYTES = 256 * 1024
# The whole spec as JSON: a bound on what one job costs to store, to keep in
# memory while it is queued or lately finished, and to list (at most 1,000 a
# listing). A real job's is a few KiB.
MAX_SPEC_BYTES = 256 * 1024
MAX_ENV_ITEMS = 1024
MAX_PATH_CHARS = 4096  # a script or output path: PATH_MAX
MAX_OUTPUTS = 1024
MAX_DEPENDENCIES = 100  # jobs in after and after_any together
MAX_INPUTS = 1024
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 63
MAX_LABEL_VALUE_CHARS = 256
# A timeout past this (a year) is a mistake, not a job: refused at submit.
MAX_TIMEOUT_S = 366 * 24 * 3600.0
# A retry's first wait past this (a day) is a mistake, not a back-off.
MAX_RETRY_DELAY_S = 24 * 3600.0

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What every record handed out shows in place of a secret's value.
REDACTED = "<redacted>"


class ArrayTask(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which array a job is a task of, and its index there (arrays.py). Set
    by the control plane on each task; never in a spec submitted."""

    array: str
    index: NonNegInt


class ArtifactRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A stored file or directory tree: its digest (blob or manifest) and size."""

    kind: Literal["file", "dir"]
    digest: Digest
    size: NonNegInt = 0


class JobSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What to run, with what, and how.

    Exactly one of ``command`` (any argv) or ``script`` (a Python file inside
    the bundle, run with the worker's interpreter) is set.
    """

    command: list[str] | None = None
    script: str | None = None
    args: list[str] = []
    bundle: Digest | None = None
    inputs: dict[str, ArtifactRef] = {}
    outputs: list[str] = []
    env: dict[str, str] = {}
    # Environment variables whose values are never shown back: sealed at
    # rest, "<redacted>" in every record handed out (see secretbox.py).
    secrets: dict[str, str] = {}
    gpus: NonNegInt = 0
    nodes: PosInt = 1
    procs_per_node: PosInt = 1
    launcher: Literal["direct", "torchrun"] | None = None
    priority: int = 0
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0
    # Seconds before the first retry, doubled at each next one; None: the
    # default back-off (defaults.RETRY_DELAY_S, up to RETRY_DELAY_MAX_S);
    # 0: retry at once. Left out of the JSON when None (omit_defaults), so
    # a spec without it reads and compares as before it existed.
    retry_delay: Annotated[float, msgspec.Meta(ge=0)] | None = None
    timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    name: str | None = None
    labels: dict[str, str] = {}
    # False: start cold, never forked from the worker's ready interpreter
    # (see worker/warm/). Left out of the JSON when True (omit_defaults).
    warm: bool = True
    # It may be stopped (SIGTERM, the worker's kill grace, SIGKILL) to make
    # room for a job of higher priority, and queued again without using a
    # retry; it gets GPULAYER_PREEMPT_NOTICE (the grace, in seconds).
    preemptible: bool = False
    # Jobs it waits for (ids, or their starts; stored as full ids): to
    # succeed (``after``), or to end whatever way (``after_any``). It is
    # cancelled, saying why, once one of ``after`` can no longer succeed.
    after: list[str] = []
    after_any: list[str] = []
    # The project it is submitted into (projects.py); None: its user's
    # first. The control plane stores the one it chose. Left out of the
    # JSON when None, so a spec without it reads and compares as before.
    project: str | None = None
    # An array (a sweep, arrays.py): one task per index, each a job that
    # reads its index as GPULAYER_ARRAY_INDEX; at most ``max_parallel`` of
    # them running at once (None: as many as fit).
    array: list[NonNegInt] = []
    max_parallel: PosInt | None = None
    # On each task of an array: set by the control plane, refused in a submit.
    array_task: ArrayTask | None = None

    def __repr__(self) -> str:
        # Never a secret's value: not in a traceback, a log line or a test's diff.
        return msgspec.Struct.__repr__(redact(self))

    def __rich_repr__(self) -> Any:
        yield from msgspec.Struct.__rich_repr__(redact(self))

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def distributed(self) -> bool:
        """Whether its ranks are wired up (rank variables, a master port)."""
        return self.world_size > 1 or self.launcher == "torchrun"


_CHOICES = {"launcher": LAUNCHERS}
_encode = msgspec.json.Encoder().encode


def parse_spec(data: Mapping[str, Any] | JobSpec) -> JobSpec:
    """Validate ``data`` into a :class:`JobSpec`, or raise ``SpecError``."""
    if isinstance(data, JobSpec):
        spec = data
    else:
        try:
            spec = msgspec.convert(dict(data), JobSpec, strict=True)
        except UnicodeError:  # msgspec cannot even say where: look for it
            from .spec_errors import unencodable_field

            raise SpecError(
                unencodable_field(data), "holds text that is not valid Unicode (a lone surrogate)"
            ) from None
        except msgspec.ValidationError as exc:
            from .spec_errors import plain_spec_error

            raise plain_spec_error(
                str(exc),
                data,
                fields=JobSpec.__struct_fields__,
                choices={**_CHOICES, "kind": ("file", "dir")},
            ) from None
    check_spec(spec)
    return spec


def check_spec(spec: JobSpec) -> None:
    """The rules a type cannot express; raises ``SpecError``."""
    if (spec.command is None) == (spec.script is None):
        raise SpecError("command", "give exactly one of a script or a command")
    if spec.command is not None and (not spec.command or not spec.command[0]):
        raise SpecError("command", "must name a program to run, got an empty command")
    if spec.script is not None:
        check_relative_path("script", spec.script)
        if spec.bundle is None:
            raise SpecError("bundle", "a script job needs the bundle holding its script")
    for index, path in enumerate(spec.outputs):
        check_relative_path(f"outputs[{index}]", path)
    for name in spec.inputs:
        check_input_name(name)
    for key in spec.env:
        if not _ENV_RE.match(key):
            raise SpecError(f"env.{key}", "not a valid environment variable name")
    check_secrets(spec)
    if spec.name is not None and not spec.name.strip():
        raise SpecError("name", "must not be blank")
    if len(spec.after) + len(spec.after_any) > MAX_DEPENDENCIES:
        raise SpecError(
            "after"
            if len(spec.after) > MAX_DEPENDENCIES
            else "after_any"
            if len(spec.after_any) > MAX_DEPENDENCIES
            else "after and after_any",
            f"at most {MAX_DEPENDENCIES} jobs to wait for, got "
            f"{len(spec.after) + len(spec.after_any)}",
        )
    for field, ids in (("after", spec.after), ("after_any", spec.after_any)):
        for index, job_id in enumerate(ids):
            check_id_or_prefix(f"{field}[{index}]", job_id)
    if spec.array or spec.max_parallel is not None:
        from .arrays import check_array

        check_array(spec.array, spec.max_parallel)
    if spec.project is not None:
        from .projects import check_project_name

        try:
            check_project_name(spec.project)
        except GPUlayerError as exc:
            raise SpecError("project", str(exc)) from None
    _check_sizes(spec)
    if spec.nodes > MAX_NODES:
        raise SpecError("nodes", f"at most {MAX_NODES} nodes, got {spec.nodes}")
    if spec.procs_per_node > MAX_PROCS_PER_NODE:
        raise SpecError(
            "procs_per_node", f"at most {MAX_PROCS_PER_NODE} per node, got {spec.procs_per_node}"
        )
    if 0 < spec.gpus < spec.procs_per_node:
        raise SpecError(
            "procs_per_node",
            f"{spec.procs_per_node} ranks per node cannot each have a GPU of the {spec.gpus} "
            "asked for (gpus is per node); ask for gpus >= procs_per_node, or gpus=0 for CPU ranks",
        )


def _check_sizes(spec: JobSpec) -> None:
    """Every string and collection of a spec within its limit (see the MAX_ constants)."""
    if spec.name is not None:
        _at_most("name", len(spec.name), MAX_NAME_CHARS, "characters")
        _text_bytes("name", spec.name)
    argv = [*(spec.command or []), *spec.args]
    _at_most("args", len(argv), MAX_ARGV_ITEMS, "items in command and args together")
    launch = 0
    for field, items in (("command", spec.command or []), ("args", spec.args)):
        for index, arg in enumerate(items):
            size = _text_bytes(f"{field}[{index}]", arg)
            _at_most(f"{field}[{index}]", size, MAX_ARG_BYTES, "bytes")
            launch += size + 1
    _at_most("env", len(spec.env), MAX_ENV_ITEMS, "variables")
    for key, value in spec.env.items():
        size = _text_bytes(f"env.{key[:64]}", value)
        _at_most(f"env.{key[:64]}", size, MAX_ARG_BYTES, "bytes")
        launch += len(key) + size + 2
    _at_most("env", launch, MAX_LAUNCH_BYTES, "bytes of command, args and env together")
    if spec.script is not None:
        _at_most("script", len(spec.script), MAX_PATH_CHARS, "characters")
        _text_bytes("script", spec.script)
    _at_most("outputs", len(spec.outputs), MAX_OUTPUTS, "entries")
    for index, path in enumerate(spec.outputs):
        _at_most(f"outputs[{index}]", len(path), MAX_PATH_CHARS, "characters")
        _text_bytes(f"outputs[{index}]", path)
    _at_most("inputs", len(spec.inputs), MAX_INPUTS, "entries")
    _at_most("labels", len(spec.labels), MAX_LABELS, "entries")
    for key, value in spec.labels.items():
        if not key:
            raise SpecError("labels", "a label's key must not be empty")
        _at_most(f"labels.{key[:64]}", len(key), MAX_LABEL_KEY_CHARS, "characters in its key")
        _at_most(f"labels.{key[:64]}", len(value), MAX_LABEL_VALUE_CHARS, "characters in its value")
        _text_bytes(f"labels.{key[:64]}", key + value)
    size = len(_encode(spec))
    _at_most("spec", size, MAX_SPEC_BYTES, "bytes of JSON for the whole spec")
    if spec.retry_delay is not None and not spec.retry_delay <= MAX_RETRY_DELAY_S:
        raise SpecError(
            "retry_delay",
            f"at most {MAX_RETRY_DELAY_S:.0f} s (a day) before the first retry, got "
            f"{spec.retry_delay:g}; leave it out for the default back-off",
        )
    if spec.timeout is not None and not spec.timeout <= MAX_TIMEOUT_S:
        raise SpecError(
            "timeout",
            f"at most {MAX_TIMEOUT_S:.0f} s (366 days), got {spec.timeout:g}; "
            "leave it out for no timeout",
        )


def _text_bytes(field: str, value: str) -> int:
    """The length of ``value`` in UTF-8; a SpecError naming ``field`` (never
    the value: it may be a secret) for text a process cannot be given."""
    if "\x00" in value:
        raise SpecError(
            field, "holds a NUL character, which no program's arguments or environment can"
        )
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise SpecError(
            field, "is not valid UTF-8 text (a lone surrogate: bytes that were not UTF-8)"
        ) from None


def _at_most(field: str, size: int, limit: int, unit: str) -> None:
    if size > limit:
        raise SpecError(field, f"at most {limit:,} {unit}, got {size:,}")


def check_secrets(spec: JobSpec) -> None:
    """Secret names are environment variable names of their own, and secrets
    count in the limits of the environment they join; never says a value."""
    if not spec.secrets:
        return
    count = len(spec.env) + len(spec.secrets)
    _at_most("secrets", count, MAX_ENV_ITEMS, "variables in env and secrets together")
    for key, value in spec.secrets.items():
        if not _ENV_RE.match(key):
            raise SpecError(f"secrets.{key[:64]}", "not a valid environment variable name")
        size = _text_bytes(f"secrets.{key}", value)
        _at_most(f"secrets.{key}", size, MAX_ARG_BYTES, "bytes")
    launch = sum(_text_bytes("command", a) + 1 for a in spec.command or [])
    launch += sum(_text_bytes("args", a) + 1 for a in spec.args)
    for key, value in (*spec.env.items(), *spec.secrets.items()):
        launch += len(key) + _text_bytes(f"env.{key}", value) + 2
    _at_most("secrets", launch, MAX_LAUNCH_BYTES, "bytes of command, args, env and secrets")
    for key, value in spec.secrets.items():
        if key in spec.env:
            raise SpecError(
                f"secrets.{key}",
                "also given in env; give it once, as a secret or as a plain variable",
            )
        if value == REDACTED:
            # A record's spec submitted again: its values were never in it.
            raise SpecError(
                f"secrets.{key}",
                f"holds {REDACTED!r}, what job records show in place of a secret; give the value",
            )


def redact(spec: JobSpec) -> JobSpec:
    """``spec`` with each secret's value replaced by :data:`REDACTED`."""
    if not spec.secrets:
        return spec
    return msgspec.structs.replace(spec, secrets=dict.fromkeys(spec.secrets, REDACTED))


def check_relative_path(field: str, path: str) -> None:
    """A path inside the workspace: relative, no '..', no NUL."""
    if not path or "\x00" in path:
        raise SpecError(field, "must be a non-empty path")
    if path.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", path):
        raise SpecError(
            field, f"must be relative to the job's workspace, got absolute path {path!r}"
        )
    if ".." in re.split(r"[\\/]", path):
        raise SpecError(field, f"must stay inside the job's workspace, got {path!r}")


def check_input_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise SpecError(
            f"inputs.{name}",
            "an input name is 1-128 letters, digits, '_', '.' or '-', not starting with '.' or '-'",
        )
