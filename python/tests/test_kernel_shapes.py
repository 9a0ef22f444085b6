# SPDX-License-Identifier: Apache-2.0
"""Issue 17 through Python: every kernel entry with the shapes real callers use -- one token (T = 1),
one sequence, one KV head, blocks of one token -- through torch (whose DLPack export gives
extent-1 dimensions stride 1) and NumPy, and grouped-query attention with 1 to 128 query heads
per KV head (Falcon-7B: 71), against the plain-torch reference of test_kernels.py."""

import numpy as np
import pytest
import torch

import blockkv
from conftest import allocate, kv_config
from test_kernels import reference

HEAD = 64


class Engine:
    """One layer of `kv_heads` heads in blocks of `block`, fp32, and its batch."""

    def __init__(self, block, kv_heads, num_blocks=64):
        config = blockkv.StateManagerConfig(memory_config=allocate(num_blocks))
        kv = kv_config(block_size=block, layers=1, heads=kv_heads, head_size=HEAD, dtype="fp32",
                       max_blocks_per_allocation_group=64)
        self.manager = blockkv.StateManager(config, (kv,), device="cpu")
        self.batch = blockkv.RaggedBatchWrapper(self.manager)
        self.layer = self.manager.get_cache(0)
        self.cache = torch.from_dlpack(self.layer)  # torch's strides on re-export
        self.cache.zero_()
        self.block, self.kv_heads = block, kv_heads

    def step(self, uid, n):
        self.manager.schedule([uid], [n])
        seen = self.manager.get_sequence(uid).seen_tokens
        self.batch.clear()
        self.batch.insert_sequence(self.manager.get_sequence(uid), list(range(n)))
        self.batch.finalize(False)
        return seen

    def gathered(self, uid, length):
        table = torch.from_numpy(self.manager.get_sequence(uid).block_table()).long()
        flat = self.cache[table].reshape(-1, 2, self.kv_heads, HEAD)[:length]
        return flat[:, 0], flat[:, 1]


def run_steps(engine, q_heads, as_numpy, steps=(3, 1, 1)):
    """Prefill then one-token decodes of sequence 7; checks the cache and out after each."""
    generator = torch.Generator().manual_seed(q_heads)
    for n in steps:
        seen = engine.step(7, n)
        q = torch.randn(n, q_heads, HEAD, generator=generator)
        k = torch.randn(n, engine.kv_heads, HEAD, generator=generator)
        v = torch.randn(n, engine.kv_heads, HEAD, generator=generator)
        out = torch.zeros_like(q)
        if as_numpy:
            out_np = np.zeros((n, q_heads, HEAD), dtype=np.float32)
            blockkv.append_kv(engine.layer, k.numpy(), v.numpy(), engine.batch)
            blockkv.paged_attention(q.numpy(), engine.layer, engine.batch, out_np)
            out = torch.from_numpy(out_np)
        else:  # the cache as a torch tensor too: its extent-1 dimensions come with stride 1
            blockkv.append_kv(engine.cache, k, v, engine.batch)
            blockkv.paged_attention(q, engine.cache, engine.batch, out, num_threads=2)
        cached_k, cached_v = engine.gathered(7, seen + n)
        assert torch.equal(cached_k[seen:], k)
        assert torch.equal(cached_v[seen:], v)
        torch.testing.assert_close(out, reference(q, cached_k, cached_v, seen),
                                   atol=1e-4, rtol=1e-4)
        engine.manager.post_forward([7])


@pytest.mark.parametrize("as_numpy", [False, True], ids=["torch", "numpy"])
@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_one_token_one_sequence_one_kv_head_block_size_one(as_numpy, block, kv_heads):
    run_steps(Engine(block, kv_heads), q_heads=kv_heads, as_numpy=as_numpy)


@pytest.mark.parametrize("as_numpy", [False, True], ids=["torch", "numpy"])
@pytest.mark.parametrize("group", [1, 2, 7, 64, 65, 71, 128])
def test_gqa_groups_up_to_128(as_numpy, group):
    run_steps(Engine(4, 1), q_heads=group, as_numpy=as_numpy)


def test_two_kv_heads_of_71_query_heads_each():
    run_steps(Engine(4, 2), q_heads=142, as_numpy=False)
