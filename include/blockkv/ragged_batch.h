// SPDX-License-Identifier: Apache-2.0
// RaggedBatch: the metadata of one forward over several sequences, in the formats kernels take —
// DeepSpeed-FastGen's RaggedBatchWrapper, plus FlashInfer's CSR page table and vLLM's slot
// mapping.
//
//   auto batch = RaggedBatch::Create(manager);
//   // One call: schedule the forward and build its batch (StateManager::ScheduleBatch) ...
//   Status s = manager.ScheduleBatch({.uids = uids, .lengths = lengths}, tokens, **batch,
//                                    /*padding=*/true);
//   // ... or sequence by sequence:
//   s = manager.Schedule({.uids = uids, .lengths = lengths});
//   for (size_t i = 0; i < uids.size(); ++i) {
//     s = (*batch)->InsertSequence(*manager.GetSequence(uids[i]), tokens_of[i]);
//   }
//   s = (*batch)->Finalize(/*padding=*/true);
//   // kernels read input_ids(), tokens_to_seq(), slot_mapping(), kv_indptr(), ...
//   (*batch)->Clear();   // next step (ScheduleBatch clears the batch itself)
//
// Layout after Finalize (S = current_sequences(), T = current_tokens(), P = padded_tokens() —
// T rounded up to a multiple of 64 up to 512 tokens and of 128 beyond when padding, else T):
//   input_ids               int64 [P]      token ids; padding −1
//   tokens_to_seq           int32 [P]      index of each token's sequence in the batch; padding −1
//   inflight_seq_descriptors int32 [S, 4]  [start_idx, n_tokens, seen_tokens, 0]
//   batch_metadata          int32 [2]      [T, S]
//   per cache group g:
//   block_tables(g)         int32 [S, max_blocks_per_sequence(g)]  kNoBlock past each table
//   kv_ptrs(g)              int64 [S]      address of row i of block_tables(g)
//   kv_indptr(g)            int32 [S + 1]  CSR offsets into kv_indices (FlashInfer)
//   kv_indices(g)           int32 [kv_indptr[S]] the blocks holding tokens [0, seen + n_tokens)
//                                          (entries released by FreeLeadingBlocks stay kNoBlock)
//   kv_last_page_len(g)     int32 [S]      tokens in each sequence's last block, 1..block_size
//                                          (0 for a sequence with no tokens at all)
//   slot_mapping(g)         int64 [P]      block · block_size + offset of each new token; −1 pad
//
// Host arrays always; when the manager's cache lives on a CUDA device, Finalize (and
// ScheduleBatch) also copies the arrays into a device mirror, reached with on_device = true. Its
// device addresses are fixed from Create on (CUDA graphs may capture them). The host arrays are
// pinned, and Finalize queues their copy (one cudaMemcpyAsync over the used parts, see
// src/ragged_batch.cc) on the legacy default stream without waiting for it: kernels launched
// after Finalize on that stream, or on a blocking stream, run after the copy; the next step waits
// for the copy before it writes the host arrays. The mirror is single-buffered. REQUIRES of
// kernels on a non-blocking stream (cudaStreamNonBlocking, e.g. torch's side streams): that
// stream waits for the default stream's work after Finalize before reading the mirror (an event
// recorded on it, or torch's current_stream().wait_stream(default_stream())), and kernels reading
// one step's mirror have finished before the next Finalize (kernels on the default stream are
// ordered before the next step's copy by the stream itself).
//
// Limits are checked on every insert: more than max_ragged_sequence_count sequences or
// max_ragged_batch_size tokens is kResourceExhausted naming the limit, and nothing is added.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "blockkv/device.h"
#include "blockkv/state_manager.h"
#include "blockkv/status.h"
#include "blockkv/tensor.h"

namespace blockkv {

// DeepSpeed's to_padded: 0 → 0; up to 512 a multiple of 64; beyond, a multiple of 128.
int64_t PaddedTokenCount(int64_t n_tokens);

class RaggedBatch {
 public:
  // Buffers for `manager`'s limits and cache groups. The batch reads `manager`'s configuration
  // only; REQUIRES: `manager` outlives the batch.
  static Result<std::unique_ptr<RaggedBatch>> Create(const StateManager& manager);

  RaggedBatch(const RaggedBatch&) = delete;
  RaggedBatch& operator=(const RaggedBatch&) = delete;
  ~RaggedBatch();

  // Appends `tokens` as the next tokens of `seq` (positions seen_tokens ... + n). REQUIRES of
  // the state, else kFailedPrecondition: tokens.size() == seq.in_flight_tokens() (Schedule it
  // first) and the sequence holds blocks for every new position in every cache group (never
  // writes through a block it does not own). kAlreadyExists if `seq` is already in the batch;
  // kResourceExhausted past a limit; kFailedPrecondition after Finalize until Clear;
  // kInvalidArgument when `seq` is not a tracked sequence of this batch's manager (another
  // manager's, or flushed); kOutOfRange when seen_tokens + n does not fit the int32
  // descriptors.
  Status InsertSequence(const Sequence& seq, std::span<const TokenId> tokens);

  // Builds the arrays (and copies them to the device mirror). An empty batch is valid: T = S = 0.
  // kFailedPrecondition, with nothing changed, when an inserted sequence was flushed, scheduled
  // or advanced since it was inserted.
  Status Finalize(bool padding = false);

  // Empties the batch for the next step; buffers are kept.
  void Clear();

  // The i-th inserted sequence as it was inserted: its seen_tokens then, and the tokens it was
  // given (positions seen_tokens ...), as input_ids holds them. REQUIRES: 0 <= i <
  // current_sequences().
  struct Inserted {
    const Sequence* seq;
    int64_t seen_tokens;
    std::span<const int64_t> tokens;  // a view of input_ids: int64, DeepSpeed's dtype
  };
  Inserted inserted(int32_t i) const;

  // The state manager whose sequences the batch holds.
  const StateManager& manager() const;

  int32_t current_tokens() const;
  int32_t current_sequences() const;
  int32_t padded_tokens() const;  // P; valid after Finalize
  bool finalized() const;

  // Views of the arrays above, valid after Finalize until Clear. on_device = true asks for the
  // device mirror: kFailedPrecondition when the cache is on the host.
  Result<TensorView> input_ids(bool on_device = false) const;
  Result<TensorView> tokens_to_seq(bool on_device = false) const;
  Result<TensorView> inflight_seq_descriptors(bool on_device = false) const;
  Result<TensorView> batch_metadata(bool on_device = false) const;
  Result<TensorView> block_tables(int group = 0, bool on_device = false) const;
  Result<TensorView> kv_ptrs(int group = 0, bool on_device = false) const;
  Result<TensorView> kv_indptr(int group = 0, bool on_device = false) const;
  Result<TensorView> kv_indices(int group = 0, bool on_device = false) const;
  Result<TensorView> kv_last_page_len(int group = 0, bool on_device = false) const;
  Result<TensorView> slot_mapping(int group = 0, bool on_device = false) const;

 private:
  // StateManager::ScheduleBatch fills the batch's Impl (src/ragged_batch_impl.h) in the pass that
  // commits a schedule, and PostForward(batch) reads its entries.
  friend class StateManager;

  struct Impl;
  explicit RaggedBatch(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockkv
