# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's ``BlockedKVCache`` and ``split_kv`` (``deepspeed.inference.v2.ragged.kv_cache``)
over ``blockkv.BlockedKVCache``: block ids and caches come back as torch tensors."""

from typing import Tuple, Union

import blockkv
import numpy
import torch

from .manager_configs import KVCacheConfig, MemoryConfig
from .ragged_manager import _core_kv_configs


def split_kv(kv_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The K and V planes of one layer's [blocks, block_size, 2, heads, head_size] cache, each
    [blocks, block_size, heads, head_size] with stride(1) = 2 * heads * head_size: views.
    ValueError unless 5-D."""
    return blockkv.split_kv(kv_cache)


class BlockedKVCache:
    """The KV cache of one or more cache groups, each with its own allocator.

    ``BlockedKVCache(configs, memory_config, mp_group=None, offload=False)`` as in DeepSpeed;
    ``device`` is blockkv's (see DSStateManager). ``mp_group`` must be None and
    ``offload=True`` raises NotImplementedError, as DeepSpeed's.
    """

    def __init__(self, configs: Union[KVCacheConfig, Tuple[KVCacheConfig, ...]],
                 memory_config: MemoryConfig, mp_group=None, offload: bool = False, *,
                 device=None) -> None:
        if offload:
            raise NotImplementedError("Offloading of KV-caches is not yet supported.")
        memory = memory_config.to_blockkv() if isinstance(memory_config, MemoryConfig) else \
            memory_config
        self._cache = blockkv.BlockedKVCache(_core_kv_configs(configs), memory, mp_group,
                                             False, device)

    @property
    def core(self) -> blockkv.BlockedKVCache:
        """blockkv's BlockedKVCache underneath."""
        return self._cache

    def reserve(self, num_blocks: int, cache_group: int = 0) -> torch.Tensor:
        """``num_blocks`` free blocks of ``cache_group``, int32. ValueError
        (``blockkv.ResourceExhaustedError``) when fewer are free."""
        return torch.from_numpy(self._cache.reserve(num_blocks, cache_group))

    def free(self, blocks, cache_group: int = 0) -> None:
        """Returns blocks: checked first (ValueError for an id that is out of range, free, or
        repeated), then all freed."""
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.numpy() if blocks.device.type == "cpu" else blocks.cpu().numpy()
        self._cache.free(blocks, cache_group)

    def offload(self, blocks, cache_group: int = 0) -> torch.Tensor:
        raise NotImplementedError("Offloading is not yet supported.")

    def restore(self, blocks, cache_group: int = 0) -> torch.Tensor:
        raise NotImplementedError("Offloading is not yet supported.")

    def get_cache(self, cache_id: int, cache_group: int = 0) -> torch.Tensor:
        """Layer ``cache_id`` of ``cache_group``: a torch view of the cache's memory."""
        return torch.from_dlpack(self._cache.get_cache(cache_id, cache_group))

    @property
    def free_blocks(self) -> numpy.ndarray:
        """Free blocks, an int32 NumPy array [num_caches] (see DSStateManager.free_blocks)."""
        return numpy.array(self._cache.free_blocks, dtype=numpy.int32)

    @property
    def num_caches(self) -> int:
        """The number of cache groups (DeepSpeed's name)."""
        return self._cache.num_caches
