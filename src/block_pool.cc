// SPDX-License-Identifier: Apache-2.0
#include "blockkv/block_pool.h"

#include <algorithm>
#include <bit>

#include "internal/check.h"
#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

BlockPool::BlockPool(BlockedKVCache* cache, int group)
    : cache_(cache), group_(group), blocks_(static_cast<size_t>(cache->num_blocks())) {
  BLOCKKV_CHECK(group >= 0 && group < cache->num_groups(), "BlockPool: group out of range");
  heads_.fill(kNoBlock);
  tails_.fill(kNoBlock);
}

Status BlockPool::CheckId(BlockId block) const {
  if (block < 0 || block >= num_blocks()) {
    return OutOfRangeError(StrCat("invalid block ", block, ": ids of cache group ", group_,
                                  " are in [0, ", num_blocks(), ")"));
  }
  return Status::Ok();
}

int32_t BlockPool::free_blocks() const {
  return cache_->allocator(group_).free_blocks() + evictable_;
}

// ---- eviction lists ---------------------------------------------------------------------------

void BlockPool::PushEvictable(BlockId block) {
  const int p = blocks_[block].priority;
  blocks_[block].prev = tails_[p];
  blocks_[block].next = kNoBlock;
  if (tails_[p] == kNoBlock) {
    heads_[p] = block;
    nonempty_[p / 64] |= uint64_t{1} << (p % 64);
  } else {
    blocks_[tails_[p]].next = block;
  }
  tails_[p] = block;
  ++evictable_;
}

void BlockPool::RemoveEvictable(BlockId block) {
  const int p = blocks_[block].priority;
  const BlockId before = blocks_[block].prev;
  const BlockId after = blocks_[block].next;
  (before == kNoBlock ? heads_[p] : blocks_[before].next) = after;
  (after == kNoBlock ? tails_[p] : blocks_[after].prev) = before;
  if (heads_[p] == kNoBlock) nonempty_[p / 64] &= ~(uint64_t{1} << (p % 64));
  blocks_[block].prev = blocks_[block].next = kNoBlock;
  --evictable_;
}

BlockId BlockPool::PopEvictable() {
  const int p =
      nonempty_[0] != 0 ? std::countr_zero(nonempty_[0]) : 64 + std::countr_zero(nonempty_[1]);
  const BlockId block = heads_[p];
  RemoveEvictable(block);
  return block;
}

// ---- references -------------------------------------------------------------------------------

Status BlockPool::Take(int32_t n, std::span<BlockId> out) {
  if (n < 0 || out.size() < static_cast<size_t>(n)) {
    return InvalidArgumentError(
        StrCat("cannot take ", n, " blocks into a span of ", out.size(), " ids"));
  }
  const int32_t unused = cache_->allocator(group_).free_blocks();
  const int32_t fresh = std::min(n, unused);
  if (n - fresh > evictable_) {
    return ResourceExhaustedError(StrCat("cannot take ", n, " blocks of cache group ", group_, ": ",
                                         unused, " free and ", evictable_, " evictable"));
  }
  BLOCKKV_RETURN_IF_ERROR(cache_->Reserve(fresh, out.first(static_cast<size_t>(fresh)), group_));
  for (int32_t i = fresh; i < n; ++i) {
    const BlockId block = PopEvictable();
    blocks_[block].cached = 0;
    if (listener_ != nullptr) listener_->OnEvict(group_, block);
    out[i] = block;
  }
  for (int32_t i = 0; i < n; ++i) {
    BLOCKKV_CHECK(blocks_[out[i]].refs == 0,
                  "BlockPool::Take: a fresh block already has references");
    blocks_[out[i]].refs = 1;
  }
  return Status::Ok();
}

Status BlockPool::AddRef(std::span<const BlockId> blocks) {
  for (const BlockId block : blocks) {
    BLOCKKV_RETURN_IF_ERROR(CheckId(block));
    if (blocks_[block].refs == 0 && blocks_[block].cached == 0) {
      return FailedPreconditionError(
          StrCat("cannot share block ", block, " of cache group ", group_, ": it is free"));
    }
  }
  for (const BlockId block : blocks) {
    if (blocks_[block].refs++ == 0) RemoveEvictable(block);
  }
  return Status::Ok();
}

Status BlockPool::Release(std::span<const BlockId> blocks) {
  // Decrement first, undoing on failure, so a block listed k times must hold k references.
  for (size_t i = 0; i < blocks.size(); ++i) {
    Status error = CheckId(blocks[i]);
    if (error.ok() && blocks_[blocks[i]].refs == 0) {
      error = FailedPreconditionError(StrCat("cannot release block ", blocks[i], " of cache group ",
                                             group_, ": no references left"));
    }
    if (!error.ok()) {
      for (size_t j = 0; j < i; ++j) ++blocks_[blocks[j]].refs;
      return error;
    }
    --blocks_[blocks[i]].refs;
  }
  scratch_.clear();
  for (const BlockId block : blocks) {
    // A block listed twice reaches 0 once; the second sighting finds it already queued.
    if (blocks_[block].refs != 0) continue;
    blocks_[block].refs = -1;  // transient: handled
    if (blocks_[block].cached != 0) {
      PushEvictable(block);
    } else {
      scratch_.push_back(block);
    }
  }
  for (const BlockId block : blocks) blocks_[block].refs = std::max(blocks_[block].refs, 0);
  const Status freed = cache_->Free(scratch_, group_);
  BLOCKKV_CHECK(freed.ok(), "BlockPool::Release: allocator refused blocks the pool held");
  return Status::Ok();
}

// ---- cached marks -----------------------------------------------------------------------------

void BlockPool::MarkCached(BlockId block, int32_t priority) {
  BLOCKKV_CHECK(block >= 0 && block < num_blocks() && blocks_[block].refs > 0,
                "BlockPool::MarkCached: the block is not held");
  BLOCKKV_CHECK(priority >= kMinRetentionPriority && priority <= kMaxRetentionPriority,
                "BlockPool::MarkCached: priority out of range");
  const auto p = static_cast<uint8_t>(priority);
  blocks_[block].priority = blocks_[block].cached != 0 ? std::max(blocks_[block].priority, p) : p;
  blocks_[block].cached = 1;
}

void BlockPool::Uncache(BlockId block) {
  BLOCKKV_CHECK(block >= 0 && block < num_blocks() && blocks_[block].cached != 0,
                "BlockPool::Uncache: the block is not cached");
  blocks_[block].cached = 0;
  if (blocks_[block].refs != 0) return;
  RemoveEvictable(block);
  const Status freed = cache_->Free(std::span<const BlockId>(&block, 1), group_);
  BLOCKKV_CHECK(freed.ok(), "BlockPool::Uncache: allocator refused an evictable block");
}

int32_t BlockPool::ref_count(BlockId block) const {
  BLOCKKV_CHECK(block >= 0 && block < num_blocks(), "BlockPool::ref_count: invalid block");
  return blocks_[block].refs;
}

Status BlockPool::CheckInvariants() const {
  const BlockedAllocator& allocator = cache_->allocator(group_);
  BLOCKKV_RETURN_IF_ERROR(allocator.CheckInvariants());
  for (BlockId block = 0; block < num_blocks(); ++block) {
    if (blocks_[block].refs < 0)
      return InternalError(StrCat("block ", block, " has a negative count"));
    const bool held = blocks_[block].refs > 0 || blocks_[block].cached != 0;
    if (held != allocator.IsUsed(block)) {
      return InternalError(StrCat("block ", block, " has ", blocks_[block].refs, " references",
                                  blocks_[block].cached != 0 ? " and is cached" : "", " but is ",
                                  allocator.IsUsed(block) ? "used" : "free", " in the allocator"));
    }
  }
  // Walk every list: each evictable block exactly once, in its own priority's list.
  std::vector<uint8_t> seen(blocks_.size(), 0);
  int32_t listed = 0;
  for (int p = 0; p < kPriorities; ++p) {
    const bool marked = ((nonempty_[p / 64] >> (p % 64)) & 1) != 0;
    if (marked != (heads_[p] != kNoBlock)) {
      return InternalError(StrCat("eviction list ", p, " and its mask bit disagree"));
    }
    BlockId before = kNoBlock;
    for (BlockId b = heads_[p]; b != kNoBlock; before = b, b = blocks_[b].next) {
      if (seen[b] != 0 || !is_evictable(b) || blocks_[b].priority != p ||
          blocks_[b].prev != before) {
        return InternalError(StrCat("block ", b, " is misplaced in eviction list ", p));
      }
      seen[b] = 1;
      ++listed;
    }
    if (tails_[p] != before) return InternalError(StrCat("eviction list ", p, " has a bad tail"));
  }
  int32_t evictable = 0;
  for (BlockId block = 0; block < num_blocks(); ++block) evictable += is_evictable(block) ? 1 : 0;
  if (listed != evictable_ || evictable != evictable_) {
    return InternalError(StrCat(evictable_, " evictable blocks counted, ", listed, " listed, ",
                                evictable, " found"));
  }
  return Status::Ok();
}

}  // namespace blockkv
