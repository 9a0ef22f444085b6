# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding from Python: post_forward(uids, accepted=...) and rollback(uid, n), their
errors (ValueError naming the value and the limit, nothing changed), forks, the prefix cache and
the blockkv.deepspeed descriptor."""

import pickle

import blockkv
import numpy as np
import pytest
import torch
from blockkv.deepspeed import DSStateManager, DSStateManagerConfig, KVCacheConfig, MemoryConfig
from conftest import allocate, kv_config, make_manager


def step(manager, uid, tokens, accepted=None):
    manager.schedule([uid], [tokens])
    manager.post_forward([uid], None if accepted is None else [accepted])


def test_accepting_j_of_k_tokens_keeps_j_and_frees_blocks_past_the_end():
    m = make_manager(num_blocks=16, block_size=4, max_blocks=8)
    step(m, 1, 3)
    m.schedule([1], [7])  # the verified token + 6 drafts: positions 3..9, 3 blocks
    seq = m.get_sequence(1)
    assert seq.cur_allocated_blocks == 3 and m.free_blocks == [13]
    m.post_forward([1], accepted=[2])
    assert (seq.seen_tokens, seq.in_flight_tokens, seq.cur_allocated_blocks) == (5, 0, 2)
    assert m.free_blocks == [14]
    assert seq.kv_cache_ids()[0, 2] == -1
    m.check_invariants()


def test_accepted_none_keeps_all_and_accepts_numpy_and_torch():
    m = make_manager(num_blocks=16, block_size=4)
    m.schedule([1, 2], [5, 5])
    m.post_forward([1, 2], accepted=None)
    assert [m.get_sequence(u).seen_tokens for u in (1, 2)] == [5, 5]
    m.schedule([1, 2], [5, 5])
    m.post_forward(np.array([1, 2]), accepted=np.array([1, 5], dtype=np.int64))
    m.schedule([1, 2], [5, 5])
    m.post_forward([1, 2], accepted=torch.tensor([0, 2], dtype=torch.int32))
    assert [m.get_sequence(u).seen_tokens for u in (1, 2)] == [6, 12]
    m.check_invariants()


def test_one_token_step_and_one_kv_head():
    kv = kv_config(block_size=1, heads=1, head_size=64, max_blocks_per_allocation_group=32)
    m = blockkv.StateManager(blockkv.StateManagerConfig(memory_config=allocate(32)), (kv,),
                             device="cpu")
    step(m, 1, 1, accepted=1)
    step(m, 1, 1, accepted=0)  # T = 1, rejected: nothing kept
    seq = m.get_sequence(1)
    assert (seq.seen_tokens, seq.cur_allocated_blocks) == (1, 1)
    step(m, 1, 4, accepted=3)
    assert (seq.seen_tokens, seq.cur_allocated_blocks) == (4, 4)
    m.rollback(1, 1)
    assert (seq.seen_tokens, seq.cur_allocated_blocks) == (3, 3)
    m.check_invariants()


def test_bad_accepted_counts_raise_value_error_and_change_nothing():
    m = make_manager(num_blocks=16, block_size=4)
    m.schedule([1, 2], [5, 1])
    free = m.free_blocks
    for accepted, words in (([6, 1], ["6", "[0, 5]"]), ([1, -1], ["-1", "[0, 1]"]),
                            ([1], ["1 accepted counts for 2 sequences"]),
                            ([], ["0 accepted counts for 2 sequences"])):
        with pytest.raises(ValueError) as e:
            m.post_forward([1, 2], accepted=accepted)
        for w in words:
            assert w in str(e.value)
        assert [m.get_sequence(u).in_flight_tokens for u in (1, 2)] == [5, 1]
        assert [m.get_sequence(u).seen_tokens for u in (1, 2)] == [0, 0]
        assert m.free_blocks == free
    with pytest.raises(ValueError, match="twice"):
        m.schedule([1], [5])
        m.post_forward([1, 1], accepted=[1, 1])
    with pytest.raises(ValueError):
        m.post_forward([1, 9], accepted=[1, 1])  # unknown uid
    m.check_invariants()


def test_rollback_of_committed_tokens_and_its_errors():
    m = make_manager(num_blocks=16, block_size=4)
    step(m, 1, 10)
    seq = m.get_sequence(1)
    with pytest.raises(ValueError) as e:
        m.rollback(1, 11)
    assert "11" in str(e.value) and "10" in str(e.value)
    with pytest.raises(ValueError, match="-1"):
        m.rollback(1, -1)
    with pytest.raises(ValueError):
        m.rollback(7, 1)  # unknown uid
    assert (seq.seen_tokens, seq.cur_allocated_blocks) == (10, 3)
    m.schedule([1], [2])
    with pytest.raises(ValueError, match="2 tokens in flight"):
        m.rollback(1, 1)
    assert (seq.seen_tokens, seq.in_flight_tokens) == (10, 2)
    m.post_forward([1], accepted=[0])
    m.rollback(1, 6)
    assert (seq.seen_tokens, seq.cur_allocated_blocks) == (4, 1)
    assert m.free_blocks == [15]
    m.check_invariants()


def test_rolling_back_a_fork_copies_the_shared_block():
    m = make_manager(num_blocks=16, block_size=4)
    step(m, 1, 8)
    m.fork(1, 2)
    parent, child = m.get_sequence(1), m.get_sequence(2)
    assert child.block_table().tolist() == parent.block_table().tolist()
    m.rollback(2, 1)
    assert child.block_table()[0] == parent.block_table()[0]
    assert child.block_table()[1] != parent.block_table()[1]
    assert parent.seen_tokens == 8 and child.seen_tokens == 7
    m.check_invariants()


def test_rollback_without_a_block_for_the_copy_is_resource_exhausted():
    m = make_manager(num_blocks=2, block_size=4)
    step(m, 1, 8)
    m.fork(1, 2)
    with pytest.raises(blockkv.ResourceExhaustedError):
        m.rollback(2, 1)
    assert m.get_sequence(2).seen_tokens == 8
    m.check_invariants()


def test_rejected_drafts_are_never_published():
    prefix = blockkv.PrefixCacheConfig()
    prefix.enabled = True
    m = make_manager(num_blocks=16, block_size=4, prefix_cache=prefix)
    batch = blockkv.RaggedBatchWrapper(m)
    seq = m.add_sequence(1, [0, 1])
    m.schedule_batch([1], [2], [0, 1], batch)
    m.post_forward(batch)
    m.schedule_batch([1], [6], [2, 3, 1002, 1003, 1004, 1005], batch)
    m.post_forward(batch, accepted=[2])
    assert seq.seen_tokens == 4
    events = m.drain_cache_events().events
    assert len(events) == 1 and events[0].tokens == [0, 1, 2, 3]
    m.schedule_batch([1], [1], [4], batch)
    with pytest.raises(ValueError, match="0 accepted counts for 1 sequences"):
        m.post_forward(batch, accepted=[])
    m.post_forward(batch, accepted=[1])
    m.check_invariants()


def test_deepspeed_descriptor_post_forward_takes_accepted():
    kv = KVCacheConfig(block_size=4, cache_shape=(2, 2, 8), max_blocks_per_allocation_group=4)
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=16))
    manager = DSStateManager(config, (kv,), device="cpu")
    seq = manager.get_or_create_sequence(1)
    seq.extend_kv_cache(manager.allocate_blocks(2))
    seq.pre_forward(5)  # the verified token + 4 drafts
    with pytest.raises(ValueError):
        seq.post_forward(accepted=6)
    assert seq.in_flight_tokens == 5
    seq.post_forward(accepted=2)
    assert (seq.seen_tokens, seq.cur_allocated_blocks) == (2, 1)
    assert manager.free_blocks.tolist() == [15]
    seq.pre_forward(1)
    seq.post_forward()  # DeepSpeed's call: keeps all
    assert seq.seen_tokens == 3


def test_dense_and_local_groups_release_only_the_windows_blocks():
    # Gemma-2 style: a full-attention group and a LOCAL group of window 6 in one manager.
    dense = kv_config(block_size=4, max_blocks_per_allocation_group=16)
    local = kv_config(block_size=4, max_blocks_per_allocation_group=16,
                      type=blockkv.KVCacheType.LOCAL, local_window=6)
    m = blockkv.StateManager(blockkv.StateManagerConfig(memory_config=allocate(16)),
                             (dense, local), device="cpu")
    step(m, 1, 10)
    for _ in range(20):
        step(m, 1, 1)
    seq = m.get_sequence(1)
    assert (seq.released_blocks(0), seq.released_blocks(1)) == (0, 6)  # (30 - 6) // 4
    assert m.free_blocks == [8, 14]
    assert (seq.kv_cache_ids(1)[0, :6] == -1).all()
    with pytest.raises(ValueError, match="at most 0 of its 30 tokens"):
        m.rollback(1, 1)
    assert seq.seen_tokens == 30
    m.check_invariants()


def test_a_shared_pool_lends_the_local_groups_released_blocks_to_the_dense_group():
    # vLLM's hybrid allocator: MemoryConfig(shared_pool=True), one pool of 8 blocks for both.
    dense = kv_config(block_size=4, max_blocks_per_allocation_group=16)
    local = kv_config(block_size=4, max_blocks_per_allocation_group=16,
                      type=blockkv.KVCacheType.LOCAL, local_window=4)
    memory = blockkv.MemoryConfig(mode="allocate", size=8, shared_pool=True)
    m = blockkv.StateManager(blockkv.StateManagerConfig(memory_config=memory), (dense, local),
                             device="cpu")
    m.schedule([1], [8])
    seq = m.get_sequence(1)
    local0 = int(seq.kv_cache_ids(1)[0, 0])
    assert m.free_blocks == [4, 4]  # one count: the pool's
    m.post_forward([1])  # LOCAL's first block leaves the window
    assert m.free_blocks == [5, 5]
    step(m, 1, 4)
    assert int(seq.kv_cache_ids(0)[0, 2]) == local0  # DENSE took it
    # 3 DENSE + 3 LOCAL blocks: 6 of the 4 free. Refused, nothing changed.
    with pytest.raises(blockkv.SchedulingError,
                       match=r"1 left for it \(4 free in the pool its groups share\)"):
        m.schedule([2], [12])
    assert m.get_sequence(2) is None and m.free_blocks == [4, 4]
    m.check_invariants()


def test_a_shared_pool_refuses_groups_of_other_shapes_naming_them():
    memory = blockkv.MemoryConfig(mode="allocate", size=8, shared_pool=True)
    groups = (kv_config(block_size=4), kv_config(block_size=8))
    with pytest.raises(ValueError, match="MemoryConfig.shared_pool: a block of one layer of cache "
                                         "group 1 is .* bytes and one of cache group 0 is"):
        blockkv.StateManager(blockkv.StateManagerConfig(memory_config=memory), groups,
                             device="cpu")


def test_a_state_group_gives_each_sequence_one_slot_copied_on_fork():
    # Jamba-like: a DENSE group and a STATE group of 2 layers of 4 fp32 (16 bytes) per sequence.
    dense = kv_config(block_size=4, max_blocks_per_allocation_group=16)
    state = blockkv.KVCacheConfig(cache_shape=(2, 1, 4), cache_dtype="fp32", type="state",
                                  state_bytes=16)
    config = blockkv.StateManagerConfig(max_tracked_sequences=4, max_ragged_sequence_count=4,
                                        max_context=64, memory_config=allocate(16))
    m = blockkv.StateManager(config, (dense, state), device="cpu")
    assert m.free_blocks == [16, 4]  # one slot per tracked sequence
    step(m, 1, 9)
    seq = m.get_sequence(1)
    slot = int(seq.kv_cache_ids(1)[0, 0])
    layer0 = torch.from_dlpack(m.get_cache(0, cache_group=1))  # [slots, 4 floats]
    assert tuple(layer0.shape) == (4, 4)
    layer0[slot] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m.fork(1, 2)
    child = int(m.get_sequence(2).kv_cache_ids(1)[0, 0])
    assert child != slot and torch.equal(layer0[child], layer0[slot])
    assert m.free_blocks == [12, 2]  # 3 DENSE blocks + the child's copy of the partial one
    with pytest.raises(ValueError, match="a state cannot un-apply tokens"):
        m.rollback(1, 1)
    assert seq.seen_tokens == 9
    m.check_invariants()


def test_a_state_group_resumes_a_shared_prompt_from_a_checkpoint():
    # With prefix caching, a forward that ends at a multiple of state_checkpoint_tokens saves the
    # state; a later prompt with the same tokens resumes from it, its fresh slot a copy.
    dense = kv_config(block_size=4, max_blocks_per_allocation_group=16)
    state = blockkv.KVCacheConfig(cache_shape=(2, 1, 4), cache_dtype="fp32", type="state",
                                  state_bytes=16)
    prefix = blockkv.PrefixCacheConfig(state_checkpoint_tokens=16)
    assert prefix.state_checkpoint_tokens == 16 and "state_checkpoint_tokens=16" in repr(prefix)
    assert pickle.loads(pickle.dumps(prefix)) == prefix
    with pytest.raises(ValueError, match="state_checkpoint_tokens is -4"):
        blockkv.PrefixCacheConfig(state_checkpoint_tokens=-4)
    config = blockkv.StateManagerConfig(max_tracked_sequences=4, max_ragged_sequence_count=4,
                                        max_context=64, memory_config=allocate(64),
                                        prefix_cache=prefix)
    config.memory_config.state_slots = 8
    m = blockkv.StateManager(config, (dense, state), device="cpu")
    layer0 = torch.from_dlpack(m.get_cache(0, cache_group=1))
    prompt = list(range(100, 140))
    m.add_sequence(1, prompt)
    for chunk in (16, 16, 8):
        m.schedule([1], [chunk])
        slot = int(m.get_sequence(1).kv_cache_ids(1)[0, 0])
        layer0[slot] = float(m.get_sequence(1).seen_tokens + chunk)  # the "state" after it
        m.post_forward([1])
    m.add_sequence(2, prompt)
    m.schedule([2], [40])
    two = m.get_sequence(2)
    assert (two.seen_tokens, two.in_flight_tokens) == (32, 8)
    assert torch.equal(layer0[int(two.kv_cache_ids(1)[0, 0])], torch.full((4,), 32.0))
    m.check_invariants()
    with pytest.raises(ValueError, match="not a multiple of cache group 0's block_size 4"):
        blockkv.StateManager(blockkv.StateManagerConfig(
            max_tracked_sequences=4, max_ragged_sequence_count=4, max_context=64,
            memory_config=allocate(64),
            prefix_cache=blockkv.PrefixCacheConfig(state_checkpoint_tokens=6)),
            (dense, state), device="cpu")
