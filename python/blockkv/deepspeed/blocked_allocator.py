# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's ``BlockedAllocator`` (``deepspeed.inference.v2.ragged.blocked_allocator``) over
``blockkv.BlockedAllocator``: the same LIFO order and errors, ids as int32 torch tensors."""

from typing import Iterable, Union

import blockkv
import torch


class BlockedAllocator:
    """A free list of ``num_blocks`` block ids. ``ValueError`` for ``num_blocks < 1``."""

    def __init__(self, num_blocks: int) -> None:
        self._allocator = blockkv.BlockedAllocator(num_blocks)

    def allocate(self, num_blocks: int) -> torch.Tensor:
        """``num_blocks`` ids as an int32 tensor: a fresh allocator hands out 0, 1, 2, ...; the
        last freed comes back first. ``ValueError`` (``blockkv.ResourceExhaustedError``) when
        fewer are free; nothing changes then."""
        return torch.from_numpy(self._allocator.allocate(num_blocks))

    def free(self, blocks: Union[Iterable[int], int]) -> None:
        """Returns ids (an int, an iterable, a NumPy array or a tensor), each pushed onto the
        free list in order. Every id is checked first: one outside ``[0, num_blocks)``, one
        that is free, or one given twice is a ``ValueError`` and nothing is freed (DeepSpeed
        accepts the repeated id and corrupts its free list)."""
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.numpy() if blocks.device.type == "cpu" else blocks.cpu().numpy()
        elif not isinstance(blocks, int) and not hasattr(blocks, "__array__") and not isinstance(
                blocks, (list, tuple)):
            blocks = list(blocks)
        self._allocator.free(blocks)

    @property
    def free_blocks(self) -> int:
        return self._allocator.free_blocks

    @property
    def num_blocks(self) -> int:
        return self._allocator.num_blocks

    def check_invariants(self) -> None:
        """blockkv's consistency check of the free list (``RuntimeError`` if it is broken)."""
        self._allocator.check_invariants()
