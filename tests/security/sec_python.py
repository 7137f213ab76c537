"""A Python that another Unix user (nobody) can run GPUlayer with.

The tests that run a worker, or a GPUlayer command, as an ordinary user use
the system's interpreter (the default one lives under /root, mode 0700) with
the checkout's sources and the venv's packages on ``PYTHONPATH``. Where the
checkout itself is out of that user's reach (a clone under /root), the
packages GPUlayer imports are copied once to a folder it can read.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

import gpulayer

SYSTEM_PYTHON = "/usr/bin/python3.11"
NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

# What a worker, a server or a client command imports, lazily imported parts too.
_IMPORTS = (
    "gpulayer.cli",
    "gpulayer.worker.worker",
    "gpulayer.worker.containment",
    "gpulayer.http.server",
    "gpulayer.secretbox",
    "gpulayer.transport.http",
    "gpulayer.transport.wire",
    "cryptography.fernet",
    "psutil",
    "httptools",
    "click",
    "rich.table",
    "yaml",
    "pathspec",
)


def _reachable(paths: list[str]) -> bool:
    check = "import " + ", ".join(_IMPORTS)
    done = subprocess.run(
        [*AS_NOBODY, SYSTEM_PYTHON, "-c", check],
        env={"PYTHONPATH": os.pathsep.join(paths), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=60,
    )
    return done.returncode == 0


def _top_levels() -> list[Path]:
    """The folders (and single-file modules) those imports load from."""
    code = (
        "import json, sys\n"
        f"import {', '.join(_IMPORTS)}\n"
        "print(json.dumps([getattr(m, '__file__', None) for m in list(sys.modules.values())]))\n"
    )
    files = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    )
    roots = {Path(gpulayer.__file__).parents[1], Path(msgspec.__file__).parents[1]}
    found: set[Path] = set()
    for name in files:
        if not name:
            continue
        path = Path(name)
        for root in roots:
            if path.is_relative_to(root):
                found.add(root / path.relative_to(root).parts[0])
    # Compiled helpers beside the packages (cffi's backend, for one).
    for root in roots:
        found.update(p for p in root.glob("_cffi_backend*") if p.is_file())
    return sorted(found)


@functools.cache
def nobody_pythonpath() -> str:
    """A PYTHONPATH with which nobody's SYSTEM_PYTHON imports GPUlayer."""
    paths = [str(Path(gpulayer.__file__).parents[1]), str(Path(msgspec.__file__).parents[1])]
    if _reachable(paths):
        return os.pathsep.join(paths)
    site = Path(tempfile.mkdtemp(prefix="gpulayer-site-"))
    atexit.register(shutil.rmtree, site, True)
    site.chmod(0o755)
    for item in _top_levels():
        target = site / item.name
        if item.is_dir():
            shutil.copytree(item, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(item, target)
    for folder, dirs, names in os.walk(site):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o755)
        for name in names:
            path = os.path.join(folder, name)
            os.chmod(path, os.stat(path).st_mode | 0o444)
    assert _reachable([str(site)]), f"nobody cannot import GPUlayer from {site} either"
    return str(site)
