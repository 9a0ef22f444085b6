# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's test_manager_configs.py scenarios (DeepSpeed 38327e07) through blockkv.deepspeed,
and the config behaviour DeepSpeed's models have: defaults, "auto", extra keys, assignment,
dtype aliases, and blockkv's own checks surfacing as ValidationError too."""

import pydantic
import pytest
import torch

import blockkv
from blockkv.deepspeed import (AllocationMode, DSStateManagerConfig, KVCacheConfig,
                               MemoryConfig)
from blockkv.deepspeed import _pydantic
from blockkv.deepspeed.manager_configs import DtypeEnum, KVCacheType


@pytest.mark.parametrize("bad_val", [-1, 0])
@pytest.mark.parametrize("field", ["max_tracked_sequences", "max_ragged_batch_size",
                                   "max_ragged_sequence_count"])
def test_non_positive_count_is_validation_error(field, bad_val):
    with pytest.raises(pydantic.ValidationError):
        DSStateManagerConfig(**{field: bad_val})


def test_sequence_count_above_batch_size():
    with pytest.raises(pydantic.ValidationError, match="max_ragged_batch_size"):
        DSStateManagerConfig(max_ragged_batch_size=512, max_ragged_sequence_count=1024)


def test_sequence_count_above_tracked_sequences():
    with pytest.raises(pydantic.ValidationError, match="max_tracked_sequences"):
        DSStateManagerConfig(max_tracked_sequences=512, max_ragged_sequence_count=1024)


def test_equal_counts_are_accepted():
    config = DSStateManagerConfig(max_tracked_sequences=16, max_ragged_batch_size=16,
                                  max_ragged_sequence_count=16)
    assert config.max_ragged_sequence_count == 16


def test_defaults_are_deepspeeds():
    config = DSStateManagerConfig()
    assert (config.max_tracked_sequences, config.max_ragged_batch_size,
            config.max_ragged_sequence_count, config.max_context) == (2048, 768, 512, 8192)
    assert config.offload is False
    assert config.memory_config.mode == "reserve"  # use_enum_values: the value is stored
    assert config.memory_config.size == 1_000_000_000
    kv = KVCacheConfig(cache_shape=(2, 4, 64))
    assert (kv.block_size, kv.num_allocation_groups, kv.max_blocks_per_allocation_group) == (
        128, 1, 64)
    assert kv.cache_dtype == torch.float16
    assert kv.type == "dense"


def test_invalid_assignment_is_validation_error_and_keeps_the_value():
    config = DSStateManagerConfig(max_ragged_sequence_count=16)
    with pytest.raises(pydantic.ValidationError):
        config.max_tracked_sequences = 0
    assert config.max_tracked_sequences == 2048


def test_unknown_key_is_validation_error():
    with pytest.raises(pydantic.ValidationError):
        DSStateManagerConfig(max_batch=3)
    with pytest.raises(pydantic.ValidationError):
        KVCacheConfig(cache_shape=(1, 1, 8), layers=3)


def test_auto_values_are_dropped():
    assert DSStateManagerConfig(max_context="auto").max_context == 8192


def test_kv_cache_config_cache_shape_is_required_and_positive():
    with pytest.raises(pydantic.ValidationError):
        KVCacheConfig()
    with pytest.raises(pydantic.ValidationError):
        KVCacheConfig(cache_shape=(2, 0, 64))
    with pytest.raises(pydantic.ValidationError):
        KVCacheConfig(cache_shape=(2, 4))


@pytest.mark.parametrize("alias, dtype", [("fp16", torch.float16), ("half", torch.float16),
                                          (torch.float16, torch.float16),
                                          ("bf16", torch.bfloat16), ("fp32", torch.float32),
                                          ("float", torch.float32), ("int8", torch.int8),
                                          (DtypeEnum.bf16, torch.bfloat16)])
def test_cache_dtype_aliases_store_torch_dtype(alias, dtype):
    assert KVCacheConfig(cache_shape=(1, 1, 8), cache_dtype=alias).cache_dtype == dtype


def test_unknown_cache_dtype_is_validation_error():
    with pytest.raises(pydantic.ValidationError, match="cache_dtype"):
        KVCacheConfig(cache_shape=(1, 1, 8), cache_dtype="fp64")


def test_kv_cache_type_is_stored():
    assert KVCacheConfig(cache_shape=(1, 1, 8), type=KVCacheType.LOCAL).type == "local"
    with pytest.raises(pydantic.ValidationError):
        KVCacheConfig(cache_shape=(1, 1, 8), type="sliding")


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_is_checked_by_blockkv(block_size):
    # DeepSpeed accepts block_size=0 and divides by it later.
    with pytest.raises(pydantic.ValidationError, match="block_size"):
        KVCacheConfig(cache_shape=(1, 1, 8), block_size=block_size)


def test_memory_config_shared_pool_and_state_slots_reach_the_core_config():
    assert MemoryConfig().shared_pool is False
    core = MemoryConfig(mode="allocate", size=8, shared_pool=True).to_blockkv()
    assert core == blockkv.MemoryConfig(mode="allocate", size=8, shared_pool=True)
    assert MemoryConfig(state_slots=4).to_blockkv().state_slots == 4


def test_memory_config_modes_and_size():
    assert MemoryConfig(mode=AllocationMode.ALLOCATE, size=8).mode == "allocate"
    assert MemoryConfig(mode="allocate", size=8).to_blockkv() == blockkv.MemoryConfig(
        mode="allocate", size=8)
    with pytest.raises(pydantic.ValidationError):
        MemoryConfig(size=0)
    with pytest.raises(pydantic.ValidationError):
        MemoryConfig(mode="spill")


def test_to_blockkv_carries_every_field():
    kv = KVCacheConfig(block_size=16, cache_shape=(2, 4, 64), cache_dtype="bf16",
                       max_blocks_per_allocation_group=32)
    assert kv.to_blockkv() == blockkv.KVCacheConfig(block_size=16, cache_shape=(2, 4, 64),
                                                    cache_dtype="bf16",
                                                    max_blocks_per_allocation_group=32)
    config = DSStateManagerConfig(max_tracked_sequences=64, max_ragged_batch_size=256,
                                  max_ragged_sequence_count=32, max_context=1024,
                                  memory_config=MemoryConfig(mode="allocate", size=8))
    core = config.to_blockkv()
    assert (core.max_tracked_sequences, core.max_ragged_batch_size,
            core.max_ragged_sequence_count, core.max_context) == (64, 256, 32, 1024)
    assert core.memory_config == blockkv.MemoryConfig(mode="allocate", size=8)


def test_validation_error_is_the_installed_pydantics():
    assert _pydantic.ValidationError is pydantic.ValidationError
    assert _pydantic.PYDANTIC_V2 == pydantic.VERSION.startswith("2")
