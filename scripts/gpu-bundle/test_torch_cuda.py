# SPDX-License-Identifier: Apache-2.0
"""The GPU bundle's Python check (run.sh step 5): blockkv's module, compiled on the GPU machine,
over torch CUDA tensors. A cache and a state manager on cuda:0, the cache's layers as zero-copy
torch views, the batch's device mirror as torch tensors, and append_kv + paged_attention on torch
CUDA tensors against plain torch attention (fp32) over the K/V gathered through the block tables;
shapes that real callers use: one token, one KV head, grouped queries beyond 64 per KV head.
Prints one summary line last; exits non-zero on the first failure."""

import math
import sys

import blockkv
import torch

CHECKS = 0


def check(condition, what):
    global CHECKS
    if not condition:
        print(f"FAILED: {what}")
        sys.exit(1)
    CHECKS += 1


def reference(q, k, v, seen):
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,khd->htk", q, k) / math.sqrt(q.shape[-1])
    positions = torch.arange(seen, seen + q.shape[0], device=q.device).unsqueeze(1)
    keys = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    scores = scores.masked_fill(keys > positions, float("-inf"))
    return torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), v)


def run(dtype, kv_heads, q_heads, head, block, steps):
    name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    kv = blockkv.KVCacheConfig(block_size=block, cache_shape=(1, kv_heads, head), cache_dtype=name)
    config = blockkv.StateManagerConfig(memory_config=blockkv.MemoryConfig(mode="allocate", size=256))
    manager = blockkv.StateManager(config, (kv,), device="cuda:0")
    batch = blockkv.RaggedBatchWrapper(manager)
    layer = manager.get_cache(0)
    cache = torch.from_dlpack(layer)
    check(cache.is_cuda and tuple(cache.shape[1:]) == (block, 2, kv_heads, head),
          f"the cache is a CUDA view of [N, {block}, 2, {kv_heads}, {head}]: {cache.shape}")
    cache.zero_()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for uids, lengths in steps:
        manager.schedule(uids, lengths)
        batch.clear()
        rows, start = [], 0
        for uid, n in zip(uids, lengths):
            seq = manager.get_sequence(uid)
            batch.insert_sequence(seq, list(range(n)))
            rows.append((uid, start, n, seq.seen_tokens))
            start += n
        batch.finalize(False)
        ids = torch.from_dlpack(batch.input_ids(on_device=True))
        check(ids.is_cuda and ids.shape[0] == batch.current_tokens, "input_ids on the device")
        t = batch.current_tokens
        q = torch.randn(t, q_heads, head, generator=gen, device="cuda").to(dtype)
        k = torch.randn(t, kv_heads, head, generator=gen, device="cuda").to(dtype)
        v = torch.randn(t, kv_heads, head, generator=gen, device="cuda").to(dtype)
        out = torch.zeros_like(q)
        blockkv.append_kv(layer, k, v, batch)
        blockkv.paged_attention(q, layer, batch, out)
        torch.cuda.synchronize()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for uid, s, n, seen in rows:
            table = torch.from_numpy(manager.get_sequence(uid).block_table()).long().cuda()
            flat = cache[table].reshape(-1, 2, kv_heads, head)[: seen + n]
            check(torch.equal(flat[seen:, 0], k[s:s + n]) and torch.equal(flat[seen:, 1], v[s:s + n]),
                  f"append_kv wrote uid {uid}'s rows ({name}, {kv_heads}/{q_heads} heads)")
            expected = reference(q[s:s + n], flat[:, 0], flat[:, 1], seen)
            err = (out[s:s + n].float() - expected).abs().max().item()
            check(err <= tol * 4, f"paged_attention of uid {uid} ({name}, {kv_heads}/{q_heads} "
                                  f"heads, block {block}): max error {err}")
        manager.post_forward(uids)


PREFILL_THEN_DECODE = [([1, 2, 3], [5, 17, 1]), ([1, 2, 3], [1, 1, 1]), ([2], [1])]
run(torch.float16, 8, 32, 128, 16, PREFILL_THEN_DECODE)
run(torch.bfloat16, 2, 8, 64, 16, PREFILL_THEN_DECODE)
run(torch.float32, 1, 8, 128, 1, PREFILL_THEN_DECODE)  # one KV head, block size 1
run(torch.bfloat16, 1, 71, 64, 16, PREFILL_THEN_DECODE)  # Falcon-7B: 71 query heads per KV head
run(torch.float16, 1, 4, 128, 16, [([7], [1]), ([7], [1])])  # one sequence, one token
print(f"torch CUDA test: {CHECKS} checks passed (torch {torch.__version__})")
