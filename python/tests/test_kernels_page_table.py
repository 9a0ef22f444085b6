# SPDX-License-Identifier: Apache-2.0
"""append_kv and paged_attention over page tables of the caller's (blockkv.CsrPageTable,
blockkv.SlotMappingPageTable) on a BlockedKVCache's layers with blocks from reserve(): the
RaggedBatch path's numerics, scattered and shared blocks, one table for every layer, torch and NumPy
index arrays, and every check with nothing written."""

import numpy as np
import pytest
import torch

import blockkv
from conftest import allocate, kv_config
from test_kernels import reference

BLOCK, KV_HEADS, Q_HEADS, HEAD = 4, 2, 4, 64


def make_cache(layers=2, num_blocks=16):
    kv = kv_config(block_size=BLOCK, layers=layers, heads=KV_HEADS, head_size=HEAD, dtype="fp32")
    cache = blockkv.BlockedKVCache((kv,), allocate(num_blocks), device="cpu")
    generator = torch.Generator().manual_seed(0)
    for layer in range(layers):
        view = torch.from_dlpack(cache.get_cache(layer))
        view.copy_(torch.randn(view.shape, generator=generator))
    return cache


def tables(seqs, as_numpy=False, padding_rows=0):
    """Both forms of (blocks, length, new tokens) per sequence; torch or NumPy arrays."""
    qo, kv, indices, last, positions, slots, lens = [0], [0], [], [], [], [], []
    width = max(len(b) for b, _, _ in seqs)
    rows = []
    for blocks, length, n in seqs:
        used = -(-length // BLOCK)
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + used)
        indices += blocks[:used]
        last.append((length - 1) % BLOCK + 1)
        lens.append(length)
        rows.append(blocks + [0] * (width - len(blocks)))
        for p in range(length - n, length):
            positions.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
    slots += [-1] * padding_rows
    if as_numpy:
        i32 = lambda x: np.array(x, dtype=np.int32)  # noqa: E731
        i64 = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
    else:
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    csr = blockkv.CsrPageTable(i32(qo), i32(kv), i32(indices), i32(last), i32(positions))
    slot = blockkv.SlotMappingPageTable(i64(slots), i32(rows), i32(lens), i32(qo))
    return csr, slot


def gathered(cache_view, blocks, length):
    flat = cache_view[torch.tensor(blocks).long()].reshape(-1, 2, KV_HEADS, HEAD)[:length]
    return flat[:, 0], flat[:, 1]


@pytest.mark.parametrize("form", ["csr", "slots"])
@pytest.mark.parametrize("as_numpy", [False, True], ids=["torch", "numpy"])
def test_scattered_and_shared_blocks_one_table_for_every_layer(form, as_numpy):
    cache = make_cache()
    b = [int(x) for x in cache.reserve(6)]  # the engine's own blocks
    # A in scattered blocks; B shares A's first (full) block; C is one token.
    seqs = [([b[4], b[1], b[5]], 11, 3), ([b[4], b[2]], 7, 2), ([b[0]], 1, 1)]
    table = tables(seqs, as_numpy)[0 if form == "csr" else 1]
    generator = torch.Generator().manual_seed(1)
    for layer in range(2):  # one table, both layers
        layer_cache = cache.get_cache(layer)
        view = torch.from_dlpack(layer_cache)
        q = torch.randn(6, Q_HEADS, HEAD, generator=generator)
        k = torch.randn(6, KV_HEADS, HEAD, generator=generator)
        v = torch.randn(6, KV_HEADS, HEAD, generator=generator)
        out = torch.zeros_like(q)
        blockkv.append_kv(layer_cache, k, v, table)
        blockkv.paged_attention(q, layer_cache, table, out, num_threads=2)
        start = 0
        for blocks, length, n in seqs:
            cached_k, cached_v = gathered(view, blocks, length)
            assert torch.equal(cached_k[length - n:], k[start:start + n])
            assert torch.equal(cached_v[length - n:], v[start:start + n])
            expected = reference(q[start:start + n], cached_k, cached_v, length - n)
            torch.testing.assert_close(out[start:start + n], expected, atol=1e-4, rtol=1e-4)
            start += n


def test_same_results_as_the_ragged_batch():
    config = blockkv.StateManagerConfig(memory_config=allocate(32))
    kv = kv_config(block_size=BLOCK, layers=1, heads=KV_HEADS, head_size=HEAD, dtype="fp32")
    manager = blockkv.StateManager(config, (kv,), device="cpu")
    batch = blockkv.RaggedBatchWrapper(manager)
    manager.schedule([1, 2], [6, 3])
    manager.post_forward([1, 2])
    manager.schedule([1, 2], [1, 2])
    batch.insert_sequence(manager.get_sequence(1), [0])
    batch.insert_sequence(manager.get_sequence(2), [0, 0])
    batch.finalize(False)
    layer = torch.from_dlpack(manager.get_cache(0))
    layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(2)))
    copy = layer.clone()
    seqs = [([int(x) for x in manager.get_sequence(u).block_table()], length, n)
            for u, length, n in ((1, 7, 1), (2, 5, 2))]
    csr, _ = tables(seqs)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(3, Q_HEADS, HEAD, generator=generator)
    k = torch.randn(3, KV_HEADS, HEAD, generator=generator)
    out_batch, out_table = torch.zeros_like(q), torch.zeros_like(q)
    blockkv.append_kv(layer, k, k, batch)
    blockkv.paged_attention(q, layer, batch, out_batch)
    blockkv.append_kv(copy, k, k, csr)  # any cache tensor in blockkv's layout
    blockkv.paged_attention(q, copy, csr, out_table)
    assert torch.equal(layer, copy)
    assert torch.equal(out_batch, out_table)


def test_one_token_one_kv_head_block_size_one():
    kv = kv_config(block_size=1, layers=1, heads=1, head_size=HEAD, dtype="fp32")
    cache = blockkv.BlockedKVCache((kv,), allocate(8), device="cpu")
    view = torch.from_dlpack(cache.get_cache(0))  # torch's strides: stride 1 for extent 1
    view.zero_()
    csr = blockkv.CsrPageTable(torch.tensor([0, 1], dtype=torch.int32),
                               torch.tensor([0, 3], dtype=torch.int32),
                               torch.tensor([6, 2, 5], dtype=torch.int32),
                               torch.tensor([1], dtype=torch.int32))
    k = torch.randn(1, 1, HEAD)
    q = torch.randn(1, 1, HEAD)
    out = torch.zeros_like(q)
    blockkv.append_kv(view, k, k, csr)
    blockkv.paged_attention(q, view, csr, out)
    assert torch.equal(view[5, 0, 0], k[0])
    keys = view[[6, 2, 5], 0, 0]
    torch.testing.assert_close(out, reference(q, keys, keys, 2), atol=1e-5, rtol=1e-5)


def expect_rejected(cache, call, match):
    before = torch.from_dlpack(cache.get_cache(0)).clone()
    with pytest.raises(ValueError, match=match):
        call()
    assert torch.equal(torch.from_dlpack(cache.get_cache(0)), before)


def test_every_table_error_writes_nothing():
    cache = make_cache()
    layer = cache.get_cache(0)
    k = torch.randn(4, KV_HEADS, HEAD)
    q = torch.randn(4, Q_HEADS, HEAD)
    out = torch.zeros_like(q)
    good = [([3, 7], 6, 2), ([9], 3, 1)]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731

    def both(table, match):
        expect_rejected(cache, lambda: blockkv.append_kv(layer, k, k, table), match)
        expect_rejected(cache, lambda: blockkv.paged_attention(q, layer, table, out), match)
        assert not out.any()

    both(tables([([3, 16], 6, 2), ([9], 3, 1)])[0], "uses block 16 .*outside layer_cache's 16")
    both(tables([([3, -2], 6, 2), ([9], 3, 1)])[1], "uses block -2")
    both(blockkv.CsrPageTable(i32([0, 2, 3]), i32([0, 2, 3]), i32([3, 7, 9]), i32([5, 3])),
         r"kv_last_page_len\[0\] = 5 must be in \[1, block_size 4\]")
    both(blockkv.CsrPageTable(i32([0, 2, 7]), i32([0, 2, 3]), i32([3, 7, 9]), i32([2, 3])),
         "sequence 1 has 5 new tokens but holds 3")
    both(blockkv.CsrPageTable(i32([1, 2, 3]), i32([0, 2, 3]), i32([3, 7, 9]), i32([2, 3])),
         r"qo_indptr\[0\] must be 0, got 1")
    csr, slots = tables(good, padding_rows=1)
    wrong_positions = blockkv.CsrPageTable(i32([0, 2, 3]), i32([0, 2, 3]), i32([3, 7, 9]),
                                           i32([2, 3]), i32([4, 4, 2]))
    expect_rejected(cache, lambda: blockkv.append_kv(layer, k, k, wrong_positions),
                    r"positions\[1\] = 4 but the table puts token 1 of sequence 0 at position 5")
    bad_slots = blockkv.SlotMappingPageTable(torch.tensor([28, 29, 38, 5]), i32([[3, 7], [9, 0]]),
                                             i32([6, 3]), i32([0, 2, 3]))
    both(bad_slots, r"slot_mapping\[3\] = 5 is past the 3 tokens")
    shared = tables([([3, 7], 6, 2), ([3, 7], 6, 1)])[0]  # both write position 5 of block 7
    expect_rejected(cache, lambda: blockkv.append_kv(layer, k, k, shared),
                    "tokens 1 and 2 would both be written to slot 29")
    expect_rejected(cache, lambda: blockkv.append_kv(layer, k[:2], k[:2], csr),
                    r"T >= 3 \(the table's tokens\)")
    # What C++ takes on trust is checked here: dtypes, shapes, array lengths.
    with pytest.raises(ValueError, match="kv_indices must be int32, got int64"):
        blockkv.CsrPageTable(i32([0, 1]), i32([0, 1]), torch.tensor([3]), i32([1]))
    with pytest.raises(ValueError, match="kv_indices has 1 entries; at least 2 expected"):
        blockkv.CsrPageTable(i32([0, 1]), i32([0, 2]), i32([3]), i32([1]))
    with pytest.raises(ValueError, match="kv_last_page_len has 2 entries; 1 expected"):
        blockkv.CsrPageTable(i32([0, 1]), i32([0, 1]), i32([3]), i32([1, 1]))
    with pytest.raises(ValueError, match="block_tables must be a contiguous 2-D array"):
        blockkv.SlotMappingPageTable(torch.tensor([1]), i32([3]), i32([2]), i32([0, 1]))
    with pytest.raises(TypeError, match="CsrPageTable or SlotMappingPageTable"):
        blockkv.append_kv(layer, k, k, [0, 1])
    # The valid tables work.
    blockkv.append_kv(layer, k, k, csr)
    blockkv.paged_attention(q, layer, slots, out)
