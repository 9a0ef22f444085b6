// SPDX-License-Identifier: Apache-2.0
// StateManager::CheckInvariants: what tests verify after every operation. The rest of the
// manager is in state_manager.cc and state_manager_prefix.cc.
#include <algorithm>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/strings.h"
#include "internal/uid_map.h"
#include "prefix_host_tier.h"
#include "state_manager_impl.h"

namespace blockkv {

using internal::StrCat;

Status StateManager::Impl::CheckSequence(const Sequence& seq, std::vector<int32_t>* owners,
                                         int group) const {
  const Sequence::GroupState& state = seq.groups_[group];
  const int32_t capacity = max_blocks_per_sequence(group);
  if (state.released < 0 || state.released > state.allocated || state.allocated > capacity) {
    return InternalError(StrCat("sequence ", seq.uid_, " group ", group, ": released ",
                                state.released, ", allocated ", state.allocated, ", capacity ",
                                capacity));
  }
  if (seq.seen_tokens_ + seq.in_flight_tokens_ > int64_t{state.allocated} * kv_block_size(group)) {
    return InternalError(StrCat("sequence ", seq.uid_, " holds ",
                                seq.seen_tokens_ + seq.in_flight_tokens_, " tokens in ",
                                state.allocated, " blocks of group ", group));
  }
  for (int32_t i = 0; i < capacity; ++i) {
    const BlockId block = state.row[i];
    const bool held = !seq.preempted_ && i >= state.released && i < state.allocated;
    if (!held) {
      if (block != kNoBlock) {
        return InternalError(StrCat("sequence ", seq.uid_, " group ", group, " entry ", i,
                                    " holds block ", block, " outside its held range"));
      }
      continue;
    }
    if (block < 0 || block >= pools_[group].num_blocks()) {
      return InternalError(StrCat("sequence ", seq.uid_, " group ", group, " entry ", i,
                                  " holds invalid block ", block));
    }
    ++(*owners)[block];
  }
  return CheckParked(seq, group);
}

Status StateManager::Impl::CheckInvariants() const {
  if (slots_.used_blocks() != n_tracked_sequences()) {
    return InternalError(StrCat(slots_.used_blocks(), " slots used for ", n_tracked_sequences(),
                                " tracked sequences"));
  }
  BLOCKKV_RETURN_IF_ERROR(slots_.CheckInvariants());
  Status mapping;
  by_uid_->ForEach([&](SeqId uid, int32_t slot) {
    if (mapping.ok() &&
        (!slots_.IsUsed(slot) || sequences_[slot].uid_ != uid || sequences_[slot].slot_ != slot)) {
      mapping = InternalError(StrCat("sequence ", uid, " maps to inconsistent slot ", slot));
    }
  });
  BLOCKKV_RETURN_IF_ERROR(mapping);
  // Per memory pool (one per group unless shared): every block's references are its owners in
  // all the pool's groups, and a block belongs to one group at a time.
  for (int lead = 0; lead < num_groups(); ++lead) {
    if (pool_lead_[lead] != lead) continue;
    BLOCKKV_RETURN_IF_ERROR(pools_[lead].CheckInvariants());
    const auto num_blocks = static_cast<size_t>(pools_[lead].num_blocks());
    std::vector<int32_t> owners(num_blocks, 0);
    std::vector<int> group_of(num_blocks, -1);
    for (int g = lead; g < num_groups(); ++g) {
      if (pool_lead_[g] != lead) continue;
      std::vector<int32_t> mine(num_blocks, 0);
      Status sequences;
      by_uid_->ForEach([&](SeqId, int32_t slot) {
        if (sequences.ok()) sequences = CheckSequence(sequences_[slot], &mine, g);
        if (sequences.ok() && g == 0) sequences = CheckKeys(sequences_[slot]);
      });
      BLOCKKV_RETURN_IF_ERROR(sequences);
      if (offload_ != nullptr) {
        for (const BlockId block : offload_->held_blocks(g)) ++mine[block];  // copies in flight
      }
      if (!engine_held_.empty()) {  // AllocateBlocks' blocks not given to a sequence yet
        int32_t held = 0;
        for (size_t block = 0; block < engine_held_[g].marks.size(); ++block) {
          if (engine_held_[g].marks[block] != 0) {
            ++mine[block];
            ++held;
          }
        }
        if (held != engine_held_[g].count) {
          return InternalError(StrCat(held, " blocks of group ", g, " are marked engine-held, ",
                                      engine_held_[g].count, " counted"));
        }
      }
      for (size_t block = 0; block < num_blocks; ++block) {
        const auto b = static_cast<BlockId>(block);
        const bool cached = pools_[g].is_cached(b) && pools_[g].cached_group(b) == g;
        if (mine[block] == 0 && !cached) continue;
        if (group_of[block] >= 0) {
          return InternalError(StrCat("block ", block, " of the memory pool groups ",
                                      group_of[block], " and ", g, " share is held by both"));
        }
        group_of[block] = g;
        owners[block] += mine[block];
      }
    }
    for (BlockId block = 0; block < pools_[lead].num_blocks(); ++block) {
      if (owners[block] != pools_[lead].ref_count(block)) {
        return InternalError(StrCat(
            "block ", block, " of group ", group_of[block] < 0 ? lead : group_of[block], " is in ",
            owners[block], " tables but has ", pools_[lead].ref_count(block), " references"));
      }
    }
  }
  if (prefix_ != nullptr) BLOCKKV_RETURN_IF_ERROR(prefix_->CheckInvariants());
  if (offload_ != nullptr) BLOCKKV_RETURN_IF_ERROR(offload_->CheckInvariants());
  if (host_prefix_ != nullptr) BLOCKKV_RETURN_IF_ERROR(host_prefix_->CheckInvariants());
  // Rows of free slots are empty.
  for (int32_t slot = 0; slot < config_.max_tracked_sequences; ++slot) {
    if (slots_.IsUsed(slot)) continue;
    for (int g = 0; g < num_groups(); ++g) {
      const BlockId* row = sequences_[slot].groups_[g].row;
      if (std::any_of(row, row + max_blocks_per_sequence(g),
                      [](BlockId b) { return b != kNoBlock; })) {
        return InternalError(StrCat("free slot ", slot, " has a non-empty table in group ", g));
      }
    }
  }
  return Status::Ok();
}

}  // namespace blockkv
