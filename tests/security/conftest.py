"""The hostile tests: jobs, workers and users that attack on purpose.

They use the server fixtures of ``tests/server`` (a real server process on a
free port, real worker processes), re-exported here.
"""

from __future__ import annotations

from server.conftest import ServerProc, server

__all__ = ["ServerProc", "server"]
