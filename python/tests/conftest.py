# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for blockkv's Python tests (run by ctest with the build tree's module first on
PYTHONPATH: see tests/CMakeLists.txt)."""

import blockkv
import pytest

blockkv.set_log_level("warning")  # no "KV cache group 0 on cpu ..." line per cache

# CUDA is the only thing these tests may skip: this module may be built without it, or run where
# there is no GPU.
HAVE_GPU = blockkv.built_with_cuda
if HAVE_GPU:
    try:
        blockkv.CudaDevice(0)
    except RuntimeError:
        HAVE_GPU = False

requires_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs blockkv built with CUDA and a GPU")
without_gpu = pytest.mark.skipif(HAVE_GPU, reason="checks the behaviour without a usable GPU")


def kv_config(block_size=16, layers=2, heads=2, head_size=8, dtype="fp16", **kwargs):
    return blockkv.KVCacheConfig(block_size=block_size, cache_shape=(layers, heads, head_size),
                                 cache_dtype=dtype, **kwargs)


def allocate(num_blocks):
    return blockkv.MemoryConfig(mode="allocate", size=num_blocks)


def make_cache(num_blocks=16, configs=None, **kwargs):
    configs = configs if configs is not None else (kv_config(**kwargs),)
    return blockkv.BlockedKVCache(configs, allocate(num_blocks), device="cpu")


def make_manager(num_blocks=64, block_size=16, max_blocks=64, kv_configs=None, **config):
    config.setdefault("memory_config", allocate(num_blocks))
    manager_config = blockkv.StateManagerConfig(**config)
    if kv_configs is None:
        kv_configs = (kv_config(block_size=block_size, max_blocks_per_allocation_group=max_blocks),)
    return blockkv.StateManager(manager_config, kv_configs, device="cpu")
