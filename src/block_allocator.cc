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
    : next_(static_cast<size_t>(num_blocks)), head_(0), free_blocks_(num_blocks) {
  for (int32_t id = 0; id + 1 < num_blocks; ++id) next_[id] = id + 1;
  next_[num_blocks - 1] = kListEnd;
}

Result<std::vector<BlockId>> BlockedAllocator::Allocate(int32_t n) {
  if (n < 0)
    return InvalidArgumentError(StrCat("cannot allocate a negative number of blocks: ", n));
  std::vector<BlockId> out(static_cast<size_t>(n));
  BLOCKKV_RETURN_IF_ERROR(Allocate(n, out));
  return out;
}

Status BlockedAllocator::Allocate(int32_t n, std::span<BlockId> out) {
  if (n < 0)
    return InvalidArgumentError(StrCat("cannot allocate a negative number of blocks: ", n));
  if (out.size() < static_cast<size_t>(n)) {
    return InvalidArgumentError(
        StrCat("output span holds ", out.size(), " ids, fewer than the ", n, " requested"));
  }
  if (n > free_blocks_) {
    return ResourceExhaustedError(
        StrCat("cannot allocate ", n, " blocks: ", free_blocks_, " of ", num_blocks(), " free"));
  }
  int32_t id = head_;
  for (int32_t i = 0; i < n; ++i) {
    out[i] = id;
    const int32_t next = next_[id];
    next_[id] = kUsed;
    id = next;
  }
  head_ = id;
  free_blocks_ -= n;
  return Status::Ok();
}

Status BlockedAllocator::Free(std::span<const BlockId> blocks) {
  // Pass 1: check every id, marking each as being freed so a repeat is caught in O(1).
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockId id = blocks[i];
    Status error;
    if (id < 0 || id >= num_blocks()) {
      error = OutOfRangeError(
          StrCat("invalid block ", id, " provided to free: ids are in [0, ", num_blocks(), ")"));
    } else if (next_[id] == kFreeing) {
      error = FailedPreconditionError(StrCat("block ", id, " appears more than once in one free"));
    } else if (next_[id] != kUsed) {
      error = FailedPreconditionError(StrCat("block ", id, " is already free"));
    }
    if (!error.ok()) {
      for (size_t j = 0; j < i; ++j) {
        if (next_[blocks[j]] == kFreeing) next_[blocks[j]] = kUsed;
      }
      return error;
    }
    next_[id] = kFreeing;
  }
  // Pass 2: push each onto the head in the order given.
  for (const BlockId id : blocks) {
    next_[id] = head_;
    head_ = id;
  }
  free_blocks_ += static_cast<int32_t>(blocks.size());
  return Status::Ok();
}

bool BlockedAllocator::IsUsed(BlockId id) const {
  return id >= 0 && id < num_blocks() && next_[id] == kUsed;
}

Status BlockedAllocator::CheckInvariants() const {
  const int32_t n = num_blocks();
  if (free_blocks_ < 0 || free_blocks_ > n) {
    return InternalError(StrCat("free_blocks ", free_blocks_, " outside [0, ", n, "]"));
  }
  // Walk the free list; more than n steps means a cycle.
  int32_t listed = 0;
  for (int32_t id = head_; id != kListEnd; id = next_[id]) {
    if (id < 0 || id >= n) return InternalError(StrCat("free list holds invalid id ", id));
    if (++listed > n) return InternalError("free list has a cycle");
  }
  if (listed != free_blocks_) {
    return InternalError(
        StrCat("free list holds ", listed, " ids but free_blocks is ", free_blocks_));
  }
  int32_t used = 0;
  for (int32_t id = 0; id < n; ++id) {
    const int32_t next = next_[id];
    if (next == kUsed) {
      ++used;
    } else if (next != kListEnd && (next < 0 || next >= n)) {
      return InternalError(StrCat("block ", id, " has invalid link ", next));
    }
  }
  // Every non-used id is linked (listed == free) and ids are distinct because the walk of
  // `free_blocks_` steps visited no used id and found no cycle.
  if (used != n - free_blocks_) {
    return InternalError(StrCat(used, " blocks marked used, expected ", n - free_blocks_));
  }
  return Status::Ok();
}

}  // namespace blockkv
