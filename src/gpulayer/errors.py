"""The exceptions GPUlayer raises.

Every error derives from :class:`GPUlayerError`, so ``except GPUlayerError``
catches anything GPUlayer itself decided was wrong::

    GPUlayerError
    ├── SpecError            a job spec is invalid (names the field and why)
    ├── BundleError          a source tree or input cannot be packed or unpacked
    │   └── UnsafePathError  a bundle entry would land outside its workspace
    │       └── UnsafeOutputError  (also a SpecError; gpulayer.outputs) a task's
    │                           result names an output its job did not declare safely
    ├── ArtifactError        a blob is missing or its bytes do not match its digest
    ├── StoreError           the database cannot be used (e.g. schema too new)
    ├── JobNotFoundError     no job has that id (or the prefix is ambiguous)
    ├── InvalidStateError    the operation does not apply to the job's state
    ├── WaitTimeout          ``wait(timeout=...)`` ran out before the job ended
    ├── WorkerError          a worker cannot start (bad slot count, no GPUs...)
    └── TransportError       talking to a server failed
        ├── ServerUnreachable    no answer (down, restarting, network); retry later
        └── AccessDenied         the token is missing, wrong, or not allowed to do this

Messages carry what was expected and what was found, and never a secret.
"""

from __future__ import annotations


class GPUlayerError(Exception):
    """Root of every error GPUlayer raises on purpose."""


class SpecError(GPUlayerError, ValueError):
    """A job spec is invalid. ``field`` names the offending field."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"invalid job spec: {field}: {reason}")


class BundleError(GPUlayerError):
    """A source directory or input cannot be bundled or materialised."""


class UnsafePathError(BundleError):
    """A bundle entry would be written outside the directory it unpacks into."""


class ArtifactError(GPUlayerError):
    """An artifact is missing, or its content does not match its digest."""


class StoreError(GPUlayerError):
    """The job store cannot be opened or used."""


class JobNotFoundError(GPUlayerError, LookupError):
    """No job matches the given id."""


class InvalidStateError(GPUlayerError):
    """The operation does not apply to the job in its current state."""


class WaitTimeout(GPUlayerError, TimeoutError):
    """A wait ran out before the job reached a final state."""


class WorkerError(GPUlayerError):
    """A worker cannot be started or configured as asked."""


class TransportError(GPUlayerError):
    """A request to a GPUlayer server failed; ``status`` is the HTTP status
    of the answer, where one came."""

    status: int | None = None


class ServerUnreachable(TransportError, ConnectionError):
    """The server did not answer: it may be down or restarting. Safe to retry;
    ``retry_after``: the seconds it asked for first (its Retry-After), if any."""

    retry_after: float | None = None


class UntrustedServer(ServerUnreachable):
    """The server's TLS certificate is not one this side trusts (no CA file,
    the wrong one, or a certificate for another name). Nothing was sent;
    trying again changes nothing until the certificate or the CA file does."""


class AccessDenied(TransportError, PermissionError):
    """The server refused the token (missing, unknown, or not allowed to do this)."""
