"""The server fixture of tests/server (a real server process), re-exported."""

from __future__ import annotations

from server.conftest import ServerProc, server

__all__ = ["ServerProc", "server"]
