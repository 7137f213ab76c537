"""Where this process sits in a distributed job: the cluster environment.

GPUlayer's launchers (and torchrun) describe each rank with environment
variables. The Trainer reads them once, here, when ``fit`` or ``validate``
starts, never at import time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from gpulayer.train.errors import TrainerError

#: Variables a distributed rank needs; GPUlayer's launchers set all of them.
REQUIRED_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ClusterEnvironment(ABC):
    """The rank layout of the job this process belongs to."""

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    @abstractmethod
    def global_rank(self) -> int: ...

    @property
    @abstractmethod
    def local_rank(self) -> int: ...

    @property
    @abstractmethod
    def local_world_size(self) -> int: ...

    @property
    @abstractmethod
    def main_address(self) -> str: ...

    @property
    @abstractmethod
    def main_port(self) -> int: ...

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class SingleProcess(ClusterEnvironment):
    """One process, no process group."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def local_world_size(self) -> int:
        return 1

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0


@dataclass(frozen=True)
class EnvVarEnvironment(ClusterEnvironment):
    """A rank described by ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``... variables."""

    rank: int
    size: int
    local: int
    local_size: int
    address: str
    port: int

    @property
    def world_size(self) -> int:
        return self.size

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def local_rank(self) -> int:
        return self.local

    @property
    def local_world_size(self) -> int:
        return self.local_size

    @property
    def main_address(self) -> str:
        return self.address

    @property
    def main_port(self) -> int:
        return self.port


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise TrainerError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise TrainerError(f"environment variable {name}={raw!r} is not an integer") from None


def detect_environment(env: Mapping[str, str]) -> ClusterEnvironment:
    """The environment ``env`` describes: distributed when WORLD_SIZE > 1."""
    if _int_var(env, "WORLD_SIZE", default=1) <= 1:
        return SingleProcess()
    missing = [name for name in REQUIRED_VARS if not env.get(name)]
    if missing:
        raise TrainerError(
            f"WORLD_SIZE={env['WORLD_SIZE']!r} asks for a distributed run, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; "
            f"a distributed rank needs all of {', '.join(REQUIRED_VARS)}"
        )
    size = _int_var(env, "WORLD_SIZE")
    rank = _int_var(env, "RANK")
    if not 0 <= rank < size:
        raise TrainerError(f"RANK={rank} is outside 0..{size - 1} (WORLD_SIZE={size})")
    local_size = _int_var(env, "LOCAL_WORLD_SIZE", default=size)
    local = _int_var(env, "LOCAL_RANK", default=rank % local_size)
    if not 0 <= local < local_size:
        raise TrainerError(
            f"LOCAL_RANK={local} is outside 0..{local_size - 1} (LOCAL_WORLD_SIZE={local_size})"
        )
    port = _int_var(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise TrainerError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return EnvVarEnvironment(rank, size, local, local_size, env["MASTER_ADDR"], port)
