"""The light zygote's test: whether a script evidently imports only the
standard library, read from its text (:func:`imports_only`); such a script
forks from the zygote that preloaded nothing (see WarmStarts)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

LIGHT_SCRIPT_MAX_BYTES = 64 << 10  # a script longer is not read: its fork is the full zygote's
LIGHT_SCRIPT_MAX_IMPORTS = 500  # import statements read, at most (about 0.5 ms)


def imports_only(script: Path, workspace: Path, allowed: frozenset[str]) -> bool:
    """Whether ``script`` evidently imports no module but ``allowed`` ones:
    its import statements, at any depth, read from its text (not parsed:
    a job's text never reaches a parser in the worker). A guess, trusted for
    speed only: a module imported otherwise (``importlib``, ``exec``) is
    imported as a cold start would. What is not read plainly says no: a
    file over ``LIGHT_SCRIPT_MAX_BYTES`` or of more import statements than ``LIGHT_SCRIPT_MAX_IMPORTS``, one that is no regular file of
    the workspace (a link out of it, a FIFO), a statement not understood."""
    try:
        root = os.path.realpath(workspace)
        real = os.path.realpath(script)
        if os.path.commonpath([root, real]) != root:
            return False  # never read as the worker what the job could not
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
        fd = os.open(real, flags)
    except (OSError, ValueError):
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > LIGHT_SCRIPT_MAX_BYTES:
            return False
        text = os.read(fd, LIGHT_SCRIPT_MAX_BYTES + 1)
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(text) > LIGHT_SCRIPT_MAX_BYTES:
        return False  # grew since its size was read
    for count, found in enumerate(_IMPORT.finditer(text)):
        if count >= LIGHT_SCRIPT_MAX_IMPORTS:
            return False  # bounds the time read, for a text of import lines only
        origin, names = found.groups()
        if origin is not None:
            if origin.startswith(b"."):
                continue  # relative: a script run by path has no package to find it in
            modules = [origin]
        else:  # "a.b as c, d": each first word
            modules = [(part.split(None, 1) or [b""])[0] for part in names.split(b",")]
        for module in modules:
            top = module.partition(b".")[0]
            if _NAME.fullmatch(top) is None or top.decode() not in allowed:
                return False
    return True


# An import statement at a line's start, or after ";" or ":" (a one-line
# "if x: import y"): ``from X import`` or ``import A, B as C``. In a string
# too: a needless "no", never a wrong "yes" that matters.
_IMPORT = re.compile(
    rb"(?:^|[;:])[ \t]*(?:from[ \t]+(\S+)[ \t]+import\b|import[ \t]+([^\n;#]*))", re.MULTILINE
)
_NAME = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
