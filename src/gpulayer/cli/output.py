"""How commands print: tables for people, plain lines for pipes, JSON for scripts.

- stdout a terminal: a rich table, colours, long cells cut to fit.
- stdout anything else (a pipe, a file): one row a line, cells separated by
  one tab, nothing cut, no colour; so ``gpulayer jobs | grep succeeded``,
  ``awk '{print $1}'`` and ``cut -f4`` work.
- ``--json``: the objects of docs/json-output.md, ASCII only.

Every cell, piped or not, has its control characters written as escapes
(``\\n``, ``\\t``, ``\\x1b``, ``\\\\``...): a job's name, given by whoever
submitted it, can neither split a row nor send escape sequences to the
terminal of whoever lists it. Rich markup in a cell is shown as typed.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import click

from ..jobs import MARKS, JobInfo, LogLine, TaskInfo, WorkerInfo
from ..projects import DEFAULT_PROJECT
from ..spec import ArtifactRef

# The version of the objects `--json` prints. Within a version keys are only
# added, never removed, renamed or given another type (docs/json-output.md).
JSON_SCHEMA = 1

# What a cell shows for nothing, so that whitespace-splitting tools (awk
# without -F) still count columns right.
EMPTY = "-"

# Characters that would break a row or reach the terminal as a command:
# control characters (C0, DEL, C1), line and paragraph separators, and the
# bidirectional overrides that make text read other than it is stored. The
# backslash too, so that an escape shown is never ambiguous.
_UNSAFE = re.compile("[\\\\\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` safe for one cell of one row: every unsafe character as an escape."""
    return _UNSAFE.sub(_escape_char, text)


def to_terminal() -> bool:
    """Whether stdout is a terminal (people), rather than a pipe or a file (programs)."""
    return sys.stdout.isatty()


@dataclass(frozen=True)
class Column:
    header: str
    # On a terminal, the widest the column grows before its cells are cut
    # with an ellipsis; piped, nothing is cut.
    max_width: int | None = None


@dataclass(frozen=True)
class Styled:
    """A cell with a colour for the terminal (piped: the text alone)."""

    text: str
    style: str


Cell = str | Styled | None


def _text(cell: Cell) -> str:
    if cell is None or cell == "":
        return EMPTY
    return escape(cell.text if isinstance(cell, Styled) else cell)


def table(
    columns: Sequence[Column],
    rows: Iterable[Sequence[Cell]],
    *,
    header: bool = True,
    title: str | None = None,
) -> None:
    """Print ``rows``: a rich table on a terminal, tab-separated lines otherwise
    (a ``title`` on a line of its own, after a blank line: a section of ``show``)."""
    if not to_terminal():
        lines = ["", title] if title else []
        if header:
            lines.append("\t".join(column.header for column in columns))
        lines.extend("\t".join(_text(cell) for cell in row) for row in rows)
        for line in lines:
            click.echo(line)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    grid = Table(box=None, show_header=header, title=title)
    for column in columns:
        grid.add_column(column.header, no_wrap=True, max_width=column.max_width)
    for row in rows:
        # Text, never a str: rich would read "[red]" in a job's name as markup.
        grid.add_row(*(Text(_text(c), style=c.style if isinstance(c, Styled) else "") for c in row))
    Console().print(grid)


def fields(rows: Mapping[str, Cell]) -> None:
    """Print ``key: value`` pairs (``show``): a borderless table, or tab-separated lines."""
    if not to_terminal():
        for key, value in rows.items():
            click.echo(f"{key}\t{_text(value)}")
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    grid = Table(box=None, show_header=False)
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column()
    for key, value in rows.items():
        grid.add_row(
            key, Text(_text(value), style=value.style if isinstance(value, Styled) else "")
        )
    Console().print(grid)


def paragraph(title: str, text: str) -> None:
    """A titled block of several lines (a failure's reason with its stderr
    tail): each line escaped, the lines after the first indented."""
    lines = [escape(line) for line in text.splitlines()] or [""]
    body = "\n".join([lines[0], *("  " + line for line in lines[1:])])
    if not to_terminal():
        click.echo(f"{title}: {body}")
        return
    from rich.console import Console
    from rich.text import Text

    Console().print(Text.assemble((f"{title}:", "bold"), " ", body))


def print_json(value: Any) -> None:
    """One JSON document, indented. ASCII only: a name's escape sequence is
    ``\\u001b`` in the text, never a byte a terminal would act on."""
    click.echo(json.dumps(value, indent=2, ensure_ascii=True))


def print_json_line(value: Any) -> None:
    """One JSON object on one line (JSON Lines), flushed for a reader that follows."""
    sys.stdout.write(json.dumps(value, ensure_ascii=True, separators=(",", ":")) + "\n")
    sys.stdout.flush()


# The objects of `--json` (docs/json-output.md), built key by key from the
# public records rather than dumped: a record's new field is not a key until
# it is chosen and documented, and a secret's value can never be one.


def job_object(info: JobInfo) -> dict[str, Any]:
    """A job as ``jobs --json`` and ``show --json`` give it."""
    spec = info.spec
    usage = {
        "cpu_seconds": info.marks.get("cpu_s"),
        "peak_memory_bytes": info.marks.get("peak_memory"),
    }
    return {
        "schema": JSON_SCHEMA,
        "id": info.id,
        "name": spec.name,
        "user": info.user,
        "project": spec.project or DEFAULT_PROJECT,
        "state": info.state,
        "exit_code": info.exit_code,
        "reason": info.reason,
        "attempt": info.attempt,
        "given_back": info.given_back,
        "cancel_requested": info.cancel_requested,
        "worker": info.worker,
        "slots": list(info.slots),
        "gpu_ids": list(info.gpus),
        "spec": {
            "command": None if spec.command is None else list(spec.command),
            "script": spec.script,
            "args": list(spec.args),
            "env": dict(spec.env),
            # Names only: a record handed out holds "<redacted>" for each
            # value, and even that placeholder is not worth a key.
            "secrets": sorted(spec.secrets),
            "labels": dict(spec.labels),
            "gpus": spec.gpus,
            "nodes": spec.nodes,
            "procs_per_node": spec.procs_per_node,
            "launcher": spec.launcher,
            "priority": spec.priority,
            "max_retries": spec.max_retries,
            "timeout": spec.timeout,
            "bundle": spec.bundle,
            "inputs": {name: _artifact(ref) for name, ref in spec.inputs.items()},
            "outputs": list(spec.outputs),
        },
        "marks": {mark: info.marks[mark] for mark in MARKS if mark in info.marks},
        "timings": info.timings(),
        "usage": usage,
        "outputs": {path: _artifact(ref) for path, ref in info.outputs.items()},
        "tasks": [_task(task) for task in info.tasks],
        "start": info.start,
        # An array (arrays.py): its indices, its limit and its tasks by
        # state; a task of one: the array's id and its index.
        "array": None
        if not spec.array
        else {
            "size": len(spec.array),
            "indices": list(spec.array),
            "max_parallel": spec.max_parallel,
            "tasks": dict(info.array_states),
        },
        "array_task": None
        if spec.array_task is None
        else {"array": spec.array_task.array, "index": spec.array_task.index},
    }


def _artifact(ref: ArtifactRef) -> dict[str, Any]:
    return {"kind": ref.kind, "digest": ref.digest, "size": ref.size}


def _task(task: TaskInfo) -> dict[str, Any]:
    result = task.result
    return {
        "node": task.node,
        "worker": task.worker,
        "slots": list(task.slots),
        "gpu_ids": list(task.gpus),
        "outcome": None if result is None else result.outcome,
        "exit_code": None if result is None else result.exit_code,
        "start": task.start,
    }


def worker_object(worker: WorkerInfo) -> dict[str, Any]:
    """A worker as ``workers --json`` gives it."""
    return {
        "schema": JSON_SCHEMA,
        "id": worker.id,
        "name": worker.name,
        "host": worker.host,
        "address": worker.address,
        "slots": len(worker.slot_gpus),
        "slot_gpus": list(worker.slot_gpus),
        "gpu_vendor": worker.gpu_vendor,
        "gpu_names": list(worker.gpu_names),
        "containment": worker.containment,
        "started": worker.started,
        "last_seen": worker.last_seen,
        "running": list(worker.running),
    }


def log_object(line: LogLine, procs_per_node: int) -> dict[str, Any]:
    """A log line as ``logs --json`` gives it; ``node`` follows from the rank
    (ranks are numbered node by node, see worker/launch.py)."""
    return {
        "schema": JSON_SCHEMA,
        "seq": line.seq,
        "time": line.ts,
        "stream": line.stream,
        "rank": line.rank,
        "node": None if line.rank is None else line.rank // procs_per_node,
        "text": line.text,
    }
