"""API tokens on a machine others share: where a process finds its own, and
how it keeps it from the other processes there.

A token on a command line is in ``/proc/<pid>/cmdline``, which every local
user can read (``ps``). So a process is given its token in a file only its
owner may read (``--token-file``, as ssh's keys) or in its environment
(``$GPULAYER_TOKEN``); ``--token`` still works, with a warning.

A process's environment and memory are open to every other process of the
same user (``/proc/<pid>/environ``, ``/proc/<pid>/mem``, ``ptrace``), jobs
included. A worker or a server therefore makes itself non-dumpable
(:func:`keep_memory_private`) before it reads a token: the kernel then lets
only root read them. The flag is the process's and its forks' (the worker's
warden); a job, started with ``execve``, has it cleared, so it can still
read the environment of other jobs of the same Unix user
(``docs/security.md``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import sys
from collections.abc import MutableMapping
from pathlib import Path

from . import defaults
from .errors import GPUlayerError

log = logging.getLogger(__name__)

_PR_SET_DUMPABLE = 4  # <linux/prctl.h>
_TOKEN_FILE_MAX_BYTES = 64 * 1024  # a token is under 100 bytes; a bigger file is not one

# Said when a token comes on the command line.
ON_COMMAND_LINE = (
    "a token given with --token is visible to every user of this machine (in `ps`); "
    f"give it in ${defaults.TOKEN_ENV} or in a file only you can read, with --token-file PATH"
)


def keep_memory_private() -> bool:
    """Make this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so that
    no other process of its user can read its environment or memory, or
    trace it; it also writes no core dump. Linux only: elsewhere nothing is
    done and False is returned (as when the call fails)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # The running program's own symbols, libc's among them: no ldconfig run.
        libc = ctypes.CDLL(None, use_errno=True)
        done = bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        done = False
    if not done:
        log.warning(
            "could not make this process non-dumpable (errno %d): "
            "other processes of its user can read its environment",
            ctypes.get_errno(),
        )
    return done


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path``, a file only its owner may read or write.

    Refused, as ssh refuses a private key, when its group or others have any
    permission on it: the token would already be theirs.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise GPUlayerError(f"cannot read the token file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GPUlayerError(f"the token file {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if os.name == "posix" and st.st_uid != os.geteuid():
            # Another user could rewrite it: a job run as that user (--run-as)
            # would choose the token this process acts with.
            raise GPUlayerError(
                f"the token file {path} belongs to user id {st.st_uid}, not to this process's "
                f"({os.geteuid()}), so it is not used; give it to this user (chown) or copy it"
            )
        if os.name == "posix" and mode & 0o077:
            raise GPUlayerError(
                f"the token file {path} has permissions {mode:04o}: other users may read "
                f"it, so it is not used; make it its owner's only (chmod 600 {path})"
            )
        data = os.read(fd, _TOKEN_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        lines = data.decode().split()
    except UnicodeError:
        lines = ["", ""]
    if len(data) > _TOKEN_FILE_MAX_BYTES or len(lines) != 1:
        raise GPUlayerError(
            f"the token file {path} must hold one token on one line"
            + ("; it is empty" if not data.strip() else "")
        )
    return lines[0]


def find_token(
    *,
    token: str | None,
    token_file: str | os.PathLike[str] | None,
    env: MutableMapping[str, str] | None = None,
    forget: bool = False,
) -> str | None:
    """The token a process uses, by the documented precedence: ``token`` or
    ``token_file`` (an argument; not both), then ``$GPULAYER_TOKEN``, then
    the file named by ``$GPULAYER_TOKEN_FILE``; None when none is given.

    ``forget``: take both variables out of ``env`` (a worker's, before its
    jobs inherit it). What the process was started with stays in its
    ``/proc/<pid>/environ``: that is closed by :func:`keep_memory_private`.
    """
    env = os.environ if env is None else env
    if token is not None and token_file is not None:
        raise GPUlayerError("give --token or --token-file, not both")
    from_env, file_from_env = env.get(defaults.TOKEN_ENV), env.get(defaults.TOKEN_FILE_ENV)
    if forget:
        env.pop(defaults.TOKEN_ENV, None)
        env.pop(defaults.TOKEN_FILE_ENV, None)
    if token is not None:
        return token
    if token_file is not None:
        return read_token_file(Path(token_file))
    if from_env:
        return from_env
    if file_from_env:
        return read_token_file(Path(file_from_env))
    return None
