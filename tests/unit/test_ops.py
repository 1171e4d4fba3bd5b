"""CacheOperation's transfers and merge_ops: one transfer per pool whose host and device index
counts agree, and merges of one kind only (a mis-paired merge copies into another op's pages)."""

from __future__ import annotations

import pytest
import torch

from asynccache.errors import ConfigError, TransferError
from asynccache.ops import CacheOperation, OpKind
from asynccache.storage import PoolName, PoolTransfer


def transfer(host: list[int], device: list[int], pool: PoolName = PoolName.KV) -> PoolTransfer:
    return PoolTransfer(
        pool_name=pool,
        host_indices=torch.tensor(host, dtype=torch.int64),
        device_indices=torch.tensor(device, dtype=torch.int64),
    )


async def test_merge_pairs_every_operations_pages_in_order() -> None:
    a = CacheOperation(
        OpKind.LOAD, [transfer([0, 1], [10, 11]), transfer([3, 3], [4, 5], PoolName.MAMBA)], plan=None
    )
    b = CacheOperation(OpKind.LOAD, [transfer([5], [20])], plan=None)
    merged = CacheOperation.merge_ops([a, b])
    kv = merged[PoolName.KV]
    assert list(zip(kv.host_indices.tolist(), kv.device_indices.tolist(), strict=True)) == [(0, 10), (1, 11), (5, 20)]
    # A state fanned out to several device slots repeats its host slot: the counts still agree.
    assert merged[PoolName.MAMBA].host_indices.tolist() == [3, 3]


async def test_a_second_transfer_of_one_pool_is_refused() -> None:
    with pytest.raises(TransferError, match="two transfers of pool kv"):
        CacheOperation(OpKind.LOAD, [transfer([0, 1], [10, 11]), transfer([2], [12])], plan=None)
    with pytest.raises(TransferError, match="two transfers of pool mamba"):
        CacheOperation(
            OpKind.LOAD,
            [],
            plan=None,
            deferred=[transfer([0], [1], PoolName.MAMBA), transfer([2], [3], PoolName.MAMBA)],
        )


@pytest.mark.parametrize(("host", "device"), [([0, 1, 2], [10, 11]), ([5, 6], [20, 21, 22]), ([1], [])])
async def test_a_transfer_whose_host_and_device_counts_differ_is_refused(host: list[int], device: list[int]) -> None:
    with pytest.raises(TransferError, match=f"{len(host)} host indices and {len(device)} device indices"):
        CacheOperation(OpKind.LOAD, [transfer(host, device)], plan=None)


async def test_merging_loads_with_writes_is_refused() -> None:
    load = CacheOperation(OpKind.LOAD, [transfer([0], [10])], plan=None)
    write = CacheOperation(OpKind.WRITE, [transfer([7], [30])], plan=None)
    with pytest.raises(TransferError, match="load and write"):
        CacheOperation.merge_ops([load, write])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_trailing": 1.5}, "num_trailing must be an int >= 1"),
        ({"num_trailing": "2"}, "num_trailing must be an int >= 1"),
        ({"num_trailing": True}, "num_trailing must be an int >= 1"),
        ({"num_trailing": 0}, "num_trailing must be an int >= 1"),
        ({"host_indices": [0, 1]}, "host_indices must be a torch.Tensor"),
        ({"device_indices": (2,)}, "device_indices must be a torch.Tensor"),
    ],
)
def test_a_transfer_of_the_wrong_types_is_refused_when_made(fields: dict, message: str) -> None:
    """Not halfway through a storage call (a bare TypeError after its I/O)."""
    with pytest.raises(ConfigError, match=message):
        PoolTransfer(pool_name=PoolName.MAMBA, **fields)
