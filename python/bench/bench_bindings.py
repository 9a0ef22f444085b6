# SPDX-License-Identifier: Apache-2.0
"""Per-call cost of blockkv's Python bindings, measured from Python in one process.

    PYTHONPATH=build/default/python /usr/bin/python3 python/bench/bench_bindings.py

Prints the ns per call (the best of ROUNDS rounds: the least disturbed by other processes) of
- BlockedAllocator.allocate(1), and free of one id passed as an int, a list, a NumPy int32 array
  (what allocate returns) and a CPU torch int32 tensor (what DeepSpeed's callers pass), with the
  ratio free / allocate;
- one decode step of 1,024 sequences from Python: StateManager.schedule_batch + post_forward.
The ratios are the result; absolute numbers depend on the machine and its load.
"""

import sys
import time

import numpy as np

import blockkv

try:
    import torch
except ImportError:  # the torch row is skipped
    torch = None

ROUNDS = 7


def best_ns_per_call(run, calls):
    """The least ns per call over ROUNDS runs of run(calls), which returns the elapsed ns."""
    return min(run(calls) / calls for _ in range(ROUNDS))


def bench_allocator(calls=20000):
    allocator = blockkv.BlockedAllocator(calls * 2)
    allocate, free = allocator.allocate, allocator.free

    def timed_allocate(n):
        held = []
        append = held.append
        start = time.perf_counter_ns()
        for _ in range(n):
            append(allocate(1))
        elapsed = time.perf_counter_ns() - start
        free(np.concatenate(held))
        return elapsed

    def timed_free(make):
        def run(n):
            args = [make(int(i)) for i in allocate(n)]
            start = time.perf_counter_ns()
            for a in args:
                free(a)
            return time.perf_counter_ns() - start
        return run

    makers = {
        "int": lambda i: i,
        "list": lambda i: [i],
        "numpy int32": lambda i: np.array([i], dtype=np.int32),
    }
    if torch is not None:
        makers["torch int32"] = lambda i: torch.tensor([i], dtype=torch.int32)

    results = {"allocate(1)": best_ns_per_call(timed_allocate, calls)}
    for name, make in makers.items():
        results["free(" + name + ")"] = best_ns_per_call(timed_free(make), calls)
    allocator.check_invariants()
    assert allocator.free_blocks == calls * 2
    base = results["allocate(1)"]
    print("BlockedAllocator, best of %d rounds of %d calls:" % (ROUNDS, calls))
    for name, ns in results.items():
        print("  %-20s %7.0f ns   %.2fx allocate" % (name, ns, ns / base))


def bench_decode_step(num_seqs=1024, steps_per_round=25, block_size=16):
    prompt = 16
    context = prompt + steps_per_round * ROUNDS + block_size
    max_blocks = context // block_size + 1
    kv = blockkv.KVCacheConfig(block_size=block_size, cache_shape=(1, 1, 8), cache_dtype="fp16",
                               max_blocks_per_allocation_group=max_blocks)
    config = blockkv.StateManagerConfig(
        max_tracked_sequences=num_seqs, max_ragged_batch_size=num_seqs * prompt,
        max_ragged_sequence_count=num_seqs, max_context=context,
        memory_config=blockkv.MemoryConfig(mode="allocate", size=num_seqs * max_blocks))
    manager = blockkv.StateManager(config, (kv,), device="cpu")
    batch = blockkv.RaggedBatchWrapper(manager)
    uids = np.arange(num_seqs, dtype=np.int64)
    manager.schedule_batch(uids, np.full(num_seqs, prompt, dtype=np.int64),
                           np.zeros(num_seqs * prompt, dtype=np.int64), batch)
    manager.post_forward(batch)
    ones = np.ones(num_seqs, dtype=np.int64)
    tokens = np.zeros(num_seqs, dtype=np.int64)

    def run(steps):
        start = time.perf_counter_ns()
        for _ in range(steps):
            manager.schedule_batch(uids, ones, tokens, batch)
            manager.post_forward(batch)
        return time.perf_counter_ns() - start

    ns = best_ns_per_call(run, steps_per_round)
    manager.check_invariants()
    print("decode step, %d sequences: schedule_batch + post_forward %.1f us (best of %d rounds "
          "of %d steps)" % (num_seqs, ns / 1000, ROUNDS, steps_per_round))


if __name__ == "__main__":
    blockkv.set_log_level("warning")
    print("python", sys.version.split()[0], "numpy", np.__version__,
          "torch", torch.__version__ if torch is not None else "-")
    bench_allocator()
    bench_decode_step()
