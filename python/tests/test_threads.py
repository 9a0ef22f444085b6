# SPDX-License-Identifier: Apache-2.0
"""Python threads on shared blockkv objects: every bound method holds its object's lock, so any mix
of calls from any number of threads is serialized per object, never crashes the interpreter and
leaves the object's invariants intact.

The hammer test drives one StateManager (offload and prefix caching on, a RaggedBatchWrapper per
thread and one shared by all, the kernels over them), one BlockedKVCache with offload and one
BlockedAllocator from 8 threads with random calls, valid and invalid, for a bounded number of
operations. Each thread owns its own uids, ids, blocks and handles, so it knows what each of its
calls must do: a valid call may only fail for want of a shared resource (blocks, slots, tier
space), and an invalid one must raise its error. Afterwards every free count adds up to what the
threads still hold and check_invariants() passes.
"""

import random
import sys
import threading
import traceback
import warnings

import blockkv
import numpy as np
import pytest
import torch
from conftest import allocate, kv_config

THREADS = 8
OPS_PER_THREAD = 300

ALLOCATOR_BLOCKS = 512
CACHE_BLOCKS = 96
MANAGER_BLOCKS = 192
BLOCK = 4
HEADS = 2  # query heads = KV heads
HEAD = 64

# What a valid call may raise when the threads together used up something shared.
SHORT = (blockkv.ResourceExhaustedError, blockkv.SchedulingError)


class Broken(Exception):
    """A call did what it must not: an invalid call succeeded, a valid one failed."""


def expect_error(kind, fn, *args):
    try:
        fn(*args)
    except kind:
        return
    raise Broken("%s%r did not raise %s" % (fn.__name__, args, kind.__name__))


class Shared:
    def __init__(self):
        self.allocator = blockkv.BlockedAllocator(ALLOCATOR_BLOCKS)
        self.cache = blockkv.BlockedKVCache(
            (kv_config(block_size=BLOCK, layers=1, heads=HEADS, head_size=HEAD),),
            allocate(CACHE_BLOCKS), offload=True, host_blocks=48, device="cpu")
        config = blockkv.StateManagerConfig(
            max_tracked_sequences=THREADS * 8, max_ragged_sequence_count=16,
            max_ragged_batch_size=128, max_context=64, memory_config=allocate(MANAGER_BLOCKS),
            offload=True, offload_config=blockkv.OffloadConfig(host_blocks=64),
            prefix_cache=blockkv.PrefixCacheConfig())
        kv = kv_config(block_size=BLOCK, layers=1, heads=HEADS, head_size=HEAD,
                       max_blocks_per_allocation_group=16)
        self.manager = blockkv.StateManager(config, (kv,), device="cpu")
        self.layer = self.manager.get_cache(0)
        self.shared_batch = blockkv.RaggedBatchWrapper(self.manager)


class Worker:
    """One thread's calls and what it holds."""

    def __init__(self, shared, index):
        self.s = shared
        self.rng = random.Random(1234 + index)
        self.next_uid = index * 100_000
        self.live = []       # its tracked, not preempted sequences
        self.preempted = []  # its preempted sequences
        self.ids = []        # allocator ids it holds
        self.blocks = []     # cache blocks it holds
        self.handles = []    # cache handles it holds (offloaded blocks)
        self.added = False   # whether schedule_args' new uid came from add_sequence
        self.batch = blockkv.RaggedBatchWrapper(shared.manager)
        self.ops = [getattr(self, name) for name in dir(self) if name.startswith("op_")]

    def run(self):
        for _ in range(OPS_PER_THREAD):
            self.rng.choice(self.ops)()

    def pick(self, items, most=4):
        return self.rng.sample(items, self.rng.randint(1, min(most, len(items))))

    def new_uid(self):
        self.next_uid += 1
        return self.next_uid

    # ---- BlockedAllocator ----------------------------------------------------------------------

    def op_allocate(self):
        try:
            self.ids += self.s.allocator.allocate(self.rng.randint(1, 8)).tolist()
        except SHORT:
            pass

    def op_allocator_free(self):
        if not self.ids:
            return
        ids = self.pick(self.ids, 8)
        kind = self.rng.choice([list, np.array, torch.tensor])
        self.s.allocator.free(kind(ids))
        for i in ids:
            self.ids.remove(i)

    def op_allocator_invalid(self):
        a = self.s.allocator
        expect_error(ValueError, a.free, [ALLOCATOR_BLOCKS + self.rng.randint(0, 9)])
        expect_error(ValueError, a.free, [2**63])
        expect_error(ValueError, a.allocate, -1)
        if self.ids:
            expect_error(ValueError, a.free, [self.ids[0], self.ids[0]])

    # ---- BlockedKVCache and its offload store --------------------------------------------------

    def op_reserve(self):
        try:
            self.blocks += self.s.cache.reserve(self.rng.randint(1, 4)).tolist()
        except SHORT:
            pass

    def op_cache_free(self):
        if self.blocks:
            blocks = self.pick(self.blocks)
            self.s.cache.free(blocks)
            for b in blocks:
                self.blocks.remove(b)

    def op_copy_blocks(self):
        if len(self.blocks) >= 2:
            src, dst = self.rng.sample(self.blocks, 2)
            self.s.cache.copy_blocks([src], [dst])

    def op_offload(self):
        if not self.blocks:
            return
        blocks = self.pick(self.blocks)
        try:
            handles, ticket = self.s.cache.offload(blocks)
        except SHORT:
            return
        for b in blocks:
            self.blocks.remove(b)
        self.handles += handles.tolist()
        if self.rng.random() < 0.5:
            ticket.wait()

    def op_restore(self):
        if not self.handles:
            return
        handles = self.pick(self.handles)
        try:
            blocks, ticket = self.s.cache.restore(handles)
        except SHORT:
            return
        ticket.wait()
        for h in handles:
            self.handles.remove(h)
        self.blocks += blocks.tolist()

    def op_drop(self):
        if self.handles:
            handle = self.rng.choice(self.handles)
            self.s.cache.drop([handle])
            self.handles.remove(handle)
            expect_error(ValueError, self.s.cache.restore, [handle])  # stale now

    def op_cache_invalid(self):
        c = self.s.cache
        expect_error(ValueError, c.free, [CACHE_BLOCKS + self.rng.randint(0, 9)])
        expect_error(ValueError, c.free, [2**64 - 1])
        expect_error(ValueError, c.reserve, 2**40)
        expect_error(ValueError, c.copy_blocks, [0], [CACHE_BLOCKS])
        if self.blocks:
            expect_error(ValueError, c.free, [self.blocks[0], self.blocks[0]])

    def op_cache_check(self):
        self.s.cache.check_invariants()
        assert self.s.cache.offload_stats()["live_handles"] >= len(self.handles)

    # ---- StateManager, its batches and the kernels ---------------------------------------------

    def schedule_args(self):
        """Some of its live sequences (one token each) and maybe a new one (a prompt)."""
        uids = self.pick(self.live, 3) if self.live and self.rng.random() < 0.8 else []
        lengths = [1] * len(uids)
        new = None
        if len(self.live) + len(self.preempted) < 6 and self.rng.random() < 0.5:
            new = self.new_uid()
            prompt = [self.rng.randint(0, 3) for _ in range(self.rng.randint(1, 9))]
            self.added = self.rng.random() < 0.5
            if self.added:
                self.s.manager.add_sequence(new, prompt)
            uids.append(new)
            lengths.append(len(prompt))
        return uids, lengths, new

    def scheduled(self, new, ok):
        if new is None:
            return
        if ok:
            self.live.append(new)
        elif self.added:  # add_sequence tracks it; the failed schedule left it as it was
            assert self.s.manager.get_sequence(new).seen_tokens == 0
            self.s.manager.flush_sequence(new)
        else:  # all or nothing: the failed schedule did not create it
            assert self.s.manager.get_sequence(new) is None

    def retire_long(self):
        """Sequences near max_context are flushed, so schedules keep fitting."""
        for uid in list(self.live):
            if self.s.manager.get_sequence(uid).seen_tokens > 40:
                self.s.manager.flush_sequence(uid)
                self.live.remove(uid)

    def op_schedule_batch(self):
        self.retire_long()
        uids, lengths, new = self.schedule_args()
        if not uids:
            return
        batch = self.batch if self.rng.random() < 0.7 else self.s.shared_batch
        tokens = np.zeros(sum(lengths), dtype=np.int64)
        try:
            self.s.manager.schedule_batch(uids, lengths, tokens, batch)
        except SHORT:
            self.scheduled(new, False)
            return
        self.scheduled(new, True)
        if batch is self.batch:
            # The window keeps attention off blocks free_leading_blocks released.
            k = np.ones((batch.current_tokens, HEADS, HEAD), dtype=np.float16)
            blockkv.append_kv(self.s.layer, k, k, batch)
            blockkv.paged_attention(k, self.s.layer, batch, np.empty_like(k), sliding_window=1,
                                    num_threads=1)
            self.s.manager.post_forward(batch)
        else:  # another thread may have refilled the shared batch already
            self.s.manager.post_forward(uids)

    def op_schedule(self):
        self.retire_long()
        uids, lengths, new = self.schedule_args()
        if not uids:
            return
        try:
            self.s.manager.schedule(uids, lengths)
        except SHORT:
            self.scheduled(new, False)
            return
        self.scheduled(new, True)
        self.batch.clear()
        for uid in uids:  # a prefix cache hit schedules fewer tokens than the prompt's
            seq = self.s.manager.get_sequence(uid)
            self.batch.insert_sequence(seq, [0] * seq.in_flight_tokens)
        self.batch.finalize()
        self.s.manager.post_forward(np.array(uids, dtype=np.int64))

    def op_speculate(self):
        """A verified token and up to 3 drafts for some live sequences; each keeps a random count
        of them (post_forward's accepted), which frees the blocks past its new end."""
        self.retire_long()
        if not self.live:
            return
        uids = self.pick(self.live, 3)
        lengths = [self.rng.randint(1, 4) for _ in uids]
        try:
            self.s.manager.schedule(uids, lengths)
        except SHORT:
            return
        expect_error(ValueError, self.s.manager.post_forward, uids, [n + 1 for n in lengths])
        self.s.manager.post_forward(uids, accepted=[self.rng.randint(0, n) for n in lengths])

    def op_rollback(self):
        if not self.live:
            return
        uid = self.rng.choice(self.live)
        seq = self.s.manager.get_sequence(uid)
        expect_error(ValueError, self.s.manager.rollback, uid, seq.seen_tokens + 1)
        n = self.rng.randint(0, min(seq.seen_tokens, 6))
        # Refused only for want of a free block (a copy of a shared last block) or, after
        # free_leading_blocks, for reaching into released blocks.
        allowed = SHORT if seq.released_blocks() == 0 else (ValueError,) + SHORT
        try:
            self.s.manager.rollback(uid, n)
        except allowed:
            pass

    def op_shared_batch_kernels(self):
        """Kernels and accessors on the batch other threads refill: a shape that no longer fits, or
        a batch left unfinalized by a failed schedule_batch, is a ValueError."""
        b = self.s.shared_batch
        t = b.current_tokens
        q = np.ones((max(t, 1), HEADS, HEAD), dtype=np.float16)
        try:
            blockkv.paged_attention(q, self.s.layer, b, np.empty_like(q), sliding_window=1,
                                    num_threads=1)
        except ValueError:
            pass
        try:  # ValueError while another thread's schedule_batch left it unfinalized
            b.input_ids(), b.kv_indices(), b.inflight_seq_descriptors()
        except ValueError:
            pass

    def op_flush(self):
        if self.live:
            uid = self.rng.choice(self.live)
            self.s.manager.flush_sequence(uid)
            self.live.remove(uid)

    def op_fork(self):
        if self.live and len(self.live) + len(self.preempted) < 6:
            child = self.new_uid()
            try:
                self.s.manager.fork(self.rng.choice(self.live), child)
            except SHORT:
                return
            self.live.append(child)

    def op_free_leading_blocks(self):
        if self.live:
            uid = self.rng.choice(self.live)
            seq = self.s.manager.get_sequence(uid)
            whole = seq.seen_tokens // BLOCK - seq.released_blocks()
            if whole > 0:
                self.s.manager.free_leading_blocks(uid, 1)
            else:
                expect_error(ValueError, self.s.manager.free_leading_blocks, uid, 1)

    def op_preempt(self):
        if self.live:
            uid = self.rng.choice(self.live)
            try:
                self.s.manager.preempt_sequence(uid).wait()
            except SHORT:
                return
            self.live.remove(uid)
            self.preempted.append(uid)

    def op_resume(self):
        if self.preempted:
            uid = self.rng.choice(self.preempted)
            try:
                ticket = self.s.manager.resume_sequence(uid)
            except SHORT:
                return
            if self.rng.random() < 0.5:
                ticket.wait()
            self.preempted.remove(uid)
            self.live.append(uid)

    def op_read(self):
        m = self.s.manager
        for uid in self.live + self.preempted:
            seq = m.get_sequence(uid)
            assert seq.uid == uid and seq.in_flight_tokens == 0
            seq.block_table(), seq.all_block_ids(), repr(seq)
            m.query(uid, 4, 4)
        m.free_blocks, m.n_tracked_sequences, m.prefix_cache_stats(), m.offload_stats()
        m.drain_cache_events()
        m.can_schedule(self.live[:1], [1] * len(self.live[:1]))

    def op_manager_invalid(self):
        m = self.s.manager
        mine = self.live[0] if self.live else self.new_uid()
        expect_error(ValueError, m.schedule, [mine], [-1])
        expect_error(ValueError, m.schedule, [2**63], [1])
        expect_error(ValueError, m.get_sequence, 2**64 - 1)
        expect_error(ValueError, m.post_forward, [self.new_uid()])
        expect_error(ValueError, m.fork, self.new_uid(), self.new_uid())
        expect_error(ValueError, m.schedule_batch, [mine], [1], [1, 2], self.batch)
        expect_error(ValueError, m.free_leading_blocks, mine, -1)
        expect_error(ValueError, m.resume_sequence, mine)  # not preempted (or not tracked)
        assert m.get_sequence(2**63 - 1) is None

    def op_manager_check(self):
        self.s.manager.check_invariants()

    def op_reset_prefix_cache(self):
        self.s.manager.reset_prefix_cache()


def hammer(shared):
    workers = [Worker(shared, i) for i in range(THREADS)]
    failures = []

    def run(worker):
        try:
            worker.run()
        except Exception:  # noqa: BLE001 -- reported below, with the thread's traceback
            failures.append(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # hand the GIL over often: more calls overlap
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, "\n".join(failures)
    return workers


def test_eight_threads_on_one_manager_cache_and_store_keep_every_invariant():
    shared = Shared()
    manager_free = shared.manager.free_blocks
    workers = hammer(shared)

    a = shared.allocator
    a.check_invariants()
    assert a.free_blocks + sum(len(w.ids) for w in workers) == ALLOCATOR_BLOCKS

    c = shared.cache
    c.wait_all()
    c.check_invariants()
    assert c.free_blocks[0] + sum(len(w.blocks) for w in workers) == CACHE_BLOCKS
    assert c.offload_stats()["live_handles"] == sum(len(w.handles) for w in workers)
    for w in workers:
        if w.handles:
            c.drop(w.handles)
        if w.blocks:
            c.free(w.blocks)
    assert c.free_blocks == [CACHE_BLOCKS] and c.free_host_blocks() == 48

    m = shared.manager
    m.check_invariants()
    tracked = [uid for w in workers for uid in w.live + w.preempted]
    assert m.n_tracked_sequences == len(tracked)
    for uid in tracked:
        m.flush_sequence(uid)
    m.reset_prefix_cache()
    m.check_invariants()
    assert m.n_tracked_sequences == 0
    assert m.free_blocks == manager_free and m.free_host_blocks() == 64
