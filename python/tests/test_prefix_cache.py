# SPDX-License-Identifier: Apache-2.0
"""Prefix caching from Python: PrefixCacheConfig, StateManager.add_sequence / append_tokens,
hits on a shared prompt, namespace and adapter isolation, events, stats, reset and errors."""

import copy
import pickle

import blockkv
import numpy as np
import pytest
import torch

from conftest import allocate, kv_config

BLOCK = 16


def make_manager(num_blocks=64, prefix=None, **config):
    prefix = prefix if prefix is not None else blockkv.PrefixCacheConfig()
    config = blockkv.StateManagerConfig(memory_config=allocate(num_blocks), prefix_cache=prefix,
                                        **config)
    return blockkv.StateManager(config, (kv_config(block_size=BLOCK),), device="cpu")


def run_prompt(manager, uid, prompt, **keys):
    """Adds `uid`, schedules its whole prompt and completes the forward; returns its descriptor."""
    seq = manager.add_sequence(uid, prompt, **keys)
    manager.schedule([uid], [len(prompt)])
    manager.post_forward([uid])
    manager.check_invariants()
    return seq


PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks and a partial one


def test_config_defaults_and_values():
    p = blockkv.PrefixCacheConfig()
    assert (p.enabled, p.hash_seed, p.max_events, p.sliding_windows) == (True, 0, 65536, [])
    c = blockkv.StateManagerConfig()
    assert c.prefix_cache is None
    assert "prefix_cache=None" in repr(c)
    c = blockkv.StateManagerConfig(prefix_cache=blockkv.PrefixCacheConfig(
        hash_seed=2**64 - 1, max_events=8, sliding_windows=[0, 128]))
    assert c.prefix_cache.hash_seed == 2**64 - 1
    assert c.prefix_cache.sliding_windows == [0, 128]
    assert "sliding_windows=[0, 128]" in repr(c)
    c.prefix_cache.max_events = 4  # a view of the config's own, as memory_config is
    assert c.prefix_cache.max_events == 4
    c.prefix_cache = None
    assert c.prefix_cache is None
    # Disabled with default settings is the same as None.
    assert blockkv.StateManagerConfig(
        prefix_cache=blockkv.PrefixCacheConfig(enabled=False)).prefix_cache is None


def test_config_equality_copy_and_pickle():
    prefix = blockkv.PrefixCacheConfig(hash_seed=7, max_events=3, sliding_windows=[64])
    config = blockkv.StateManagerConfig(max_tracked_sequences=64, max_ragged_sequence_count=32,
                                        prefix_cache=prefix)
    for value in (prefix, config):
        for clone in (copy.copy(value), copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
            assert clone is not value and clone == value and repr(clone) == repr(value)
    assert config != blockkv.StateManagerConfig(max_tracked_sequences=64,
                                                max_ragged_sequence_count=32)
    assert prefix != blockkv.PrefixCacheConfig(hash_seed=8, max_events=3, sliding_windows=[64])


@pytest.mark.parametrize("kwargs", [{"hash_seed": -1}, {"hash_seed": 2**64}, {"max_events": -1},
                                    {"sliding_windows": [0, -4]}])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        blockkv.PrefixCacheConfig(**kwargs)


def test_config_rejects_bad_types_and_bad_assignment():
    with pytest.raises(TypeError):
        blockkv.PrefixCacheConfig(hash_seed=1.5)
    with pytest.raises(TypeError):
        blockkv.StateManagerConfig(prefix_cache={"enabled": True})
    p = blockkv.PrefixCacheConfig(sliding_windows=[32])
    with pytest.raises(ValueError):
        p.sliding_windows = [-1]
    assert p.sliding_windows == [32]  # unchanged
    with pytest.raises(TypeError):
        p.enabled = "yes"


def test_more_windows_than_cache_groups_is_a_value_error():
    with pytest.raises(ValueError, match="sliding_windows"):
        make_manager(prefix=blockkv.PrefixCacheConfig(sliding_windows=[0, 0]))


def test_shared_prompt_hits_its_full_blocks():
    manager = make_manager()
    assert manager.prefix_caching
    first = run_prompt(manager, 1, PROMPT)
    assert first.cached_prefix_tokens == 0 and first.seen_tokens == 40
    assert manager.cached_blocks() == 2

    # Same prompt, as a NumPy array and as a torch tensor: the two full blocks are shared.
    for uid, prompt in ((2, np.array(PROMPT + [5, 6], dtype=np.int32)),
                        (3, torch.tensor(PROMPT + [7], dtype=torch.int64))):
        seq = manager.add_sequence(uid, prompt)
        manager.schedule([uid], [len(prompt)])
        assert seq.cached_prefix_tokens == 32
        assert seq.seen_tokens == 32 and seq.in_flight_tokens == len(prompt) - 32
        assert list(seq.block_table()[:2]) == list(first.block_table()[:2])
        assert seq.block_table()[2] != first.block_table()[2]
        manager.check_invariants()

    stats = manager.prefix_cache_stats()
    assert (stats.lookups, stats.queried_tokens, stats.hit_tokens) == (3, 40 + 42 + 41, 64)
    assert stats.hit_rate == pytest.approx(64 / 123)
    assert stats._asdict()["hit_tokens"] == 64
    assert manager.prefix_cache_stats("") == stats  # everything ran in the default namespace


def test_last_prompt_token_is_always_computed():
    manager = make_manager()
    run_prompt(manager, 1, PROMPT[:32])
    seq = manager.add_sequence(2, PROMPT[:32])
    manager.schedule([2], [32])
    # Both blocks are cached, but the engine needs the logits of token 31: only block 0 is hit.
    assert seq.cached_prefix_tokens == 16 and seq.in_flight_tokens == 16


def test_namespaces_and_adapters_are_isolated():
    manager = make_manager()
    run_prompt(manager, 1, PROMPT, namespace="tenant-a")
    for uid, keys in ((2, {}), (3, {"namespace": "tenant-b"}),
                      (4, {"namespace": "tenant-a", "adapter_id": 9}),
                      (5, {"namespace": "tenant-a", "block_bytes": [b"image-1"]})):
        seq = manager.add_sequence(uid, PROMPT, **keys)
        manager.schedule([uid], [40])
        assert seq.cached_prefix_tokens == 0, keys
    seq = manager.add_sequence(6, PROMPT, "tenant-a")
    manager.schedule([6], [40])
    assert seq.cached_prefix_tokens == 32
    assert manager.prefix_cache_stats("tenant-a").hit_tokens == 32
    assert manager.prefix_cache_stats("tenant-b").hit_tokens == 0
    assert manager.prefix_cache_stats("tenant-b").lookups == 1
    assert manager.prefix_cache_stats("nobody").lookups == 0


def test_block_bytes_key_blocks():
    manager = make_manager()
    run_prompt(manager, 1, PROMPT, block_bytes=[b"img-a", bytearray(b"img-b")])
    same = manager.add_sequence(2, PROMPT, block_bytes=[b"img-a", "img-b"])  # str is UTF-8
    other = manager.add_sequence(3, PROMPT, block_bytes=[b"img-a", b"img-c"])
    manager.schedule([2, 3], [40, 40])
    assert same.cached_prefix_tokens == 32
    assert other.cached_prefix_tokens == 16  # block 0 matches, block 1's bytes differ


def test_events_chain_blocks_and_drain_empties_the_queue():
    manager = make_manager()
    run_prompt(manager, 1, PROMPT, namespace="t", adapter_id=3)
    batch = manager.drain_cache_events()
    assert isinstance(batch, blockkv.CacheEventBatch)
    assert batch.dropped == 0 and len(batch) == 2 and bool(batch)
    first, second = batch.events
    assert list(batch) == batch.events
    assert isinstance(first, blockkv.BlockStored)
    assert first.parent is None and first.parent_hex is None
    assert second.parent == first.hash and second.parent_hex == first.hash_hex
    assert first.tokens == PROMPT[:16] and second.tokens == PROMPT[16:32]
    assert (first.namespace, first.adapter_id, first.group) == ("t", 3, 0)
    assert len(first.hash_hex) == 32 and int(first.hash_hex, 16) == first.hash
    assert 0 <= first.hash < 2**128
    assert "BlockStored(hash=" + first.hash_hex in repr(first)
    empty = manager.drain_cache_events()
    assert len(empty) == 0 and not empty and empty.dropped == 0


def test_keys_depend_on_the_seed_only():
    def first_hash(seed):
        manager = make_manager(prefix=blockkv.PrefixCacheConfig(hash_seed=seed))
        run_prompt(manager, 1, PROMPT)
        return manager.drain_cache_events().events[0].hash

    assert first_hash(0) == first_hash(0)  # the same in every manager, process and run
    assert first_hash(0) != first_hash(1)


def test_decoded_tokens_are_published_with_append_tokens():
    manager = make_manager()
    run_prompt(manager, 1, PROMPT)  # 40 tokens: blocks 0, 1 published
    manager.drain_cache_events()
    for token in range(8):  # decode tokens 40..47 fill block 2
        manager.append_tokens(1, [2000 + token])
        manager.schedule([1], [1])
        manager.post_forward([1])
    events = manager.drain_cache_events().events
    assert len(events) == 1 and events[0].tokens == PROMPT[32:] + list(range(2000, 2008))
    seq = manager.add_sequence(2, PROMPT + list(range(2000, 2008)) + [1])
    manager.schedule([2], [49])
    assert seq.cached_prefix_tokens == 48
    manager.append_tokens(2, 5)  # a single int is one token


def test_post_forward_of_a_batch_records_its_tokens():
    manager = make_manager()
    batch = blockkv.RaggedBatchWrapper(manager)
    seq = manager.add_sequence(1, PROMPT)
    for tokens in (PROMPT, *([[3000 + i] for i in range(8)])):  # prefill, then 8 decode steps
        manager.schedule([1], [len(tokens)])
        batch.clear()
        batch.insert_sequence(seq, tokens)
        batch.finalize()
        manager.post_forward(batch)  # no append_tokens: the batch's tokens become known
    assert seq.seen_tokens == 48
    events = manager.drain_cache_events().events
    assert len(events) == 3 and events[2].tokens == PROMPT[32:] + list(range(3000, 3008))
    other = blockkv.StateManager(manager.config, (kv_config(block_size=BLOCK),), device="cpu")
    with pytest.raises(ValueError):
        other.post_forward(batch)  # another manager's batch
    manager.check_invariants()


def test_reset_drops_unreferenced_blocks_and_reports_it():
    manager = make_manager()
    run_prompt(manager, 1, PROMPT)
    run_prompt(manager, 2, [7] * 20)  # one more block, still held by sequence 2
    manager.drain_cache_events()
    manager.flush_sequence(1)
    assert manager.reset_prefix_cache() == 2
    events = manager.drain_cache_events().events
    assert [type(e) for e in events] == [blockkv.BlockRemoved, blockkv.BlockRemoved]
    assert all(e.group == 0 for e in events)
    assert manager.cached_blocks() == 1
    seq = manager.add_sequence(3, PROMPT)
    manager.schedule([3], [40])
    assert seq.cached_prefix_tokens == 0

    manager.flush_sequence(2)
    manager.flush_sequence(3)
    manager.drain_cache_events()
    assert manager.reset_prefix_cache() >= 1
    events = manager.drain_cache_events().events
    assert isinstance(events[-1], blockkv.AllCleared) and repr(events[-1]) == "AllCleared()"
    assert manager.cached_blocks() == 0
    manager.check_invariants()


def test_dropped_counts_events_lost_to_overflow():
    manager = make_manager(prefix=blockkv.PrefixCacheConfig(max_events=1))
    run_prompt(manager, 1, PROMPT)
    batch = manager.drain_cache_events()
    assert batch.dropped == 1 and len(batch) == 1
    assert batch.events[0].tokens == PROMPT[16:32]  # the oldest went
    manager = make_manager(prefix=blockkv.PrefixCacheConfig(max_events=0))
    run_prompt(manager, 1, PROMPT)
    batch = manager.drain_cache_events()
    assert len(batch) == 0 and batch.dropped == 0


def test_eviction_is_counted_and_reported():
    manager = make_manager(num_blocks=4)
    run_prompt(manager, 1, PROMPT)  # 3 blocks, 2 cached
    manager.flush_sequence(1)
    manager.drain_cache_events()
    run_prompt(manager, 2, [9] * 60)  # needs all 4 blocks: both cached ones are evicted
    assert manager.prefix_cache_stats().evictions == 2
    removed = [e for e in manager.drain_cache_events() if isinstance(e, blockkv.BlockRemoved)]
    assert len(removed) == 2


def test_without_prefix_caching_the_calls_are_harmless():
    config = blockkv.StateManagerConfig(memory_config=allocate(16))
    manager = blockkv.StateManager(config, (kv_config(),), device="cpu")
    assert not manager.prefix_caching
    seq = manager.add_sequence(1, PROMPT)
    manager.schedule([1], [40])
    manager.post_forward([1])
    manager.append_tokens(1, [1, 2])
    assert seq.cached_prefix_tokens == 0
    assert len(manager.drain_cache_events()) == 0
    assert manager.reset_prefix_cache() == 0
    assert manager.prefix_cache_stats().lookups == 0
    assert manager.cached_blocks() == 0


def test_errors():
    manager = make_manager(max_context=64)
    manager.add_sequence(1, PROMPT)
    with pytest.raises(ValueError, match="already tracked"):
        manager.add_sequence(1, PROMPT)
    with pytest.raises(ValueError, match="token id"):
        manager.add_sequence(2, [1, -3])
    with pytest.raises(ValueError, match="token id"):
        manager.add_sequence(2, [2**31])
    with pytest.raises(ValueError, match="priority"):
        manager.add_sequence(2, PROMPT, priority=101)
    with pytest.raises(ValueError, match="max_context"):
        manager.add_sequence(2, list(range(65)))
    with pytest.raises(TypeError):
        manager.add_sequence(2, [1.5, 2.0])
    with pytest.raises(TypeError):
        manager.add_sequence(2, PROMPT, block_bytes=[1])
    with pytest.raises(ValueError, match="token id"):
        manager.append_tokens(1, [-1])
    with pytest.raises(ValueError, match="not tracked"):
        manager.append_tokens(99, [1])
    manager.get_or_create_sequence(3)
    with pytest.raises(ValueError, match="add_sequence|AddSequence"):
        manager.append_tokens(3, [1])  # its earlier tokens are unknown
    with pytest.raises(ValueError):
        manager.cached_blocks(1)
    assert manager.get_sequence(2) is None  # nothing changed on failure
    manager.check_invariants()
