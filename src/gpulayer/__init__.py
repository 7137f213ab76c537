"""GPUlayer: run ML jobs on the GPU machines you already own.

The public surface is what ``__all__`` lists; everything else is internal and
may change. ``gpulayer.train`` (the PyTorch Trainer) is imported on its own so
that ``import gpulayer`` never imports PyTorch.
"""

from .client import Client, Job
from .errors import (
    AccessDenied,
    ArtifactError,
    BundleError,
    GPUlayerError,
    InvalidStateError,
    JobNotFoundError,
    ServerUnreachable,
    SpecError,
    StoreError,
    TransportError,
    UnsafePathError,
    UntrustedServer,
    WaitTimeout,
    WorkerError,
)
from .jobs import JobInfo, LogLine, WorkerInfo
from .spec import JobSpec

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
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
    "ServerUnreachable",
    "SpecError",
    "StoreError",
    "TransportError",
    "UnsafePathError",
    "UntrustedServer",
    "WaitTimeout",
    "WorkerError",
    "WorkerInfo",
    "__version__",
]
