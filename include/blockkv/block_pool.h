// BlockPool: shared ownership of one cache group's blocks, above its BlockedAllocator.
//
// The allocator knows only free and used ids. The pool adds a reference count per block: every
// owner (a sequence's block table, a fork, later the prefix cache and offload) holds one
// reference, and a block returns to the allocator when its last reference is dropped. Blocks that
// are shared are full and immutable; a sequence writes only into blocks it alone owns.
//
//   BlockPool pool(&cache, /*group=*/0);
//   std::array<BlockId, 4> ids;
//   Status s = pool.Take(4, ids);      // 4 fresh blocks, each with 1 reference
//   pool.AddRef(ids);                  // a fork shares them: 2 references each
//   s = pool.Release(ids);             // 1 reference each; still used
//   s = pool.Release(ids);             // 0: back to the allocator
//
// Implementation notes: one int32 reference count per block id (a flat array, no node per
// block); a block is used in the allocator exactly when its count is > 0. Not thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/kv_cache.h"
#include "blockkv/status.h"

namespace blockkv {

class BlockPool {
 public:
  // REQUIRES: `cache` outlives the pool and nothing else reserves or frees blocks of `group`.
  BlockPool(BlockedKVCache* cache, int group);

  BlockPool(BlockPool&&) noexcept = default;
  BlockPool& operator=(BlockPool&&) noexcept = default;
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // `n` fresh blocks into out[0, n), each with one reference. kResourceExhausted when fewer than
  // `n` are free (nothing taken); kInvalidArgument for n < 0 or out.size() < n.
  Status Take(int32_t n, std::span<BlockId> out);

  // One more reference to each block. kFailedPrecondition (nothing changed) if any block has no
  // reference now: only a held block can be shared. kOutOfRange for an invalid id.
  Status AddRef(std::span<const BlockId> blocks);

  // Drops one reference to each block; blocks reaching 0 go back to the allocator. A block may
  // appear several times (each drops one reference). kFailedPrecondition (nothing changed) if a
  // block would drop below 0; kOutOfRange for an invalid id.
  Status Release(std::span<const BlockId> blocks);

  int32_t ref_count(BlockId block) const;  // 0 for a free block; REQUIRES: valid id
  int32_t free_blocks() const;
  int32_t num_blocks() const { return static_cast<int32_t>(refs_.size()); }
  int group() const { return group_; }

  // Every block with references is used in the allocator and every free one has none.
  Status CheckInvariants() const;

 private:
  Status CheckId(BlockId block) const;

  BlockedKVCache* cache_;
  int group_;
  std::vector<int32_t> refs_;     // [num_blocks]
  std::vector<BlockId> scratch_;  // blocks reaching 0 in one Release
};

}  // namespace blockkv
