# SPDX-License-Identifier: Apache-2.0
"""StateManager: DeepSpeed's DSStateManager and engine queries (get_or_create_sequence,
get_sequence, flush_sequence, query, can_schedule) and blockkv's schedule, post_forward, fork and
partial freeing, driven from Python."""

import gc

import blockkv
import numpy as np
import pytest
from conftest import kv_config, make_manager

R = blockkv.SchedulingResult


def test_scheduling_result_has_deepspeeds_names_and_values():
    assert [(r.name, int(r)) for r in (
        R.Success, R.EngineSequenceLimitExceeded, R.BatchSequenceLimitExceeded,
        R.BatchTokenLimitExceeded, R.KVCacheLimitExceeded, R.SequenceTokenLimitExceeded)] == [
            ("Success", 0), ("EngineSequenceLimitExceeded", 1), ("BatchSequenceLimitExceeded", 2),
            ("BatchTokenLimitExceeded", 3), ("KVCacheLimitExceeded", 4),
            ("SequenceTokenLimitExceeded", 5)]
    assert issubclass(blockkv.SchedulingError, RuntimeError)
    assert blockkv.DSStateManager is blockkv.StateManager
    assert blockkv.DSStateManagerConfig is blockkv.StateManagerConfig


def test_sequences_are_created_found_and_flushed():
    m = make_manager(num_blocks=32, block_size=16)
    assert m.n_tracked_sequences == 0 and m.kv_block_size == 16 and m.num_caches == 1
    assert m.get_sequence(7) is None
    seq = m.get_or_create_sequence(7)
    assert isinstance(seq, blockkv.SequenceDescriptor)
    assert (seq.uid, seq.seen_tokens, seq.in_flight_tokens, seq.cur_allocated_blocks) == (7, 0, 0, 0)
    assert m.get_or_create_sequence(7).tracking_id == seq.tracking_id
    assert m.get_sequence(7).uid == 7 and m.n_tracked_sequences == 1
    m.flush_sequence(7)
    assert m.get_sequence(7) is None and m.n_tracked_sequences == 0
    with pytest.raises(ValueError):  # a descriptor of a flushed sequence
        seq.seen_tokens
    assert "flushed" in repr(seq)


def test_flushing_an_unknown_sequence_warns_as_deepspeed_does():
    m = make_manager()
    with pytest.warns(RuntimeWarning, match="does not exist"):
        m.flush_sequence(12345)


def test_schedule_post_forward_and_flush_move_blocks():
    m = make_manager(num_blocks=32, block_size=16, max_blocks=8)
    m.schedule([1, 2], [40, 16])
    one, two = m.get_sequence(1), m.get_sequence(2)
    assert (one.in_flight_tokens, one.seen_tokens, one.cur_allocated_blocks) == (40, 0, 3)
    assert two.cur_allocated_blocks == 1 and m.free_blocks == [28]
    table = one.block_table()
    assert table.dtype == np.int32 and table.tolist() == [0, 1, 2]
    assert two.block_table().tolist() == [3]
    ids = one.kv_cache_ids()
    assert ids.shape == (1, 8) and ids[0, :3].tolist() == [0, 1, 2] and np.all(ids[0, 3:] == -1)
    assert one.all_block_ids().tolist() == [0, 1, 2]
    assert one.kv_blocks_ptr != two.kv_blocks_ptr

    m.post_forward([1, 2])
    assert (one.seen_tokens, one.in_flight_tokens) == (40, 0)
    assert m.get_remaining_block_capacity(1) == 40 % 16
    m.schedule([1], [1])  # decode: the third block still has room
    assert one.cur_allocated_blocks == 3 and one.in_flight_tokens == 1
    one.post_forward()  # DeepSpeed's per-descriptor spelling
    assert one.seen_tokens == 41
    m.flush_sequence(1)
    assert m.free_blocks == [31]
    m.check_invariants()


def test_query_follows_deepspeeds_kv_requirements():
    m = make_manager(num_blocks=16, block_size=64, max_blocks=64)
    # An unknown uid is evaluated as a new sequence.
    assert m.query(1, 100, 10) == (100, 2)
    assert m.query(1, 100, 1) == (64, 1)
    m.schedule([1], [60])
    m.post_forward([1])
    assert m.query(1, 10, 0) == (4, 0)  # seen 60, 1 block: 4 tokens fit without a new block
    m.schedule([2], [10])
    m.post_forward([2])
    assert m.query(2, 5, 0) == (5, 0)
    with pytest.raises(ValueError):
        m.query(1, -1, 0)
    with pytest.raises(ValueError):
        m.query(1, 1, 1, cache_group=3)


def test_can_schedule_reports_each_limit():
    m = make_manager(num_blocks=8, block_size=16, max_blocks=8, max_tracked_sequences=4,
                     max_ragged_sequence_count=3, max_ragged_batch_size=64, max_context=100)
    assert m.can_schedule([1, 2], [16, 16]) == R.Success
    assert m.can_schedule([1, 2, 3, 4], [1, 1, 1, 1]) == R.BatchSequenceLimitExceeded
    assert m.can_schedule([1], [101]) == R.SequenceTokenLimitExceeded
    assert m.can_schedule([1, 2, 3], [48, 48, 48]) == R.KVCacheLimitExceeded
    assert m.can_schedule([1, 2], [40, 40]) == R.BatchTokenLimitExceeded
    m.schedule([1, 2, 3], [1, 1, 1])
    assert m.can_schedule([4, 5], [1, 1]) == R.EngineSequenceLimitExceeded
    assert m.can_schedule(np.array([1, 4]), np.array([1, 1])) == R.Success
    with pytest.raises(ValueError):
        m.can_schedule([1, 1], [1, 1])  # a duplicate uid
    with pytest.raises(ValueError):
        m.can_schedule([1, 2], [1])
    with pytest.raises(ValueError):
        m.can_schedule([1], [-1])


def test_schedule_raises_scheduling_error_and_changes_nothing():
    m = make_manager(num_blocks=4, block_size=16, max_blocks=8)
    with pytest.raises(blockkv.SchedulingError) as failure:
        m.schedule([1, 2], [48, 48])
    assert failure.value.result == R.KVCacheLimitExceeded
    assert isinstance(failure.value, RuntimeError)
    assert "KVCacheLimitExceeded" in str(failure.value)
    assert m.n_tracked_sequences == 0 and m.free_blocks == [4]
    with pytest.raises(ValueError):  # bad arguments are not a scheduling verdict
        m.schedule([1, 1], [1, 1])


def test_tracking_slots_run_out():
    m = make_manager(max_tracked_sequences=2, max_ragged_sequence_count=2)
    m.get_or_create_sequence(1)
    m.get_or_create_sequence(2)
    # DeepSpeed raises RuntimeError here; blockkv's ResourceExhaustedError is also a ValueError.
    with pytest.raises(RuntimeError, match="slot"):
        m.get_or_create_sequence(3)
    with pytest.raises(ValueError):
        m.get_or_create_sequence(3)
    assert m.query(3, 10, 10) == (0, 0)  # unknown with tracking full: DeepSpeed's (0, 0)


def test_fork_shares_full_blocks_and_copies_the_tail():
    m = make_manager(num_blocks=16, block_size=4, max_blocks=8)
    m.schedule([1], [10])
    m.post_forward([1])
    m.fork(1, 2)
    parent, child = m.get_sequence(1), m.get_sequence(2)
    assert child.seen_tokens == 10 and child.cur_allocated_blocks == 3
    assert child.block_table()[:2].tolist() == parent.block_table()[:2].tolist()
    assert child.block_table()[2] != parent.block_table()[2]
    assert m.free_blocks == [16 - 4]
    with pytest.raises(ValueError):
        m.fork(1, 2)  # kAlreadyExists
    with pytest.raises(ValueError):
        m.fork(99, 3)  # kNotFound
    m.check_invariants()


def test_free_leading_blocks_releases_old_blocks():
    m = make_manager(num_blocks=16, block_size=4, max_blocks=8)
    m.schedule([1], [12])
    m.post_forward([1])
    seq = m.get_sequence(1)
    m.free_leading_blocks(1, 2)
    assert seq.released_blocks() == 2 and seq.cur_allocated_blocks == 3
    assert seq.block_table().tolist()[:2] == [-1, -1]
    assert seq.all_block_ids().tolist() == [2]
    assert m.free_blocks == [15]
    with pytest.raises(ValueError):
        m.free_leading_blocks(1, 5)
    with pytest.raises(ValueError):
        m.free_leading_blocks(42, 1)


def test_get_cache_is_a_view_of_the_managers_cache():
    m = make_manager(num_blocks=4, block_size=4)
    layer = m.get_cache(1)
    assert layer.shape == (4, 4, 2, 2, 8)
    with pytest.raises(ValueError):
        m.get_cache(5)


def test_descriptors_keep_the_manager_alive():
    m = make_manager()
    seq = m.get_or_create_sequence(5)
    del m
    gc.collect()
    assert seq.seen_tokens == 0


def test_unsupported_manager_options():
    config = blockkv.StateManagerConfig(memory_config=blockkv.MemoryConfig(mode="allocate", size=4))
    with pytest.raises(NotImplementedError):
        blockkv.StateManager(config, (kv_config(),), base_mp_group=object(), device="cpu")
    with pytest.raises(NotImplementedError):
        blockkv.StateManager(config, (kv_config(num_allocation_groups=2),), device="cpu")
    with pytest.raises(TypeError):
        blockkv.StateManager(config, ("not a config",), device="cpu")
    # Offload works (test_offload.py) once offload_config sizes the host tier; without it the
    # flag is a ValueError naming offload_config, not DeepSpeed's NotImplementedError.
    config.offload = True
    with pytest.raises(ValueError, match="offload_config"):
        blockkv.StateManager(config, (kv_config(),), device="cpu")
    offload_config = blockkv.OffloadConfig
    config.offload_config = offload_config(host_blocks=4)
    manager = blockkv.StateManager(config, (kv_config(),), device="cpu")
    assert manager.config.offload and manager.free_host_blocks() == 4


def test_several_cache_groups():
    m = make_manager(num_blocks=8, kv_configs=(kv_config(block_size=4), kv_config(block_size=8)))
    m.schedule([1], [9])
    seq = m.get_sequence(1)
    assert seq.allocated_blocks(0) == 3 and seq.allocated_blocks(1) == 2
    assert m.free_blocks == [5, 6]
    assert m.max_blocks_per_sequence(1) == 64
    with pytest.raises(ValueError):
        seq.allocated_blocks(2)
