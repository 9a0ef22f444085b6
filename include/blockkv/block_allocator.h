// SPDX-License-Identifier: Apache-2.0
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
// Implementation notes: the free ids sit in an array used as a stack, `free_stack_`, whose top
// (the last element) is the head of DeepSpeed's free list; a fresh allocator's stack is
// [n−1, …, 1, 0]. One state byte per block (`state_`: free or used) makes every check O(1): 5
// bytes of metadata per block. Allocate(k) copies k ids off the top. Free(k ids) pushes them in
// one pass, each checked to be used when it is reached, so an id repeated within the call is
// found already free; on any bad id the pushes so far are undone. No heap allocation on the span
// path. A stack of ids rather than a list linked through the blocks keeps Allocate free of
// dependent loads (measured in docs/benchmarks.md).
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

  int32_t free_blocks() const { return static_cast<int32_t>(free_stack_.size()); }
  int32_t num_blocks() const { return static_cast<int32_t>(state_.size()); }
  int32_t used_blocks() const { return num_blocks() - free_blocks(); }
  // True when `id` is in range and allocated.
  bool IsUsed(BlockId id) const;

  // Walks the whole structure: the free stack holds exactly the ids whose state is free, each
  // once, and every other id is used. O(num_blocks); for tests and debugging.
  Status CheckInvariants() const;

 private:
  explicit BlockedAllocator(int32_t num_blocks);

  enum State : uint8_t { kFree, kUsed };

  // kResourceExhausted for asking `n` blocks. Off the hot path.
  [[gnu::cold]] Status NotEnoughBlocks(int32_t n) const;
  // Undoes the pushes of blocks[0, bad) and builds the error for blocks[bad]. Off the hot path.
  Status FreeFailure(std::span<const BlockId> blocks, size_t bad);

  std::vector<BlockId> free_stack_;  // [free_blocks]; back() is allocated next
  std::vector<State> state_;         // [num_blocks]
};

}  // namespace blockkv
