#include "blockkv/block_pool.h"

#include "internal/check.h"
#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

BlockPool::BlockPool(BlockedKVCache* cache, int group)
    : cache_(cache), group_(group), refs_(static_cast<size_t>(cache->num_blocks()), 0) {
  BLOCKKV_CHECK(group >= 0 && group < cache->num_groups(), "BlockPool: group out of range");
}

Status BlockPool::CheckId(BlockId block) const {
  if (block < 0 || block >= num_blocks()) {
    return OutOfRangeError(StrCat("invalid block ", block, ": ids of cache group ", group_,
                                  " are in [0, ", num_blocks(), ")"));
  }
  return Status::Ok();
}

Status BlockPool::Take(int32_t n, std::span<BlockId> out) {
  BLOCKKV_RETURN_IF_ERROR(cache_->Reserve(n, out, group_));
  for (int32_t i = 0; i < n; ++i) {
    BLOCKKV_CHECK(refs_[out[i]] == 0, "BlockPool::Take: a fresh block already has references");
    refs_[out[i]] = 1;
  }
  return Status::Ok();
}

Status BlockPool::AddRef(std::span<const BlockId> blocks) {
  for (const BlockId block : blocks) {
    BLOCKKV_RETURN_IF_ERROR(CheckId(block));
    if (refs_[block] == 0) {
      return FailedPreconditionError(
          StrCat("cannot share block ", block, " of cache group ", group_, ": it is free"));
    }
  }
  for (const BlockId block : blocks) ++refs_[block];
  return Status::Ok();
}

Status BlockPool::Release(std::span<const BlockId> blocks) {
  // Decrement first, undoing on failure, so a block listed k times must hold k references.
  for (size_t i = 0; i < blocks.size(); ++i) {
    Status error = CheckId(blocks[i]);
    if (error.ok() && refs_[blocks[i]] == 0) {
      error = FailedPreconditionError(StrCat("cannot release block ", blocks[i], " of cache group ",
                                             group_, ": no references left"));
    }
    if (!error.ok()) {
      for (size_t j = 0; j < i; ++j) ++refs_[blocks[j]];
      return error;
    }
    --refs_[blocks[i]];
  }
  scratch_.clear();
  for (const BlockId block : blocks) {
    // A block listed twice reaches 0 once; the second sighting finds it already queued.
    if (refs_[block] == 0) {
      refs_[block] = -1;  // transient: queued for the allocator
      scratch_.push_back(block);
    }
  }
  for (const BlockId block : scratch_) refs_[block] = 0;
  const Status freed = cache_->Free(scratch_, group_);
  BLOCKKV_CHECK(freed.ok(), "BlockPool::Release: allocator refused blocks the pool held");
  return Status::Ok();
}

int32_t BlockPool::ref_count(BlockId block) const {
  BLOCKKV_CHECK(block >= 0 && block < num_blocks(), "BlockPool::ref_count: invalid block");
  return refs_[block];
}

int32_t BlockPool::free_blocks() const { return cache_->allocator(group_).free_blocks(); }

Status BlockPool::CheckInvariants() const {
  const BlockedAllocator& allocator = cache_->allocator(group_);
  BLOCKKV_RETURN_IF_ERROR(allocator.CheckInvariants());
  for (BlockId block = 0; block < num_blocks(); ++block) {
    if (refs_[block] < 0) return InternalError(StrCat("block ", block, " has a negative count"));
    if ((refs_[block] > 0) != allocator.IsUsed(block)) {
      return InternalError(StrCat("block ", block, " has ", refs_[block], " references but is ",
                                  allocator.IsUsed(block) ? "used" : "free", " in the allocator"));
    }
  }
  return Status::Ok();
}

}  // namespace blockkv
