# SPDX-License-Identifier: Apache-2.0
"""KVCacheConfig, MemoryConfig, AllocationMode and StateManagerConfig: DeepSpeed's names and
defaults, its config scenarios (test_manager_configs.py), and validation on assignment."""

import copy
import pickle

import blockkv
import numpy as np
import pytest
import torch


def test_kv_cache_config_defaults_are_deepspeeds():
    c = blockkv.KVCacheConfig(cache_shape=(32, 8, 128))
    assert c.block_size == 128
    assert c.cache_shape == (32, 8, 128)
    assert c.cache_dtype == torch.float16
    assert c.dtype_name == "fp16"
    assert c.num_allocation_groups == 1
    assert c.max_blocks_per_allocation_group == 64
    assert c.bytes_per_block == 128 * 32 * 8 * 128 * 2 * 2


def test_cache_shape_is_required_and_arguments_are_keywords():
    with pytest.raises(TypeError):
        blockkv.KVCacheConfig(block_size=16)
    with pytest.raises(TypeError):  # keyword-only, as a pydantic model's fields
        blockkv.KVCacheConfig(16, (1, 2, 3))


@pytest.mark.parametrize(
    "dtype, name, torch_dtype",
    [
        (torch.float16, "fp16", torch.float16),
        ("fp16", "fp16", torch.float16),
        ("half", "fp16", torch.float16),
        ("float16", "fp16", torch.float16),
        ("torch.float16", "fp16", torch.float16),
        (np.float16, "fp16", torch.float16),
        (torch.bfloat16, "bf16", torch.bfloat16),
        ("bf16", "bf16", torch.bfloat16),
        ("bfloat16", "bf16", torch.bfloat16),
        (torch.float32, "fp32", torch.float32),
        ("fp32", "fp32", torch.float32),
        ("float", "fp32", torch.float32),
        (torch.int8, "int8", torch.int8),
        ("int8", "int8", torch.int8),
        ("fp8_e4m3", "fp8_e4m3", None),
    ],
)
def test_cache_dtype_takes_torch_dtypes_and_deepspeeds_strings(dtype, name, torch_dtype):
    c = blockkv.KVCacheConfig(cache_shape=(1, 1, 8), cache_dtype=dtype)
    assert c.dtype_name == name
    if torch_dtype is not None:
        assert c.cache_dtype == torch_dtype  # DeepSpeed's configs hand back torch dtypes
    else:  # torch 1.13 has no float8: blockkv's name
        assert c.cache_dtype in ("fp8_e4m3", getattr(torch, "float8_e4m3fn", None))


@pytest.mark.parametrize("dtype", ["fp64", "float64", torch.float64, "", 3])
def test_unknown_cache_dtype_is_a_value_error(dtype):
    with pytest.raises(ValueError):
        blockkv.KVCacheConfig(cache_shape=(1, 1, 8), cache_dtype=dtype)


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0),
        ("block_size", -1),
        ("num_allocation_groups", 0),
        ("max_blocks_per_allocation_group", -1),
        ("cache_shape", (0, 1, 8)),
        ("cache_shape", (1, -1, 8)),
        ("cache_shape", (1, 1)),
        ("cache_shape", "abc"),
        ("block_size", 2**31),
    ],
)
def test_invalid_kv_cache_config_is_a_value_error(field, value):
    kwargs = {"cache_shape": (1, 1, 8), field: value}
    with pytest.raises(ValueError):
        blockkv.KVCacheConfig(**kwargs)
    # Assignment is validated too (DeepSpeed's validate_assignment) and changes nothing.
    c = blockkv.KVCacheConfig(cache_shape=(1, 1, 8))
    before = repr(c)
    with pytest.raises(ValueError):
        setattr(c, field, value)
    assert repr(c) == before


def test_kv_cache_config_assignment_and_equality():
    c = blockkv.KVCacheConfig(cache_shape=(1, 1, 8))
    c.block_size = 16
    c.cache_dtype = "bf16"
    c.cache_shape = (2, 4, 64)
    assert (c.block_size, c.dtype_name, c.cache_shape) == (16, "bf16", (2, 4, 64))
    assert c == blockkv.KVCacheConfig(block_size=16, cache_shape=(2, 4, 64), cache_dtype="bf16")
    assert "block_size=16" in repr(c)


def test_kv_cache_type_dense_mla_and_state_are_group_kinds():
    c = blockkv.KVCacheConfig(cache_shape=(1, 1, 8), type=blockkv.KVCacheType.DENSE)
    assert c.type == blockkv.KVCacheType.DENSE and c.bytes_per_block == 128 * 2 * 8 * 2
    assert blockkv.KVCacheConfig(cache_shape=(1, 1, 8)).type == blockkv.KVCacheType.DENSE
    # DeepSeek-V3: one latent row of 512 + 64 per token and layer, no K/V split.
    mla = blockkv.KVCacheConfig(cache_shape=(61, 1, 576), type="mla", latent_dim=512, rope_dim=64,
                                cache_dtype="bf16", block_size=64)
    assert mla.type == blockkv.KVCacheType.MLA
    assert (mla.latent_dim, mla.rope_dim, mla.state_bytes) == (512, 64, 0)
    assert mla.bytes_per_block == 61 * 64 * 576 * 2
    assert "type='mla', latent_dim=512, rope_dim=64" in repr(mla)
    assert copy.deepcopy(mla) == mla and pickle.loads(pickle.dumps(mla)) == mla
    assert mla != blockkv.KVCacheConfig(cache_shape=(61, 1, 576), cache_dtype="bf16",
                                        block_size=64)
    with pytest.raises(ValueError, match=r"\(61, 1, 576\), got \(61, 1, 512\)"):
        blockkv.KVCacheConfig(cache_shape=(61, 1, 512), type="mla", latent_dim=512, rope_dim=64)
    with pytest.raises(ValueError, match="latent_dim"):
        blockkv.KVCacheConfig(cache_shape=(1, 1, 8), latent_dim=8)
    with pytest.raises(ValueError):
        mla.rope_dim = 32  # the shape no longer adds up; nothing changes
    assert mla.rope_dim == 64
    with pytest.raises(ValueError, match="state_bytes"):
        blockkv.KVCacheConfig(cache_shape=(1, 1, 8), type="state")
    # A Mamba layer's state: 64 bytes of fp16 per layer and sequence, restated in cache_shape.
    state = blockkv.KVCacheConfig(cache_shape=(3, 1, 32), type="state", state_bytes=64)
    assert state.type == blockkv.KVCacheType.STATE and state.bytes_per_block == 3 * 64
    with pytest.raises(ValueError, match=r"\(3, 1, 64 / 2\), got \(3, 1, 8\)"):
        blockkv.KVCacheConfig(cache_shape=(3, 1, 8), type="state", state_bytes=64)
    with pytest.raises(ValueError):
        blockkv.KVCacheConfig(cache_shape=(1, 1, 8), type="sparse")


def test_memory_config_defaults_and_modes():
    m = blockkv.MemoryConfig()
    assert m.mode == blockkv.AllocationMode.RESERVE and m.size == 1_000_000_000
    assert blockkv.MemoryConfig(mode="allocate", size=8).mode == blockkv.AllocationMode.ALLOCATE
    assert blockkv.MemoryConfig(mode="reserve").mode == blockkv.AllocationMode.RESERVE
    assert blockkv.MemoryConfig(mode=blockkv.AllocationMode.ALLOCATE, size=3).size == 3
    m.mode = "allocate"
    assert m.mode == blockkv.AllocationMode.ALLOCATE


def test_memory_config_shared_pool_is_off_by_default_and_round_trips():
    assert blockkv.MemoryConfig().shared_pool is False  # DeepSpeed's layout: a pool per group
    m = blockkv.MemoryConfig(mode="allocate", size=8, shared_pool=True)
    assert m.shared_pool is True
    assert "shared_pool=True" in repr(m)
    assert m != blockkv.MemoryConfig(mode="allocate", size=8)
    assert pickle.loads(pickle.dumps(m)) == m
    m.shared_pool = False
    assert m == blockkv.MemoryConfig(mode="allocate", size=8)


@pytest.mark.parametrize("kwargs", [{"size": 0}, {"size": -1}, {"mode": "borrow"}, {"mode": 3}])
def test_invalid_memory_config_is_a_value_error(kwargs):
    with pytest.raises(ValueError):
        blockkv.MemoryConfig(**kwargs)


def test_state_manager_config_defaults_are_deepspeeds():
    c = blockkv.StateManagerConfig()
    assert c.max_tracked_sequences == 2048
    assert c.max_ragged_batch_size == 768
    assert c.max_ragged_sequence_count == 512
    assert c.max_context == 8192
    assert c.memory_config == blockkv.MemoryConfig()
    assert c.offload is False


@pytest.mark.parametrize(
    "field", ["max_tracked_sequences", "max_ragged_batch_size", "max_ragged_sequence_count"])
@pytest.mark.parametrize("value", [-1, 0])
def test_non_positive_counts_are_a_value_error(field, value):
    with pytest.raises(ValueError):
        blockkv.StateManagerConfig(**{field: value})


def test_sequence_count_above_batch_size_is_a_value_error():
    with pytest.raises(ValueError):
        blockkv.StateManagerConfig(max_ragged_batch_size=512, max_ragged_sequence_count=1024)


def test_sequence_count_above_tracked_sequences_is_a_value_error():
    with pytest.raises(ValueError):
        blockkv.StateManagerConfig(max_tracked_sequences=512, max_ragged_sequence_count=1024)


def test_state_manager_config_assignment_is_validated():
    c = blockkv.StateManagerConfig()
    with pytest.raises(ValueError):
        c.max_ragged_sequence_count = 4096  # above max_tracked_sequences
    assert c.max_ragged_sequence_count == 512
    c.max_context = 1024
    c.memory_config = blockkv.MemoryConfig(mode="allocate", size=10)
    assert c.memory_config.size == 10
    c.memory_config.size = 20  # the nested config is the config's own, validated itself
    assert c.memory_config.size == 20
    with pytest.raises(ValueError):
        c.memory_config.size = 0
    assert c.memory_config.size == 20


def test_configs_copy_and_pickle():
    import copy
    import pickle

    kv = blockkv.KVCacheConfig(block_size=16, cache_shape=(2, 4, 64), cache_dtype="bf16",
                               max_blocks_per_allocation_group=8)
    mem = blockkv.MemoryConfig(mode="allocate", size=12)
    manager = blockkv.StateManagerConfig(max_tracked_sequences=64, max_ragged_sequence_count=32,
                                         memory_config=mem, max_context=512)
    for config in (kv, mem, manager):
        for clone in (copy.copy(config), copy.deepcopy(config),
                      pickle.loads(pickle.dumps(config))):
            assert clone is not config and repr(clone) == repr(config)
    clone = copy.deepcopy(manager)
    clone.memory_config.size = 99
    assert manager.memory_config.size == 12


def test_local_group_takes_its_window():
    for kind in ("local", blockkv.KVCacheType.LOCAL):
        c = blockkv.KVCacheConfig(cache_shape=(2, 1, 8), type=kind, local_window=4096)
        assert c.type == blockkv.KVCacheType.LOCAL and c.local_window == 4096
        assert "local_window=4096" in repr(c)
        assert pickle.loads(pickle.dumps(c)) == c
    assert c != blockkv.KVCacheConfig(cache_shape=(2, 1, 8), type="local", local_window=64)
    with pytest.raises(ValueError, match="local_window .* must be > 0, got 0"):
        blockkv.KVCacheConfig(cache_shape=(1, 1, 8), type="local")
    with pytest.raises(ValueError, match="local_window is for LOCAL groups.*got 16"):
        blockkv.KVCacheConfig(cache_shape=(1, 1, 8), local_window=16)
    with pytest.raises(ValueError):
        c.local_window = -1  # nothing changes
    assert c.local_window == 4096
