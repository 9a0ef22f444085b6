// BlockedAllocator: the free list of one block pool's ids. It knows only which ids are free and
// which are used; sharing and reference counts live above it.
//
//   Result<BlockedAllocator> a = BlockedAllocator::Create(16);
//   Result<std::vector<BlockId>> ids = a->Allocate(3);   // [0, 1, 2]
//   Status s = a->Free(*ids);                           // pushed on the head in order
//   ids = a->Allocate(4);                                // [2, 1, 0, 3]
//
// Semantics are DeepSpeed-FastGen's: a fresh allocator hands out 0, 1, 2, ...; Free pushes ids
// onto the head in the order given and Allocate pops from the head (LIFO reuse). Both are
// all-or-nothing: every argument is checked before anything changes. Unlike DeepSpeed, an id
// given twice in one Free is rejected instead of corrupting the list.
//
// Not thread-safe: one owner drives it (the engine's scheduling thread).
//
// Implementation notes: one int32 per block, `next_[id]`:
//   next_[id] in [0, n)   id is free; the next free id in the list
//   next_[id] == kListEnd id is free and last in the list
//   next_[id] == kUsed    id is allocated
// `head_` is the first free id (kListEnd when none). Allocate(k) and Free(k ids) are O(k) with
// no heap allocation on the span path; Free detects duplicates by marking ids while it checks
// them and unmarking on failure.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "blockkv/status.h"

namespace blockkv {

using BlockId = int32_t;

// A block table entry that holds no block.
inline constexpr BlockId kNoBlock = -1;

class BlockedAllocator {
 public:
  // kInvalidArgument if num_blocks < 1.
  static Result<BlockedAllocator> Create(int32_t num_blocks);

  BlockedAllocator(BlockedAllocator&&) noexcept = default;
  BlockedAllocator& operator=(BlockedAllocator&&) noexcept = default;
  BlockedAllocator(const BlockedAllocator&) = delete;
  BlockedAllocator& operator=(const BlockedAllocator&) = delete;

  // `n` ids popped from the head of the free list. n == 0 gives an empty vector; n < 0 is
  // kInvalidArgument; n > free_blocks() is kResourceExhausted. Nothing changes on failure.
  Result<std::vector<BlockId>> Allocate(int32_t n);
  // The same into out[0, n) without heap allocation; out.size() < n is kInvalidArgument.
  Status Allocate(int32_t n, std::span<BlockId> out);

  // Returns `blocks` to the free list, pushing each onto the head in the order given. An id
  // outside [0, num_blocks) is kOutOfRange; an id that is free, or that appears twice in
  // `blocks`, is kFailedPrecondition. Every id is checked before any is freed.
  Status Free(std::span<const BlockId> blocks);

  int32_t free_blocks() const { return free_blocks_; }
  int32_t num_blocks() const { return static_cast<int32_t>(next_.size()); }
  int32_t used_blocks() const { return num_blocks() - free_blocks_; }
  // True when `id` is in range and allocated.
  bool IsUsed(BlockId id) const;

  // Walks the whole structure: the free list reaches exactly free_blocks() distinct ids with
  // no cycle, and every other id is marked used. O(num_blocks); for tests and debugging.
  Status CheckInvariants() const;

 private:
  explicit BlockedAllocator(int32_t num_blocks);

  static constexpr int32_t kListEnd = -1;
  static constexpr int32_t kUsed = -2;
  static constexpr int32_t kFreeing = -3;  // transient mark inside Free

  std::vector<int32_t> next_;  // [num_blocks]
  int32_t head_ = kListEnd;
  int32_t free_blocks_ = 0;
};

}  // namespace blockkv
