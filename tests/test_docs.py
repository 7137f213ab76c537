"""The docs site builds from docs/ with every link and anchor resolving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    # mkdocs.yml is strict: a link to a missing page or heading, or a page
    # left out of the navigation, is a warning, and a warning fails the build.
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "server" / "index.html").is_file()
    assert (tmp_path / "adr" / "0016-speed-parallelism-and-distribution" / "index.html").is_file()
