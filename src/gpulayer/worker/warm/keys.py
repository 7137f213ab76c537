"""A zygote's key: the settings that preloaded libraries read as they load.

A task whose values of these differ from a zygote's cannot be its fork
(see the package's docstring). Which of them a zygote may be made with, when
a job's differ from the worker's, is the ``_SETTABLE`` allowlist.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# What preloaded libraries read as they load (or at interpreter start):
# a task with other values than its zygote's cannot be its fork.
_READ_AT_START = (
    "PYTHON",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO",
    "BLIS_",
    "NPY_",
    "NUMPY_",
    "TORCH",
    "PYTORCH_",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "LC_",
    "LANG",
    "HIP_",
    "ROCM_",
    "HSA_",
    "KINETO_",
    "TRITON_",
)
# Read later, when first used: each task's own, set after the fork.
_READ_LATER = frozenset(
    {
        "PYTHONPATH",  # the child builds its sys.path from its own
        "PYTHONBREAKPOINT",  # read by each breakpoint() call
        "HIP_VISIBLE_DEVICES",  # GPU runtimes read these as they initialise,
        "ROCR_VISIBLE_DEVICES",  # which a zygote never does (it is checked)
        "PYTORCH_CUDA_ALLOC_CONF",  # at the first CUDA allocation
        "PYTORCH_HIP_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
    }
)


def read_at_start(name: bytes) -> bool:
    text = name.decode("latin-1")
    return text.startswith(_READ_AT_START) and text not in _READ_LATER


Key = tuple[tuple[bytes, bytes], ...]

# The only settings a zygote is made with when a job's differ from the
# worker's, each with the values it may take. A zygote runs as the worker's
# user (root under --run-as) and serves every later job with its key: one
# made with a job's PYTHONHOME, LD_PRELOAD or PYTHONWARNINGS would run code
# that job chose, as root, in other users' jobs. Any other difference: cold,
# as the job's own user.
_COUNT = re.compile(rb"[0-9]{1,4}(,[0-9]{1,4}){0,7}")
_FLAG = re.compile(rb"[A-Za-z0-9]{0,8}")
_WORD = re.compile(rb"[A-Za-z0-9_.@:,=+-]{0,64}")  # locale names, affinity words: no path
_SETTABLE: dict[bytes, re.Pattern[bytes]] = {
    **dict.fromkeys(
        (
            b"OMP_NUM_THREADS",
            b"MKL_NUM_THREADS",
            b"OPENBLAS_NUM_THREADS",
            b"GOTO_NUM_THREADS",
            b"BLIS_NUM_THREADS",
            b"NUMEXPR_NUM_THREADS",
            b"OMP_THREAD_LIMIT",
        ),
        _COUNT,
    ),
    b"PYTHONHASHSEED": re.compile(rb"random|[0-9]{1,10}"),
    **dict.fromkeys(
        (
            b"PYTHONUNBUFFERED",
            b"PYTHONDONTWRITEBYTECODE",
            b"PYTHONUTF8",
            b"PYTHONNOUSERSITE",
            b"PYTHONSAFEPATH",
            b"PYTHONFAULTHANDLER",
            b"PYTHONDEVMODE",
            b"PYTHONOPTIMIZE",
        ),
        _FLAG,
    ),
    **dict.fromkeys(
        (
            b"LANG",
            b"LANGUAGE",
            b"LC_ALL",
            b"LC_CTYPE",
            b"LC_NUMERIC",
            b"LC_TIME",
            b"LC_COLLATE",
            b"LC_MONETARY",
            b"LC_MESSAGES",
            b"OMP_PROC_BIND",
            b"OMP_DYNAMIC",
            b"OMP_WAIT_POLICY",
            b"OMP_SCHEDULE",
            b"MKL_DYNAMIC",
            b"KMP_BLOCKTIME",
        ),
        _WORD,
    ),
}


def _not_for_a_zygote(key: Key, base: Key) -> str | None:
    """Why no zygote may be made with ``key`` (see _SETTABLE), if none may."""
    ours, theirs = dict(key), dict(base)
    for name in sorted({*ours, *theirs}):
        if ours.get(name) == theirs.get(name):
            continue
        value = ours.get(name)
        pattern = _SETTABLE.get(name)
        if pattern is None or (value is not None and pattern.fullmatch(value) is None):
            shown = name.decode("latin-1")
            return (
                f"its {shown} differs from the worker's, and a ready interpreter is made only "
                f"for thread counts, the locale and plain Python flags"
            )
    return None


def key_of(env: Mapping[bytes, bytes]) -> Key:
    return tuple(sorted((k, v) for k, v in env.items() if read_at_start(k)))


def _describe(key: Key, base: Key) -> str:
    ours, theirs = dict(key), dict(base)
    names = sorted({*ours, *theirs} - {k for k in ours if theirs.get(k) == ours[k]})
    return ", ".join(
        f"{n.decode('latin-1')}={ours[n].decode('latin-1')}" if n in ours else f"no {n.decode()}"
        for n in names
    )
