# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's engine (engine_v2.py's put / query / can_schedule / flush, the model's
get_kv_requirements / maybe_allocate_kv) replayed over blockkv.deepspeed with a stand-in model
(tokens in, random logits out), driven by an MII-style scheduler for 1,000 steps with
check_invariants() after each; and the manager / descriptor / cache calls one by one."""

import math
import random
import warnings

import numpy
import pytest
import torch

import blockkv
from blockkv.deepspeed import (AllocationMode, DSSequenceDescriptor, DSStateManager,
                               DSStateManagerConfig, KVCacheConfig, MemoryConfig,
                               PlaceholderSequenceDescriptor, RaggedBatchWrapper, split_kv)
from blockkv.deepspeed.kv_cache import BlockedKVCache
from blockkv.deepspeed.sequence_descriptor import BaseSequenceDescriptor

VOCAB = 50


class StandInModel:
    """DSTransformerModelBase's KV-cache arithmetic, and a forward that reads what DeepSpeed's
    kernels read of the batch and returns random logits [n_seqs, vocab]."""

    def __init__(self, block_size, max_sequence_length, seed=0):
        self.block_size = block_size
        self.max_sequence_length = max_sequence_length
        self.generator = torch.Generator().manual_seed(seed)
        self.state_manager = None
        self.expected = None  # uid -> (seen_tokens, tokens) the engine's caller put

    def kv_cache_config(self):
        return (KVCacheConfig(block_size=self.block_size, cache_shape=(2, 2, 64),
                              cache_dtype=torch.float16,
                              max_blocks_per_allocation_group=math.ceil(
                                  self.max_sequence_length / self.block_size)),)

    def get_kv_requirements(self, sequence, max_new_tokens, max_new_blocks):
        total_tokens = sequence.seen_tokens + max_new_tokens
        req_blocks = -(-total_tokens // self.block_size)
        block_lim = req_blocks - sequence.cur_allocated_blocks
        if block_lim <= max_new_blocks:
            return max_new_tokens, block_lim
        token_capacity = ((max_new_blocks + sequence.cur_allocated_blocks) * self.block_size -
                          sequence.seen_tokens)
        return token_capacity, max_new_blocks

    def get_remaining_block_capacity(self, sequence):
        return sequence.seen_tokens % self.block_size

    def maybe_allocate_kv(self, sequence, n_new_tokens):
        free_block = self.state_manager.free_blocks[0]
        _, n_needed_blocks = self.get_kv_requirements(sequence, n_new_tokens, free_block)
        if n_needed_blocks > 0:
            new_blocks = self.state_manager.allocate_blocks(n_needed_blocks)
            sequence.extend_kv_cache(new_blocks)

    def maybe_free_kv(self, sequence):
        pass

    def prepare_batch(self, batch):
        pass

    def forward(self, batch):
        n_tokens, n_seqs = batch.batch_metadata_buffer().tolist()
        assert n_seqs == batch.current_sequences and n_tokens == batch.current_tokens
        input_ids = batch.input_ids()
        descriptors = batch.inflight_seq_descriptors()
        tokens_to_seq = batch.tokens_to_seq()
        kv_ptrs = batch.kv_ptrs()
        assert input_ids.shape == (n_tokens,) and tokens_to_seq.shape == (n_tokens,)
        assert descriptors.shape == (n_seqs, 4) and kv_ptrs.shape == (n_seqs,)
        assert batch.masks() is None
        if self.expected is not None:
            for i, (seen, tokens) in enumerate(self.expected):
                start, count, desc_seen, _ = descriptors[i].tolist()
                assert (count, desc_seen) == (len(tokens), seen)
                assert input_ids[start:start + count].tolist() == tokens
                assert tokens_to_seq[start:start + count].eq(i).all()
        return torch.rand((n_seqs, VOCAB), generator=self.generator)


class StandInEngine:
    """InferenceEngineV2's put / query / can_schedule / flush as engine_v2.py writes them."""

    def __init__(self, model, config):
        self._model = model
        self._config = config  # the engine config's state_manager section
        self._state_manager = DSStateManager(config, model.kv_cache_config(), device="cpu")
        model.state_manager = self._state_manager
        self._batch = RaggedBatchWrapper(config)

    @property
    def free_blocks(self):
        return self._state_manager.free_blocks

    @property
    def n_kv_cache_groups(self):
        return self._state_manager.n_kv_cache_groups

    def put(self, batch_uids, batch_tokens, do_checks=True):
        if do_checks:
            token_lens = [len(tokens) for tokens in batch_tokens]
            schedule_check = self.can_schedule(batch_uids, token_lens)
            if schedule_check != blockkv.SchedulingResult.Success:
                raise blockkv.SchedulingError(schedule_check)
        self._batch.clear()
        for uid, tokens in zip(batch_uids, batch_tokens):
            host_seq_desc = self._state_manager.get_or_create_sequence(uid)
            self._model.maybe_allocate_kv(host_seq_desc, tokens.numel())
            host_seq_desc.pre_forward(tokens.numel())
            self._batch.insert_sequence(host_seq_desc, tokens, do_checks=do_checks)
        self._batch.finalize()
        self._model.prepare_batch(self._batch)
        logits = self._model.forward(self._batch)
        assert logits.shape[0] == self._batch.current_sequences
        for uid in batch_uids:
            host_seq_desc = self._state_manager.get_sequence(uid)
            host_seq_desc.post_forward()
            self._model.maybe_free_kv(host_seq_desc)
        return logits

    def query(self, uid, max_request_tokens, max_request_blocks):
        seq_desc = self._state_manager.get_sequence(uid)
        if seq_desc is None:
            if self._state_manager.n_tracked_sequences == self._config.max_tracked_sequences:
                return (0, 0)
            seq_desc = PlaceholderSequenceDescriptor()
        return self._model.get_kv_requirements(seq_desc, max_request_tokens, max_request_blocks)

    def can_schedule(self, uids, lengths):
        cur_seqs = self._state_manager.n_tracked_sequences
        free_blocks = self._state_manager.free_blocks
        batch_len = 0
        if len(uids) > self._config.max_ragged_sequence_count:
            return blockkv.SchedulingResult.BatchSequenceLimitExceeded
        for uid, length in zip(uids, lengths):
            seq_desc = self._state_manager.get_sequence(uid)
            if seq_desc is None:
                cur_seqs += 1
                seq_desc = PlaceholderSequenceDescriptor()
            sched_len, sched_blocks = self._model.get_kv_requirements(seq_desc, length,
                                                                      free_blocks)
            if sched_len != length:
                return blockkv.SchedulingResult.KVCacheLimitExceeded
            batch_len += length
            free_blocks -= sched_blocks
        if cur_seqs > self._config.max_tracked_sequences:
            return blockkv.SchedulingResult.EngineSequenceLimitExceeded
        if batch_len > self._config.max_ragged_batch_size:
            return blockkv.SchedulingResult.BatchTokenLimitExceeded
        return blockkv.SchedulingResult.Success

    def get_remaining_block_capacity(self, uid):
        seq_desc = self._state_manager.get_sequence(uid)
        if seq_desc is None:
            return 0
        return self._model.get_remaining_block_capacity(seq_desc)

    def flush(self, uid):
        self._state_manager.flush_sequence(uid)


class Request:

    def __init__(self, uid, prompt, max_new_tokens):
        self.uid = uid
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.restart()

    def restart(self):
        self.done = 0  # tokens through a forward
        self.generated = []

    @property
    def pending(self):
        # The tokens not yet through a forward: the prompt's rest, then the last sampled token.
        if self.done < len(self.prompt):
            return self.prompt[self.done:]
        return self.generated[-1:]


def _schedule(engine, requests, config, block_size):
    """MII's _schedule_token_gen then _schedule_prompts, from the facts of ragged_batching.py."""
    free = int(engine.free_blocks[0])
    tokens_left = config.max_ragged_batch_size
    seqs_left = config.max_ragged_sequence_count
    batch = []
    for r in requests:  # decoding first
        if r.done < len(r.prompt) or not seqs_left or not tokens_left:
            continue
        if engine.get_remaining_block_capacity(r.uid) == 0:
            if free == 0:
                continue
            free -= 1
        batch.append((r, r.pending))
        seqs_left -= 1
        tokens_left -= 1
    for r in requests:  # then prompts, split to the token budget (Dynamic SplitFuse)
        if r.done >= len(r.prompt):
            continue
        if free == 0 or not seqs_left or not tokens_left:
            break
        want = min(len(r.pending), tokens_left)
        n, blocks = engine.query(r.uid, want, free)
        if n <= 0:
            break
        batch.append((r, r.pending[:n]))
        free -= max(blocks, 0)
        seqs_left -= 1
        tokens_left -= n
    return batch


def _check_manager(engine, requests, block_size, num_blocks):
    manager = engine._state_manager
    manager.check_invariants()
    held = []
    for r in requests:
        seq = manager.get_sequence(r.uid)
        if r.done == 0:
            assert seq is None or seq.seen_tokens == 0
            continue
        assert seq.seen_tokens == r.done and seq.in_flight_tokens == 0
        assert seq.cur_allocated_blocks == -(-r.done // block_size)  # exactly what it needs
        held += seq.all_block_ids().tolist()
    assert len(held) == len(set(held))
    assert int(engine.free_blocks[0]) + len(held) == num_blocks
    assert manager.allocated_unused_blocks() == 0


def test_engine_v2_replay_for_1000_steps():
    rng = random.Random(1)
    block_size, num_blocks = 16, 96
    config = DSStateManagerConfig(max_tracked_sequences=24, max_ragged_batch_size=256,
                                  max_ragged_sequence_count=16, max_context=512,
                                  memory_config=MemoryConfig(mode=AllocationMode.ALLOCATE,
                                                             size=num_blocks))
    model = StandInModel(block_size, max_sequence_length=512)
    engine = StandInEngine(model, config)
    assert engine.n_kv_cache_groups == 1
    next_uid = 0
    requests = []
    finished = restarted = decode_steps = 0

    def new_request():
        nonlocal next_uid
        next_uid += 1
        prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 17, 63, 200, 300]))]
        return Request(next_uid * 7919 % 100003, prompt, rng.randint(1, 40))

    for step in range(1000):
        while len(requests) < 20:
            requests.append(new_request())
        batch = _schedule(engine, requests, config, block_size)
        if not batch:
            # MII's deadlock recovery: flush the last request holding KV and recompute it.
            victim = next(r for r in reversed(requests) if r.done > 0)
            engine.flush(victim.uid)
            victim.restart()
            restarted += 1
            _check_manager(engine, requests, block_size, num_blocks)
            continue
        uids = [r.uid for r, _ in batch]
        tokens = [torch.tensor(t, dtype=torch.int64) for _, t in batch]
        model.expected = [(r.done, t) for r, t in batch]
        logits = engine.put(uids, tokens, do_checks=step % 2 == 0)
        assert logits.shape == (len(batch), VOCAB)
        for (r, t), row in zip(batch, logits):
            decode_steps += r.done >= len(r.prompt)
            r.done += len(t)
            if r.done >= len(r.prompt):
                r.generated.append(int(row.argmax()))
            if len(r.generated) == r.max_new_tokens:
                engine.flush(r.uid)
                requests.remove(r)
                finished += 1
        _check_manager(engine, requests, block_size, num_blocks)
    # The run went through every path: prompts split, decodes, completions, recomputation.
    assert finished > 50 and decode_steps > 1000 and restarted > 0


def test_put_reports_a_full_cache_instead_of_corrupting():
    # DeepSpeed's put(do_checks=False) with too few blocks grabs what is free and writes the
    # rest through stale table entries; here pre_forward refuses and nothing is in flight.
    config = DSStateManagerConfig(max_tracked_sequences=4, max_ragged_batch_size=64,
                                  max_ragged_sequence_count=4,
                                  memory_config=MemoryConfig(mode="allocate", size=2))
    model = StandInModel(block_size=4, max_sequence_length=64)
    engine = StandInEngine(model, config)
    with pytest.raises(blockkv.SchedulingError) as error:
        engine.put([1], [torch.arange(12)])  # do_checks: can_schedule runs verbatim
    assert error.value.result == blockkv.SchedulingResult.KVCacheLimitExceeded
    with pytest.raises(ValueError, match="extend_kv_cache first"):
        engine.put([1], [torch.arange(12)], do_checks=False)
    seq = engine._state_manager.get_sequence(1)
    assert (seq.seen_tokens, seq.in_flight_tokens, seq.cur_allocated_blocks) == (0, 0, 2)
    engine.flush(1)
    assert engine.free_blocks.tolist() == [2]
    engine._state_manager.check_invariants()


def _manager(num_blocks=16, block_size=4, max_blocks=4, **config):
    config.setdefault("memory_config", MemoryConfig(mode="allocate", size=num_blocks))
    kv = KVCacheConfig(block_size=block_size, cache_shape=(2, 2, 8),
                       max_blocks_per_allocation_group=max_blocks)
    return DSStateManager(DSStateManagerConfig(**config), (kv,), device="cpu")


def test_manager_tracks_one_descriptor_per_uid():
    manager = _manager(max_tracked_sequences=2, max_ragged_sequence_count=2)
    seq = manager.get_or_create_sequence(10)
    assert isinstance(seq, DSSequenceDescriptor) and isinstance(seq, BaseSequenceDescriptor)
    assert manager.get_or_create_sequence(10) is seq and manager.get_sequence(10) is seq
    assert manager.get_sequence(11) is None
    manager.get_or_create_sequence(11)
    assert dict(manager.tracked_sequences).keys() == {10, 11}
    assert manager.n_tracked_sequences == 2
    with pytest.raises(RuntimeError):  # no tracking slot left
        manager.get_or_create_sequence(12)
    manager.flush_sequence(10)
    assert manager.get_sequence(10) is None and dict(manager.tracked_sequences).keys() == {11}
    with pytest.warns(RuntimeWarning, match="does not exist"):
        manager.flush_sequence(10)
    with pytest.raises(TypeError):
        manager.tracked_sequences[3] = seq  # a read-only view
    with pytest.raises(TypeError):
        DSSequenceDescriptor(0, (), ())


def test_manager_properties():
    manager = _manager(num_blocks=16, block_size=4)
    assert manager.kv_block_size == 4  # DeepSpeed's raises AttributeError
    assert manager.n_kv_cache_groups == 1
    free = manager.free_blocks
    assert free.dtype == numpy.int32 and free.tolist() == [16] and free[0] <= 16
    assert manager.get_cache(1).shape == (16, 4, 2, 2, 8)
    k, v = split_kv(manager.get_cache(0))
    assert k.shape == (16, 4, 2, 8) and k.stride(1) == 2 * 2 * 8
    with pytest.raises(NotImplementedError):
        DSStateManager(DSStateManagerConfig(offload=True), (KVCacheConfig(cache_shape=(1, 1, 8)),))


def test_allocate_extend_pre_forward_post_forward():
    manager = _manager(num_blocks=16, block_size=4)
    seq = manager.get_or_create_sequence(1)
    blocks = manager.allocate_blocks(2)
    assert blocks.dtype == torch.int32 and blocks.tolist() == [0, 1]
    assert manager.free_blocks.tolist() == [14] and manager.allocated_unused_blocks() == 1 * 2
    seq.extend_kv_cache(blocks)
    assert seq.cur_allocated_blocks == 2 and manager.allocated_unused_blocks() == 0
    assert seq.kv_cache_ids().tolist() == [[0, 1, -1, -1]]
    assert seq.kv_cache_ids(on_device=True).tolist() == [[0, 1, -1, -1]]
    seq.extend_kv_cache([manager.allocate_blocks(1)])  # one tensor per allocation group
    assert seq.all_block_ids().tolist() == [0, 1, 2]
    seq.pre_forward(9)
    assert seq.in_flight_tokens == 9
    seq.pre_forward(5)  # overwrites, as DeepSpeed's
    seq.post_forward()
    assert (seq.seen_tokens, seq.in_flight_tokens) == (5, 0)
    assert seq.max_context == 8192 and seq.tracking_id == 0
    manager.check_invariants()
    manager.flush_sequence(1)
    assert manager.free_blocks.tolist() == [16]


def test_allocate_more_than_free_is_value_error():
    manager = _manager(num_blocks=4)
    with pytest.raises(ValueError):
        manager.allocate_blocks(5)
    assert manager.free_blocks.tolist() == [4]


def test_extend_errors_change_nothing():
    manager = _manager(num_blocks=16, max_blocks=2)
    seq = manager.get_or_create_sequence(1)
    blocks = manager.allocate_blocks(3)
    with pytest.raises(ValueError, match="allocation groups"):
        seq.extend_kv_cache([blocks[:1], blocks[1:]])
    with pytest.raises(ValueError, match="max_blocks_per_allocation_group"):
        seq.extend_kv_cache(blocks)  # DeepSpeed: a torch shape error, and the blocks leak
    with pytest.raises(ValueError, match="twice"):
        seq.extend_kv_cache(torch.tensor([blocks[0], blocks[0]]))
    with pytest.raises(ValueError, match="not handed out"):
        seq.extend_kv_cache(torch.tensor([9], dtype=torch.int32))
    assert seq.cur_allocated_blocks == 0 and manager.allocated_unused_blocks() == 3
    manager.check_invariants()
    manager.free_allocated_blocks(blocks)
    assert manager.free_blocks.tolist() == [16] and manager.allocated_unused_blocks() == 0
    manager.check_invariants()


def test_pre_forward_checks_blocks_and_max_context():
    manager = _manager(num_blocks=16, block_size=4, max_blocks=4, max_context=10)
    seq = manager.get_or_create_sequence(1)
    with pytest.raises(ValueError, match="extend_kv_cache first"):
        seq.pre_forward(1)
    seq.extend_kv_cache(manager.allocate_blocks(3))
    with pytest.raises(ValueError, match="limit of 10"):
        seq.pre_forward(11)
    assert seq.in_flight_tokens == 0


def test_free_kv_cache_releases_the_oldest_blocks():
    manager = _manager(num_blocks=16, block_size=4)
    seq = manager.get_or_create_sequence(1)
    seq.extend_kv_cache(manager.allocate_blocks(3))
    seq.pre_forward(10)
    seq.post_forward()
    with pytest.raises(ValueError, match="oldest"):
        seq.free_kv_cache(torch.tensor([1]))
    seq.free_kv_cache(torch.tensor([0, 1], dtype=torch.int32))
    assert seq.all_block_ids().tolist() == [2]
    assert seq.kv_cache_ids().tolist() == [[-1, -1, 2, -1]]
    assert manager.free_blocks.tolist() == [15]
    manager.check_invariants()


def test_blocked_kv_cache():
    kv = KVCacheConfig(block_size=4, cache_shape=(2, 2, 8))
    cache = BlockedKVCache((kv,), MemoryConfig(mode="allocate", size=8), device="cpu")
    blocks = cache.reserve(3)
    assert blocks.dtype == torch.int32 and blocks.tolist() == [0, 1, 2]
    assert cache.free_blocks.tolist() == [5] and cache.num_caches == 1
    layer = cache.get_cache(1)
    assert isinstance(layer, torch.Tensor) and layer.shape == (8, 4, 2, 2, 8)
    with pytest.raises(ValueError):
        cache.free(torch.tensor([0, 0]))
    cache.free(blocks)
    assert cache.free_blocks.tolist() == [8]
    with pytest.raises(ValueError):
        cache.reserve(9)
    with pytest.raises(NotImplementedError):
        cache.offload(blocks)
    with pytest.raises(NotImplementedError):
        BlockedKVCache((kv,), MemoryConfig(mode="allocate", size=8), offload=True)
    with pytest.raises(ValueError):
        split_kv(layer[0])


def test_query_and_can_schedule_pass_through_to_the_core():
    manager = _manager(num_blocks=2, block_size=4, max_tracked_sequences=4,
                       max_ragged_sequence_count=4)
    assert manager.query(5, 100, 1) == (4, 1)
    assert manager.can_schedule([1, 2], [4, 4]) == blockkv.SchedulingResult.Success
    assert manager.can_schedule([1, 2], [8, 4]) == blockkv.SchedulingResult.KVCacheLimitExceeded
    seq = manager.get_or_create_sequence(1)
    seq.extend_kv_cache(manager.allocate_blocks(1))
    seq.pre_forward(3)
    seq.post_forward()
    assert manager.get_remaining_block_capacity(1) == 3
    assert manager.get_remaining_block_capacity(99) == 0
