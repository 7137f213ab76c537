"""Global options given after the command's name, against a real server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from server.conftest import ServerProc

GPULAYER = [sys.executable, "-m", "gpulayer.cli"]


def test_server_and_token_file_after_the_command(server: ServerProc, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(server.token("user", "dora") + "\n")
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    done = subprocess.run(
        [*GPULAYER, "jobs", "--server", server.url, "--token-file", str(token_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    wrong = subprocess.run(
        [
            *GPULAYER,
            "--token",
            "x",
            "jobs",
            "--server",
            server.url,
            "--token-file",
            str(token_file),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert wrong.returncode == 2 and "not both" in wrong.stderr


def test_a_bad_fair_share_half_life_is_refused_before_anything_starts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for bad in ("0", "-1d", "soon", "20y"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpulayer.cli",
                "--home",
                str(home),
                "server",
                "start",
                "--fair-share-half-life",
                bad,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert "--fair-share-half-life" in done.stderr and "is not a duration" in done.stderr
        assert not home.exists()  # nothing was made
