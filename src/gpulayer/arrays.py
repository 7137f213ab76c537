"""Job arrays (sweeps): one job id, many indexed tasks.

An array is submitted as one job whose spec lists its indices
(``JobSpec.array``) and, optionally, how many of its tasks may run at once
(``max_parallel``). The control plane stores it as one row (the array,
which never runs itself) and one job per index (its tasks), each with
``JobSpec.array_task`` naming the array and its index, which the task's
process reads as ``GPULAYER_ARRAY_INDEX``. The words people type for them
are here: ``0-99%8`` (Slurm's syntax) and ``JOB:7`` (one task).
"""

from __future__ import annotations

import re

from .errors import JobNotFoundError, SpecError
from .ids import is_job_id_or_prefix

MAX_ARRAY_TASKS = 10_000  # tasks in one array
MAX_ARRAY_INDEX = 999_999  # the largest index a task may have
INDEX_VAR = "GPULAYER_ARRAY_INDEX"  # what a task reads its index from
ARRAY_VAR = "GPULAYER_ARRAY_JOB_ID"  # and the array's id

_DIGITS = re.compile(r"[0-9]{1,7}")  # (never int() of thousands of digits)
_PART = re.compile(r"([0-9]{1,7})(?:-([0-9]{1,7})(?::([0-9]{1,7}))?)?")


def parse_array(text: str) -> tuple[list[int], int | None]:
    """``0-99%8`` into its indices and the most to run at once.

    A comma-separated list of indices (``3``) and ranges (``0-99``, both
    ends included; ``0-99:10`` takes every tenth), then optionally ``%N``.
    Raises SpecError naming what is wrong."""
    body, _, limit_text = text.strip().partition("%")
    limit = None
    if limit_text:
        if not _DIGITS.fullmatch(limit_text) or int(limit_text) < 1:
            raise SpecError(
                "array",
                f"after % comes how many tasks may run at once (1 or more), got {limit_text!r}",
            )
        limit = int(limit_text)
    indices: list[int] = []
    for part in body.split(","):
        match = _PART.fullmatch(part.strip())
        if match is None:
            raise SpecError(
                "array",
                f"{part.strip()!r} is neither an index nor a range; write e.g. 0-99, 1,5,9, "
                "0-99:10 (every tenth) and %8 for at most 8 at once",
            )
        first, last, step = match.group(1), match.group(2), match.group(3)
        start = int(first)
        stop = int(last) if last is not None else start
        stride = int(step) if step is not None else 1
        if stop < start:
            raise SpecError("array", f"range {part.strip()!r} ends before it starts")
        if stride < 1:
            raise SpecError("array", f"range {part.strip()!r} needs a step of 1 or more")
        if stop > MAX_ARRAY_INDEX:
            raise SpecError("array", f"an index is at most {MAX_ARRAY_INDEX}, got {stop}")
        if (stop - start) // stride + 1 + len(indices) > MAX_ARRAY_TASKS:
            raise SpecError("array", f"at most {MAX_ARRAY_TASKS} tasks in an array")
        indices.extend(range(start, stop + 1, stride))
    return indices, limit


def check_array(indices: list[int], max_parallel: int | None) -> None:
    """The rules of a spec's ``array`` and ``max_parallel``; raises SpecError."""
    if max_parallel is not None and not indices:
        raise SpecError("max_parallel", "limits the tasks of an array: give array too")
    if len(indices) > MAX_ARRAY_TASKS:
        raise SpecError("array", f"at most {MAX_ARRAY_TASKS} tasks in an array, got {len(indices)}")
    seen: set[int] = set()
    for position, index in enumerate(indices):
        if index > MAX_ARRAY_INDEX:
            raise SpecError(
                f"array[{position}]", f"an index is at most {MAX_ARRAY_INDEX}, got {index}"
            )
        if index in seen:
            raise SpecError(f"array[{position}]", f"index {index} is given twice")
        seen.add(index)


def split_task(ref: str) -> tuple[str, int | None]:
    """``JOB:7`` into the array's id (or its start) and the index; a plain
    id into itself and None. Anything else names no job: JobNotFoundError,
    saying how a task is named."""
    job, colon, index = ref.partition(":")
    if not colon:
        return ref, None
    if not is_job_id_or_prefix(job) or not _DIGITS.fullmatch(index) or int(index) > MAX_ARRAY_INDEX:
        shown = repr(ref) if len(ref) <= 40 else repr(ref[:37] + "...")
        raise JobNotFoundError(
            f"no job with id {shown}: a task of an array is named by the array's id (or its "
            f"start), ':' and the task's index (0 to {MAX_ARRAY_INDEX}), as in 1m8tw4bp:7"
        )
    return job, int(index)


def span(indices: list[int]) -> str:
    """A list of indices in short: ``0-99``, or its first few."""
    if not indices:
        return "none"
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return f"{indices[0]}-{indices[-1]}" if len(indices) > 1 else str(indices[0])
    shown = ",".join(map(str, indices[:5]))
    return shown + (f" and {len(indices) - 5} more" if len(indices) > 5 else "")


def tally(counts: dict[str, int]) -> str:
    """Tasks by state in a few words: ``8 running, 40 succeeded, 52 queued``."""
    from .jobs import STATES

    return ", ".join(f"{counts[s]} {s}" for s in STATES if counts.get(s))


__all__ = [
    "ARRAY_VAR",
    "INDEX_VAR",
    "MAX_ARRAY_INDEX",
    "MAX_ARRAY_TASKS",
    "check_array",
    "parse_array",
    "span",
    "split_task",
    "tally",
]
