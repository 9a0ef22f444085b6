# SPDX-License-Identifier: Apache-2.0
"""Tensors leave blockkv through DLPack: zero-copy both ways between torch, NumPy and the cache,
views that outlive their cache object, and split_kv over every kind of tensor."""

import gc

import blockkv
import numpy as np
import pytest
import torch
from conftest import make_cache, make_manager

SHAPE = dict(block_size=4, layers=2, heads=2, head_size=8)


def test_write_through_torch_read_through_numpy_and_back():
    cache = make_cache(num_blocks=6, dtype="fp16", **SHAPE)
    layer = torch.from_dlpack(cache.get_cache(0))
    assert layer.shape == (6, 4, 2, 2, 8) and layer.dtype == torch.float16
    layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).view_as(layer) / 8)

    seen = np.from_dlpack(cache.get_cache(0))  # a fresh view of the same storage
    assert seen.dtype == np.float16 and seen.shape == (6, 4, 2, 2, 8)
    np.testing.assert_array_equal(seen, layer.numpy())
    assert seen.ctypes.data == layer.data_ptr() == cache.get_cache(0).data_ptr()

    assert not seen.flags.writeable  # NumPy marks DLPack imports read-only
    writable = cache.get_cache(0).numpy()  # blockkv's own NumPy view is writable
    assert writable.ctypes.data == layer.data_ptr() and writable.flags.writeable
    writable[3, 1, 1, 0, :] = -7  # and back: a NumPy write shows in torch and in a fresh view
    assert torch.all(layer[3, 1, 1, 0] == -7)
    assert np.all(np.asarray(cache.get_cache(0))[3, 1, 1, 0] == -7)
    other = torch.utils.dlpack.from_dlpack(cache.get_cache(1))  # the older spelling
    assert other.data_ptr() == layer.data_ptr() + layer.numel() * 2  # the next layer


def test_layers_do_not_alias():
    cache = make_cache(num_blocks=3, dtype="fp32", **SHAPE)
    zero = torch.from_dlpack(cache.get_cache(0))
    one = torch.from_dlpack(cache.get_cache(1))
    zero.fill_(1)
    one.fill_(2)
    assert torch.all(zero == 1) and torch.all(one == 2)


def test_split_kv_views_see_the_cache():
    cache = make_cache(num_blocks=5, dtype="fp32", **SHAPE)
    layer = torch.from_dlpack(cache.get_cache(1))
    layer.zero_()

    # blockkv.Tensor in, blockkv.Tensors out.
    k, v = blockkv.split_kv(cache.get_cache(1))
    assert isinstance(k, blockkv.Tensor) and k.shape == (5, 4, 2, 8)
    assert k.strides == (4 * 2 * 2 * 8, 2 * 2 * 8, 8, 1)
    assert v.data_ptr() == k.data_ptr() + 2 * 8 * 4
    tk, tv = torch.from_dlpack(k), torch.from_dlpack(v)
    tk[2, 3, 1] = 5.0
    tv[4, 0, 0] = 6.0
    assert torch.all(layer[2, 3, 0, 1] == 5.0) and torch.all(layer[4, 0, 1, 0] == 6.0)

    # torch in, torch out: DeepSpeed's split_kv.
    k2, v2 = blockkv.split_kv(layer)
    assert isinstance(k2, torch.Tensor) and k2.shape == (5, 4, 2, 8)
    assert k2.stride() == layer[:, :, 0].stride()
    assert torch.equal(k2, layer[:, :, 0]) and torch.equal(v2, layer[:, :, 1])
    v2[1, 1, 1, 1] = 9.0
    assert layer[1, 1, 1, 1, 1] == 9.0

    # NumPy in, NumPy out.
    k3, v3 = blockkv.split_kv(cache.get_cache(1).numpy())
    assert isinstance(k3, np.ndarray) and v3[1, 1, 1, 1] == 9.0
    k3[0, 0, 0, 0] = 4.0
    assert layer[0, 0, 0, 0, 0] == 4.0


def test_split_kv_rejects_other_ranks():
    with pytest.raises(ValueError):
        blockkv.split_kv(torch.zeros(2, 3, 2, 4))
    with pytest.raises(ValueError):
        blockkv.split_kv(np.zeros((2, 3, 2, 4, 5, 6), dtype=np.float32))
    with pytest.raises(ValueError):  # the K/V dimension must have size 2
        blockkv.split_kv(torch.zeros(2, 3, 3, 4, 5))
    with pytest.raises(TypeError):
        blockkv.split_kv([1, 2, 3])


def test_split_kv_of_torch_keeps_autograd_as_deepspeeds_does():
    t = torch.zeros(2, 2, 2, 1, 4, requires_grad=True)
    k, v = blockkv.split_kv(t)
    assert k.shape == (2, 2, 1, 4) and k.requires_grad and v._base is t


def test_a_view_outlives_its_cache_object():
    cache = make_cache(num_blocks=4, dtype="fp32", **SHAPE)
    view = torch.from_dlpack(cache.get_cache(0))
    k, _ = blockkv.split_kv(cache.get_cache(1))
    k_view = torch.from_dlpack(k)
    array = cache.get_cache(1).numpy()
    view.fill_(3.0)
    del cache, k
    gc.collect()
    assert torch.all(view == 3.0)  # still readable
    view[0, 0, 0, 0, 0] = 11.0  # and writable
    assert view[0, 0, 0, 0, 0] == 11.0 and view.sum() == 3.0 * (view.numel() - 1) + 11.0
    k_view.fill_(1.0)
    assert array[:, :, 0].sum() == k_view.numel()


def test_a_manager_cache_view_outlives_the_manager():
    manager = make_manager(num_blocks=4, block_size=4)
    view = torch.from_dlpack(manager.get_cache(1))
    del manager
    gc.collect()
    view.fill_(2)
    assert torch.all(view == 2)


def test_unconsumed_capsules_and_repeated_exports_are_fine():
    cache = make_cache(num_blocks=2, **SHAPE)
    layer = cache.get_cache(0)
    for _ in range(3):
        capsule = layer.__dlpack__()
        assert type(capsule).__name__ == "PyCapsule"
        del capsule  # never consumed: its destructor releases the export
    assert layer.__dlpack_device__() == (1, 0)
    assert torch.from_dlpack(layer).data_ptr() == torch.from_dlpack(layer).data_ptr()
    with pytest.raises(BufferError):
        layer.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        layer.__dlpack__(dl_device=(2, 0))
    assert layer.__dlpack__(stream=None, max_version=(1, 0), dl_device=(1, 0), copy=False)


def test_bf16_goes_to_torch_but_not_numpy():
    cache = make_cache(num_blocks=2, dtype="bf16", **SHAPE)
    layer = torch.from_dlpack(cache.get_cache(0))
    assert layer.dtype == torch.bfloat16
    layer.fill_(1.5)
    assert torch.all(torch.from_dlpack(cache.get_cache(0)) == 1.5)
    with pytest.raises(RuntimeError):  # NumPy has no bfloat16
        np.from_dlpack(cache.get_cache(0))
    with pytest.raises(TypeError):
        cache.get_cache(0).numpy()


def test_fp8_travels_as_bytes_and_int8_as_int8():
    fp8 = make_cache(num_blocks=2, dtype="fp8_e4m3", **SHAPE)
    raw = torch.from_dlpack(fp8.get_cache(0))
    assert raw.dtype == torch.uint8 and raw.shape == (2, 4, 2, 2, 8)
    assert np.from_dlpack(fp8.get_cache(0)).dtype == np.uint8
    int8 = make_cache(num_blocks=2, dtype="int8", **SHAPE)
    assert torch.from_dlpack(int8.get_cache(0)).dtype == torch.int8


def test_tensor_repr_and_no_public_constructor():
    cache = make_cache(num_blocks=2, **SHAPE)
    assert "shape=(2, 4, 2, 2, 8)" in repr(cache.get_cache(0))
    with pytest.raises(TypeError):
        blockkv.Tensor()
