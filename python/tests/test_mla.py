# SPDX-License-Identifier: Apache-2.0
"""MLA from Python: a KVCacheType.MLA group, mla_append_kv and mla_paged_attention on the CPU over
torch tensors and NumPy arrays, against a NumPy float64 reference written from the equations
(score = (q_nope . c_kv + q_pe . k_pe) * scale over the keys a token sees, out = softmax . c_kv),
over a prefill step of two sequences and a decode step."""

import blockkv
import numpy as np
import pytest
import torch

from conftest import allocate

BLOCK = 4
LATENT, ROPE, HEADS = 64, 16, 8
SCALE = 1 / np.sqrt(48.0)
TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 2e-2}
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class MlaEngine:
    """A manager with one MLA layer, its batch, and the cache as a torch view."""

    def __init__(self, dtype, latent=LATENT, rope=ROPE):
        kv = blockkv.KVCacheConfig(block_size=BLOCK, cache_shape=(1, 1, latent + rope),
                                   cache_dtype=dtype, type=blockkv.KVCacheType.MLA,
                                   latent_dim=latent, rope_dim=rope)
        config = blockkv.StateManagerConfig(memory_config=allocate(64))
        self.manager = blockkv.StateManager(config, (kv,), device="cpu")
        self.batch = blockkv.RaggedBatchWrapper(self.manager)
        self.layer = self.manager.get_cache(0)  # blockkv.Tensor [N, BLOCK, L + R]
        self.cache = torch.from_dlpack(self.layer)
        self.cache.zero_()
        self.latent, self.rope = latent, rope

    def step(self, uids, lengths):
        """Schedules and batches one forward; returns [(uid, first row, n, seen_tokens)]."""
        self.manager.schedule(uids, lengths)
        self.batch.clear()
        rows, start = [], 0
        for uid, n in zip(uids, lengths):
            seq = self.manager.get_sequence(uid)
            self.batch.insert_sequence(seq, list(range(n)))
            rows.append((uid, start, n, seq.seen_tokens))
            start += n
        self.batch.finalize(False)
        return rows

    def rows_of(self, uid, length):
        """The cache rows of positions [0, length) of `uid`, in float64: [length, L + R]."""
        table = self.manager.get_sequence(uid).block_table().astype(np.int64)
        blocks = self.cache.double().numpy()[table]  # [blocks, BLOCK, L + R]
        return blocks.reshape(-1, self.latent + self.rope)[:length]


def reference(q_nope, q_pe, rows, seen, latent):
    """Causal MLA attention of n query tokens at positions seen.. in float64: [n, H, L]."""
    n = q_nope.shape[0]
    c_kv, k_pe = rows[:, :latent], rows[:, latent:]
    scores = (np.einsum("thl,sl->ths", q_nope, c_kv) + np.einsum("thr,sr->ths", q_pe, k_pe)) * SCALE
    positions = seen + np.arange(n)
    visible = np.arange(rows.shape[0])[None, :] <= positions[:, None]  # [n, S]
    scores = np.where(visible[:, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("ths,sl->thl", p, c_kv)


def as_float64(t):
    return t.double().numpy() if isinstance(t, torch.Tensor) else t.astype(np.float64)


@pytest.mark.parametrize("dtype,as_numpy", [("fp32", False), ("bf16", False), ("fp16", False),
                                            ("fp32", True), ("fp16", True)])
def test_prefill_then_decode_matches_the_float64_reference(dtype, as_numpy):
    engine = MlaEngine(dtype)
    generator = torch.Generator().manual_seed(1)
    for lengths in ([5, 3], [1, 1], [1, 2]):
        rows = engine.step([1, 2], lengths)
        t = sum(lengths)

        def make(*shape):
            x = torch.randn(*shape, generator=generator).to(TORCH_DTYPE[dtype])
            return x.numpy() if as_numpy else x

        c_kv, k_pe = make(t, LATENT), make(t, ROPE)
        q_nope, q_pe = make(t, HEADS, LATENT), make(t, HEADS, ROPE)
        out = np.full((t, HEADS, LATENT), np.nan, dtype=q_nope.dtype) if as_numpy else \
            torch.full((t, HEADS, LATENT), float("nan"), dtype=TORCH_DTYPE[dtype])
        blockkv.mla_append_kv(engine.layer, c_kv, k_pe, engine.batch)
        blockkv.mla_paged_attention(q_nope, q_pe, engine.layer, engine.batch, out, scale=SCALE)
        for uid, start, n, seen in rows:
            cached = engine.rows_of(uid, seen + n)
            # The new tokens' rows are exactly what was appended.
            np.testing.assert_array_equal(cached[seen:, :LATENT], as_float64(c_kv)[start:start + n])
            np.testing.assert_array_equal(cached[seen:, LATENT:], as_float64(k_pe)[start:start + n])
            want = reference(as_float64(q_nope)[start:start + n], as_float64(q_pe)[start:start + n],
                             cached, seen, LATENT)
            got = as_float64(out)[start:start + n]
            assert not np.isnan(got).any()
            error = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            assert error < TOLERANCE[dtype], (uid, error)
        engine.manager.post_forward([1, 2])


def test_layer_view_is_three_dimensional():
    engine = MlaEngine("bf16")
    assert tuple(engine.layer.shape) == (64, BLOCK, LATENT + ROPE)
    assert engine.cache.dtype == torch.bfloat16


def test_no_rotary_part():
    engine = MlaEngine("fp32", latent=32, rope=0)
    rows = engine.step([1], [3])
    c_kv = torch.randn(3, 32)
    k_pe = torch.empty(3, 0)
    q_nope, q_pe = torch.randn(3, 2, 32), torch.empty(3, 2, 0)
    out = torch.empty(3, 2, 32)
    blockkv.mla_append_kv(engine.layer, c_kv, k_pe, engine.batch)
    blockkv.mla_paged_attention(q_nope, q_pe, engine.layer, engine.batch, out, scale=SCALE)
    uid, start, n, seen = rows[0]
    want = reference(q_nope.double().numpy(), q_pe.double().numpy(), engine.rows_of(1, 3), 0, 32)
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-6)


def test_bad_input_raises_and_writes_nothing():
    engine = MlaEngine("fp32")
    engine.step([1], [2])
    before = engine.cache.clone()
    c_kv, k_pe = torch.randn(2, LATENT), torch.randn(2, ROPE)
    q_nope, q_pe = torch.randn(2, HEADS, LATENT), torch.randn(2, HEADS, ROPE)
    out = torch.full((2, HEADS, LATENT), float("nan"))
    with pytest.raises(ValueError, match="k_pe must be"):
        blockkv.mla_append_kv(engine.layer, c_kv, torch.randn(2, ROPE + 1), engine.batch)
    with pytest.raises(ValueError, match="dtype"):
        blockkv.mla_append_kv(engine.layer, c_kv.half(), k_pe.half(), engine.batch)
    assert torch.equal(engine.cache, before)
    with pytest.raises(TypeError):  # scale is required
        blockkv.mla_paged_attention(q_nope, q_pe, engine.layer, engine.batch, out)
    with pytest.raises(ValueError, match="scale"):
        blockkv.mla_paged_attention(q_nope, q_pe, engine.layer, engine.batch, out, scale=0.0)
    with pytest.raises(ValueError, match="overlap"):
        blockkv.mla_paged_attention(q_nope, q_pe, engine.layer, engine.batch, q_nope, scale=1.0)
    with pytest.raises(ValueError, match="MLA layer"):
        blockkv.paged_attention(q_nope, engine.layer, engine.batch, out)
    assert torch.isnan(out).all()
