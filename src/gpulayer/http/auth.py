"""Bearer tokens and what each role may do.

Tokens are random, shown once, and stored only as their sha256, so a copy
of the database grants nothing. A token is known by its id, the first 12
hex digits of that sha256: safe to show (nothing of the token can be
recovered from it), and its holder can work it out. Three roles:

- ``admin``: everything, including making tokens;
- ``user``: submit, watch and cancel its user's jobs, move blobs, list workers;
- ``worker``: register, take tasks, report on them, fetch what it was given.

A user token acts as a user (a name, see ``access.py``): the jobs it
submits are that user's, and it sees only that user's jobs. An admin token
may have a user too (the jobs it submits are that user's); a worker token
has none. A user token found without one (the store edited by hand) sees no
job at all: never every job.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import NamedTuple

from ..access import Viewer, check_user_name
from ..errors import GPUlayerError
from ..store import Store
from .schemas import TokenInfo

ROLES = ("admin", "user", "worker")
ADMIN, USER, WORKER = ROLES
ID_LENGTH = 12  # hex digits of a token's sha256 that name it (48 bits)


class Caller(NamedTuple):
    """Who sent a request, as its token says."""

    role: str
    digest: str | None  # the token's sha256 (None: a server without auth)
    expires: float | None  # when the token stops being valid (None: never)
    # The user it acts as, and whose jobs it sees; None: it sees no job (a
    # worker token, which the routes keep off the job endpoints anyway).
    viewer: Viewer | None

    @classmethod
    def of(cls, role: str, digest: str | None, expires: float | None, user: str | None) -> Caller:
        if role == ADMIN or user is not None:
            return cls(role, digest, expires, Viewer(user, admin=role == ADMIN))
        return cls(role, digest, expires, None)


class AuthError(GPUlayerError):
    """A request without a valid token (401) or with one not allowed to do it (403)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


class TokenExpired(AuthError):
    """A token that was valid until ``expires``: 401."""

    def __init__(self, digest: str, expires: float) -> None:
        self.digest = digest
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
        super().__init__(401, f"the token expired at {when}; ask an admin for a new one")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_user(role: str, user: str | None) -> None:
    """The user a token of ``role`` may have: a user token needs one (else
    it would submit jobs of no one, or see everyone's), a worker token acts
    for workers and has none; an admin token may have one or not."""
    if role not in ROLES:
        raise GPUlayerError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    if user is not None:
        check_user_name(user)
    if role == USER and user is None:
        raise GPUlayerError(
            "a user token needs a user: the name whose jobs it submits and sees "
            "(`gpulayer token create --role user --user NAME`)"
        )
    if role == WORKER and user is not None:
        raise GPUlayerError(
            f"a worker token acts for workers, not for a user: make it without a user "
            f"(got user {user!r})"
        )


def create_token(
    store: Store,
    role: str,
    name: str | None = None,
    *,
    user: str | None = None,
    expires: float | None = None,
) -> str:
    """A new token of ``role`` acting as ``user`` (see :func:`check_user`),
    valid until ``expires`` (seconds since the epoch; None: until revoked)."""
    check_user(role, user)
    taken = {hashed[:ID_LENGTH] for hashed, *_ in store.list_tokens()}
    while True:  # an id names one token (a clash is as likely as guessing 48 bits)
        token = f"glt_{role[0]}_{secrets.token_urlsafe(32)}"
        hashed = digest(token)
        if hashed[:ID_LENGTH] not in taken:
            break
    store.add_token(hashed, role, name, time.time(), expires, user=user)
    return token


def list_tokens(store: Store) -> list[TokenInfo]:
    users = store.token_users()
    return [
        TokenInfo(
            id=hashed[:ID_LENGTH],
            role=role,
            name=name,
            user=users.get(hashed),
            created=created,
            expires=expires,
        )
        for hashed, role, name, created, expires in store.list_tokens()
    ]


def find_token(store: Store, token_id: str) -> tuple[str, str] | None:
    """The sha256 and role of the token with this id, if there is one."""
    if len(token_id) != ID_LENGTH:
        return None  # a shorter prefix may name several
    for hashed, role, *_ in store.list_tokens():
        if hashed.startswith(token_id):
            return hashed, role
    return None


def digest_of(authorization: str) -> str | None:
    """The sha256 of the token in an ``Authorization: Bearer ...`` header."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return digest(token.strip())


def caller_of(store: Store, authorization: str | None) -> Caller:
    """Who is behind an ``Authorization: Bearer ...`` header; or
    AuthError(401), also once the token expired (TokenExpired)."""
    if not authorization:
        raise AuthError(401, "this endpoint needs a token: send 'Authorization: Bearer <token>'")
    hashed = digest_of(authorization)
    if hashed is None:
        raise AuthError(401, "the Authorization header must be 'Bearer <token>'")
    found = store.token_role(hashed)
    if found is None:
        raise AuthError(401, "the token is not valid on this server")  # never echo the token
    role, expires = found
    if expires is not None and expires <= time.time():
        raise TokenExpired(hashed, expires)
    return Caller.of(role, hashed, expires, store.token_user(hashed))


def require(role: str, allowed: tuple[str, ...]) -> None:
    if role != ADMIN and role not in allowed:
        needs = " or ".join(allowed) if allowed else "admin"
        raise AuthError(403, f"a {role} token cannot do this (needs: {needs})")
