"""Training data: any re-iterable of batches, sharded across ranks under DDP."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from gpulayer.train.environment import ClusterEnvironment
from gpulayer.train.errors import TrainerError
from gpulayer.train.seed import add_worker_init_fn


def check_reiterable(data: Any, argument: str) -> None:
    if data is None:
        return
    if not isinstance(data, Iterable):
        raise TrainerError(
            f"{argument} must be a DataLoader or a re-iterable of batches (e.g. a list); "
            f"got {type(data).__name__}"
        )
    if isinstance(data, list | tuple) and data and all(isinstance(d, DataLoader) for d in data):
        # Evaluation data has been through combine_loaders by now: this is training data.
        raise TrainerError(
            f"{argument} is a list of {len(data)} DataLoaders; several training dataloaders "
            f"are not supported (a list is read as a list of batches): pass one. Several "
            f"val/test/predict dataloaders are"
        )
    if isinstance(data, Iterator):
        raise TrainerError(
            f"{argument} is a one-shot iterator ({type(data).__name__}), which would be "
            f"empty from the second epoch on; pass a DataLoader or a list of batches"
        )


class SequentialLoaders:
    """Several evaluation dataloaders, run one after the other with their index
    (``dataloader_idx``), as Lightning's ``CombinedLoader`` in "sequential" mode."""

    def __init__(self, loaders: list[Any]) -> None:
        self.loaders = loaders

    def __iter__(self) -> Iterator[Any]:
        for loader in self.loaders:
            yield from loader

    def map(self, fn: Callable[[Any], Any]) -> SequentialLoaders:
        return SequentialLoaders([fn(loader) for loader in self.loaders])


def combine_loaders(data: Any) -> Any:
    """Evaluation data as Lightning reads it: a list, tuple or dict of DataLoaders
    is several dataloaders (a dict's in its order), one of them is that one;
    anything else (a DataLoader, a list of batches) is returned as it is."""
    items = list(data.values()) if isinstance(data, Mapping) else data
    if not isinstance(items, list | tuple) or not items:
        return data
    if not all(isinstance(d, DataLoader) for d in items):
        if isinstance(data, Mapping):
            kinds = sorted({type(d).__name__ for d in items})
            raise TrainerError(
                f"a dict of dataloaders must hold DataLoaders only; got {', '.join(kinds)}"
            )
        return data
    return items[0] if len(items) == 1 else SequentialLoaders(list(items))


class _Strided:
    """Every ``step``-th batch of ``data`` from ``start``, at most ``count`` of them."""

    def __init__(self, data: Iterable[Any], start: int, step: int, count: int) -> None:
        self.data, self.start, self.step, self.count = data, start, step, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.data):
            if i >= self.start + self.step * self.count:
                return
            if i % self.step == self.start:
                yield batch


def shard(data: Iterable[Any], env: ClusterEnvironment, *, shuffle: bool, seed: int) -> Any:
    """``data`` as this rank's share. Every rank gets the same number of batches.

    After ``seed_everything(..., workers=True)`` a DataLoader also gets the
    seeding ``worker_init_fn`` (before sharding, so the copy keeps it).
    """
    if isinstance(data, SequentialLoaders):
        return data.map(lambda loader: shard(loader, env, shuffle=shuffle, seed=seed))
    add_worker_init_fn(data, env.global_rank)
    if not env.distributed:
        return data
    rank, world = env.global_rank, env.world_size
    if isinstance(data, DataLoader):
        return _shard_loader(data, rank, world, seed)
    if isinstance(data, Sequence):
        per_rank = len(data) // world
        return list(data[rank : per_rank * world : world])
    if hasattr(data, "__len__"):
        return _Strided(data, rank, world, len(data) // world)  # type: ignore[arg-type]
    raise TrainerError(
        f"cannot shard {type(data).__name__} across {world} ranks: it has no len(), so "
        f"ranks could get different numbers of batches and hang; pass a DataLoader "
        f"or a list of batches"
    )


def _shard_loader(loader: DataLoader[Any], rank: int, world: int, seed: int) -> DataLoader[Any]:
    if isinstance(loader.dataset, IterableDataset):
        return loader  # the dataset shards itself (documented)
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    default_batching = type(loader.batch_sampler) is BatchSampler
    if not default_batching or not isinstance(loader.sampler, RandomSampler | SequentialSampler):
        raise TrainerError(
            f"cannot shard a DataLoader with a custom sampler "
            f"({type(loader.sampler).__name__}) across {world} ranks; give it "
            f"sampler=DistributedSampler(dataset) yourself"
        )
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset,
        num_replicas=world,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
    )
    extra: dict[str, Any] = {}
    if loader.num_workers > 0:
        extra = {
            "prefetch_factor": loader.prefetch_factor,
            "persistent_workers": loader.persistent_workers,
        }
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        **extra,
    )


def set_epoch(data: Any, epoch: int) -> None:
    """Tell a DistributedSampler which epoch it is, so each epoch shuffles anew."""
    sampler = getattr(data, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)


def batch_count(data: Any, limit: int | None) -> int | None:
    try:
        n = len(data)
    except TypeError:
        return limit
    return n if limit is None else min(n, limit)
