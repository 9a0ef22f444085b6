# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's ragged configs (``deepspeed.inference.v2.ragged.manager_configs``) as pydantic
models with DeepSpeed's fields, defaults and ``ValidationError``, checked by blockkv's own
config validation as well (so ``block_size`` must be positive and sizes may not overflow, where
DeepSpeed checks neither). ``to_blockkv()`` gives the ``blockkv`` config the core takes.
"""

from enum import Enum
from typing import Tuple

import blockkv
from pydantic import PositiveInt

from ._pydantic import ConfigModel, field_before, model_check

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency of the tests and of DeepSpeed
    torch = None


class DtypeEnum(Enum):
    """DeepSpeed's DtypeEnum: the value is the torch dtype, every alias finds its member."""

    fp16 = "fp16"
    fp32 = "fp32"
    bf16 = "bf16"
    int8 = "int8"

    @classmethod
    def _missing_(cls, value):
        name = _DTYPE_ALIASES.get(value if isinstance(value, str) else str(value))
        return cls(name) if name is not None else None

    @property
    def torch_dtype(self):
        return getattr(torch, _TORCH_NAMES[self.value]) if torch is not None else self.value


_TORCH_NAMES = {"fp16": "float16", "fp32": "float32", "bf16": "bfloat16", "int8": "int8"}
_DTYPE_ALIASES = {}
for _name, _aliases in (("fp16", ("torch.float16", "float16", "half", "torch.half")),
                        ("fp32", ("torch.float32", "float32", "float", "torch.float")),
                        ("bf16", ("torch.bfloat16", "bfloat16", "bfloat")),
                        ("int8", ("torch.int8",))):
    for _alias in _aliases:
        _DTYPE_ALIASES[_alias] = _name
del _name, _aliases, _alias


def _to_torch_dtype(value):
    # cache_dtype is stored as torch's dtype (DeepSpeed's use_enum_values of DtypeEnum); an
    # unknown name is a ValueError, which pydantic reports as ValidationError.
    if isinstance(value, DtypeEnum):
        return value.torch_dtype
    try:
        return DtypeEnum(value).torch_dtype
    except ValueError:
        raise ValueError(f"unknown cache_dtype {value!r}: expected a torch dtype or one of "
                         f"fp16, fp32, bf16, int8 (or their aliases)") from None


class KVCacheType(Enum):
    DENSE = "dense"
    LOCAL = "local"


class KVCacheConfig(ConfigModel):
    """One cache group. DeepSpeed's fields and defaults; ``type`` is informational there and
    here (it is stored, no code path reads it)."""

    type: KVCacheType = KVCacheType.DENSE
    block_size: int = 128
    num_allocation_groups: PositiveInt = 1
    cache_shape: Tuple[PositiveInt, PositiveInt, PositiveInt]
    cache_dtype: object = "fp16"
    max_blocks_per_allocation_group: PositiveInt = 64

    convert_cache_dtype = field_before("cache_dtype", _to_torch_dtype)

    def to_blockkv(self):
        """The ``blockkv.KVCacheConfig`` of the same fields."""
        return blockkv.KVCacheConfig(
            block_size=self.block_size, cache_shape=tuple(self.cache_shape),
            cache_dtype=self.cache_dtype, num_allocation_groups=self.num_allocation_groups,
            max_blocks_per_allocation_group=self.max_blocks_per_allocation_group)

    check_with_blockkv = model_check(lambda values: _kv_config_of(values))


def _kv_config_of(values):
    # blockkv's validation (block_size > 0, overflow-checked products): its ValueError becomes
    # pydantic's ValidationError.
    return blockkv.KVCacheConfig(
        block_size=values["block_size"], cache_shape=tuple(values["cache_shape"]),
        cache_dtype=values["cache_dtype"], num_allocation_groups=values["num_allocation_groups"],
        max_blocks_per_allocation_group=values["max_blocks_per_allocation_group"])


class AllocationMode(Enum):
    RESERVE = "reserve"
    ALLOCATE = "allocate"


class MemoryConfig(ConfigModel):
    """RESERVE: ``size`` is the bytes to leave free; ALLOCATE: the number of blocks."""

    mode: AllocationMode = AllocationMode.RESERVE
    size: PositiveInt = 1_000_000_000
    # Not DeepSpeed's: every cache group draws from one pool of blocks (vLLM's hybrid
    # allocator), so a LOCAL group's released blocks serve a DENSE one. False: DeepSpeed's
    # layout, a pool per group.
    shared_pool: bool = False
    # Not DeepSpeed's: slots of every STATE cache group (0: a StateManager gives one per tracked
    # sequence).
    state_slots: int = 0

    def to_blockkv(self):
        """The ``blockkv.MemoryConfig`` of the same fields."""
        mode = self.mode.value if isinstance(self.mode, AllocationMode) else self.mode
        return blockkv.MemoryConfig(mode=mode, size=self.size, shared_pool=self.shared_pool,
                                    state_slots=self.state_slots)


def _check_manager_counts(values):
    # DeepSpeed's two assertions (its messages say "less than"; both checks are <=).
    count = values["max_ragged_sequence_count"]
    if count > values["max_tracked_sequences"]:
        raise ValueError("max_ragged_sequence_count must be less than max_tracked_sequences")
    if count > values["max_ragged_batch_size"]:
        raise ValueError("max_ragged_sequence_count must be less than max_ragged_batch_size")


class DSStateManagerConfig(ConfigModel):
    """DeepSpeed's state-manager limits. ``max_context`` is enforced (DeepSpeed stores it and
    never reads it); ``offload`` must stay False (see DSStateManager)."""

    max_tracked_sequences: PositiveInt = 2048
    max_ragged_batch_size: PositiveInt = 768
    max_ragged_sequence_count: PositiveInt = 512
    max_context: PositiveInt = 8192
    memory_config: MemoryConfig = MemoryConfig()
    offload: bool = False

    check_counts = model_check(_check_manager_counts)

    def to_blockkv(self):
        """The ``blockkv.StateManagerConfig`` of the same fields."""
        return blockkv.StateManagerConfig(
            max_tracked_sequences=self.max_tracked_sequences,
            max_ragged_batch_size=self.max_ragged_batch_size,
            max_ragged_sequence_count=self.max_ragged_sequence_count,
            max_context=self.max_context, memory_config=self.memory_config.to_blockkv())
