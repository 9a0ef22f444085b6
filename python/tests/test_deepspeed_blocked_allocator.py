# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's test_blocked_allocator.py scenarios (DeepSpeed 38327e07), through
blockkv.deepspeed in DeepSpeed's import shape, plus blockkv's fix for a repeated id."""

import random

import pytest
import torch

from blockkv.deepspeed.blocked_allocator import BlockedAllocator


@pytest.mark.parametrize("bad_size", [0, -1])
def test_bad_initialization(bad_size):
    with pytest.raises(ValueError):
        BlockedAllocator(bad_size)


def test_allocation():
    allocator = BlockedAllocator(16)
    a1 = allocator.allocate(4)
    assert isinstance(a1, torch.Tensor) and a1.dtype == torch.int32
    assert a1.numel() == 4
    assert allocator.free_blocks == 12
    a2, a3, a4 = allocator.allocate(2), allocator.allocate(2), allocator.allocate(2)
    assert allocator.free_blocks == 6
    a5 = allocator.allocate(6)
    assert a5.numel() == 6
    assert allocator.free_blocks == 0
    with pytest.raises(ValueError):
        allocator.allocate(1)
    assert allocator.free_blocks == 0
    all_ids = torch.cat([a1, a2, a3, a4, a5])
    assert sorted(all_ids.tolist()) == list(range(16))


def test_too_large_allocation():
    allocator = BlockedAllocator(16)
    with pytest.raises(ValueError):
        allocator.allocate(17)
    assert allocator.free_blocks == 16


def test_deallocation():
    allocator = BlockedAllocator(16)
    all_blocks = allocator.allocate(16)
    assert allocator.free_blocks == 0
    allocator.free(all_blocks)
    assert allocator.free_blocks == 16

    all_blocks = allocator.allocate(16)
    allocator.free(all_blocks[:4])
    assert allocator.free_blocks == 4
    allocator.free(all_blocks[4:8])
    assert allocator.free_blocks == 8
    for chunk in (all_blocks[:4], all_blocks[4:8]):
        with pytest.raises(ValueError):
            allocator.free(chunk)
        assert allocator.free_blocks == 8


@pytest.mark.parametrize("index", [-1, 2])
def test_invalid_dealloc_indices(index):
    allocator = BlockedAllocator(1)
    with pytest.raises(ValueError):
        allocator.free(torch.tensor([index]))
    assert allocator.free_blocks == 1


@pytest.mark.parametrize("index", [-1, 2])
def test_invalid_alloc_indices_are_atomic(index):
    allocator = BlockedAllocator(1)
    allocator.allocate(1)
    with pytest.raises(ValueError):
        allocator.free(torch.tensor([0, index]))
    assert allocator.free_blocks == 0  # the valid id 0 was not freed either
    allocator.free(torch.tensor([0]))
    assert allocator.free_blocks == 1


def test_lifo_order_golden_values():
    allocator = BlockedAllocator(8)
    assert allocator.allocate(3).tolist() == [0, 1, 2]
    allocator.free([0, 1, 2])
    assert allocator.allocate(4).tolist() == [2, 1, 0, 3]

    allocator = BlockedAllocator(4)
    allocator.allocate(4)
    allocator.free(torch.tensor([1, 3], dtype=torch.int32))
    assert allocator.allocate(2).tolist() == [3, 1]


def test_free_takes_int_iterable_numpy_and_tensor():
    allocator = BlockedAllocator(8)
    allocator.allocate(8)
    allocator.free(0)
    allocator.free(iter([1, 2]))
    allocator.free(torch.tensor([3, 4], dtype=torch.int64).numpy())
    allocator.free(torch.tensor([5], dtype=torch.int32))
    allocator.free((6, 7))
    assert allocator.free_blocks == 8
    allocator.check_invariants()


def test_repeated_id_in_one_free_is_refused():
    # DeepSpeed accepts free([1, 1]), counts 4 free blocks of 4 and corrupts its free list.
    allocator = BlockedAllocator(4)
    blocks = allocator.allocate(2)
    with pytest.raises(ValueError):
        allocator.free(torch.tensor([1, 1]))
    assert allocator.free_blocks == 2
    allocator.free(blocks)
    assert allocator.free_blocks == 4
    allocator.check_invariants()


def test_long_running_allocation():
    rng = random.Random(0)
    total = 128
    allocator = BlockedAllocator(total)
    live = []
    allocs = frees = blocks_allocated = blocks_freed = 0
    for _ in range(8192):
        if not live or rng.random() < 0.5:
            n = rng.randint(1, 24)
            if n > allocator.free_blocks:
                with pytest.raises(ValueError):
                    allocator.allocate(n)
                continue
            live.append(allocator.allocate(n))
            allocs += 1
            blocks_allocated += n
        else:
            blocks = live.pop(rng.randrange(len(live)))
            allocator.free(blocks)
            frees += 1
            blocks_freed += blocks.numel()
        ids = torch.cat(live).tolist() if live else []
        assert len(ids) == len(set(ids)) and len(ids) <= total
        assert len(ids) == total - allocator.free_blocks
    assert allocs == frees + len(live)
    assert blocks_allocated == blocks_freed + (total - allocator.free_blocks)
    allocator.check_invariants()
