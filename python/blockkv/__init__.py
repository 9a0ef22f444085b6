# SPDX-License-Identifier: Apache-2.0
"""blockkv: a paged KV cache for LLM inference, with DeepSpeed-FastGen's Python API.

The names, argument names and defaults follow ``deepspeed.inference.v2.ragged``; code written
against DeepSpeed itself ports by importing ``blockkv.deepspeed`` instead of
``deepspeed.inference.v2.ragged`` (that package has DeepSpeed's exact API). Here::

    import blockkv
    cfg = blockkv.KVCacheConfig(block_size=16, cache_shape=(32, 8, 128), cache_dtype="fp16")
    mem = blockkv.MemoryConfig(mode="allocate", size=1024)
    cache = blockkv.BlockedKVCache((cfg,), mem, device="cpu")
    blocks = cache.reserve(4)                            # int32 NumPy array
    layer0 = torch.from_dlpack(cache.get_cache(0))       # zero-copy [1024, 16, 2, 8, 128]
    k, v = blockkv.split_kv(layer0)                      # torch views
    cache.free(blocks)

Tensors cross as DLPack without a copy; block ids come back as int32 NumPy arrays. Beyond
DeepSpeed: prefix caching (StateManagerConfig(prefix_cache=PrefixCacheConfig()),
StateManager.add_sequence), offload to host and disk tiers (BlockedKVCache(offload=True),
StateManager.preempt_sequence / resume_sequence) and the kernels append_kv / paged_attention. See docs/python.md for
the whole API, the error types and what differs from DeepSpeed.

Threads: every object may be shared between Python threads. Each StateManager, BlockedKVCache,
BlockedAllocator and RaggedBatchWrapper has a lock that all of its methods (and those of its
descriptors and tickets) hold, so calls on one object run one at a time and calls on different
objects in parallel; a call that releases the GIL also waits for the lock without it. Integers
are range-checked against the C++ type they become: a value that does not fit is a ValueError
naming it and the range, whatever carried it (int, list, NumPy array of any integer dtype, torch
tensor).
"""

import sys
from enum import Enum

from . import _blockkv
from ._blockkv import (
    AllCleared,
    AllocationMode,
    BlockedAllocator,
    BlockedKVCache,
    BlockRemoved,
    BlockStored,
    CacheEventBatch,
    CpuDevice,
    CudaDevice,
    Device,
    ImportTicket,
    KVCacheConfig,
    MemoryConfig,
    OffloadConfig,
    OffloadTicket,
    KVEventsConfig,
    KVEventsStats,
    PrefixCacheConfig,
    PrefixCacheStats,
    RaggedBatchWrapper,
    RemoteFetchTicket,
    RemoteTierConfig,
    ResourceExhaustedError,
    SchedulingResult,
    SequenceDescriptor,
    StateManager,
    StateManagerConfig,
    Tensor,
    TransferConfig,
    append_kv,
    built_with_cuda,
    mla_append_kv,
    mla_paged_attention,
    paged_attention,
    set_log_level,
)

__all__ = [
    "AllCleared",
    "AllocationMode",
    "BlockRemoved",
    "BlockStored",
    "BlockedAllocator",
    "BlockedKVCache",
    "CacheEventBatch",
    "CpuDevice",
    "CudaDevice",
    "DSSequenceDescriptor",
    "DSStateManager",
    "DSStateManagerConfig",
    "Device",
    "ImportTicket",
    "KVCacheConfig",
    "KVCacheType",
    "MemoryConfig",
    "OffloadConfig",
    "OffloadTicket",
    "PlaceholderSequenceDescriptor",
    "KVEventsConfig",
    "KVEventsStats",
    "PrefixCacheConfig",
    "PrefixCacheStats",
    "RaggedBatchWrapper",
    "RemoteFetchTicket",
    "RemoteTierConfig",
    "ResourceExhaustedError",
    "SchedulingError",
    "SchedulingResult",
    "SequenceDescriptor",
    "StateManager",
    "StateManagerConfig",
    "Tensor",
    "TransferConfig",
    "append_kv",
    "built_with_cuda",
    "mla_append_kv",
    "mla_paged_attention",
    "paged_attention",
    "set_log_level",
    "split_kv",
]

# The classes print as blockkv.X, not blockkv._blockkv.X.
for _cls in (AllCleared, AllocationMode, BlockedAllocator, BlockedKVCache, BlockRemoved,
             BlockStored, CacheEventBatch, Device, ImportTicket, KVCacheConfig, KVEventsConfig, KVEventsStats,
             MemoryConfig, OffloadConfig,
             OffloadTicket, PrefixCacheConfig, PrefixCacheStats, RaggedBatchWrapper, RemoteFetchTicket, RemoteTierConfig, ResourceExhaustedError, SchedulingResult,
             SequenceDescriptor, StateManager, StateManagerConfig, Tensor, TransferConfig):
    _cls.__module__ = __name__
del _cls

# The kernels' page tables of the caller's (include/blockkv/page_table.h, docs/kernels.md).
from ._blockkv import CsrPageTable, SlotMappingPageTable  # noqa: E402

CsrPageTable.__module__ = SlotMappingPageTable.__module__ = __name__
__all__ += ["CsrPageTable", "SlotMappingPageTable"]

# DeepSpeed's names for the same classes.
DSStateManager = StateManager
DSStateManagerConfig = StateManagerConfig
DSSequenceDescriptor = SequenceDescriptor


class KVCacheType(Enum):
    """What a cache group's layers keep per token: DeepSpeed's KVCacheType, extended (issue 21).

    DENSE: K and V per KV head. MLA: one latent row (latent_dim + rope_dim) per token, shared by
    every head (DeepSeek-V2/V3). LOCAL (sliding window) and STATE (per-sequence state) are not
    group kinds yet: KVCacheConfig raises NotImplementedError for them.
    """

    DENSE = "dense"
    LOCAL = "local"
    STATE = "state"
    MLA = "mla"


class SchedulingError(RuntimeError):
    """StateManager.schedule could not fit the batch; ``result`` says which limit (DeepSpeed's)."""

    def __init__(self, result, message=None):
        self.result = result
        super().__init__(message or f"Batch scheduling failed with result {result}")


class PlaceholderSequenceDescriptor:
    """DeepSpeed's stand-in for a sequence that is not tracked yet, holding plain values.

    blockkv's StateManager.query evaluates unknown uids itself, and RaggedBatchWrapper only
    batches tracked sequences, so this exists for code that builds one.
    """

    def __init__(self, seen_tokens=0, cur_allocated_blocks=0, kv_blocks_ptr=0):
        self._seen_tokens = seen_tokens
        self._cur_allocated_blocks = cur_allocated_blocks
        self._kv_blocks_ptr = kv_blocks_ptr

    @property
    def seen_tokens(self):
        return self._seen_tokens

    @property
    def in_flight_tokens(self):
        return 0

    @property
    def cur_allocated_blocks(self):
        return self._cur_allocated_blocks

    @property
    def kv_blocks_ptr(self):
        return self._kv_blocks_ptr


def _torch_tensor_type():
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def split_kv(kv_cache):
    """Splits one layer's cache [num_blocks, block_size, 2, H, D] into its K and V planes.

    Each is [num_blocks, block_size, H, D] with stride(1) = 2*H*D, a view of the same memory.
    A torch tensor gives torch views back (DeepSpeed's split_kv, autograd and all), a NumPy array
    NumPy views; anything else with __dlpack__ (a blockkv.Tensor from get_cache) goes through
    blockkv's SplitKV and gives blockkv.Tensors. ValueError unless 5-D with a dimension 2 of
    size 2.
    """
    torch_tensor = _torch_tensor_type()
    numpy = sys.modules.get("numpy")
    if (torch_tensor is not None and isinstance(kv_cache, torch_tensor)) or (
            numpy is not None and isinstance(kv_cache, numpy.ndarray)):
        if kv_cache.ndim != 5:
            raise ValueError(f"KV-cache must have 5 dimensions, got {kv_cache.ndim}.")
        if kv_cache.shape[2] != 2:
            raise ValueError(f"KV-cache dimension 2 holds K and V and must be 2, got "
                             f"{kv_cache.shape[2]}.")
        return kv_cache[:, :, 0], kv_cache[:, :, 1]
    return _blockkv._split_kv(kv_cache)
