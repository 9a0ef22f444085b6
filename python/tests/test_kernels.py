# SPDX-License-Identifier: Apache-2.0
"""append_kv and paged_attention from Python, on the CPU, against a reference in plain torch ops:
softmax(Q K^T * scale) V with a causal (or windowed) mask over the K/V gathered from the cache
through each sequence's block table."""

import math

import blockkv
import pytest
import torch

from conftest import allocate, kv_config

BLOCK = 4  # small blocks: every sequence spans several
KV_HEADS, Q_HEADS, HEAD = 2, 4, 64  # grouped-query attention, 2 query heads per KV head
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class Engine:
    """A manager with one layer, its batch, and the cache as a torch view."""

    def __init__(self, dtype, num_blocks=64, head_size=HEAD, cache_dtype=None):
        config = blockkv.StateManagerConfig(memory_config=allocate(num_blocks))
        kv = kv_config(block_size=BLOCK, layers=1, heads=KV_HEADS, head_size=head_size,
                       dtype=cache_dtype or DTYPE_NAME[dtype])
        self.manager = blockkv.StateManager(config, (kv,), device="cpu")
        self.batch = blockkv.RaggedBatchWrapper(self.manager)
        self.layer = self.manager.get_cache(0)  # blockkv.Tensor [N, BLOCK, 2, Hkv, D]
        self.cache = torch.from_dlpack(self.layer)  # the same memory
        self.cache.zero_()  # blockkv does not clear new memory; zeros compare with torch.equal
        self.dtype = dtype

    def step(self, uids, lengths, padding=False):
        """Schedules and batches one forward; returns [(uid, first row, n, seen_tokens)]."""
        self.manager.schedule(uids, lengths)
        self.batch.clear()
        rows, start = [], 0
        for uid, n in zip(uids, lengths):
            seq = self.manager.get_sequence(uid)
            self.batch.insert_sequence(seq, list(range(n)))
            rows.append((uid, start, n, seq.seen_tokens))
            start += n
        self.batch.finalize(padding)
        return rows

    def activations(self, heads, generator):
        t = self.batch.padded_tokens
        return torch.randn(t, heads, HEAD, generator=generator).to(self.dtype)

    def gathered(self, uid, length):
        """K and V of positions [0, length) of `uid`, read from the cache: [length, Hkv, D]."""
        table = torch.from_numpy(self.manager.get_sequence(uid).block_table()).long()
        blocks = self.cache[table]  # [blocks, BLOCK, 2, Hkv, D]
        flat = blocks.reshape(-1, 2, KV_HEADS, blocks.shape[-1])[:length]
        return flat[:, 0], flat[:, 1]


def reference(q, k, v, seen, causal=True, window=0, scale=None):
    """Attention of the n query rows at positions seen.. over keys [0, len(k)): [n, Hq, D]."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("thd,khd->htk", q, k) * scale
    positions = torch.arange(seen, seen + q.shape[0]).unsqueeze(1)
    keys = torch.arange(k.shape[0]).unsqueeze(0)
    allowed = torch.ones_like(keys > positions) if not causal else keys <= positions
    if window:
        allowed = allowed & (keys > positions - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), v)


def check_step(engine, rows, q, k, v, out, **attention):
    tol = TOLERANCE[engine.dtype]
    for uid, start, n, seen in rows:
        cached_k, cached_v = engine.gathered(uid, seen + n)
        # append_kv wrote this step's rows where the block table says.
        assert torch.equal(cached_k[seen:], k[start:start + n])
        assert torch.equal(cached_v[seen:], v[start:start + n])
        expected = reference(q[start:start + n], cached_k, cached_v, seen, **attention)
        torch.testing.assert_close(out[start:start + n].float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", [{}, {"window": 3}, {"causal": False}])
def test_prefill_then_decode_matches_torch(dtype, attention):
    engine = Engine(dtype)
    generator = torch.Generator().manual_seed(0)
    options = {"causal": attention.get("causal", True),
               "sliding_window": attention.get("window", 0)}
    for uids, lengths in (([1, 2, 3], [5, 9, 1]),   # prefill, one of a single token
                          ([1, 2, 3], [1, 3, 2]),   # decode and chunked prefill, mixed
                          ([2, 1], [1, 4])):        # another order
        rows = engine.step(uids, lengths)
        q = engine.activations(Q_HEADS, generator)
        k = engine.activations(KV_HEADS, generator)
        v = engine.activations(KV_HEADS, generator)
        out = torch.zeros_like(q)
        blockkv.append_kv(engine.layer, k, v, engine.batch)
        blockkv.paged_attention(q, engine.layer, engine.batch, out, num_threads=2, **options)
        check_step(engine, rows, q, k, v, out, **attention)
        engine.manager.post_forward(uids)


def test_torch_cache_view_scale_and_padding():
    engine = Engine(torch.float32)
    generator = torch.Generator().manual_seed(1)
    rows = engine.step([1, 2], [6, 2], padding=True)
    assert engine.batch.padded_tokens == 64 and engine.batch.current_tokens == 8
    q = engine.activations(Q_HEADS, generator)
    k = engine.activations(KV_HEADS, generator)
    v = engine.activations(KV_HEADS, generator)
    out = torch.full_like(q, float("nan"))
    blockkv.append_kv(engine.cache, k, v, engine.batch)  # the torch view works as the cache too
    blockkv.paged_attention(q, engine.cache, engine.batch, out, scale=0.5)
    check_step(engine, rows, q, k, v, out, scale=0.5)
    assert torch.isnan(out[8:]).all()  # padded rows are not written


def rotate_half(x, positions, theta, dim):
    """Rotate-half RoPE of x [T, H, D] on its first `dim` features (angles in float64)."""
    half = dim // 2
    inv = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / dim)
    angle = positions.double().unsqueeze(1) * inv  # [T, half]
    cos, sin = angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)
    x = x.double()
    a, b = x[..., :half], x[..., half:dim]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., dim:]], dim=-1).float()


@pytest.mark.parametrize("rotary_dim", [0, 32])
def test_rotary_rotates_k_and_q_in_place(rotary_dim):
    engine = Engine(torch.float32)
    generator = torch.Generator().manual_seed(2)
    engine.step([1], [3])
    engine.manager.post_forward([1])
    rows = engine.step([1, 2], [2, 3])  # positions 3, 4 and 0, 1, 2
    positions = torch.tensor([3, 4, 0, 1, 2])
    q = engine.activations(Q_HEADS, generator)
    k = engine.activations(KV_HEADS, generator)
    v = engine.activations(KV_HEADS, generator)
    q_before = q.clone()
    blockkv.append_kv(engine.layer, k, v, engine.batch, rotary=True, rotary_dim=rotary_dim,
                      theta=500000.0, q=q)
    dim = rotary_dim or HEAD
    torch.testing.assert_close(q, rotate_half(q_before, positions, 500000.0, dim),
                               atol=1e-5, rtol=1e-5)
    for uid, start, n, seen in rows:
        cached_k, cached_v = engine.gathered(uid, seen + n)
        torch.testing.assert_close(
            cached_k[seen:], rotate_half(k[start:start + n], positions[start:start + n],
                                         500000.0, dim), atol=1e-5, rtol=1e-5)
        assert torch.equal(cached_v[seen:], v[start:start + n])  # V is not rotated


def decode_e4m3(raw):
    """fp8 e4m3fn bytes (uint8) as float32: bias 7, subnormals, no infinities."""
    raw = raw.long()
    sign = 1.0 - 2.0 * (raw >> 7).float()
    exponent, mantissa = (raw >> 3) & 0xF, (raw & 0x7).float()
    normal = torch.pow(2.0, exponent.float() - 7.0) * (1.0 + mantissa / 8.0)
    subnormal = 2.0 ** -6 * mantissa / 8.0
    return sign * torch.where(exponent == 0, subnormal, normal)


def test_fp8_cache_with_kv_scale():
    engine = Engine(torch.float32, cache_dtype="fp8_e4m3")
    assert engine.cache.dtype == torch.uint8  # fp8 travels as bytes
    generator = torch.Generator().manual_seed(4)
    rows = engine.step([1, 2], [7, 3])
    q = engine.activations(Q_HEADS, generator)
    k = engine.activations(KV_HEADS, generator) * 3.0
    v = engine.activations(KV_HEADS, generator) * 3.0
    out = torch.zeros_like(q)
    blockkv.append_kv(engine.layer, k, v, engine.batch, kv_scale=0.5)
    blockkv.paged_attention(q, engine.layer, engine.batch, out, kv_scale=0.5)
    for uid, start, n, seen in rows:
        raw_k, raw_v = engine.gathered(uid, seen + n)
        cached_k, cached_v = decode_e4m3(raw_k) * 0.5, decode_e4m3(raw_v) * 0.5
        # e4m3 keeps 3 mantissa bits: within 1/16 relative (plus the subnormal step).
        torch.testing.assert_close(cached_k, k[start:start + n], rtol=1 / 16, atol=2.0 ** -9)
        torch.testing.assert_close(cached_v, v[start:start + n], rtol=1 / 16, atol=2.0 ** -9)
        # Attention reads exactly the stored values times kv_scale.
        expected = reference(q[start:start + n], cached_k, cached_v, seen)
        torch.testing.assert_close(out[start:start + n], expected, atol=1e-4, rtol=1e-4)


def test_bad_input_raises_and_writes_nothing():
    engine = Engine(torch.float32)
    generator = torch.Generator().manual_seed(3)
    engine.step([1], [4])
    q = engine.activations(Q_HEADS, generator)
    k = engine.activations(KV_HEADS, generator)
    v = engine.activations(KV_HEADS, generator)
    out = torch.zeros_like(q)
    cache_before = engine.cache.clone()

    bad_append = [
        ((engine.layer, k.to(torch.bfloat16), v, engine.batch), {}),  # dtype mix
        ((engine.layer, k[:, :1], v[:, :1], engine.batch), {}),  # Hkv differs from the cache
        ((engine.layer, k[:2], v[:2], engine.batch), {}),  # fewer rows than tokens
        ((engine.layer, k, v, engine.batch), {"rotary": True, "rotary_dim": 3}),  # odd
        ((engine.layer, k, v, engine.batch), {"kv_scale": 0.0}),
        ((engine.layer, k, v, engine.batch), {"num_threads": -1}),
        ((engine.layer, k, v, engine.batch), {"group": 1}),  # no such cache group
    ]
    # Integers that do not fit the C++ parameter: a ValueError naming the value (pybind11's own
    # conversion raised a TypeError that named neither).
    for kwargs in ({"group": 2**31}, {"group": -2**63 - 1}, {"num_threads": 2**40},
                   {"rotary": True, "rotary_dim": 2**32}):
        name, value = [(n, x) for n, x in kwargs.items() if n != "rotary"][0]
        with pytest.raises(ValueError, match=f"{name}.*{value}|{value}.*{name}"):
            blockkv.append_kv(engine.layer, k, v, engine.batch, **kwargs)
    for kwargs in ({"sliding_window": 2**63}, {"group": 2**40}, {"num_threads": -2**31 - 1}):
        (name, value), = kwargs.items()
        with pytest.raises(ValueError, match=f"{name}.*{value}|{value}.*{name}"):
            blockkv.paged_attention(q, engine.layer, engine.batch, out, **kwargs)
    for args, kwargs in bad_append:
        with pytest.raises(ValueError):
            blockkv.append_kv(*args, **kwargs)
    assert torch.equal(engine.cache, cache_before)

    bad_attention = [
        ((q, engine.layer, engine.batch, out.to(torch.bfloat16)), {}),
        ((q[:, :3], engine.layer, engine.batch, out[:, :3]), {}),  # 3 % 2 KV heads
        ((q, engine.layer, engine.batch, out), {"causal": False, "sliding_window": 4}),
        ((q, engine.layer, engine.batch, out), {"sliding_window": -1}),
        ((q, engine.layer, engine.batch, out), {"scale": float("nan")}),
    ]
    for args, kwargs in bad_attention:
        with pytest.raises(ValueError):
            blockkv.paged_attention(*args, **kwargs)
    assert not out.any()

    with pytest.raises(TypeError):
        blockkv.append_kv(engine.layer, k.tolist(), v, engine.batch)  # no DLPack
    with pytest.raises(TypeError):
        blockkv.paged_attention(q, engine.layer, engine.manager, out)  # not a batch

    engine.batch.clear()  # not finalized
    with pytest.raises(ValueError, match="finaliz"):
        blockkv.append_kv(engine.layer, k, v, engine.batch)


def test_unsupported_head_size_is_a_value_error():
    engine = Engine(torch.float32, head_size=8)
    engine.step([1], [2])
    k = torch.zeros(2, KV_HEADS, 8)
    with pytest.raises(ValueError, match="8"):
        blockkv.append_kv(engine.layer, k, k.clone(), engine.batch)
