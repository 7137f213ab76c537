"""Sharding training data across ranks so that every rank gets as many batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, WeightedRandomSampler

from gpulayer.train import TrainerError
from gpulayer.train.data import batch_count, shard
from gpulayer.train.environment import EnvVarEnvironment, SingleProcess

pytestmark = pytest.mark.torch


def rank(r: int, world: int = 2) -> EnvVarEnvironment:
    return EnvVarEnvironment(rank=r, size=world, local=r, local_size=world, address="h", port=1)


def test_single_process_keeps_the_data() -> None:
    data = [1, 2, 3]
    assert shard(data, SingleProcess(), shuffle=True, seed=0) is data


def test_lists_are_strided_and_truncated_evenly() -> None:
    data = list(range(7))
    assert shard(data, rank(0), shuffle=True, seed=0) == [0, 2, 4]
    assert shard(data, rank(1), shuffle=True, seed=0) == [1, 3, 5]


def test_sized_iterables_are_strided_lazily() -> None:
    class Sized:
        def __len__(self) -> int:
            return 7

        def __iter__(self) -> Any:
            return iter(range(7))

    shards = [shard(Sized(), rank(r, 3), shuffle=True, seed=0) for r in range(3)]
    assert [list(s) for s in shards] == [[0, 3], [1, 4], [2, 5]]
    assert [len(s) for s in shards] == [2, 2, 2]
    assert batch_count(shards[0], None) == 2 and batch_count(shards[0], 1) == 1


def test_unsized_iterables_cannot_be_sharded() -> None:
    class Stream:
        def __iter__(self) -> Any:
            return iter(range(3))

    with pytest.raises(TrainerError, match="cannot shard Stream across 2 ranks: it has no len"):
        shard(Stream(), rank(0), shuffle=True, seed=0)


def test_data_loaders_get_a_distributed_sampler() -> None:
    dataset = TensorDataset(torch.arange(10.0))
    for shuffle in (True, False):
        loader = DataLoader(dataset, batch_size=2, shuffle=shuffle)
        parts = [shard(loader, rank(r), shuffle=True, seed=5) for r in range(2)]
        for part in parts:
            assert isinstance(part.sampler, DistributedSampler)
            assert part.sampler.shuffle is shuffle and part.sampler.seed == 5
            assert part.batch_size == 2
        seen = [torch.cat([b[0] for b in part]).tolist() for part in parts]
        assert sorted(seen[0] + seen[1]) == list(range(10))
        assert not set(seen[0]) & set(seen[1])


def test_custom_samplers_must_be_distributed_by_the_user() -> None:
    dataset = TensorDataset(torch.arange(4.0))
    loader = DataLoader(dataset, sampler=WeightedRandomSampler([1.0] * 4, 4))
    with pytest.raises(
        TrainerError, match=r"custom sampler \(WeightedRandomSampler\).*DistributedSampler"
    ):
        shard(loader, rank(0), shuffle=True, seed=0)
    ready = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    assert shard(ready, rank(0), shuffle=True, seed=0) is ready
