"""Bearer tokens and what each role may do.

Tokens are random, shown once, and stored only as their sha256, so a copy
of the database grants nothing. Three roles:

- ``admin``: everything, including making tokens;
- ``user``: submit, watch and cancel jobs, move blobs, list workers;
- ``worker``: register, take tasks, report on them, fetch what it was given.
"""

from __future__ import annotations

import hashlib
import secrets
import time

from ..errors import GPUlayerError
from ..store import Store

ROLES = ("admin", "user", "worker")
ADMIN, USER, WORKER = ROLES


class AuthError(GPUlayerError):
    """A request without a valid token (401) or with one not allowed to do it (403)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(store: Store, role: str, name: str | None = None) -> str:
    if role not in ROLES:
        raise GPUlayerError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    token = f"glt_{role[0]}_{secrets.token_urlsafe(32)}"
    store.add_token(digest(token), role, name, time.time())
    return token


def role_of(store: Store, authorization: str | None) -> str:
    """The role behind an ``Authorization: Bearer ...`` header, or AuthError(401)."""
    if not authorization:
        raise AuthError(401, "this endpoint needs a token: send 'Authorization: Bearer <token>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError(401, "the Authorization header must be 'Bearer <token>'")
    role = store.token_role(digest(token.strip()))
    if role is None:
        raise AuthError(401, "the token is not valid on this server")  # never echo the token
    return role


def require(role: str, allowed: tuple[str, ...]) -> None:
    if role != ADMIN and role not in allowed:
        needs = " or ".join(allowed) if allowed else "admin"
        raise AuthError(403, f"a {role} token cannot do this (needs: {needs})")
