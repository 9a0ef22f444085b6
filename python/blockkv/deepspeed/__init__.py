# SPDX-License-Identifier: Apache-2.0
"""blockkv.deepspeed: DeepSpeed-FastGen's ragged KV-cache API (``deepspeed.inference.v2.ragged``)
over blockkv's core.

Replace ``deepspeed.inference.v2.ragged`` by ``blockkv.deepspeed`` in an import and the code
runs on blockkv: the modules (``blocked_allocator``, ``kv_cache``, ``manager_configs``,
``ragged_manager``, ``ragged_wrapper``, ``sequence_descriptor``) and the names they define are
DeepSpeed's, with DeepSpeed's signatures, defaults, torch int32 tensors and exceptions (pydantic's
``ValidationError`` for invalid configs, with pydantic 1 or 2). What still differs, and why, is
listed in docs/python.md ("blockkv.deepspeed").
"""

from .kv_cache import split_kv
from .manager_configs import AllocationMode, DSStateManagerConfig, KVCacheConfig, MemoryConfig
from .ragged_manager import DSStateManager
from .ragged_wrapper import RaggedBatchWrapper
from .sequence_descriptor import DSSequenceDescriptor, PlaceholderSequenceDescriptor

__all__ = [
    "AllocationMode",
    "DSSequenceDescriptor",
    "DSStateManager",
    "DSStateManagerConfig",
    "KVCacheConfig",
    "MemoryConfig",
    "PlaceholderSequenceDescriptor",
    "RaggedBatchWrapper",
    "split_kv",
]
