// SPDX-License-Identifier: Apache-2.0
// Sequence: one sequence the StateManager tracks, as the engine reads it (DeepSpeed's
// DSSequenceDescriptor): its uid, how many tokens it has seen and has in flight, and its block
// table per cache group. Only the manager creates and changes sequences; the engine gets a
// `const Sequence*` from StateManager::GetSequence and reads it.
//
//   const Sequence* seq = mgr->GetSequence(uid);
//   int64_t next_position = seq->seen_tokens() + seq->in_flight_tokens();
//   std::span<const BlockId> table = seq->block_table();  // token t: table[t / block_size]
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "blockkv/block_allocator.h"

namespace blockkv {
class StateManager;
namespace internal {
class SnapshotCodec;
}  // namespace internal

using SeqId = int64_t;  // the engine's id for a sequence (DeepSpeed's uid)
// A token id, in every call of the scheduling API (AddSequence, AppendTokens, ScheduleBatch,
// RaggedBatch::InsertSequence) and the prefix cache's keys. int32, as vLLM's input_ids: every
// vocabulary fits. The batch's input_ids array stays int64, DeepSpeed's dtype (docs/design.md).
using TokenId = int32_t;

// One tracked sequence (DeepSpeed's DSSequenceDescriptor). Read-only to the engine: the manager
// changes it through Schedule, PostForward, FreeLeadingBlocks and Fork. Not thread-safe: read it
// only while no call of its manager runs. (Its layout, one cache line for what a decode step
// touches, is in docs/design.md.)
class alignas(64) Sequence {
 public:
  // Not copyable: a Sequence is known by its address (RaggedBatch checks that what it is given
  // is the manager's own), so a copy would be a stale snapshot.
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  SeqId uid() const { return uid_; }
  int32_t tracking_slot() const { return slot_; }
  int64_t seen_tokens() const { return seen_tokens_; }
  int64_t in_flight_tokens() const { return in_flight_tokens_; }
  // Accessors by cache group REQUIRE 0 <= group < the manager's num_groups().
  // Logical length of the block table of `group`: blocks allocated so far, released ones
  // included (token positions never move).
  int32_t cur_allocated_blocks(int group = 0) const { return groups_[group].allocated; }
  // Leading table entries released by FreeLeadingBlocks (now kNoBlock).
  int32_t released_blocks(int group = 0) const { return groups_[group].released; }
  // Changes whenever an entry of this sequence's tables changes other than by appending: a
  // new sequence (a tracking slot reused included) and FreeLeadingBlocks get a fresh value,
  // unique within the manager. Between two equal values the tables only grew, so a consumer
  // that copied a prefix of a table may copy just what was appended.
  uint64_t table_version() const { return table_version_; }
  // Tokens taken from the prefix cache when the sequence was first scheduled (0 without a hit;
  // never more than seen_tokens: a Rollback below it lowers it).
  int64_t cached_prefix_tokens() const { return cached_prefix_tokens_; }
  // True between PreemptSequence and ResumeSequence: its blocks are in the offload tiers and
  // its table entries are kNoBlock.
  bool preempted() const { return preempted_; }
  // The table row of `group`, entries [0, cur_allocated_blocks(group)).
  std::span<const BlockId> block_table(int group = 0) const {
    return {groups_[group].row, static_cast<size_t>(groups_[group].allocated)};
  }

 private:
  friend class StateManager;
  friend class internal::SnapshotCodec;  // LoadSnapshot puts sequences back in their slots
  Sequence() = default;
  struct GroupState {
    BlockId* row = nullptr;  // [max_blocks_per_allocation_group] in the manager's table
    int32_t allocated = 0;
    int32_t released = 0;
    // Table entries [released, allocated): the blocks it holds (kNoBlock while preempted).
    std::span<BlockId> held() const {
      return {row + released, static_cast<size_t>(allocated - released)};
    }
    // Appends the `k` blocks at `cursor` to the table and moves the cursor past them.
    void Take(const BlockId*& cursor, int32_t k) {
      BlockId* const to = row + allocated;
      if (k == 1) {
        to[0] = *cursor;
      } else if (k > 1) {
        std::copy_n(cursor, k, to);
      }
      cursor += k;
      allocated += k;
    }
  };

  SeqId uid_ = 0;
  int32_t slot_ = -1;
  bool preempted_ = false;
  bool exported_ = false;   // ExportSequence until confirmed or cancelled: pinned
  bool importing_ = false;  // StartImport until CompleteImports: pinned, its blocks being read
  int64_t seen_tokens_ = 0;
  int64_t in_flight_tokens_ = 0;
  uint64_t table_version_ = 0;
  // [num_groups]: with one cache group, &one_group_; with more, this slot's row of the
  // manager's flat group_states_ (one_group_ unused).
  GroupState* groups_ = nullptr;
  GroupState one_group_;
  // The second line.
  int64_t cached_prefix_tokens_ = 0;
};

}  // namespace blockkv
