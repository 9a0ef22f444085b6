# SPDX-License-Identifier: Apache-2.0
"""How blockkv's status codes reach Python: ValueError for what DeepSpeed raises ValueError for
(and for every bad argument or state), ResourceExhaustedError (a ValueError and a RuntimeError)
for running out, NotImplementedError for what is not implemented, RuntimeError otherwise; the
C++ message carried over."""

import blockkv
import numpy as np
import pytest
from conftest import make_cache, make_manager, without_gpu


def test_invalid_argument_is_a_value_error():
    with pytest.raises(ValueError, match="0"):
        blockkv.BlockedAllocator(0)


def test_out_of_range_is_a_value_error_naming_the_id():
    a = blockkv.BlockedAllocator(8)
    with pytest.raises(ValueError, match="100"):
        a.free([100])
    with pytest.raises(ValueError, match="7"):
        make_cache(num_blocks=2).get_cache(7)


def test_failed_precondition_is_a_value_error():
    a = blockkv.BlockedAllocator(2)
    with pytest.raises(ValueError, match="1"):
        a.free([1])  # already free


def test_resource_exhausted_is_both_value_and_runtime_error():
    assert issubclass(blockkv.ResourceExhaustedError, ValueError)
    assert issubclass(blockkv.ResourceExhaustedError, RuntimeError)
    a = blockkv.BlockedAllocator(16)
    with pytest.raises(blockkv.ResourceExhaustedError, match="17") as failure:
        a.allocate(17)
    assert isinstance(failure.value, ValueError) and isinstance(failure.value, RuntimeError)


def test_already_exists_and_not_found_are_value_errors():
    m = make_manager()
    m.schedule([1, 2], [1, 1])
    m.post_forward([1, 2])
    with pytest.raises(ValueError, match="2"):
        m.fork(1, 2)
    with pytest.raises(ValueError, match="77"):
        m.post_forward([77])
    with pytest.raises(ValueError):
        m.fork(77, 3)


def test_unimplemented_is_not_implemented_error():
    with pytest.raises(NotImplementedError, match="num_allocation_groups"):
        make_manager(kv_configs=(blockkv.KVCacheConfig(cache_shape=(1, 1, 8),
                                                       num_allocation_groups=2),))


@without_gpu
def test_unavailable_is_a_runtime_error():
    with pytest.raises(RuntimeError) as failure:
        blockkv.CudaDevice(0)
    assert not isinstance(failure.value, ValueError)
    assert str(failure.value)


def test_scheduling_error_carries_the_result():
    m = make_manager(num_blocks=1, block_size=4)
    with pytest.raises(blockkv.SchedulingError) as failure:
        m.schedule([1], [5])
    assert failure.value.result == blockkv.SchedulingResult.KVCacheLimitExceeded
    assert blockkv.SchedulingError(blockkv.SchedulingResult.Success).args[0].startswith(
        "Batch scheduling failed with result")


# ---- Integers out of range: a ValueError naming the value and the range, nothing changed --------

INT64 = r"outside int64 \[-9223372036854775808, 9223372036854775807\]"
INT32 = r"outside int32 \[-2147483648, 2147483647\]"


@pytest.mark.parametrize("uid", [2**63, 2**64 - 1, 2**64, -(2**63) - 1, 2**100])
def test_uids_past_int64_are_value_errors_and_change_nothing(uid):
    m = make_manager()
    free = m.free_blocks
    batch = blockkv.RaggedBatchWrapper(m)
    calls = [
        lambda: m.schedule([uid], [1]),
        lambda: m.schedule([1, uid], [1, 1]),
        lambda: m.schedule((uid,), (1,)),
        lambda: m.can_schedule([uid], [1]),
        lambda: m.schedule_batch([uid], [1], [0], batch),
        lambda: m.post_forward([uid]),
        lambda: m.get_sequence(uid),
        lambda: m.get_or_create_sequence(uid),
        lambda: m.flush_sequence(uid),
        lambda: m.query(uid, 1, 1),
        lambda: m.fork(uid, 1),
        lambda: m.fork(1, uid),
        lambda: m.free_leading_blocks(uid, 1),
        lambda: m.get_remaining_block_capacity(uid),
        lambda: m.add_sequence(uid, [1, 2]),
        lambda: m.append_tokens(uid, [1]),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=str(uid).replace("-", r"\-")):
            call()
    with pytest.raises(ValueError, match=INT64):
        m.schedule([uid], [1])
    assert m.n_tracked_sequences == 0 and m.free_blocks == free and not batch.finalized
    m.check_invariants()


@pytest.mark.parametrize("make", [
    lambda v: np.array([v], dtype=np.uint64),
    lambda v: np.array([v], dtype=object),
    lambda v: [np.uint64(v)],
    lambda v: np.uint64(v),
])
def test_uids_past_int64_in_numpy_forms_are_value_errors(make):
    m = make_manager()
    for value in (2**63, 2**64 - 1):
        with pytest.raises(ValueError, match=f"{value} is {INT64}"):
            m.schedule(make(value), [1])
    assert m.n_tracked_sequences == 0
    m.schedule(make(2**63 - 1), [1])  # the largest int64 is a uid like any other
    assert m.get_sequence(2**63 - 1).in_flight_tokens == 1


def test_the_message_names_the_argument_and_the_position():
    m = make_manager()
    with pytest.raises(ValueError, match=r"^uids\[1\] = 9223372036854775808 is " + INT64):
        m.schedule([1, 2**63], [1, 1])
    with pytest.raises(ValueError, match=r"^lengths\[0\] = 18446744073709551615 is " + INT64):
        m.schedule([1], np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(ValueError, match=r"^uid 9223372036854775808 is " + INT64):
        m.get_sequence(2**63)
    with pytest.raises(ValueError, match=r"^num_blocks 2147483648 is " + INT32):
        m.free_leading_blocks(1, 2**31)
    with pytest.raises(ValueError, match=r"^cache_group 4294967296 is " + INT32):
        m.max_blocks_per_sequence(2**32)


def test_counts_block_ids_groups_and_handles_past_their_type_are_value_errors():
    a = blockkv.BlockedAllocator(4)
    for call in (lambda: a.allocate(2**31), lambda: a.allocate(2**63),
                 lambda: a.free([2**31]), lambda: a.free(np.array([2**32], dtype=np.int64)),
                 lambda: a.free(np.array([2**63], dtype=np.uint64)), lambda: a.free(2**64),
                 lambda: a.free(np.int64(-(2**31) - 1)), lambda: blockkv.BlockedAllocator(2**31)):
        with pytest.raises(ValueError, match=INT32):
            call()
    assert a.free_blocks == 4

    c = make_cache(num_blocks=4)
    for call in (lambda: c.reserve(2**31), lambda: c.reserve(1, cache_group=2**31),
                 lambda: c.free([0], cache_group=-(2**31) - 1), lambda: c.get_cache(2**63),
                 lambda: c.copy_blocks([0], [2**40])):
        with pytest.raises(ValueError, match="outside int"):
            call()
    assert c.free_blocks == [4]
    c.check_invariants()

    m = make_manager()
    m.schedule([1], [1])
    seq = m.get_sequence(1)
    for call in (lambda: seq.block_table(2**31), lambda: seq.allocated_blocks(2**63),
                 lambda: m.get_cache(0, 2**40), lambda: m.query(1, 2**63, 1),
                 lambda: m.query(1, 1, 2**31)):
        with pytest.raises(ValueError, match="outside int"):
            call()
    assert seq.in_flight_tokens == 1


def test_sizes_and_token_ids_past_their_type_are_value_errors():
    for call in (lambda: blockkv.StateManagerConfig(max_context=2**63),
                 lambda: blockkv.StateManagerConfig(max_tracked_sequences=2**31),
                 lambda: blockkv.MemoryConfig(size=2**64),
                 lambda: blockkv.OffloadConfig(host_bytes=2**63),
                 lambda: blockkv.OffloadConfig(host_blocks=2**31),
                 lambda: blockkv.PrefixCacheConfig(max_events=2**63),
                 lambda: blockkv.KVCacheConfig(cache_shape=(1, 1, 2**63))):
        with pytest.raises(ValueError, match="outside int"):
            call()
    config = blockkv.StateManagerConfig()
    with pytest.raises(ValueError, match=INT64):
        config.max_context = 2**63
    assert config.max_context == 8192

    m = make_manager()
    batch = blockkv.RaggedBatchWrapper(m)
    # Token ids are TokenId (int32) in C++.
    with pytest.raises(ValueError, match=r"tokens\[0\] = 9223372036854775808 is " + INT32):
        m.schedule_batch([1], [1], np.array([2**63], dtype=np.uint64), batch)
    with pytest.raises(ValueError, match=r"tokens\[0\] = 2147483648 is " + INT32):
        m.schedule_batch([1], [1], [2**31], batch)
    assert m.n_tracked_sequences == 0 and not batch.finalized


def test_non_integers_stay_type_errors():
    m = make_manager()
    for call in (lambda: m.get_sequence(1.0), lambda: m.get_sequence(True),
                 lambda: m.schedule([1.5], [1]), lambda: m.schedule([True], [1]),
                 lambda: m.schedule("1", [1]), lambda: m.schedule(None, [1])):
        with pytest.raises(TypeError):
            call()
    assert m.n_tracked_sequences == 0
