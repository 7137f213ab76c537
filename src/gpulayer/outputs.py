"""Output names: the paths a task's result gives the files it stored.

A result names each output by its path in the job's workspace, and a client
later writes the output at that path under its download folder. A name is
therefore checked where it is made (the worker, collecting the outputs),
where it enters the control plane (:func:`check_result`, before anything is
stored: a worker may be hostile) and where it is used (the client, before it
writes: a server may be old or hostile). Each time it must be a relative,
normalised path (:func:`check_name`); the control plane also checks that the
job declared it, by name or by a glob (:func:`matches`).

Globs mean what :func:`glob.glob` with ``recursive=True`` means: ``*``, ``?``
and ``[...]`` within one component, ``**`` for any number of folders, and a
wildcard does not match a name starting with ``.`` unless its own pattern does.
"""

from __future__ import annotations

import fnmatch
import glob
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

from .errors import GPUlayerError, SpecError, UnsafePathError

_DRIVE = re.compile(r"^[A-Za-z]:")


class UnsafeOutputError(UnsafePathError, SpecError):
    """A task's result names an output that is not a safe path its job declared.

    An unsafe path, and a result that does not match the spec's ``outputs``:
    a server answers 422, naming the output.
    """

    def __init__(self, name: object, reason: str) -> None:
        self.name = name
        self.field = "outputs"
        self.reason = reason
        Exception.__init__(self, f"output {name!r} refused: {reason}")


class OutputLimitError(GPUlayerError):
    """A task's outputs pass a limit its worker sets for one job: their size
    (by default), or their number, depth or path length (see the other
    constructors). Nothing is stored; the message is the job's reason."""

    def __init__(self, total: int, limit: int, reason: str | None = None) -> None:
        self.total = total
        self.limit = limit
        super().__init__(
            (
                reason
                or f"its outputs total {_size(total)}, over the limit of {_size(limit)} a job "
                "may store (set by its worker's --max-output-bytes)"
            )
            + "; nothing was stored"
        )

    @classmethod
    def too_many(cls, limit: int, *, looked: bool = False) -> OutputLimitError:
        what = "output globs look in or match" if looked else "outputs hold"
        return cls(
            limit + 1,
            limit,
            f"its {what} more than {limit} files, folders and links, the most a job may "
            "store (each file is a blob to store, and to fetch on download)",
        )

    @classmethod
    def too_deep(cls, path: str, limit: int) -> OutputLimitError:
        return cls(
            path.count("/"),
            limit,
            f"its output {shorten(path)!r} is more than {limit} folders deep, the most a job's "
            "outputs may be",
        )

    @classmethod
    def too_long(cls, path: str, size: int, limit: int) -> OutputLimitError:
        return cls(
            size,
            limit,
            f"its output path {shorten(path)!r} is {size} bytes long, over the {limit} bytes an "
            "output's path may be (a client could not write it)",
        )

    @classmethod
    def name_too_long(cls, path: str, size: int, limit: int) -> OutputLimitError:
        return cls(
            size,
            limit,
            f"its output {shorten(path)!r} has a name of {size} bytes, over the {limit} bytes a "
            "file name may be (a client could not write it)",
        )


def shorten(path: str, keep: int = 120) -> str:
    """A path for a message: a long one cut (it may be thousands of bytes)."""
    return path if len(path) <= keep else path[:keep] + "..."


_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``10G``, ``512MiB``, ``1048576``: binary units (K, M, G, T)."""
    found = _SIZE.match(text)
    if not found or int(found.group(1)) < 1:
        raise ValueError(
            f"expected a size of at least 1 byte such as 10G, 512M or 1048576, got {text!r}"
        )
    return int(found.group(1)) * _UNITS[found.group(2).upper()]


def _size(n: int) -> str:
    """Bytes in binary units, with the exact count (limits are set in bytes)."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit} ({n} bytes)"


def check_name(name: object) -> str:
    """``name`` if it is a relative, normalised path (``a/b``), else UnsafeOutputError with why."""
    if not isinstance(name, str) or not name:
        raise UnsafeOutputError(name, "an output name must be a non-empty path")
    if "\0" in name:
        raise UnsafeOutputError(name, "a NUL in the name")
    if "\\" in name:
        raise UnsafeOutputError(name, "a backslash in the name (a path separator on Windows)")
    if name.startswith("/"):
        raise UnsafeOutputError(name, "an absolute path; outputs are relative to the workspace")
    if _DRIVE.match(name):
        raise UnsafeOutputError(name, "a drive letter; outputs are relative to the workspace")
    for part in name.split("/"):
        if part == "..":
            raise UnsafeOutputError(name, "a '..' component, which leaves the workspace")
        if part in ("", "."):
            raise UnsafeOutputError(name, "not normalised (an empty or '.' component)")
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise UnsafeOutputError(name, "the name is not valid UTF-8") from None
    return name


def tidy(name: object) -> str:
    """A stored output's name as a client writes it: ``./out/`` as ``out``
    (records from before names were checked), never ``..`` nor absolute."""
    if isinstance(name, str) and name.startswith("/"):
        check_name(name)  # refused, as absolute
    return check_name(normalise(name) if isinstance(name, str) else name)


def normalise(pattern: str) -> str:
    """A declared output as results name it: without ``.`` and empty components.

    ``./out/`` is ``out``; ``..`` is kept (and refused by :func:`check_name`).
    """
    return "/".join(p for p in pattern.split("/") if p not in ("", "."))


def is_glob(pattern: str) -> bool:
    return glob.has_magic(pattern)


def part_matches(part: str, name: str) -> bool:
    """Whether one component ``name`` matches one component of a glob."""
    if not glob.has_magic(part):
        return part == name
    if name.startswith(".") and not part.startswith("."):
        return False  # as glob: a wildcard does not match a hidden name
    return _part_regex(part).match(name) is not None


@lru_cache(maxsize=4096)
def _part_regex(part: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(part))


def glob_parts(pattern: str) -> tuple[str, ...]:
    """A normalised glob's components, a run of ``**`` as one (it means the same)."""
    parts: list[str] = []
    for part in pattern.split("/"):
        if not (part == "**" and parts and parts[-1] == "**"):
            parts.append(part)
    return tuple(parts)


def matches(pattern: str, name: str) -> bool:
    """Whether the output ``name`` is what the declared ``pattern`` collects."""
    pattern = normalise(pattern)
    if not is_glob(pattern):
        return pattern == name
    parts, names = glob_parts(pattern), name.split("/")
    if "**" not in parts and len(parts) != len(names):
        return False
    # later[j]: whether the parts after the current one match names[j:]
    # (iterative: a pattern may have thousands of components).
    later = [False] * len(names) + [True]
    for part in reversed(parts):
        now = [False] * (len(names) + 1)
        for j in range(len(names), -1, -1):
            if part == "**":  # no folder, or one more (not a hidden one)
                now[j] = later[j] or (
                    j < len(names) and not names[j].startswith(".") and now[j + 1]
                )
            else:
                now[j] = j < len(names) and later[j + 1] and part_matches(part, names[j])
        later = now
    return later[0]


def check_result(declared: Sequence[str], names: Iterable[str]) -> None:
    """Raise UnsafeOutputError for the first of ``names`` that is unsafe or undeclared."""
    literal = {normalise(p) for p in declared if not is_glob(p)}
    globs = [p for p in declared if is_glob(p)]
    for name in names:
        check_name(name)
        if name in literal or any(matches(p, name) for p in globs):
            continue
        shown = ", ".join(repr(p) for p in declared[:5]) + (", ..." if len(declared) > 5 else "")
        raise UnsafeOutputError(
            name,
            f"not an output the job declared (its outputs: {shown})"
            if declared
            else "the job declared no outputs",
        )
