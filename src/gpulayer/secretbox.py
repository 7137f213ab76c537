"""A job's secrets: sealed at rest, shown to no one, opened only for its worker.

A spec's ``secrets`` (``gpulayer run --secret``, ``--env-file``,
``Client.submit(secrets=...)``) hold one of three things, by where the spec is:

1. the values themselves, in the submitting client and in the ``RunTask`` a
   worker takes (it needs them to start the job; they travel as the worker's
   token does, so over TLS on a network);
2. sealed values in the job store and in the control plane's memory: each one
   encrypted with the key in the home's ``secrets.key`` (Fernet: AES-128-CBC
   with an HMAC-SHA256, from ``cryptography``; ADR-0018), so a copy of the
   database without the key reveals nothing;
3. :data:`~gpulayer.spec.REDACTED` in every record handed out (API, CLI,
   ``Client``): names only.

The key is made on first use, readable by its owner only; a home that never
sees a secret never has one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from . import defaults
from .errors import GPUlayerError, SpecError
from .jobs import JobInfo
from .spec import JobSpec, redact

if TYPE_CHECKING:
    from cryptography.fernet import Fernet

_KEY_MAX_BYTES = 4096  # a Fernet key is 44 characters; anything much longer is not one


class SecretBox:
    """Seals and opens job secrets with one home's key (``key_file``), loaded
    or made on first use; without a file, a key that lives as long as this
    object (for a store that has no home, as in tests)."""

    def __init__(self, key_file: Path | None) -> None:
        self.key_file = key_file
        self._fernet: Fernet | None = None
        self._lock = threading.Lock()

    @classmethod
    def beside(cls, store: object) -> SecretBox:
        """The box for a job store: its key in the folder of the store's
        database file (the home, embedded or a server's)."""
        path = getattr(store, "path", None)
        if isinstance(path, Path) and path.name != ":memory:":
            return cls(path.parent / defaults.SECRETS_KEY_FILENAME)
        return cls(None)

    def seal(self, spec: JobSpec) -> JobSpec:
        """``spec`` with each secret's value encrypted (what is stored)."""
        if not spec.secrets:
            return spec
        fernet = self._key()
        sealed = {k: fernet.encrypt(v.encode()).decode("ascii") for k, v in spec.secrets.items()}
        return msgspec.structs.replace(spec, secrets=sealed)

    def open(self, spec: JobSpec) -> JobSpec:
        """``spec`` with its sealed secrets decrypted (what its worker gets);
        raises GPUlayerError, naming no value, if they cannot be."""
        if not spec.secrets:
            return spec
        from cryptography.fernet import InvalidToken

        fernet = self._key()
        opened = {}
        for name, sealed in spec.secrets.items():
            try:
                opened[name] = fernet.decrypt(sealed.encode("ascii")).decode()
            except (InvalidToken, UnicodeError):
                raise GPUlayerError(
                    f"the secret {name} cannot be decrypted with the key in {self._where()}: "
                    "it was sealed with another key (a job store moved without its key "
                    "file?); submit the job again"
                ) from None
        return msgspec.structs.replace(spec, secrets=opened)

    def cannot_open(self, spec: JobSpec) -> str | None:
        """Why ``spec``'s secrets cannot be opened here, or None if they can."""
        try:
            self.open(spec)
        except GPUlayerError as exc:
            return str(exc)
        return None

    def _where(self) -> str:
        return str(self.key_file) if self.key_file is not None else "this process's memory"

    def _key(self) -> Fernet:
        with self._lock:
            if self._fernet is None:
                from cryptography.fernet import Fernet

                key = Fernet.generate_key() if self.key_file is None else _load_key(self.key_file)
                try:
                    self._fernet = Fernet(key)
                except ValueError:
                    raise GPUlayerError(
                        f"{self.key_file} does not hold a GPUlayer secrets key; move it away "
                        "(the secrets of jobs already stored are lost with it)"
                    ) from None
            return self._fernet


def _load_key(path: Path) -> bytes:
    """The key in ``path``, made there (mode 0600) if there is none yet.

    Made under a temporary name and linked into place, which fails if another
    process made one meanwhile: then that one is the key, for both.
    """
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    from cryptography.fernet import Fernet

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, Fernet.generate_key() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process's key won
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the key outlives a crash, or the secrets sealed with it are lost
    finally:
        os.close(dir_fd)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(_KEY_MAX_BYTES).strip()


def redacted(job: JobInfo) -> JobInfo:
    """The record of ``job`` as handed out: its secrets' names, no values."""
    if not job.spec.secrets:
        return job
    return msgspec.structs.replace(job, spec=redact(job.spec))


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``NAME=VALUE`` lines of an env file (``gpulayer run --env-file``).

    Blank lines and lines starting with ``#`` are skipped, as is an
    ``export`` before a name; a value in matching quotes loses them and is
    otherwise taken as it is (no escapes, no ``$VAR``). Errors name the line,
    never what is on it: it may hold a secret.
    """
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise SpecError("env_file", f"cannot read {path}: {reason}") from None
    found: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not name:
            raise SpecError("env_file", f"{path} line {number}: expected NAME=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        found[name] = value
    return found
