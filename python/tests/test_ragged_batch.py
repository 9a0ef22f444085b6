# SPDX-License-Identifier: Apache-2.0
"""RaggedBatchWrapper: DeepSpeed's ragged-wrapper scenarios (test_ragged_wrapper.py), restated
against blockkv with a real StateManager (each sequence scheduled before it is inserted), plus
the CSR page table, the slot mapping, padding, and the array views' lifetime."""

import gc

import blockkv
import numpy as np
import pytest
import torch
from conftest import make_manager


def step(manager, lengths, rng, first_uid=0):
    """Schedules one new sequence per length; returns (uids, tokens per sequence)."""
    uids = list(range(first_uid, first_uid + len(lengths)))
    manager.schedule(uids, lengths)
    tokens = [rng.integers(0, 100, size=n, dtype=np.int64) for n in lengths]
    return uids, tokens


def check_finalized(batch, descriptors, tokens, seen=None):
    """The arrays of a finalized batch of `descriptors` with new `tokens`, unpadded."""
    lens = [t.size for t in tokens]
    seen = seen or [0] * len(lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    assert batch.current_tokens == sum(lens) and batch.current_sequences == len(lens)
    np.testing.assert_array_equal(batch.input_ids(), np.concatenate(tokens))
    np.testing.assert_array_equal(
        batch.tokens_to_seq(), np.concatenate([np.full(n, i) for i, n in enumerate(lens)]))
    rows = batch.inflight_seq_descriptors()
    assert rows.shape == (len(lens), 4) and rows.dtype == np.int32
    np.testing.assert_array_equal(rows[:, 0], starts)
    np.testing.assert_array_equal(rows[:, 1], lens)
    np.testing.assert_array_equal(rows[:, 2], seen)
    assert batch.batch_metadata_buffer().tolist() == [sum(lens), len(lens)]
    # kv_ptrs: the address of each sequence's row of the batch's block_tables (DeepSpeed points
    # at the manager's table row instead; blockkv's batch holds its own copy of the rows).
    tables = batch.block_tables()
    np.testing.assert_array_equal(
        batch.kv_ptrs(), [tables.ctypes.data + i * tables.strides[0] for i in range(len(lens))])
    for row, d in zip(tables, descriptors):
        n = d.cur_allocated_blocks
        assert row[:n].tolist() == d.block_table().tolist() and np.all(row[n:] == -1)


@pytest.mark.parametrize("seq_count, batch_size", [(128, 512), (128, 1024)])
def test_construction_is_empty(seq_count, batch_size):
    m = make_manager(max_ragged_sequence_count=seq_count, max_ragged_batch_size=batch_size,
                     max_tracked_sequences=seq_count)
    batch = blockkv.RaggedBatchWrapper(m)
    assert batch.current_tokens == 0 and batch.current_sequences == 0


@pytest.mark.parametrize("n_tokens", [1, 37, 128, 512])
def test_one_sequence(n_tokens):
    rng = np.random.default_rng(n_tokens)
    m = make_manager(num_blocks=64, block_size=16)  # DeepSpeed's default limits
    batch = blockkv.RaggedBatchWrapper(m)
    uids, tokens = step(m, [n_tokens], rng)
    seq = m.get_sequence(uids[0])
    batch.insert_sequence(seq, tokens[0])
    assert batch.current_tokens == n_tokens and batch.current_sequences == 1
    batch.finalize()
    check_finalized(batch, [seq], tokens)
    assert np.all(batch.tokens_to_seq() == 0)
    assert batch.batch_metadata_buffer().tolist() == [n_tokens, 1]
    batch.clear()
    assert batch.current_tokens == 0 and batch.current_sequences == 0


@pytest.mark.parametrize("lengths", [[128, 128], [1, 32, 243], [64, 1, 1, 1, 1, 393, 27, 2]])
def test_several_sequences(lengths):
    rng = np.random.default_rng(len(lengths))
    m = make_manager(num_blocks=128, block_size=16)
    batch = blockkv.RaggedBatchWrapper(m)
    uids, tokens = step(m, lengths, rng)
    seqs = [m.get_sequence(u) for u in uids]
    for i, (seq, toks) in enumerate(zip(seqs, tokens)):
        batch.insert_sequence(seq, toks)
        assert batch.current_sequences == i + 1
        assert batch.current_tokens == sum(lengths[: i + 1])
    batch.finalize()
    check_finalized(batch, seqs, tokens)
    # The batch after each insert: rebuilt from the same (still in-flight) sequences.
    for i in range(len(lengths)):
        batch.clear()
        for seq, toks in zip(seqs[: i + 1], tokens[: i + 1]):
            batch.insert_sequence(seq, toks)
        batch.finalize()
        check_finalized(batch, seqs[: i + 1], tokens[: i + 1])


def test_page_table_and_slot_mapping():
    rng = np.random.default_rng(3)
    bs = 16
    m = make_manager(num_blocks=64, block_size=bs, max_blocks=8)
    batch = blockkv.RaggedBatchWrapper(m)
    uids, tokens = step(m, [20, 5, 33], rng)
    seqs = [m.get_sequence(u) for u in uids]
    for seq, toks in zip(seqs, tokens):
        batch.insert_sequence(seq, toks)
    batch.finalize()
    tables = batch.block_tables()
    assert tables.shape == (3, 8)
    for row, seq in zip(tables, seqs):
        n = seq.cur_allocated_blocks
        assert row[:n].tolist() == seq.block_table().tolist() and np.all(row[n:] == -1)
    indptr = batch.kv_indptr()
    assert indptr.tolist() == [0, 2, 3, 6]
    np.testing.assert_array_equal(batch.kv_indices(),
                                  np.concatenate([s.block_table() for s in seqs]))
    assert batch.kv_last_page_len().tolist() == [20 - 16, 5, 33 - 32]
    slots = batch.slot_mapping()
    assert slots.dtype == np.int64 and slots.size == 58
    expected = [seq.block_table()[p // bs] * bs + p % bs
                for seq, n in zip(seqs, [20, 5, 33]) for p in range(n)]
    assert slots.tolist() == expected


def test_a_decode_step_continues_the_sequences():
    rng = np.random.default_rng(4)
    m = make_manager(num_blocks=64, block_size=16)
    batch = blockkv.RaggedBatchWrapper(m)
    uids, tokens = step(m, [17, 3], rng)
    for u, t in zip(uids, tokens):
        batch.insert_sequence(m.get_sequence(u), t)
    batch.finalize()
    m.post_forward(uids)
    batch.clear()
    m.schedule(uids, [1, 1])
    nxt = [np.array([7]), np.array([8])]
    for u, t in zip(uids, nxt):
        batch.insert_sequence(m.get_sequence(u), t)
    batch.finalize()
    check_finalized(batch, [m.get_sequence(u) for u in uids], nxt, seen=[17, 3])
    assert batch.slot_mapping().tolist()[0] == m.get_sequence(0).block_table()[1] * 16 + 1


def test_padding_follows_deepspeeds_to_padded():
    rng = np.random.default_rng(5)
    m = make_manager(num_blocks=64, block_size=16)
    batch = blockkv.RaggedBatchWrapper(m)
    uids, tokens = step(m, [65], rng)
    batch.insert_sequence(m.get_sequence(uids[0]), tokens[0])
    batch.finalize(padding=True)
    assert batch.padded_tokens == batch.tensor_toks == 128
    ids = batch.input_ids()
    assert ids.size == 128 and np.all(ids[65:] == -1)
    assert np.all(batch.tokens_to_seq()[65:] == -1) and np.all(batch.slot_mapping()[65:] == -1)
    assert batch.current_tokens == 65


def test_on_device_on_a_host_cache_gives_the_host_arrays():
    rng = np.random.default_rng(6)
    m = make_manager()
    batch = blockkv.RaggedBatchWrapper(m)
    uids, tokens = step(m, [5], rng)
    batch.insert_sequence(m.get_sequence(uids[0]), tokens[0])
    batch.finalize()
    for name in ("input_ids", "tokens_to_seq", "inflight_seq_descriptors",
                 "batch_metadata_buffer", "kv_ptrs", "block_tables", "kv_indptr", "kv_indices",
                 "kv_last_page_len", "slot_mapping"):
        on, off = getattr(batch, name)(), getattr(batch, name)(on_device=False)
        assert isinstance(on, np.ndarray)
        np.testing.assert_array_equal(on, off)
        assert on.ctypes.data == off.ctypes.data  # the same host array, no copy
    assert batch.masks() is None


def test_arrays_are_zero_copy_views_that_outlive_the_batch():
    rng = np.random.default_rng(7)
    m = make_manager()
    batch = blockkv.RaggedBatchWrapper(m)
    uids, tokens = step(m, [6], rng)
    batch.insert_sequence(m.get_sequence(uids[0]), tokens[0])
    batch.finalize()
    ids = batch.input_ids()
    as_torch = torch.from_dlpack(ids)  # NumPy arrays speak DLPack too
    assert as_torch.data_ptr() == ids.ctypes.data
    del batch, m
    gc.collect()
    np.testing.assert_array_equal(ids, tokens[0])
    assert as_torch.tolist() == tokens[0].tolist()


def test_tokens_as_list_numpy_and_torch():
    m = make_manager()
    batch = blockkv.RaggedBatchWrapper(m)
    m.schedule([1, 2, 3, 4], [3, 3, 3, 1])
    batch.insert_sequence(m.get_sequence(1), [1, 2, 3])
    batch.insert_sequence(m.get_sequence(2), np.array([4, 5, 6], dtype=np.int32))
    batch.insert_sequence(m.get_sequence(3), torch.tensor([7, 8, 9]))
    batch.insert_sequence(m.get_sequence(4), 10)
    batch.finalize()
    assert batch.input_ids().tolist() == list(range(1, 11))


def test_insert_errors():
    m = make_manager(max_ragged_batch_size=8, max_ragged_sequence_count=2)
    other = make_manager()
    batch = blockkv.RaggedBatchWrapper(m)
    m.schedule([1, 2], [4, 4])
    with pytest.raises(ValueError):  # not scheduled for these many tokens
        batch.insert_sequence(m.get_sequence(1), [1, 2])
    batch.insert_sequence(m.get_sequence(1), [1, 2, 3, 4])
    with pytest.raises(ValueError):  # already in the batch
        batch.insert_sequence(m.get_sequence(1), [1, 2, 3, 4])
    other.schedule([2], [4])
    with pytest.raises(ValueError):
        batch.insert_sequence(other.get_sequence(2), [1, 2, 3, 4])
    with pytest.raises(TypeError):
        batch.insert_sequence(blockkv.PlaceholderSequenceDescriptor(), [1])
    with pytest.raises(TypeError):
        batch.insert_sequence(m.get_sequence(2), [1.5, 2, 3, 4])
    with pytest.raises(ValueError):  # arrays are read after finalize
        batch.input_ids()
    batch.insert_sequence(m.get_sequence(2), [5, 6, 7, 8])
    batch.finalize()
    with pytest.raises(ValueError):  # finalized: clear first
        batch.insert_sequence(m.get_sequence(2), [5, 6, 7, 8])


def test_batch_limits_raise_what_deepspeed_raises():
    m = make_manager(max_ragged_batch_size=8, max_ragged_sequence_count=2,
                     max_tracked_sequences=8)
    batch = blockkv.RaggedBatchWrapper(m)
    m.schedule([1, 2], [6, 2])
    batch.insert_sequence(m.get_sequence(1), list(range(6)))
    batch.insert_sequence(m.get_sequence(2), [1, 2])
    m.schedule([3], [1])
    with pytest.raises(RuntimeError, match="sequence limit"):  # DeepSpeed: RuntimeError
        batch.insert_sequence(m.get_sequence(3), [1])
    with pytest.raises(blockkv.ResourceExhaustedError):
        batch.insert_sequence(m.get_sequence(3), [1])
    assert batch.current_sequences == 2 and batch.current_tokens == 8


def test_takes_the_manager_not_the_config():
    with pytest.raises(TypeError, match="StateManager"):
        blockkv.RaggedBatchWrapper(blockkv.StateManagerConfig())


def test_an_empty_batch_finalizes():
    m = make_manager()
    batch = blockkv.RaggedBatchWrapper(m)
    batch.finalize(padding=True)
    assert batch.input_ids().size == 0 and batch.batch_metadata_buffer().tolist() == [0, 0]
    assert batch.kv_indptr().tolist() == [0]


# --- StateManager.schedule_batch: schedule + insert_sequence + finalize in one call -------------

ARRAYS = ("input_ids", "tokens_to_seq", "inflight_seq_descriptors", "batch_metadata_buffer",
          "block_tables", "kv_indptr", "kv_indices", "kv_last_page_len", "slot_mapping")


def snapshot(batch):
    """Copies of every array of a finalized batch, and its sizes."""
    arrays = {name: getattr(batch, name)().copy() for name in ARRAYS}
    # kv_ptrs are addresses of the batch's own block_tables rows: compared as row offsets.
    arrays["kv_ptrs"] = batch.kv_ptrs() - batch.block_tables().ctypes.data
    sizes = (batch.current_tokens, batch.current_sequences, batch.padded_tokens, batch.finalized)
    return arrays, sizes


def assert_same_batch(a, b):
    (arrays_a, sizes_a), (arrays_b, sizes_b) = snapshot(a), snapshot(b)
    assert sizes_a == sizes_b
    for name in arrays_a:
        np.testing.assert_array_equal(arrays_a[name], arrays_b[name], err_msg=name)


def reference_step(manager, batch, uids, lengths, tokens, padding):
    """What schedule_batch replaces: schedule, insert each sequence's tokens, finalize."""
    manager.schedule(uids, lengths)
    batch.clear()
    start = 0
    for uid, n in zip(uids, lengths):
        batch.insert_sequence(manager.get_sequence(uid), tokens[start:start + n])
        start += n
    batch.finalize(padding=padding)


@pytest.mark.parametrize("padding", [False, True])
def test_schedule_batch_builds_what_schedule_insert_and_finalize_build(padding):
    rng = np.random.default_rng(11)
    # Two managers with the same history hand out the same blocks: one steps the separate way,
    # the other through schedule_batch.
    ref, fast = (make_manager(num_blocks=64, block_size=16, max_blocks=8) for _ in range(2))
    ref_batch, fast_batch = blockkv.RaggedBatchWrapper(ref), blockkv.RaggedBatchWrapper(fast)
    steps = [([0, 1, 2], [20, 5, 33]),       # prefills
             ([0, 1, 2, 3], [1, 12, 1, 40]),  # decodes, a chunk of history, a new prefill
             ([3, 2, 1, 0], [1, 1, 1, 15])]   # decodes across a block boundary, order changed
    for uids, lengths in steps:
        tokens = rng.integers(0, 32000, size=sum(lengths), dtype=np.int64)
        seen = [ref.get_sequence(u).seen_tokens if ref.get_sequence(u) else 0 for u in uids]
        reference_step(ref, ref_batch, uids, lengths, tokens, padding)
        fast.schedule_batch(uids, lengths, tokens, fast_batch, padding=padding)
        assert_same_batch(fast_batch, ref_batch)
        np.testing.assert_array_equal(fast_batch.input_ids()[:sum(lengths)], tokens)
        assert fast_batch.inflight_seq_descriptors()[:, 2].tolist() == seen
        for u in uids:
            assert (fast.get_sequence(u).block_table().tolist()
                    == ref.get_sequence(u).block_table().tolist())
        ref.post_forward(ref_batch)
        fast.post_forward(fast_batch)
        fast.check_invariants()
    assert fast.free_blocks == ref.free_blocks


def test_schedule_batch_then_post_forward_advances_the_sequences():
    m = make_manager(num_blocks=64, block_size=16)
    batch = blockkv.RaggedBatchWrapper(m)
    m.schedule_batch([1, 2], [17, 3], list(range(20)), batch)
    assert [m.get_sequence(u).in_flight_tokens for u in (1, 2)] == [17, 3]
    m.post_forward(batch)
    assert [(m.get_sequence(u).seen_tokens, m.get_sequence(u).in_flight_tokens)
            for u in (1, 2)] == [(17, 0), (3, 0)]
    m.schedule_batch([1, 2], [1, 1], np.array([7, 8], dtype=np.int32), batch)
    check_finalized(batch, [m.get_sequence(u) for u in (1, 2)],
                    [np.array([7]), np.array([8])], seen=[17, 3])
    assert batch.slot_mapping().tolist()[0] == m.get_sequence(1).block_table()[1] * 16 + 1
    m.post_forward(batch)
    assert [m.get_sequence(u).seen_tokens for u in (1, 2)] == [18, 4]
    m.check_invariants()


def test_schedule_batch_takes_tokens_as_list_numpy_and_torch():
    m = make_manager()
    batch = blockkv.RaggedBatchWrapper(m)
    for i, tokens in enumerate(([1, 2, 3, 4], np.array([1, 2, 3, 4], dtype=np.int32),
                                torch.tensor([1, 2, 3, 4]))):
        m.schedule_batch([i * 2, i * 2 + 1], [3, 1], tokens, batch)
        assert batch.input_ids().tolist() == [1, 2, 3, 4]
        m.post_forward(batch)


def test_schedule_batch_limit_hit_raises_and_leaves_manager_and_batch_as_they_were():
    m = make_manager(num_blocks=8, block_size=16, max_blocks=8, max_ragged_batch_size=64,
                     max_ragged_sequence_count=8)
    batch = blockkv.RaggedBatchWrapper(m)
    m.schedule_batch([1], [20], list(range(20)), batch, padding=True)
    m.post_forward(batch)
    before = snapshot(batch)
    free, seq = m.free_blocks, m.get_sequence(1)
    for lengths, result in (([1, 100], blockkv.SchedulingResult.KVCacheLimitExceeded),
                            ([1, 64], blockkv.SchedulingResult.BatchTokenLimitExceeded)):
        with pytest.raises(blockkv.SchedulingError) as failure:
            m.schedule_batch([1, 2], lengths, list(range(sum(lengths))), batch)
        assert failure.value.result == result
        assert m.free_blocks == free and m.n_tracked_sequences == 1
        assert (seq.seen_tokens, seq.in_flight_tokens) == (20, 0)
        after = snapshot(batch)
        assert after[1] == before[1]
        for name in before[0]:
            np.testing.assert_array_equal(after[0][name], before[0][name], err_msg=name)
    m.check_invariants()


def test_schedule_batch_argument_errors_are_value_errors_and_change_nothing():
    m = make_manager(num_blocks=8, block_size=16)
    other = make_manager()
    batch = blockkv.RaggedBatchWrapper(m)
    m.schedule_batch([1], [3], [1, 2, 3], batch)
    before = snapshot(batch)
    with pytest.raises(ValueError, match="4 tokens given, but the lengths add up to 5"):
        m.schedule_batch([1, 2], [2, 3], [1, 2, 3, 4], batch)
    with pytest.raises(ValueError):  # a wrong count wins over a limit that is also hit
        m.schedule_batch([1, 2], [2, 1000], [1, 2], batch)
    with pytest.raises(ValueError, match="another state manager"):
        other.schedule_batch([1], [1], [5], batch)
    with pytest.raises(ValueError):  # a duplicate uid
        m.schedule_batch([2, 2], [1, 1], [5, 6], batch)
    with pytest.raises(TypeError):
        m.schedule_batch([2], [1], [1.5], batch)
    with pytest.raises(TypeError):  # not a RaggedBatchWrapper
        m.schedule_batch([2], [1], [1], None)
    assert m.n_tracked_sequences == 1 and other.n_tracked_sequences == 0
    assert m.get_sequence(1).in_flight_tokens == 3
    after = snapshot(batch)
    assert after[1] == before[1]
    for name in before[0]:
        np.testing.assert_array_equal(after[0][name], before[0][name], err_msg=name)


def test_schedule_batch_gives_a_prefix_hit_the_tokens_past_its_cached_prefix():
    m = make_manager(num_blocks=16, block_size=16, prefix_cache=blockkv.PrefixCacheConfig())
    batch = blockkv.RaggedBatchWrapper(m)
    prompt = list(range(1000, 1040))  # two full blocks and a partial one
    m.add_sequence(1, prompt)
    m.schedule_batch([1], [40], prompt, batch)
    m.post_forward(batch)
    seq = m.add_sequence(2, prompt)
    m.schedule_batch([1, 2], [1, 40], [7] + prompt, batch)
    assert seq.cached_prefix_tokens == 32 and seq.in_flight_tokens == 8
    assert batch.input_ids().tolist() == [7] + prompt[32:]
    assert batch.inflight_seq_descriptors().tolist() == [[0, 1, 40, 0], [1, 8, 32, 0]]
    assert batch.kv_indptr().tolist() == [0, 3, 6]
    # The hit shares the first sequence's two full blocks.
    assert batch.kv_indices().tolist()[3:5] == m.get_sequence(1).block_table().tolist()[:2]
    m.post_forward(batch)
    assert seq.seen_tokens == 40
    m.check_invariants()


def test_schedule_batch_gives_a_chunked_prefix_hit_the_tokens_at_its_positions():
    m = make_manager(num_blocks=16, block_size=16, prefix_cache=blockkv.PrefixCacheConfig())
    batch = blockkv.RaggedBatchWrapper(m)
    prompt = list(range(1000, 1040))
    m.add_sequence(1, prompt)
    m.schedule_batch([1], [40], prompt, batch)
    m.post_forward(batch)
    # The second request's first chunk, 4 of its 40 tokens (what schedule would run too: the 4
    # after the 32 cached ones); its tokens are passed from its first, as for any sequence.
    seq = m.add_sequence(2, prompt)
    m.schedule_batch([2], [4], prompt[:4], batch)
    assert (seq.seen_tokens, seq.in_flight_tokens) == (32, 4)
    assert batch.inflight_seq_descriptors().tolist() == [[0, 4, 32, 0]]
    assert batch.input_ids().tolist() == prompt[32:36]
