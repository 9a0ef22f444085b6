# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's test_ragged_wrapper.py scenarios (DeepSpeed 38327e07) through blockkv.deepspeed:
placeholder sequences as DeepSpeed's tests build them, and the same layouts from tracked
sequences, which go through blockkv's RaggedBatchWrapper."""

import pytest
import torch

import blockkv
from blockkv.deepspeed import (AllocationMode, DSStateManager, DSStateManagerConfig,
                               KVCacheConfig, MemoryConfig, PlaceholderSequenceDescriptor,
                               RaggedBatchWrapper)
from blockkv.deepspeed.ragged_wrapper import to_padded

MULTI_LENS = [[128, 128], [1, 32, 243], [64, 1, 1, 1, 1, 393, 27, 2]]


@pytest.mark.parametrize("max_ragged_sequence_count, max_ragged_batch_size", [(128, 512),
                                                                               (128, 1024)])
def test_wrapper_initialization(max_ragged_sequence_count, max_ragged_batch_size):
    config = DSStateManagerConfig(max_tracked_sequences=max_ragged_sequence_count,
                                  max_ragged_batch_size=max_ragged_batch_size,
                                  max_ragged_sequence_count=max_ragged_sequence_count)
    batch = RaggedBatchWrapper(config)
    assert batch.current_tokens == 0
    assert batch.current_sequences == 0


@pytest.mark.parametrize("seq_len", [1, 37, 128, 512])
def test_single_sequence_batch(seq_len):
    batch = RaggedBatchWrapper(DSStateManagerConfig())
    tokens = torch.randint(0, 100, (seq_len,))
    batch.insert_sequence(PlaceholderSequenceDescriptor(), tokens)
    batch.finalize()
    assert batch.current_tokens == seq_len
    assert batch.current_sequences == 1
    assert torch.equal(batch.input_ids(), tokens)
    assert torch.equal(batch.tokens_to_seq(), torch.zeros_like(tokens, dtype=torch.int32))
    assert torch.equal(batch.batch_metadata_buffer(),
                       torch.tensor([seq_len, 1], dtype=torch.int32))
    batch.clear()
    assert batch.current_tokens == 0
    assert batch.current_sequences == 0


def _expected(lens):
    starts = [sum(lens[:i]) for i in range(len(lens))]
    tokens_to_seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])
    return starts, tokens_to_seq


@pytest.mark.parametrize("seq_lens", MULTI_LENS)
def test_multi_sequence_batch(seq_lens):
    batch = RaggedBatchWrapper(DSStateManagerConfig())
    all_tokens = [torch.randint(0, 100, (n,)) for n in seq_lens]
    for i, tokens in enumerate(all_tokens):
        batch.insert_sequence(PlaceholderSequenceDescriptor(), tokens)
        assert batch.current_sequences == i + 1
        assert batch.current_tokens == sum(seq_lens[:i + 1])
    batch.finalize()
    starts, tokens_to_seq = _expected(seq_lens)
    assert torch.equal(batch.input_ids(), torch.cat(all_tokens))
    assert torch.equal(batch.tokens_to_seq(), tokens_to_seq)
    descriptors = batch.inflight_seq_descriptors()
    for i, n in enumerate(seq_lens):
        assert descriptors[i, :3].tolist() == [starts[i], n, 0]
    assert batch.batch_metadata_buffer().tolist() == [sum(seq_lens), len(seq_lens)]
    batch.clear()
    assert (batch.current_tokens, batch.current_sequences) == (0, 0)


def _manager(config, block_size=64):
    kv = KVCacheConfig(block_size=block_size, cache_shape=(1, 2, 64),
                       max_blocks_per_allocation_group=64)
    return DSStateManager(config, (kv,), device="cpu")


def _insert_tracked(manager, batch, uid, tokens, history=0):
    # engine_v2's put for one uid: get_or_create_sequence, maybe_allocate_kv, pre_forward, insert.
    seq = manager.get_or_create_sequence(uid)
    if history:
        _allocate(manager, seq, history)
        seq.pre_forward(history)
        seq.post_forward()
    _allocate(manager, seq, tokens.numel())
    seq.pre_forward(tokens.numel())
    batch.insert_sequence(seq, tokens, do_checks=True)
    return seq


def _allocate(manager, seq, n):
    bs = manager.kv_block_size
    need = -(-(seq.seen_tokens + n) // bs) - seq.cur_allocated_blocks
    if need > 0:
        seq.extend_kv_cache(manager.allocate_blocks(need))


@pytest.mark.parametrize("seq_lens", MULTI_LENS)
def test_multi_sequence_batch_of_tracked_sequences(seq_lens):
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode=AllocationMode.ALLOCATE,
                                                             size=64))
    manager = _manager(config)
    batch = RaggedBatchWrapper(config)
    all_tokens = [torch.randint(0, 100, (n,)) for n in seq_lens]
    history = [3 * i for i in range(len(seq_lens))]
    for i, tokens in enumerate(all_tokens):
        _insert_tracked(manager, batch, 100 + i, tokens, history[i])
        assert (batch.current_sequences, batch.current_tokens) == (i + 1, sum(seq_lens[:i + 1]))
    batch.finalize()
    starts, tokens_to_seq = _expected(seq_lens)
    assert batch.input_ids().dtype == torch.int64
    assert torch.equal(batch.input_ids(), torch.cat(all_tokens))
    assert torch.equal(batch.tokens_to_seq(), tokens_to_seq)
    descriptors = batch.inflight_seq_descriptors()
    assert descriptors.dtype == torch.int32 and descriptors.shape == (len(seq_lens), 4)
    for i, n in enumerate(seq_lens):
        assert descriptors[i].tolist() == [starts[i], n, history[i], 0]
    assert batch.batch_metadata_buffer().tolist() == [sum(seq_lens), len(seq_lens)]
    kv_ptrs = batch.kv_ptrs()
    assert kv_ptrs.dtype == torch.int64 and kv_ptrs.shape == (len(seq_lens),)
    # Each kv_ptr is the address of the sequence's block-table row in the batch.
    tables = torch.from_numpy(batch.core.block_tables())
    for i in range(len(seq_lens)):
        assert kv_ptrs[i].item() == tables[i].data_ptr()
        seq = manager.get_sequence(100 + i)
        assert tables[i, :seq.cur_allocated_blocks].tolist() == seq.all_block_ids().tolist()
    assert batch.masks() is None
    for uid in range(100, 100 + len(seq_lens)):
        manager.get_sequence(uid).post_forward()
    manager.check_invariants()
    batch.clear()
    assert (batch.current_tokens, batch.current_sequences) == (0, 0)


def test_accessors_on_device_false_give_the_same_host_arrays():
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=8))
    manager = _manager(config)
    batch = RaggedBatchWrapper(config)
    _insert_tracked(manager, batch, 1, torch.tensor([5, 6, 7]))
    batch.finalize()
    for name in ("input_ids", "tokens_to_seq", "inflight_seq_descriptors", "kv_ptrs",
                 "batch_metadata_buffer"):
        assert torch.equal(getattr(batch, name)(on_device=False), getattr(batch, name)())
    assert batch.masks(on_device=False) is None


@pytest.mark.parametrize("n, padded", [(0, 0), (1, 64), (64, 64), (65, 128), (512, 512),
                                       (513, 640), (768, 768)])
def test_to_padded_golden_values(n, padded):
    assert to_padded(n) == padded


@pytest.mark.parametrize("tracked", [False, True])
def test_finalize_with_padding_fills_minus_one(tracked):
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=8))
    batch = RaggedBatchWrapper(config)
    tokens = torch.arange(70)
    if tracked:
        _insert_tracked(_manager(config), batch, 1, tokens)
    else:
        batch.insert_sequence(PlaceholderSequenceDescriptor(), tokens)
    batch.finalize(padding=True)
    assert batch.tensor_toks == 128
    assert torch.equal(batch.input_ids()[:70], tokens)
    assert batch.input_ids()[70:].eq(-1).all()
    assert batch.tokens_to_seq()[70:].eq(-1).all()
    assert batch.batch_metadata_buffer().tolist() == [70, 1]


@pytest.mark.parametrize("tracked", [False, True])
def test_tokens_on_a_device_are_refused(tracked):
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=8))
    batch = RaggedBatchWrapper(config)
    seq = PlaceholderSequenceDescriptor()
    if tracked:
        manager = _manager(config)
        seq = manager.get_or_create_sequence(1)
        _allocate(manager, seq, 3)
        seq.pre_forward(3)
    with pytest.raises(RuntimeError, match="Expected tokens to be on host but found device 'meta'"):
        batch.insert_sequence(seq, torch.empty(3, dtype=torch.int64, device="meta"))
    assert batch.current_sequences == 0


def test_placeholder_limits_raise_runtime_error():
    config = DSStateManagerConfig(max_tracked_sequences=2, max_ragged_batch_size=8,
                                  max_ragged_sequence_count=2)
    batch = RaggedBatchWrapper(config)
    batch.insert_sequence(PlaceholderSequenceDescriptor(), torch.arange(6))
    with pytest.raises(RuntimeError, match="capacity limit: 8"):
        batch.insert_sequence(PlaceholderSequenceDescriptor(), torch.arange(3))
    batch.insert_sequence(PlaceholderSequenceDescriptor(), torch.arange(2))
    with pytest.raises(RuntimeError, match="sequence limit: 2"):
        batch.insert_sequence(PlaceholderSequenceDescriptor(), torch.arange(0))
    assert (batch.current_sequences, batch.current_tokens) == (2, 8)


def test_tracked_limits_raise_runtime_error_and_change_nothing():
    config = DSStateManagerConfig(max_tracked_sequences=4, max_ragged_batch_size=8,
                                  max_ragged_sequence_count=2,
                                  memory_config=MemoryConfig(mode="allocate", size=8))
    manager = _manager(config, block_size=4)
    batch = RaggedBatchWrapper(config)
    _insert_tracked(manager, batch, 1, torch.arange(6))
    seq = manager.get_or_create_sequence(2)
    _allocate(manager, seq, 3)
    seq.pre_forward(3)
    with pytest.raises(RuntimeError):  # 9 tokens > max_ragged_batch_size, whatever do_checks
        batch.insert_sequence(seq, torch.arange(3), do_checks=False)
    assert (batch.current_sequences, batch.current_tokens) == (1, 6)


def test_insert_needs_pre_forward_of_exactly_the_tokens():
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=8))
    manager = _manager(config)
    batch = RaggedBatchWrapper(config)
    seq = manager.get_or_create_sequence(1)
    _allocate(manager, seq, 4)
    with pytest.raises(ValueError):  # nothing in flight
        batch.insert_sequence(seq, torch.arange(4))
    seq.pre_forward(3)
    with pytest.raises(ValueError):  # 4 tokens for 3 in flight
        batch.insert_sequence(seq, torch.arange(4))
    assert batch.current_sequences == 0


def test_placeholders_and_tracked_sequences_do_not_mix():
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=8))
    manager = _manager(config)
    batch = RaggedBatchWrapper(config)
    batch.insert_sequence(PlaceholderSequenceDescriptor(), torch.arange(2))
    seq = manager.get_or_create_sequence(1)
    _allocate(manager, seq, 2)
    seq.pre_forward(2)
    with pytest.raises(ValueError, match="Placeholder"):
        batch.insert_sequence(seq, torch.arange(2))
    batch.clear()
    batch.insert_sequence(seq, torch.arange(2))
    with pytest.raises(ValueError, match="tracked"):
        batch.insert_sequence(PlaceholderSequenceDescriptor(), torch.arange(2))


def test_batch_config_must_match_the_managers_limits():
    manager = _manager(DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=8)))
    batch = RaggedBatchWrapper(DSStateManagerConfig(max_ragged_batch_size=1024))
    seq = manager.get_or_create_sequence(1)
    _allocate(manager, seq, 1)
    seq.pre_forward(1)
    with pytest.raises(ValueError, match="max_ragged_batch_size"):
        batch.insert_sequence(seq, torch.tensor([1]))


def test_empty_batch_finalizes():
    # DeepSpeed's finalize of an empty batch fails in torch.cat.
    config = DSStateManagerConfig()
    batch = RaggedBatchWrapper(config)
    batch.finalize()
    assert batch.input_ids().numel() == 0
    assert batch.batch_metadata_buffer().tolist() == [0, 0]


def test_core_batch_drives_blockkv_kernels():
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=8))
    manager = _manager(config, block_size=4)
    batch = RaggedBatchWrapper(config)
    _insert_tracked(manager, batch, 1, torch.arange(6))
    batch.finalize()
    layer = manager.get_cache(0)
    k = torch.randn(6, 2, 64, dtype=torch.float16)
    v = torch.randn(6, 2, 64, dtype=torch.float16)
    blockkv.append_kv(layer, k, v, batch.core)
    blocks = manager.get_sequence(1).all_block_ids().tolist()
    for t in range(6):
        assert torch.equal(layer[blocks[t // 4], t % 4, 0], k[t])
        assert torch.equal(layer[blocks[t // 4], t % 4, 1], v[t])


def test_int32_tokens_and_tokens_outside_int32():
    config = DSStateManagerConfig(memory_config=MemoryConfig(mode="allocate", size=8))
    manager = _manager(config)
    batch = RaggedBatchWrapper(config)
    seq = manager.get_or_create_sequence(1)
    _allocate(manager, seq, 3)
    seq.pre_forward(3)
    with pytest.raises(ValueError, match="outside int32"):  # blockkv's token ids are int32
        batch.insert_sequence(seq, torch.tensor([1, 2**40, 3]))
    assert batch.current_sequences == 0
    batch.insert_sequence(seq, torch.tensor([4, 5, 6], dtype=torch.int32))
    batch.finalize()
    assert batch.input_ids().tolist() == [4, 5, 6]
