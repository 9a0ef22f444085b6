// SPDX-License-Identifier: Apache-2.0
// BlockPool: shared ownership of one cache group's blocks, above its BlockedAllocator, and the
// eviction order of the blocks the prefix cache keeps.
//
// The allocator knows only free and used ids. The pool adds a reference count per block: every
// owner (a sequence's block table, a fork, a prefix-cache hit) holds one reference, and a block
// returns to the allocator when its last reference is dropped — unless it is *cached*: a cached
// block whose count falls to 0 keeps its contents and becomes *evictable*. Evictable blocks count
// as free: Take hands out allocator-free blocks first and then evicts the least valuable
// evictable ones (lowest retention priority first, least recently used within a priority),
// telling the EvictionListener so that the prefix cache drops their keys. Blocks that are shared
// are full and immutable; a sequence writes only into blocks it alone owns.
//
//   BlockPool pool(&cache, /*group=*/0);
//   std::array<BlockId, 4> ids;
//   Status s = pool.Take(4, ids);      // 4 fresh blocks, each with 1 reference
//   s = pool.AddRef(ids);              // a fork shares them: 2 references each
//   s = pool.Release(ids);             // 1 reference each; still used
//   pool.MarkCached(ids[0], 35);       // the prefix cache keeps block ids[0]
//   s = pool.Release(ids);             // 0: ids[0] evictable, the others back to the allocator
//   s = pool.AddRef(std::span(ids).first(1));  // a prefix hit revives ids[0]
//
// Implementation notes: one 16-byte record per block id (State::blocks), no node per block:
//   refs      references; a block is used in the allocator when refs > 0 or it is cached
//   cached    1 when the prefix cache holds the block's key
//   priority  retention priority 0..100 of a cached block
//   prev/next intrusive doubly linked lists of evictable blocks, one per priority
//             (heads_/tails_ [101]), oldest at the head
// so touch (a hit on an evictable block), insert and evict are O(1); the lowest non-empty
// priority is found with a 128-bit mask. Not thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/kv_cache.h"
#include "blockkv/status.h"

namespace blockkv {

inline constexpr int32_t kMinRetentionPriority = 0;
inline constexpr int32_t kMaxRetentionPriority = 100;
inline constexpr int32_t kDefaultRetentionPriority = 35;  // TensorRT-LLM's default

class BlockPool {
 public:
  // Told when an evictable block is taken for reuse, before its new owner gets it.
  class EvictionListener {
   public:
    virtual ~EvictionListener() = default;
    virtual void OnEvict(int group, BlockId block) = 0;
  };

  // REQUIRES: `cache` outlives the pool and nothing else reserves or frees blocks of `group`.
  BlockPool(BlockedKVCache* cache, int group);
  // `group`'s pool when it shares its memory pool with `owner`'s group (MemoryConfig::
  // shared_pool): one set of block ids, references and eviction lists for both, so a block
  // either group releases can be taken by the other. Each block belongs to one group at a time;
  // a cached block remembers the group that cached it, and the listener is told that group when
  // it is evicted. REQUIRES: cache.pool_of(group) == cache.pool_of(owner.group()), and `owner`
  // (the object, not a moved-from shell) outlives this pool.
  BlockPool(BlockPool& owner, int group);

  BlockPool(BlockPool&&) noexcept = default;
  BlockPool& operator=(BlockPool&&) noexcept = default;
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // `n` fresh blocks into out[0, n), each with one reference: allocator-free blocks first, then
  // evicted ones (their listener is told and their cached mark dropped). kResourceExhausted when
  // fewer than `n` are free or evictable (nothing taken); kInvalidArgument for n < 0 or
  // out.size() < n.
  Status Take(int32_t n, std::span<BlockId> out);

  // One more reference to each block. A cached block with no reference (evictable) leaves the
  // eviction order: a prefix-cache hit. kFailedPrecondition (nothing changed) if any block is
  // neither referenced nor cached: only a held or cached block can be shared. kOutOfRange for an
  // invalid id.
  Status AddRef(std::span<const BlockId> blocks);

  // Drops one reference to each block; blocks reaching 0 go back to the allocator, or, when
  // cached, to the most recently used end of their priority's eviction list (in the order
  // given). A block may appear several times (each drops one reference). kFailedPrecondition
  // (nothing changed) if a block would drop below 0; kOutOfRange for an invalid id.
  Status Release(std::span<const BlockId> blocks);

  // Marks a referenced block as cached with retention `priority` (raised to it if already
  // cached with a lower one). REQUIRES: ref_count(block) > 0, priority in [0, 100].
  void MarkCached(BlockId block, int32_t priority);
  // Drops the cached mark (the prefix cache forgot the key); an evictable block goes back to the
  // allocator. The listener is not told. REQUIRES: is_cached(block).
  void Uncache(BlockId block);

  int32_t ref_count(BlockId block) const;  // 0 for a free or evictable block; REQUIRES: valid id
  // Cached by any group of the pool. REQUIRES: valid id.
  bool is_cached(BlockId block) const { return s_->blocks[block].cached != 0; }
  bool is_evictable(BlockId block) const {
    return s_->blocks[block].cached != 0 && s_->blocks[block].refs == 0;
  }
  // The group that cached the block (this pool's group unless its memory pool is shared).
  // REQUIRES: is_cached(block).
  int cached_group(BlockId block) const { return s_->blocks[block].group; }
  int32_t priority(BlockId block) const { return s_->blocks[block].priority; }  // REQUIRES: cached
  // Blocks Take can hand out: allocator-free + evictable.
  int32_t free_blocks() const;
  // Evictable blocks of the whole memory pool (every group sharing it).
  int32_t evictable_blocks() const { return s_->evictable; }
  // Calls f(block) for every evictable block in the order Take would evict them: lowest
  // priority first, least recently used first within a priority. Releasing blocks in this order
  // rebuilds the same order (what a snapshot relies on). `f` must not change the pool.
  template <class F>
  void ForEachEvictable(F&& f) const {
    for (int p = 0; p < kPriorities; ++p) {
      for (BlockId b = s_->heads[p]; b != kNoBlock; b = s_->blocks[b].next) f(b);
    }
  }
  int32_t num_blocks() const { return static_cast<int32_t>(s_->blocks.size()); }
  int group() const { return group_; }
  // True when both are pools of one memory pool (MemoryConfig::shared_pool), or the same pool.
  bool same_pool(const BlockPool& other) const { return s_ == other.s_; }
  // One listener per memory pool: setting it on any group's pool sets it for all of them.
  void set_eviction_listener(EvictionListener* listener) { s_->listener = listener; }

  // Every block with references or a cached mark is used in the allocator and every free one
  // has neither; the eviction lists hold exactly the evictable blocks, each once, in its
  // priority's list.
  Status CheckInvariants() const;

 private:
  static constexpr int kPriorities = kMaxRetentionPriority + 1;

  Status CheckId(BlockId block) const;
  void PushEvictable(BlockId block);
  void RemoveEvictable(BlockId block);
  BlockId PopEvictable();  // the lowest priority's least recently used; REQUIRES: evictable_ > 0

  BlockedKVCache* cache_;
  int group_;
  // What the pool knows of one block: one 16-byte record, so that a share, release or eviction
  // touches one cache line per block.
  struct BlockState {
    int32_t refs = 0;
    BlockId prev = kNoBlock;  // eviction list links, kNoBlock at the ends
    BlockId next = kNoBlock;
    uint8_t cached = 0;    // 1 when the prefix cache holds the block's key
    uint8_t priority = 0;  // retention priority of a cached block
    uint8_t group = 0;     // the cache group that cached it (shared memory pools)
  };
  // Shared by the pools of every group of one memory pool (one owner, see the constructors).
  struct State {
    EvictionListener* listener = nullptr;
    std::vector<BlockState> blocks;            // [num_blocks]
    std::array<BlockId, kPriorities> heads{};  // least recently used evictable block, per priority
    std::array<BlockId, kPriorities> tails{};  // most recently used
    std::array<uint64_t, 2> nonempty{};        // bit p: list p is not empty
    int32_t evictable = 0;
    std::vector<BlockId> scratch;  // blocks reaching 0 in one Release
  };
  std::unique_ptr<State> state_;  // null in a pool sharing another's
  State* s_ = nullptr;            // state_, or the owner's
};

}  // namespace blockkv
