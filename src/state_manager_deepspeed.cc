// SPDX-License-Identifier: Apache-2.0
// StateManager's DeepSpeed-shaped step: AllocateBlocks, ExtendSequence, FreeBlocks, PreForward
// (DeepSpeed's allocate_blocks, extend_kv_cache and pre_forward, which blockkv.deepspeed binds).
// Schedule in state_manager.cc does the same in one all-or-nothing call.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/block_size.h"
#include "internal/check.h"
#include "internal/strings.h"
#include "state_manager_impl.h"

namespace blockkv {

using internal::StrCat;

namespace {

// Marks while a call checks its ids: kHeld is the engine's block, kSeen one of this call's ids.
constexpr uint8_t kNotHeld = 0;
constexpr uint8_t kHeld = 1;
constexpr uint8_t kSeen = 2;

}  // namespace

Status StateManager::Impl::AllocateBlocks(std::span<BlockId> out, int group) {
  BLOCKKV_RETURN_IF_ERROR(CheckGroupArg(group));
  if (engine_held_.empty()) engine_held_.resize(static_cast<size_t>(num_groups()));
  EngineHeld& held = engine_held_[group];
  if (held.marks.empty()) held.marks.assign(static_cast<size_t>(pools_[group].num_blocks()), 0);
  const auto n = static_cast<int32_t>(out.size());
  if (Status taken = pools_[group].Take(n, out); !taken.ok()) {
    return {taken.code(), StrCat("AllocateBlocks: ", taken.message())};
  }
  for (const BlockId block : out) held.marks[static_cast<size_t>(block)] = kHeld;
  held.count += n;
  return Status::Ok();
}

namespace {

// Checks that every id of `blocks` is a block of `group` the engine holds, once. On success the
// marks are as they were; on failure too (the error names the first bad id).
Status CheckEngineHeld(std::span<const BlockId> blocks, int32_t num_blocks,
                       std::vector<uint8_t>* marks, int group, const char* who) {
  Status status;
  size_t checked = 0;
  for (; checked < blocks.size(); ++checked) {
    const BlockId block = blocks[checked];
    if (block < 0 || block >= num_blocks) {
      status = OutOfRangeError(StrCat(who, ": block ", block, " is outside [0, ", num_blocks,
                                      ") of cache group ", group));
      break;
    }
    uint8_t& mark = (*marks)[static_cast<size_t>(block)];
    if (mark != kHeld) {
      status = FailedPreconditionError(
          mark == kSeen ? StrCat(who, ": block ", block, " appears twice")
                        : StrCat(who, ": block ", block, " of cache group ", group,
                                 " was not handed out by allocate_blocks, or was given on since"));
      break;
    }
    mark = kSeen;
  }
  for (size_t i = 0; i < checked; ++i) (*marks)[static_cast<size_t>(blocks[i])] = kHeld;
  return status;
}

}  // namespace

Status StateManager::Impl::ExtendSequence(SeqId uid, std::span<const BlockId> blocks, int group) {
  BLOCKKV_RETURN_IF_ERROR(CheckGroupArg(group));
  Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("ExtendSequence: sequence ", uid, " is not tracked"));
  }
  BLOCKKV_RETURN_IF_ERROR(RequireResident(*seq, StrCat("ExtendSequence: sequence ", uid)));
  Sequence::GroupState& state = seq->groups_[group];
  const int64_t capacity = max_blocks_per_sequence(group);
  if (int64_t{state.allocated} + std::ssize(blocks) > capacity) {
    return OutOfRangeError(StrCat("ExtendSequence: sequence ", uid, " has ", state.allocated,
                                  " blocks of cache group ", group, "; ", blocks.size(),
                                  " more pass its table's ", capacity,
                                  " (max_blocks_per_allocation_group)"));
  }
  if (blocks.empty()) return Status::Ok();
  if (engine_held_.empty() || engine_held_[group].count == 0) {
    return FailedPreconditionError(StrCat("ExtendSequence: block ", blocks[0], " of cache group ",
                                          group, " was not handed out by allocate_blocks"));
  }
  EngineHeld& held = engine_held_[group];
  BLOCKKV_RETURN_IF_ERROR(
      CheckEngineHeld(blocks, pools_[group].num_blocks(), &held.marks, group, "ExtendSequence"));
  std::copy(blocks.begin(), blocks.end(), state.row + state.allocated);
  state.allocated += static_cast<int32_t>(blocks.size());
  for (const BlockId block : blocks) held.marks[static_cast<size_t>(block)] = kNotHeld;
  held.count -= static_cast<int32_t>(blocks.size());
  return Status::Ok();
}

Status StateManager::Impl::FreeBlocks(std::span<const BlockId> blocks, int group) {
  BLOCKKV_RETURN_IF_ERROR(CheckGroupArg(group));
  if (blocks.empty()) return Status::Ok();
  if (engine_held_.empty() || engine_held_[group].count == 0) {
    return FailedPreconditionError(StrCat("FreeBlocks: block ", blocks[0], " of cache group ",
                                          group, " was not handed out by allocate_blocks"));
  }
  EngineHeld& held = engine_held_[group];
  BLOCKKV_RETURN_IF_ERROR(
      CheckEngineHeld(blocks, pools_[group].num_blocks(), &held.marks, group, "FreeBlocks"));
  const Status released = pools_[group].Release(blocks);
  BLOCKKV_CHECK(released.ok(), "an engine-held block had no reference");
  for (const BlockId block : blocks) held.marks[static_cast<size_t>(block)] = kNotHeld;
  held.count -= static_cast<int32_t>(blocks.size());
  return Status::Ok();
}

Status StateManager::Impl::PreForward(SeqId uid, int64_t num_tokens) {
  if (num_tokens < 0) {
    return InvalidArgumentError(
        StrCat("PreForward: sequence ", uid, " given a negative token count ", num_tokens));
  }
  Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("PreForward: sequence ", uid, " is not tracked"));
  }
  BLOCKKV_RETURN_IF_ERROR(RequireResident(*seq, StrCat("PreForward: sequence ", uid)));
  const int64_t seen = seq->seen_tokens_;
  if (num_tokens > TokenCapacity(seen)) {
    return OutOfRangeError(StrCat("PreForward: sequence ", uid, " has seen ", seen, " tokens; ",
                                  num_tokens, " more pass its limit of ", token_limit_,
                                  " (max_context and the block tables' capacity)"));
  }
  for (int g = 0; g < num_groups(); ++g) {
    const int32_t allocated = seq->groups_[g].allocated;
    if (block_sizes_[g].BlocksFor(seen + num_tokens) > allocated) {
      return FailedPreconditionError(StrCat(
          "PreForward: sequence ", uid, " has ", allocated, " blocks of cache group ", g, " (",
          int64_t{allocated} * kv_block_size(g), " tokens), fewer than its ", seen, " seen + ",
          num_tokens, " new tokens need: allocate_blocks and extend_kv_cache first"));
    }
  }
  seq->in_flight_tokens_ = num_tokens;
  return Status::Ok();
}

Status StateManager::AllocateBlocks(std::span<BlockId> out, int group) {
  return impl_->AllocateBlocks(out, group);
}
Status StateManager::ExtendSequence(SeqId uid, std::span<const BlockId> blocks, int group) {
  return impl_->ExtendSequence(uid, blocks, group);
}
Status StateManager::FreeBlocks(std::span<const BlockId> blocks, int group) {
  return impl_->FreeBlocks(blocks, group);
}
Status StateManager::PreForward(SeqId uid, int64_t num_tokens) {
  return impl_->PreForward(uid, num_tokens);
}
int32_t StateManager::engine_held_blocks(int group) const {
  return impl_->engine_held_blocks(group);
}

}  // namespace blockkv
