// SPDX-License-Identifier: Apache-2.0
#include "blockkv/block_pool.h"

#include <algorithm>
#include <bit>

#include "internal/check.h"
#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

BlockPool::BlockPool(BlockedKVCache* cache, int group)
    : cache_(cache), group_(group), state_(std::make_unique<State>()), s_(state_.get()) {
  BLOCKKV_CHECK(group >= 0 && group < cache->num_groups(), "BlockPool: group out of range");
  s_->blocks.resize(static_cast<size_t>(cache->num_blocks(group)));
  s_->heads.fill(kNoBlock);
  s_->tails.fill(kNoBlock);
}

BlockPool::BlockPool(BlockPool& owner, int group)
    : cache_(owner.cache_), group_(group), s_(owner.s_) {
  BLOCKKV_CHECK(group >= 0 && group < cache_->num_groups() &&
                    cache_->pool_of(group) == cache_->pool_of(owner.group_),
                "BlockPool: a group shares the pool of a group of its own memory pool only");
}

Status BlockPool::CheckId(BlockId block) const {
  if (block < 0 || block >= num_blocks()) {
    return OutOfRangeError(StrCat("invalid block ", block, ": ids of cache group ", group_,
                                  " are in [0, ", num_blocks(), ")"));
  }
  return Status::Ok();
}

int32_t BlockPool::free_blocks() const {
  return cache_->allocator(group_).free_blocks() + s_->evictable;
}

// ---- eviction lists ---------------------------------------------------------------------------

void BlockPool::PushEvictable(BlockId block) {
  const int p = s_->blocks[block].priority;
  s_->blocks[block].prev = s_->tails[p];
  s_->blocks[block].next = kNoBlock;
  if (s_->tails[p] == kNoBlock) {
    s_->heads[p] = block;
    s_->nonempty[p / 64] |= uint64_t{1} << (p % 64);
  } else {
    s_->blocks[s_->tails[p]].next = block;
  }
  s_->tails[p] = block;
  ++s_->evictable;
}

void BlockPool::RemoveEvictable(BlockId block) {
  const int p = s_->blocks[block].priority;
  const BlockId before = s_->blocks[block].prev;
  const BlockId after = s_->blocks[block].next;
  (before == kNoBlock ? s_->heads[p] : s_->blocks[before].next) = after;
  (after == kNoBlock ? s_->tails[p] : s_->blocks[after].prev) = before;
  if (s_->heads[p] == kNoBlock) s_->nonempty[p / 64] &= ~(uint64_t{1} << (p % 64));
  s_->blocks[block].prev = s_->blocks[block].next = kNoBlock;
  --s_->evictable;
}

BlockId BlockPool::PopEvictable() {
  const int p = s_->nonempty[0] != 0 ? std::countr_zero(s_->nonempty[0])
                                     : 64 + std::countr_zero(s_->nonempty[1]);
  const BlockId block = s_->heads[p];
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
  if (n - fresh > s_->evictable) {
    return ResourceExhaustedError(StrCat("cannot take ", n, " blocks of cache group ", group_, ": ",
                                         unused, " free and ", s_->evictable, " evictable"));
  }
  BLOCKKV_RETURN_IF_ERROR(cache_->Reserve(fresh, out.first(static_cast<size_t>(fresh)), group_));
  for (int32_t i = fresh; i < n; ++i) {
    const BlockId block = PopEvictable();
    s_->blocks[block].cached = 0;
    if (s_->listener != nullptr) s_->listener->OnEvict(s_->blocks[block].group, block);
    out[i] = block;
  }
  for (int32_t i = 0; i < n; ++i) {
    BLOCKKV_CHECK(s_->blocks[out[i]].refs == 0,
                  "BlockPool::Take: a fresh block already has references");
    s_->blocks[out[i]].refs = 1;
  }
  return Status::Ok();
}

Status BlockPool::AddRef(std::span<const BlockId> blocks) {
  for (const BlockId block : blocks) {
    BLOCKKV_RETURN_IF_ERROR(CheckId(block));
    if (s_->blocks[block].refs == 0 && s_->blocks[block].cached == 0) {
      return FailedPreconditionError(
          StrCat("cannot share block ", block, " of cache group ", group_, ": it is free"));
    }
  }
  for (const BlockId block : blocks) {
    if (s_->blocks[block].refs++ == 0) RemoveEvictable(block);
  }
  return Status::Ok();
}

Status BlockPool::Release(std::span<const BlockId> blocks) {
  // Decrement first, undoing on failure, so a block listed k times must hold k references.
  for (size_t i = 0; i < blocks.size(); ++i) {
    Status error = CheckId(blocks[i]);
    if (error.ok() && s_->blocks[blocks[i]].refs == 0) {
      error = FailedPreconditionError(StrCat("cannot release block ", blocks[i], " of cache group ",
                                             group_, ": no references left"));
    }
    if (!error.ok()) {
      for (size_t j = 0; j < i; ++j) ++s_->blocks[blocks[j]].refs;
      return error;
    }
    --s_->blocks[blocks[i]].refs;
  }
  s_->scratch.clear();
  for (const BlockId block : blocks) {
    // A block listed twice reaches 0 once; the second sighting finds it already queued.
    if (s_->blocks[block].refs != 0) continue;
    s_->blocks[block].refs = -1;  // transient: handled
    if (s_->blocks[block].cached != 0) {
      PushEvictable(block);
    } else {
      s_->scratch.push_back(block);
    }
  }
  for (const BlockId block : blocks) s_->blocks[block].refs = std::max(s_->blocks[block].refs, 0);
  const Status freed = cache_->Free(s_->scratch, group_);
  BLOCKKV_CHECK(freed.ok(), "BlockPool::Release: allocator refused blocks the pool held");
  return Status::Ok();
}

// ---- cached marks -----------------------------------------------------------------------------

void BlockPool::MarkCached(BlockId block, int32_t priority) {
  BLOCKKV_CHECK(block >= 0 && block < num_blocks() && s_->blocks[block].refs > 0,
                "BlockPool::MarkCached: the block is not held");
  BLOCKKV_CHECK(priority >= kMinRetentionPriority && priority <= kMaxRetentionPriority,
                "BlockPool::MarkCached: priority out of range");
  BLOCKKV_CHECK(s_->blocks[block].cached == 0 || s_->blocks[block].group == group_,
                "BlockPool::MarkCached: the block is cached by another group of its pool");
  const auto p = static_cast<uint8_t>(priority);
  s_->blocks[block].priority =
      s_->blocks[block].cached != 0 ? std::max(s_->blocks[block].priority, p) : p;
  s_->blocks[block].cached = 1;
  s_->blocks[block].group = static_cast<uint8_t>(group_);
}

void BlockPool::Uncache(BlockId block) {
  BLOCKKV_CHECK(block >= 0 && block < num_blocks() && s_->blocks[block].cached != 0 &&
                    s_->blocks[block].group == group_,
                "BlockPool::Uncache: the block is not cached by this group");
  s_->blocks[block].cached = 0;
  if (s_->blocks[block].refs != 0) return;
  RemoveEvictable(block);
  const Status freed = cache_->Free(std::span<const BlockId>(&block, 1), group_);
  BLOCKKV_CHECK(freed.ok(), "BlockPool::Uncache: allocator refused an evictable block");
}

int32_t BlockPool::ref_count(BlockId block) const {
  BLOCKKV_CHECK(block >= 0 && block < num_blocks(), "BlockPool::ref_count: invalid block");
  return s_->blocks[block].refs;
}

Status BlockPool::CheckInvariants() const {
  const BlockedAllocator& allocator = cache_->allocator(group_);
  BLOCKKV_RETURN_IF_ERROR(allocator.CheckInvariants());
  for (BlockId block = 0; block < num_blocks(); ++block) {
    if (s_->blocks[block].refs < 0)
      return InternalError(StrCat("block ", block, " has a negative count"));
    const bool held = s_->blocks[block].refs > 0 || s_->blocks[block].cached != 0;
    if (held != allocator.IsUsed(block)) {
      return InternalError(StrCat("block ", block, " has ", s_->blocks[block].refs, " references",
                                  s_->blocks[block].cached != 0 ? " and is cached" : "", " but is ",
                                  allocator.IsUsed(block) ? "used" : "free", " in the allocator"));
    }
  }
  // Walk every list: each evictable block exactly once, in its own priority's list.
  std::vector<uint8_t> seen(s_->blocks.size(), 0);
  int32_t listed = 0;
  for (int p = 0; p < kPriorities; ++p) {
    const bool marked = ((s_->nonempty[p / 64] >> (p % 64)) & 1) != 0;
    if (marked != (s_->heads[p] != kNoBlock)) {
      return InternalError(StrCat("eviction list ", p, " and its mask bit disagree"));
    }
    BlockId before = kNoBlock;
    for (BlockId b = s_->heads[p]; b != kNoBlock; before = b, b = s_->blocks[b].next) {
      if (seen[b] != 0 || !is_evictable(b) || s_->blocks[b].priority != p ||
          s_->blocks[b].prev != before) {
        return InternalError(StrCat("block ", b, " is misplaced in eviction list ", p));
      }
      seen[b] = 1;
      ++listed;
    }
    if (s_->tails[p] != before)
      return InternalError(StrCat("eviction list ", p, " has a bad tail"));
  }
  int32_t evictable = 0;
  for (BlockId block = 0; block < num_blocks(); ++block) evictable += is_evictable(block) ? 1 : 0;
  if (listed != s_->evictable || evictable != s_->evictable) {
    return InternalError(StrCat(s_->evictable, " evictable blocks counted, ", listed, " listed, ",
                                evictable, " found"));
  }
  return Status::Ok();
}

}  // namespace blockkv
