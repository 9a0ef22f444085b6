# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's sequence descriptors (``deepspeed.inference.v2.ragged.sequence_descriptor``).

``DSSequenceDescriptor`` is a view of one of blockkv's tracked sequences: every read and every
change goes to the core's ``StateManager`` (``seen_tokens``, the block table, ``pre_forward``,
``extend_kv_cache``), so the descriptor holds no state of its own beyond its uid.
"""

from typing import List, Union

import torch

from .. import _blockkv


class BaseSequenceDescriptor:
    """What the batch reads of a sequence. Each property raises NotImplementedError here."""

    @property
    def seen_tokens(self) -> int:
        raise NotImplementedError()

    @property
    def cur_allocated_blocks(self) -> int:
        raise NotImplementedError()

    @property
    def kv_blocks_ptr(self) -> int:
        raise NotImplementedError()


class PlaceholderSequenceDescriptor(BaseSequenceDescriptor):
    """Plain values for a sequence that is not tracked (dry-run scheduling, tests)."""

    def __init__(self, seen_tokens=0, cur_allocated_blocks=0, kv_blocks_ptr=0) -> None:
        self._seen_tokens = seen_tokens
        self._cur_allocated_blocks = cur_allocated_blocks
        self._kv_blocks_ptr = kv_blocks_ptr

    @property
    def seen_tokens(self) -> int:
        return self._seen_tokens

    @property
    def cur_allocated_blocks(self) -> int:
        return self._cur_allocated_blocks

    @property
    def kv_blocks_ptr(self) -> int:
        return self._kv_blocks_ptr


def _host_ids(ids) -> object:
    # A CPU tensor's NumPy view (no copy); anything else as it is (the binding checks it).
    if isinstance(ids, torch.Tensor):
        return ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy()
    return ids


class DSSequenceDescriptor(_blockkv._DSSequenceBase, BaseSequenceDescriptor):
    """One tracked sequence. Made by ``DSStateManager.get_or_create_sequence``; DeepSpeed's
    constructor, which takes views of the manager's tables, has no meaning here.

    From its C++ base: ``uid``, ``tracking_id``, ``seen_tokens``, ``in_flight_tokens``,
    ``cur_allocated_blocks`` (cache group 0), ``kv_blocks_ptr`` (host address of the sequence's
    row of the manager's block table, group 0), ``max_context`` (enforced), ``pre_forward(n)``
    (in_flight_tokens = n, checked against the sequence's blocks and max_context: ValueError),
    ``post_forward(accepted=None)`` (with ``accepted``, speculative decoding: only that many
    in-flight tokens are kept). A descriptor of a flushed sequence raises ValueError when read.
    """

    def __init__(self, *args, **kwargs) -> None:
        raise TypeError("DSSequenceDescriptor is created by DSStateManager.get_or_create_sequence")

    @classmethod
    def _of(cls, manager, core_manager, seq):
        self = cls.__new__(cls)
        _blockkv._DSSequenceBase.__init__(self, seq)
        self._manager = manager  # the DSStateManager (whose batch binding reads it)
        self._core = core_manager  # blockkv.StateManager
        self._seq = seq  # blockkv.SequenceDescriptor
        return self

    def kv_cache_ids(self, cache_group: int = 0, on_device: bool = False) -> torch.Tensor:
        """The table row, int32 [1, max_blocks_per_allocation_group] (a copy; -1 past the
        allocated blocks). The table lives on the host, so on_device changes nothing."""
        return torch.from_numpy(self._seq.kv_cache_ids(cache_group, on_device))

    def all_block_ids(self, cache_group: int = 0) -> torch.Tensor:
        """The blocks the sequence holds in ``cache_group``, int32, in table order."""
        return torch.from_numpy(self._seq.all_block_ids(cache_group))

    def extend_kv_cache(self, new_ids: Union[List[torch.IntTensor], torch.IntTensor],
                        cache_group: int = 0) -> None:
        """Appends ids from ``DSStateManager.allocate_blocks`` to the table of ``cache_group``:
        a tensor, or a list of one tensor per allocation group (there is one). Checked before
        anything changes: each id must be one allocate_blocks handed out and no sequence took,
        and the table must have room (ValueError otherwise; DeepSpeed overflows its table)."""
        if isinstance(new_ids, torch.Tensor):
            new_ids = [new_ids]
        if len(new_ids) != 1:
            raise ValueError(f"Only {len(new_ids)} allocation groups provided, expected 1")
        _blockkv._ds_extend(self._core, self.uid, _host_ids(new_ids[0]), cache_group)

    def free_kv_cache(self, free_ids: Union[List[torch.IntTensor], torch.IntTensor],
                      cache_group: int = 0) -> None:
        """Releases the sequence's oldest held blocks (sliding-window attention): ``free_ids``
        must be exactly them, in table order, and wholly before seen_tokens; their table
        entries become -1 and token positions do not move (ValueError otherwise, nothing
        freed). DeepSpeed's raises NotImplementedError."""
        if isinstance(free_ids, torch.Tensor):
            free_ids = [free_ids]
        if len(free_ids) != 1:
            raise ValueError(f"Only {len(free_ids)} allocation groups provided, expected 1")
        ids = torch.as_tensor(_host_ids(free_ids[0]), dtype=torch.int64).reshape(-1)
        held = torch.from_numpy(self._seq.all_block_ids(cache_group)).to(torch.int64)
        if ids.numel() > held.numel() or not torch.equal(ids, held[:ids.numel()]):
            raise ValueError(f"free_kv_cache frees a sequence's oldest blocks in table order: "
                             f"sequence {self.uid} holds {held.tolist()[:ids.numel() + 1]}..., "
                             f"asked to free {ids.tolist()}")
        self._core.free_leading_blocks(self.uid, ids.numel(), cache_group)

    def __repr__(self) -> str:
        return repr(self._seq).replace("blockkv.SequenceDescriptor", "DSSequenceDescriptor", 1)
