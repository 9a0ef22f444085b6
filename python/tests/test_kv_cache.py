# SPDX-License-Identifier: Apache-2.0
"""BlockedKVCache: construction in both modes, devices, per-group reserve/free, layer views, and
what DeepSpeed leaves unimplemented (offload itself is in test_offload.py)."""

import blockkv
import numpy as np
import pytest
import torch
from conftest import allocate, kv_config, make_cache, requires_gpu, without_gpu


def test_allocate_mode_and_layer_views():
    cache = make_cache(num_blocks=16, block_size=4, layers=3, heads=2, head_size=8)
    assert cache.num_blocks == 16
    assert cache.free_blocks == [16]
    assert cache.num_caches == 1  # DeepSpeed's meaning: the number of cache groups
    assert cache.bytes_per_block == 3 * 4 * 2 * 2 * 8 * 2
    assert cache.total_bytes == 16 * cache.bytes_per_block
    layer = cache.get_cache(2)
    assert isinstance(layer, blockkv.Tensor)
    assert layer.shape == (16, 4, 2, 2, 8)
    assert layer.strides == (4 * 2 * 2 * 8, 2 * 2 * 8, 2 * 8, 8, 1)
    assert layer.dtype == "fp16" and layer.device == "cpu" and layer.ndim == 5
    assert layer.is_contiguous() and layer.numel() == 16 * 4 * 2 * 2 * 8 and len(layer) == 16
    storage = cache.get_group_storage()
    assert storage.shape == (3, 16, 4, 2, 2, 8)
    layer_bytes = 16 * 4 * 2 * 2 * 8 * 2
    assert layer.data_ptr() == storage.data_ptr() + 2 * layer_bytes
    assert cache.device.kind == "cpu"


def test_reserve_and_free_per_group():
    configs = (kv_config(block_size=4, layers=1), kv_config(block_size=8, layers=2, heads=1))
    cache = make_cache(num_blocks=8, configs=configs)
    assert cache.num_caches == 2 and cache.free_blocks == [8, 8]
    ids = cache.reserve(3)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 1, 2]
    other = cache.reserve(5, cache_group=1)
    assert cache.free_blocks == [5, 3]
    assert cache.get_cache(1, cache_group=1).shape == (8, 8, 2, 1, 8)
    cache.free(ids)
    cache.free(torch.tensor(other.tolist()), cache_group=1)
    assert cache.free_blocks == [8, 8]
    with pytest.raises(ValueError):
        cache.reserve(9)
    with pytest.raises(ValueError):
        cache.free([0])  # already free
    with pytest.raises(ValueError):
        cache.reserve(1, cache_group=2)
    with pytest.raises(ValueError):
        cache.get_cache(2, cache_group=1)
    with pytest.raises(ValueError):
        cache.config(2)
    assert cache.config(1).block_size == 8
    cache.check_invariants()


def test_a_single_config_is_accepted_as_well_as_a_tuple():
    cache = blockkv.BlockedKVCache(kv_config(), allocate(2), device="cpu")
    assert cache.num_caches == 1
    with pytest.raises(TypeError):
        blockkv.BlockedKVCache(("not a config",), allocate(2), device="cpu")


def test_reserve_mode_plans_against_a_budgeted_device():
    cfg = kv_config(block_size=4, layers=1, heads=1, head_size=8)  # 128 bytes per block
    leave_free = 1000
    device = blockkv.CpuDevice(budget_bytes=leave_free + 10 * 128 + 100)
    assert device.total_memory == leave_free + 10 * 128 + 100
    cache = blockkv.BlockedKVCache((cfg,), blockkv.MemoryConfig(mode="reserve", size=leave_free),
                                   device=device)
    assert cache.num_blocks == 10
    assert device.available_memory == leave_free + 100 - (cache.total_bytes - 10 * 128)
    tiny = blockkv.CpuDevice(budget_bytes=leave_free + 64)
    with pytest.raises(ValueError, match="1064|1000"):  # DeepSpeed: ValueError, numbers named
        blockkv.BlockedKVCache((cfg,), blockkv.MemoryConfig(size=leave_free), device=tiny)


def test_allocate_mode_beyond_the_budget_is_resource_exhausted():
    device = blockkv.CpuDevice(budget_bytes=1024)
    with pytest.raises(blockkv.ResourceExhaustedError):
        blockkv.BlockedKVCache((kv_config(),), allocate(1000), device=device)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "CpuDevice"])
def test_cpu_devices(device):
    if device == "CpuDevice":
        device = blockkv.CpuDevice()
    cache = blockkv.BlockedKVCache((kv_config(),), allocate(2), device=device)
    assert cache.get_cache(0).device == "cpu"


@without_gpu
def test_default_device_is_the_host_without_a_gpu():
    cache = blockkv.BlockedKVCache((kv_config(),), allocate(2))
    assert cache.device.kind == "cpu"


@without_gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda:0")])
def test_cuda_without_a_gpu_is_a_runtime_error(device):
    with pytest.raises(RuntimeError):
        blockkv.BlockedKVCache((kv_config(),), allocate(2), device=device)
    with pytest.raises(RuntimeError):
        blockkv.CudaDevice(0)


@requires_gpu
def test_cuda_cache_exports_device_tensors():
    cache = blockkv.BlockedKVCache((kv_config(),), allocate(4), device="cuda:0")
    layer = cache.get_cache(0)
    assert layer.device == "cuda:0" and layer.__dlpack_device__() == (2, 0)
    default = blockkv.BlockedKVCache((kv_config(),), allocate(4))
    assert default.device.kind == "cuda"


@pytest.mark.parametrize("device, error", [("tpu", ValueError), ("cuda:x", ValueError),
                                           (3.5, TypeError)])
def test_unknown_devices(device, error):
    with pytest.raises(error):
        blockkv.BlockedKVCache((kv_config(),), allocate(2), device=device)


def test_offload_needs_a_host_tier_and_groups_are_not_implemented():
    # DeepSpeed raises NotImplementedError for offload; blockkv implements it (test_offload.py)
    # and needs the host tier's size, which has no default.
    with pytest.raises(ValueError, match="host_blocks"):
        blockkv.BlockedKVCache((kv_config(),), allocate(2), offload=True, device="cpu")
    with pytest.raises(NotImplementedError):
        blockkv.BlockedKVCache((kv_config(),), allocate(2), mp_group=object(), device="cpu")
    cache = make_cache(num_blocks=2)
    blocks = cache.reserve(1)
    with pytest.raises(RuntimeError, match="offload is off"):
        cache.offload(blocks)
    with pytest.raises(RuntimeError, match="offload is off"):
        cache.restore([0])
    assert cache.free_blocks == [1]


def test_copy_blocks_copies_every_layer():
    cache = make_cache(num_blocks=4, block_size=2, layers=2, heads=1, head_size=4, dtype="fp32")
    layers = [torch.from_dlpack(cache.get_cache(i)) for i in range(2)]
    for i, layer in enumerate(layers):
        layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).view_as(layer) + 1000 * i)
    cache.copy_blocks([0, 1], [3, 2])
    for layer in layers:
        assert torch.equal(layer[3], layer[0]) and torch.equal(layer[2], layer[1])
    with pytest.raises(ValueError):
        cache.copy_blocks([0], [4])
