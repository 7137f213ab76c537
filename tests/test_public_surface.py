"""The declared public surface, and what importing it costs."""

from __future__ import annotations

import subprocess
import sys

import gpulayer

EXPECTED = {
    "AccessDenied",
    "ServerUnreachable",
    "UntrustedServer",
    "TransportError",
    "ArtifactError",
    "BundleError",
    "Client",
    "GPUlayerError",
    "InvalidStateError",
    "Job",
    "JobInfo",
    "JobNotFoundError",
    "JobSpec",
    "LogLine",
    "SpecError",
    "StoreError",
    "UnsafePathError",
    "WaitTimeout",
    "WorkerError",
    "WorkerInfo",
    "__version__",
}


def test_all_lists_exactly_the_public_names() -> None:
    assert set(gpulayer.__all__) == EXPECTED
    for name in gpulayer.__all__:
        assert hasattr(gpulayer, name), name


def test_every_error_derives_from_the_root() -> None:
    for name in EXPECTED:
        obj = getattr(gpulayer, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, gpulayer.GPUlayerError), name


def test_import_gpulayer_stays_light() -> None:
    code = (
        "import sys, gpulayer, gpulayer.cli, gpulayer.worker.worker, gpulayer.embedded\n"
        "heavy = [m for m in ('torch', 'numpy', 'rich', 'psutil', 'yaml', 'pathspec') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "", f"imported on the dispatch path: {out.strip()}"
