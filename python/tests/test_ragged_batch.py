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
