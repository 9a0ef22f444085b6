# SPDX-License-Identifier: Apache-2.0
"""The cost of the DeepSpeed drop-in: one decode step of N sequences through blockkv.deepspeed
(engine_v2.py's put: get_or_create_sequence, the model's maybe_allocate_kv, pre_forward,
insert_sequence per uid, finalize, post_forward per uid) beside blockkv's own
schedule_batch + post_forward(batch) on an identical manager, in the same run.

    PYTHONPATH=build/default/python /usr/bin/python3 bench/deepspeed_step_bench.py

Each step gives every sequence one token; sequences start at 100 seen tokens with block size
16, so one step in 16 crosses into a new block (allocate_blocks + extend_kv_cache in the
drop-in). The two paths run in alternating rounds; the numbers are medians over rounds of the
mean step time within a round. put(do_checks=True) adds engine_v2's can_schedule.
"""

import argparse
import statistics
import time

import blockkv
import numpy
import torch
from blockkv.deepspeed import (DSStateManager, DSStateManagerConfig, KVCacheConfig,
                               MemoryConfig, PlaceholderSequenceDescriptor, RaggedBatchWrapper)

BLOCK_SIZE = 16
PROMPT = 100


def ds_config(n, blocks):
    return DSStateManagerConfig(max_tracked_sequences=n, max_ragged_batch_size=max(n, PROMPT),
                                max_ragged_sequence_count=n, max_context=4096,
                                memory_config=MemoryConfig(mode="allocate", size=blocks))


def kv_config():
    return KVCacheConfig(block_size=BLOCK_SIZE, cache_shape=(1, 1, 8),
                         max_blocks_per_allocation_group=256)


class Engine:
    """engine_v2.py's put and can_schedule, and the model's KV arithmetic, verbatim in shape."""

    def __init__(self, config):
        self.config = config
        self.state_manager = DSStateManager(config, (kv_config(),), device="cpu")
        self.batch = RaggedBatchWrapper(config)

    def get_kv_requirements(self, sequence, max_new_tokens, max_new_blocks):
        total_tokens = sequence.seen_tokens + max_new_tokens
        req_blocks = -(-total_tokens // BLOCK_SIZE)
        block_lim = req_blocks - sequence.cur_allocated_blocks
        if block_lim <= max_new_blocks:
            return max_new_tokens, block_lim
        return ((max_new_blocks + sequence.cur_allocated_blocks) * BLOCK_SIZE -
                sequence.seen_tokens), max_new_blocks

    def maybe_allocate_kv(self, sequence, n_new_tokens):
        free_block = self.state_manager.free_blocks[0]
        _, n_needed_blocks = self.get_kv_requirements(sequence, n_new_tokens, free_block)
        if n_needed_blocks > 0:
            sequence.extend_kv_cache(self.state_manager.allocate_blocks(n_needed_blocks))

    def can_schedule(self, uids, lengths):
        cur_seqs = self.state_manager.n_tracked_sequences
        free_blocks = self.state_manager.free_blocks
        batch_len = 0
        if len(uids) > self.config.max_ragged_sequence_count:
            return blockkv.SchedulingResult.BatchSequenceLimitExceeded
        for uid, length in zip(uids, lengths):
            seq_desc = self.state_manager.get_sequence(uid)
            if seq_desc is None:
                cur_seqs += 1
                seq_desc = PlaceholderSequenceDescriptor()
            sched_len, sched_blocks = self.get_kv_requirements(seq_desc, length, free_blocks)
            if sched_len != length:
                return blockkv.SchedulingResult.KVCacheLimitExceeded
            batch_len += length
            free_blocks -= sched_blocks
        if cur_seqs > self.config.max_tracked_sequences:
            return blockkv.SchedulingResult.EngineSequenceLimitExceeded
        if batch_len > self.config.max_ragged_batch_size:
            return blockkv.SchedulingResult.BatchTokenLimitExceeded
        return blockkv.SchedulingResult.Success

    def put(self, batch_uids, batch_tokens, do_checks=True):
        if do_checks:
            token_lens = [len(tokens) for tokens in batch_tokens]
            if self.can_schedule(batch_uids, token_lens) != blockkv.SchedulingResult.Success:
                raise blockkv.SchedulingError(blockkv.SchedulingResult.KVCacheLimitExceeded)
        self.batch.clear()
        for uid, tokens in zip(batch_uids, batch_tokens):
            host_seq_desc = self.state_manager.get_or_create_sequence(uid)
            self.maybe_allocate_kv(host_seq_desc, tokens.numel())
            host_seq_desc.pre_forward(tokens.numel())
            self.batch.insert_sequence(host_seq_desc, tokens, do_checks=do_checks)
        self.batch.finalize()
        # (the model's forward would run here)
        for uid in batch_uids:
            self.state_manager.get_sequence(uid).post_forward()


def run(n, rounds, steps):
    blocks = n * (-(-(PROMPT + rounds * steps * 3) // BLOCK_SIZE) + 1)
    uids = list(range(1000, 1000 + n))
    prompt = torch.arange(PROMPT, dtype=torch.int64)

    # blockkv's own path.
    core = blockkv.StateManager(ds_config(n, blocks).to_blockkv(), (kv_config().to_blockkv(),),
                                device="cpu")
    core_batch = blockkv.RaggedBatchWrapper(core)
    core_uids = numpy.array(uids, dtype=numpy.int64)
    for uid in uids:  # prefill one sequence at a time
        core.schedule_batch([uid], [PROMPT], prompt, core_batch)
        core.post_forward(core_batch)
    ones = numpy.ones(n, dtype=numpy.int64)
    core_tokens = numpy.full(n, 7, dtype=numpy.int64)

    def core_step():
        core.schedule_batch(core_uids, ones, core_tokens, core_batch)
        core.post_forward(core_batch)

    # The drop-in, engine_v2's way; tokens are the caller's per-uid CPU tensors.
    engines = {}
    for checks in (False, True):
        engine = Engine(ds_config(n, blocks))
        for uid in uids:
            engine.put([uid], [prompt], do_checks=False)
        engines[checks] = engine
    decode_tokens = [torch.tensor([7], dtype=torch.int64) for _ in uids]

    def ds_step(checks):
        return lambda: engines[checks].put(uids, decode_tokens, do_checks=checks)

    paths = {"blockkv": core_step, "deepspeed": ds_step(False), "deepspeed_checks": ds_step(True)}
    samples = {name: [] for name in paths}
    for _ in range(rounds):
        for name, step in paths.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            samples[name].append((time.perf_counter() - start) / steps)
    core.check_invariants()
    for engine in engines.values():
        engine.state_manager.check_invariants()
    return {name: statistics.median(s) for name, s in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    blockkv.set_log_level("warning")
    print(f"{'sequences':>9} {'blockkv us':>11} {'drop-in us':>11} {'ratio':>7} "
          f"{'us/seq':>7} {'+checks us':>11} {'ratio':>7}")
    for n in args.sequences:
        t = run(n, args.rounds, args.steps)
        base, ds, checks = t["blockkv"], t["deepspeed"], t["deepspeed_checks"]
        print(f"{n:>9} {base * 1e6:>11.1f} {ds * 1e6:>11.1f} {ds / base:>7.1f} "
              f"{ds * 1e6 / n:>7.2f} {checks * 1e6:>11.1f} {checks / base:>7.1f}")


if __name__ == "__main__":
    main()
