# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's ``DSStateManager`` (``deepspeed.inference.v2.ragged.ragged_manager``) over
``blockkv.StateManager``: the core owns the cache, the block tables and the sequences; this
class keeps DeepSpeed's names and return types and one descriptor object per tracked uid."""

import types
from typing import Any, Dict, Optional, Tuple, Union

import blockkv
import numpy
import torch

from .. import _blockkv
from .manager_configs import DSStateManagerConfig, KVCacheConfig
from .sequence_descriptor import DSSequenceDescriptor


def _core_kv_configs(kv_configs):
    if isinstance(kv_configs, (KVCacheConfig, blockkv.KVCacheConfig)):
        kv_configs = (kv_configs,)
    return tuple(c.to_blockkv() if isinstance(c, KVCacheConfig) else c for c in kv_configs)


def _core_manager_config(config):
    if isinstance(config, DSStateManagerConfig):
        if config.offload:
            raise NotImplementedError(
                "Offloading of KV-caches is not yet supported: DeepSpeed's offload flag has no "
                "host tier size; use blockkv.StateManager with StateManagerConfig(offload=True, "
                "offload_config=blockkv.OffloadConfig(host_blocks=N))")
        return config.to_blockkv()
    return config


class DSStateManager:
    """The sequences of an engine and their KV blocks.

    ``DSStateManager(config, kv_configs, base_mp_group=None)`` as in DeepSpeed; ``device`` is
    blockkv's (None: the current CUDA GPU when blockkv was built with CUDA and one is usable,
    else host memory; "cpu", "cuda:N", ...). ``base_mp_group`` must be None (communicators are
    not bound to Python).
    """

    def __init__(self, config: DSStateManagerConfig,
                 kv_configs: Union[KVCacheConfig, Tuple[KVCacheConfig, ...]],
                 base_mp_group: Optional[Any] = None, *, device=None) -> None:
        self._config = config
        self._kv_configs = kv_configs
        self._core = blockkv.StateManager(_core_manager_config(config),
                                          _core_kv_configs(kv_configs), base_mp_group, device)
        self._seqs: Dict[int, DSSequenceDescriptor] = {}

    @property
    def core(self) -> blockkv.StateManager:
        """blockkv's StateManager underneath (prefix caching, fork, snapshots, ...). Sequences
        it creates or flushes directly are seen here on the next lookup."""
        return self._core

    def get_cache(self, cache_id: int, cache_group: int = 0) -> torch.Tensor:
        """Layer ``cache_id``'s cache, [num_blocks, block_size, 2, heads, head_size], a torch
        view of the cache's memory."""
        return torch.from_dlpack(self._core.get_cache(cache_id, cache_group))

    def flush_sequence(self, uid: int) -> None:
        """Frees the sequence's blocks and slot. An unknown uid is a RuntimeWarning only."""
        self._core.flush_sequence(uid)
        self._seqs.pop(uid, None)

    def get_sequence(self, uid: int) -> Optional[DSSequenceDescriptor]:
        """The descriptor, or None when ``uid`` is not tracked."""
        seq = self._seqs.get(uid)
        if seq is not None:
            return seq
        core_seq = self._core.get_sequence(uid)  # created through .core, or a stale entry
        return self._track(core_seq) if core_seq is not None else None

    def get_or_create_sequence(self, uid: int) -> DSSequenceDescriptor:
        """The descriptor of ``uid``, tracking it first when it is new. RuntimeError
        (``blockkv.ResourceExhaustedError``) when every tracking slot is taken."""
        seq = self._seqs.get(uid)
        if seq is not None:
            return seq
        return self._track(self._core.get_or_create_sequence(uid))

    def _track(self, core_seq) -> DSSequenceDescriptor:
        seq = DSSequenceDescriptor._of(self, self._core, core_seq)
        self._seqs[seq.uid] = seq
        return seq

    @property
    def tracked_sequences(self) -> Dict[int, DSSequenceDescriptor]:
        """uid -> descriptor of every sequence tracked through this object (a read-only view)."""
        return types.MappingProxyType(self._seqs)

    @property
    def n_tracked_sequences(self) -> int:
        return self._core.n_tracked_sequences

    @property
    def kv_block_size(self) -> int:
        """Cache group 0's block size (DeepSpeed's raises AttributeError)."""
        return self._core.kv_block_size

    @property
    def n_kv_cache_groups(self) -> int:
        return self._core.num_caches

    @property
    def free_blocks(self) -> numpy.ndarray:
        """Free blocks (unreferenced cached blocks included), an int32 NumPy array
        [n_kv_cache_groups]. DeepSpeed's engine documents a tensor and its cache returns a list,
        on which engine_v2's can_schedule fails (DeepSpeed #5407); an array indexes, iterates,
        compares and subtracts as that tensor does (so can_schedule runs), at NumPy's cost per
        operation rather than torch's, which engine_v2 pays per sequence and step."""
        return _blockkv._ds_free_block_counts(self._core)

    def allocate_blocks(self, n_blocks: int, cache_group: int = 0) -> torch.Tensor:
        """``n_blocks`` blocks of ``cache_group`` as an int32 tensor, the engine's until
        ``extend_kv_cache`` gives them to a sequence (or ``free_allocated_blocks`` takes them
        back). ValueError (``blockkv.ResourceExhaustedError``) when fewer are free."""
        return torch.from_numpy(_blockkv._ds_allocate_blocks(self._core, n_blocks, cache_group))

    # ---- beyond DeepSpeed's DSStateManager --------------------------------------------------

    def free_allocated_blocks(self, blocks, cache_group: int = 0) -> None:
        """Returns blocks ``allocate_blocks`` handed out that no sequence took (DeepSpeed's
        engine would call its cache's free). ValueError for any other id; all or nothing."""
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.numpy() if blocks.device.type == "cpu" else blocks.cpu().numpy()
        _blockkv._ds_free_blocks(self._core, blocks, cache_group)

    def allocated_unused_blocks(self, cache_group: int = 0) -> int:
        """Blocks ``allocate_blocks`` handed out that are in no sequence's table yet."""
        return _blockkv._ds_engine_held_blocks(self._core, cache_group)

    def query(self, uid: int, max_request_tokens: int, max_request_blocks: int):
        """(tokens, blocks) ``uid`` may run next: DeepSpeed's ``InferenceEngineV2.query``."""
        return self._core.query(uid, max_request_tokens, max_request_blocks)

    def can_schedule(self, uids, lengths) -> "blockkv.SchedulingResult":
        """DeepSpeed's ``InferenceEngineV2.can_schedule``, with its bugs fixed (#5407's free
        block list, duplicate uids, SequenceTokenLimitExceeded)."""
        return self._core.can_schedule(uids, lengths)

    def get_remaining_block_capacity(self, uid: int) -> int:
        """seen_tokens % block_size (0 for an unknown uid), as DeepSpeed's engine."""
        return self._core.get_remaining_block_capacity(uid)

    def check_invariants(self) -> None:
        """blockkv's consistency check of the whole manager (RuntimeError if broken)."""
        self._core.check_invariants()
