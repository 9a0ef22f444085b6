# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's ``RaggedBatchWrapper`` (``deepspeed.inference.v2.ragged.ragged_wrapper``).

Built from the ``DSStateManagerConfig`` as in DeepSpeed. Tracked sequences
(``DSSequenceDescriptor``) go into blockkv's ``RaggedBatchWrapper`` of their manager, created on
the first insert: the arrays the kernels read (and blockkv's CSR page table and slot mapping)
are the core's, handed out as torch tensors without a copy. ``PlaceholderSequenceDescriptor``s,
which have no manager and no blocks, only lay out tokens: the wrapper concatenates those itself.
One batch holds one kind.
"""

from typing import Optional

import blockkv
import numpy
import torch

from .. import _blockkv

from .manager_configs import DSStateManagerConfig
from .sequence_descriptor import BaseSequenceDescriptor, DSSequenceDescriptor


_IN_PLACE_DTYPES = (torch.int64, torch.int32)


def to_padded(original_size: int) -> int:
    """The token count a padded batch rounds up to: a multiple of 64 up to 512, of 128 above."""
    if original_size <= 0:
        return 0
    granularity = 64 if original_size <= 512 else 128
    return (original_size + granularity - 1) // granularity * granularity


def _torch(array) -> torch.Tensor:
    # A NumPy array views the batch's host buffer; a blockkv.Tensor its device mirror.
    if isinstance(array, numpy.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


class RaggedBatchWrapper:
    """The metadata of one forward: each sequence's new tokens, its position and its blocks."""

    def __init__(self, config: DSStateManagerConfig) -> None:
        self._config = config
        self._batch: Optional[blockkv.RaggedBatchWrapper] = None  # the core's, once bound
        self._manager = None  # the DSStateManager whose sequences this batch holds
        self._placeholders = _PlaceholderBatch(config)
        self._tracked = False  # this batch (since clear) holds tracked sequences

    @property
    def core(self) -> Optional[blockkv.RaggedBatchWrapper]:
        """blockkv's RaggedBatchWrapper (for blockkv.append_kv / paged_attention), None until a
        tracked sequence was inserted."""
        return self._batch

    def clear(self) -> None:
        """Empties the batch for the next forward."""
        if self._tracked:
            self._batch.clear()
        self._placeholders.clear()
        self._tracked = False

    def insert_sequence(self, seq_descriptor: BaseSequenceDescriptor, tokens: torch.Tensor,
                        do_checks: bool = True) -> None:
        """Appends the sequence's tokens (a CPU tensor, NumPy array, list or int). A tracked
        sequence must have had ``pre_forward(len(tokens))``; the sequence count and token
        limits are checked whatever ``do_checks`` says (RuntimeError, nothing appended)."""
        if (type(seq_descriptor) is DSSequenceDescriptor and
                seq_descriptor._manager is self._manager and not self._placeholders.count and
                type(tokens) is torch.Tensor and tokens.is_cpu and
                tokens.dtype in _IN_PLACE_DTYPES and tokens.is_contiguous()):
            # engine_v2's step: the caller's int64 (or int32) tokens, read in place.
            _blockkv._ds_insert(self._batch, seq_descriptor, tokens.data_ptr(), tokens.numel(),
                                tokens.dtype is torch.int64)
            self._tracked = True
            return
        is_tensor = isinstance(tokens, torch.Tensor)
        if is_tensor and not tokens.is_cpu:
            raise RuntimeError(f"Expected tokens to be on host but found device '{tokens.device}'")
        if isinstance(seq_descriptor, DSSequenceDescriptor):
            if self._placeholders.count:
                raise ValueError("this batch holds PlaceholderSequenceDescriptors; clear it before "
                                 "inserting tracked sequences")
            if seq_descriptor._manager is not self._manager:
                self._bind(seq_descriptor._manager)
            self._batch.insert_sequence(seq_descriptor._seq, tokens.numpy() if is_tensor else tokens)
            self._tracked = True
            return
        if self._tracked:
            raise ValueError("this batch holds tracked sequences; clear it before inserting "
                             "a PlaceholderSequenceDescriptor")
        self._placeholders.insert(seq_descriptor, tokens.numpy() if is_tensor else tokens,
                                  do_checks)

    def _bind(self, manager) -> None:
        if self._tracked:
            raise ValueError("this batch holds sequences of another DSStateManager; clear it first")
        limits = manager.core.config
        for name in ("max_ragged_batch_size", "max_ragged_sequence_count"):
            if getattr(limits, name) != getattr(self._config, name):
                raise ValueError(f"the batch's config has {name}={getattr(self._config, name)} "
                                 f"but the sequence's DSStateManager {getattr(limits, name)}")
        self._batch = blockkv.RaggedBatchWrapper(manager.core)
        self._manager = manager

    def finalize(self, padding: bool = False) -> None:
        """Lays the batch out (and, with the cache on a GPU, copies it to the device). With
        padding, the token arrays are padded to ``to_padded(current_tokens)`` with -1."""
        if self._tracked:
            self._batch.finalize(padding)
        else:
            self._placeholders.finalize(padding)

    def _array(self, name, on_device):
        if self._tracked:
            return _torch(getattr(self._batch, name)(on_device))
        return self._placeholders.array(name)

    def input_ids(self, on_device: bool = True) -> torch.Tensor:
        """int64 [tensor_toks]: the tokens, padding -1."""
        return self._array("input_ids", on_device)

    def batch_metadata_buffer(self, on_device: bool = True) -> torch.Tensor:
        """int32 [2]: current_tokens, current_sequences."""
        return self._array("batch_metadata_buffer", on_device)

    def tokens_to_seq(self, on_device: bool = True) -> torch.Tensor:
        """int32 [tensor_toks]: each token's sequence index in the batch, padding -1."""
        return self._array("tokens_to_seq", on_device)

    def inflight_seq_descriptors(self, on_device: bool = True) -> torch.Tensor:
        """int32 [current_sequences, 4]: start index, new tokens, seen tokens, 0."""
        return self._array("inflight_seq_descriptors", on_device)

    def kv_ptrs(self, on_device: bool = True) -> torch.Tensor:
        """int64 [current_sequences]: the address of each sequence's block-table row (blockkv:
        the batch's own copy of the rows; placeholders: their kv_blocks_ptr)."""
        return self._array("kv_ptrs", on_device)

    def masks(self, on_device: bool = True) -> Optional[torch.Tensor]:
        """None, as in DeepSpeed."""
        return None

    @property
    def current_tokens(self) -> int:
        return self._batch.current_tokens if self._tracked else self._placeholders.current_tokens

    @property
    def current_sequences(self) -> int:
        if self._tracked:
            return self._batch.current_sequences
        return self._placeholders.current_sequences

    @property
    def tensor_toks(self) -> int:
        """Tokens in the arrays after finalize, padding included."""
        return self._batch.padded_tokens if self._tracked else self._placeholders.tensor_toks


class _PlaceholderBatch:
    """The token layout of a batch of PlaceholderSequenceDescriptors (DeepSpeed's tests build
    them to check the layout; they have no blocks, so nothing of blockkv's core is involved)."""

    def __init__(self, config):
        self._max_sequences = config.max_ragged_sequence_count
        self._max_tokens = config.max_ragged_batch_size
        self.clear()

    def clear(self):
        self._tokens = []
        self._seqs = []
        self.count = 0  # sequences
        self.current_tokens = 0
        self.tensor_toks = 0
        self._arrays = None

    @property
    def current_sequences(self):
        return self.count

    def insert(self, seq, tokens, do_checks):
        tokens = torch.as_tensor(tokens).reshape(-1)
        if do_checks:
            if len(self._seqs) == self._max_sequences:
                raise RuntimeError(
                    f"Ragged batch is full due to sequence limit: {self._max_sequences}")
            if self.current_tokens + tokens.numel() > self._max_tokens:
                raise RuntimeError(
                    f"Ragged batch is full due to capacity limit: {self._max_tokens}")
        self._tokens.append(tokens)
        self._seqs.append((self.current_tokens, tokens.numel(), seq.seen_tokens,
                           seq.kv_blocks_ptr))
        self.current_tokens += tokens.numel()
        self.count += 1

    def finalize(self, padding):
        n = self.current_tokens
        size = to_padded(n) if padding else n
        input_ids = torch.full((size,), -1, dtype=torch.int64)
        tokens_to_seq = torch.full((size,), -1, dtype=torch.int32)
        descriptors = torch.zeros((len(self._seqs), 4), dtype=torch.int32)
        kv_ptrs = torch.zeros((len(self._seqs),), dtype=torch.int64)
        for i, (tokens, (start, count, seen, ptr)) in enumerate(zip(self._tokens, self._seqs)):
            input_ids[start:start + count] = tokens
            tokens_to_seq[start:start + count] = i
            descriptors[i, 0], descriptors[i, 1], descriptors[i, 2] = start, count, seen
            kv_ptrs[i] = ptr
        metadata = torch.tensor([n, len(self._seqs)], dtype=torch.int32)
        self.tensor_toks = size
        self._arrays = {"input_ids": input_ids, "tokens_to_seq": tokens_to_seq,
                        "inflight_seq_descriptors": descriptors, "kv_ptrs": kv_ptrs,
                        "batch_metadata_buffer": metadata}

    def array(self, name):
        if self._arrays is None:
            raise ValueError("the batch is not finalized: call finalize() first")
        return self._arrays[name]
