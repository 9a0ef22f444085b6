// SPDX-License-Identifier: Apache-2.0
#include "blockkv/block_allocator.h"

#include "internal/check.h"
#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

Result<BlockedAllocator> BlockedAllocator::Create(int32_t num_blocks) {
  if (num_blocks < 1) {
    return InvalidArgumentError(
        StrCat("a BlockedAllocator needs at least 1 block, got num_blocks=", num_blocks));
  }
  return BlockedAllocator(num_blocks);
}

BlockedAllocator::BlockedAllocator(int32_t num_blocks)
    : free_stack_(static_cast<size_t>(num_blocks)), state_(static_cast<size_t>(num_blocks), kFree) {
  // Top of the stack is the back: a fresh allocator hands out 0, 1, 2, ...
  for (int32_t i = 0; i < num_blocks; ++i) free_stack_[i] = num_blocks - 1 - i;
}

Result<std::vector<BlockId>> BlockedAllocator::Allocate(int32_t n) {
  if (n < 0)
    return InvalidArgumentError(StrCat("cannot allocate a negative number of blocks: ", n));
  if (n > free_blocks()) return NotEnoughBlocks(n);  // before a huge n sizes a vector
  std::vector<BlockId> out(static_cast<size_t>(n));
  BLOCKKV_RETURN_IF_ERROR(Allocate(n, out));
  return out;
}

Status BlockedAllocator::Allocate(int32_t n, std::span<BlockId> out) {
  if (n < 0 || out.size() < static_cast<size_t>(n) || n > free_blocks()) [[unlikely]] {
    if (n < 0) {
      return InvalidArgumentError(StrCat("cannot allocate a negative number of blocks: ", n));
    }
    if (out.size() < static_cast<size_t>(n)) {
      return InvalidArgumentError(
          StrCat("output span holds ", out.size(), " ids, fewer than the ", n, " requested"));
    }
    return NotEnoughBlocks(n);
  }
  const size_t top = free_stack_.size();
  for (int32_t i = 0; i < n; ++i) {
    const BlockId id = free_stack_[top - 1 - static_cast<size_t>(i)];
    out[i] = id;
    state_[id] = kUsed;
  }
  free_stack_.resize(top - static_cast<size_t>(n));  // never reallocates: shrinking
  return Status::Ok();
}

Status BlockedAllocator::Free(std::span<const BlockId> blocks) {
  // One pass: push each id in the order given (the last one pushed is allocated first). A bad id
  // stops the pass and FreeFailure pops what was pushed, so a failed call changes nothing. The
  // stack's capacity is num_blocks, so pushing never reallocates.
  const auto n = static_cast<BlockId>(state_.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockId id = blocks[i];
    if (id < 0 || id >= n || state_[id] != kUsed) [[unlikely]] {
      return FreeFailure(blocks, i);
    }
    state_[id] = kFree;
    free_stack_.push_back(id);
  }
  return Status::Ok();
}

Status BlockedAllocator::NotEnoughBlocks(int32_t n) const {
  return ResourceExhaustedError(
      StrCat("cannot allocate ", n, " blocks: ", free_blocks(), " of ", num_blocks(), " free"));
}

Status BlockedAllocator::FreeFailure(std::span<const BlockId> blocks, size_t bad) {
  for (size_t j = 0; j < bad; ++j) state_[blocks[j]] = kUsed;
  free_stack_.resize(free_stack_.size() - bad);
  const BlockId id = blocks[bad];
  if (id < 0 || id >= num_blocks()) {
    return OutOfRangeError(
        StrCat("invalid block ", id, " provided to free: ids are in [0, ", num_blocks(), ")"));
  }
  for (size_t j = 0; j < bad; ++j) {
    if (blocks[j] == id) {
      return FailedPreconditionError(StrCat("block ", id, " appears more than once in one free"));
    }
  }
  return FailedPreconditionError(StrCat("block ", id, " is already free"));
}

bool BlockedAllocator::IsUsed(BlockId id) const {
  return id >= 0 && id < num_blocks() && state_[id] == kUsed;
}

Status BlockedAllocator::CheckInvariants() const {
  const int32_t n = num_blocks();
  if (free_stack_.size() > state_.size() || free_stack_.capacity() < state_.size()) {
    return InternalError(StrCat("free stack holds ", free_stack_.size(), " ids (capacity ",
                                free_stack_.capacity(), ") for ", n, " blocks"));
  }
  // Every stacked id is in range and free; marking them finds repeats.
  std::vector<bool> stacked(state_.size(), false);
  for (const BlockId id : free_stack_) {
    if (id < 0 || id >= n) return InternalError(StrCat("free stack holds invalid id ", id));
    if (state_[id] != kFree) return InternalError(StrCat("stacked block ", id, " is not free"));
    if (stacked[id]) return InternalError(StrCat("block ", id, " is stacked twice"));
    stacked[id] = true;
  }
  for (BlockId id = 0; id < n; ++id) {
    if (state_[id] == kFree && !stacked[id]) {
      return InternalError(StrCat("free block ", id, " is missing from the free stack"));
    }
  }
  return Status::Ok();
}

}  // namespace blockkv
