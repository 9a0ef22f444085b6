# SPDX-License-Identifier: Apache-2.0
"""BlockedAllocator: DeepSpeed's allocator scenarios (test_blocked_allocator.py), restated from
their facts against blockkv, plus the argument types free() takes and blockkv's fixes."""

import random

import blockkv
import numpy as np
import pytest
import torch


@pytest.mark.parametrize("bad_size", [0, -1])
def test_bad_size_is_a_value_error(bad_size):
    with pytest.raises(ValueError):
        blockkv.BlockedAllocator(bad_size)


def test_allocation_counts_exhaustion_and_uniqueness():
    a = blockkv.BlockedAllocator(16)
    first = a.allocate(4)
    assert first.size == 4 and a.free_blocks == 12
    taken = [first]
    for expected_free in (10, 8, 6):
        taken.append(a.allocate(2))
        assert taken[-1].size == 2 and a.free_blocks == expected_free
    taken.append(a.allocate(6))
    assert taken[-1].size == 6 and a.free_blocks == 0
    with pytest.raises(ValueError):
        a.allocate(1)
    ids = np.concatenate(taken)
    assert sorted(ids.tolist()) == list(range(16))


def test_allocating_more_than_exists_fails_and_changes_nothing():
    a = blockkv.BlockedAllocator(16)
    with pytest.raises(ValueError):
        a.allocate(17)
    assert a.free_blocks == 16
    assert a.allocate(16).tolist() == list(range(16))


def test_deallocation_in_chunks_and_double_free():
    a = blockkv.BlockedAllocator(16)
    ids = a.allocate(16)
    assert a.free_blocks == 0
    a.free(ids)
    assert a.free_blocks == 16

    ids = a.allocate(16)
    a.free(ids[0:4])
    assert a.free_blocks == 4
    a.free(ids[4:8])
    assert a.free_blocks == 8
    for chunk in (ids[0:4], ids[4:8]):
        with pytest.raises(ValueError):
            a.free(chunk)
        assert a.free_blocks == 8


@pytest.mark.parametrize("bad_id", [-1, 2])
def test_invalid_id_is_a_value_error(bad_id):
    a = blockkv.BlockedAllocator(1)
    with pytest.raises(ValueError):
        a.free(torch.tensor([bad_id]))
    assert a.free_blocks == 1


@pytest.mark.parametrize("bad_id", [-1, 2])
def test_mixed_free_is_atomic(bad_id):
    a = blockkv.BlockedAllocator(1)
    a.allocate(1)
    with pytest.raises(ValueError):
        a.free(torch.tensor([0, bad_id]))
    assert a.free_blocks == 0  # the valid id was not freed either
    a.free([0])
    assert a.free_blocks == 1


def test_long_random_run():
    rng = random.Random(1234)
    num_blocks = 128
    a = blockkv.BlockedAllocator(num_blocks)
    live = []
    allocs = frees = blocks_allocated = blocks_freed = 0
    for _ in range(8192):
        if not live or rng.random() < 0.5:
            n = rng.randint(1, 24)
            if n > a.free_blocks:
                with pytest.raises(ValueError):
                    a.allocate(n)
                continue
            ids = a.allocate(n)
            assert ids.dtype == np.int32 and ids.size == n
            live.append(ids)
            allocs += 1
            blocks_allocated += n
        else:
            ids = live.pop(rng.randrange(len(live)))
            a.free(ids)
            frees += 1
            blocks_freed += ids.size
        held = np.concatenate(live) if live else np.empty(0, np.int32)
        assert len(set(held.tolist())) == held.size <= num_blocks
        assert a.free_blocks == num_blocks - held.size
    a.check_invariants()
    assert allocs == frees + len(live)
    assert blocks_allocated == blocks_freed + (num_blocks - a.free_blocks)


def test_lifo_reuse_golden_orders():
    a = blockkv.BlockedAllocator(8)
    first = a.allocate(3)
    assert first.tolist() == [0, 1, 2]
    a.free(first)
    assert a.allocate(4).tolist() == [2, 1, 0, 3]

    b = blockkv.BlockedAllocator(4)
    b.allocate(4)
    b.free([1, 3])
    assert b.allocate(2).tolist() == [3, 1]


def test_duplicate_ids_in_one_free_are_rejected():
    # DeepSpeed accepts free([1, 1]) and over-counts free_blocks; blockkv refuses it whole.
    a = blockkv.BlockedAllocator(4)
    a.allocate(2)
    with pytest.raises(ValueError):
        a.free([1, 1])
    assert a.free_blocks == 2
    a.check_invariants()


def test_allocate_returns_int32_numpy_and_zero_is_empty():
    a = blockkv.BlockedAllocator(4)
    empty = a.allocate(0)
    assert isinstance(empty, np.ndarray) and empty.dtype == np.int32 and empty.size == 0
    assert a.free_blocks == 4
    with pytest.raises(ValueError):
        a.allocate(-1)
    with pytest.raises(ValueError):
        a.allocate(2**40)
    assert a.num_blocks == 4 and a.free_blocks == 4


@pytest.mark.parametrize(
    "as_blocks",
    [
        lambda ids: int(ids[0]),
        lambda ids: [int(i) for i in ids],
        lambda ids: tuple(int(i) for i in ids),
        lambda ids: ids,  # the int32 array allocate returned
        lambda ids: ids.astype(np.int64),
        lambda ids: ids.astype(np.uint16),
        lambda ids: np.int64(ids[0]),
        lambda ids: torch.from_numpy(ids.astype(np.int64)),
        lambda ids: torch.tensor(ids.tolist(), dtype=torch.int32),
        lambda ids: torch.tensor(int(ids[0])),
    ],
    ids=["int", "list", "tuple", "np-int32", "np-int64", "np-uint16", "np-scalar", "torch-int64",
         "torch-int32", "torch-0d"],
)
def test_free_accepts_ints_lists_numpy_and_torch(as_blocks):
    a = blockkv.BlockedAllocator(8)
    ids = a.allocate(3)
    blocks = as_blocks(ids)
    expected = 1 if np.ndim(np.asarray(blocks)) == 0 else 3
    a.free(blocks)
    assert a.free_blocks == 5 + expected
    a.check_invariants()


def test_free_of_nothing_is_fine():
    a = blockkv.BlockedAllocator(2)
    a.free([])
    a.free(np.array([], dtype=np.float64))  # an empty list's default dtype
    assert a.free_blocks == 2


@pytest.mark.parametrize("blocks", [1.0, [0.0, 1.0], np.array([0.5]), True, "0", None])
def test_free_rejects_non_integers(blocks):
    a = blockkv.BlockedAllocator(2)
    a.allocate(2)
    with pytest.raises(TypeError):
        a.free(blocks)
    assert a.free_blocks == 0


def test_free_rejects_ids_outside_int32_and_2d_input():
    a = blockkv.BlockedAllocator(2)
    a.allocate(2)
    with pytest.raises(ValueError):
        a.free([2**33])
    with pytest.raises(ValueError):
        a.free(np.zeros((1, 2), dtype=np.int32))
    assert a.free_blocks == 0


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                   np.uint32, np.uint64, ">i4", ">u8", "<i8"])
def test_free_reads_numpy_arrays_of_every_integer_dtype_and_byte_order(dtype):
    a = blockkv.BlockedAllocator(8)
    ids = a.allocate(8)
    a.free(np.array(ids[:3], dtype=dtype))
    a.free(np.array(ids[3:8], dtype=dtype)[::2])  # strided: ids 3, 5, 7
    assert a.free_blocks == 6
    a.free(np.array(ids[4], dtype=dtype))  # 0-d
    a.free(np.array([ids[6]], dtype=dtype)[0])  # a NumPy scalar
    assert a.free_blocks == 8
    a.check_invariants()


def test_free_reads_torch_tensors_small_large_strided_and_0d():
    torch = pytest.importorskip("torch")
    a = blockkv.BlockedAllocator(1024)
    ids = torch.from_numpy(a.allocate(1024))
    a.free(ids[:1])                       # one id: read through tolist()
    a.free(ids[1:2].to(torch.int64)[0])   # 0-d
    a.free(ids[2:1000:2])                 # strided, 499 ids: read through the NumPy view
    a.free(ids[3:1000:2].to(torch.int16))  # also 499 ids, int16 (the ids fit)
    assert a.free_blocks == 1000
    with pytest.raises(TypeError):
        a.free(ids[1000:1002].float())
    with pytest.raises(TypeError):
        a.free(torch.ones(300, dtype=torch.float32))
    with pytest.raises(ValueError, match="2 dimensions"):
        a.free(ids[1000:1004].view(2, 2))
    assert a.free_blocks == 1000
    a.free(ids[1000:])
    a.check_invariants()


def test_free_of_a_list_reads_python_and_numpy_ints_and_refuses_nesting():
    a = blockkv.BlockedAllocator(4)
    ids = a.allocate(4).tolist()
    with pytest.raises(ValueError, match="2 dimensions"):
        a.free([[ids[0]]])
    with pytest.raises(TypeError, match=r"block ids\[1\] must be an int, got float"):
        a.free([ids[0], 1.0])
    assert a.free_blocks == 0
    a.free([np.int64(ids[0]), np.uint8(ids[1])])
    a.free((ids[2], ids[3]))
    assert a.free_blocks == 4
