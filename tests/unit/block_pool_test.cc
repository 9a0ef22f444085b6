// SPDX-License-Identifier: Apache-2.0
// BlockPool: reference counts above one cache group's allocator. Every test checks the counts of
// all blocks, the allocator's free count and CheckInvariants() after each operation, so a failed
// call is seen to change nothing.
#include "blockkv/block_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <iostream>
#include <memory>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "unit/test_util.h"

namespace blockkv {
namespace {

constexpr int32_t kNumBlocks = 8;

// 2 layers, 16 tokens, 1 head of 4, fp16: 512 bytes per block.
KVCacheConfig SmallGroup(int32_t block_size = 16) {
  return KVCacheConfig{.block_size = block_size, .cache_shape = {2, 1, 4}};
}

std::unique_ptr<BlockedKVCache> MakeCache(std::vector<KVCacheConfig> configs, int32_t num_blocks) {
  Result<std::unique_ptr<BlockedKVCache>> cache = BlockedKVCache::Create(
      std::move(configs), MemoryConfig{.mode = AllocationMode::kAllocate, .size = num_blocks},
      CpuDevice(/*memory_budget=*/1 << 20));
  EXPECT_OK(cache);
  return cache.ok() ? std::move(cache).value() : nullptr;
}

class BlockPoolTest : public ::testing::Test {
 protected:
  BlockPoolTest() : cache_(MakeCache({SmallGroup()}, kNumBlocks)), pool_(cache_.get(), 0) {}

  // Takes `n` blocks, which must succeed.
  std::vector<BlockId> Take(int32_t n) {
    std::vector<BlockId> ids(static_cast<size_t>(n), kNoBlock);
    EXPECT_OK(pool_.Take(n, ids));
    return ids;
  }

  // The reference count of every block, the free count and the invariants, all at once: the
  // blocks listed in `expected` (as block -> count pairs) have those counts, every other block 0.
  void ExpectCounts(const std::vector<std::pair<BlockId, int32_t>>& expected) {
    std::vector<int32_t> want(kNumBlocks, 0);
    for (const auto& [block, count] : expected) want[static_cast<size_t>(block)] = count;
    int32_t free = 0;
    for (BlockId block = 0; block < kNumBlocks; ++block) {
      EXPECT_EQ(pool_.ref_count(block), want[static_cast<size_t>(block)]) << "block " << block;
      EXPECT_EQ(cache_->allocator(0).IsUsed(block), want[static_cast<size_t>(block)] > 0)
          << "block " << block;
      if (want[static_cast<size_t>(block)] == 0) ++free;
    }
    EXPECT_EQ(pool_.free_blocks(), free);
    EXPECT_EQ(cache_->free_blocks()[0], free);
    EXPECT_OK(pool_.CheckInvariants());
    EXPECT_OK(cache_->CheckInvariants());
  }

  std::unique_ptr<BlockedKVCache> cache_;
  BlockPool pool_;
};

TEST_F(BlockPoolTest, FreshPoolHasNoReferences) {
  EXPECT_EQ(pool_.num_blocks(), kNumBlocks);
  EXPECT_EQ(pool_.group(), 0);
  ExpectCounts({});
}

TEST_F(BlockPoolTest, TakeGivesOneReferenceEach) {
  const std::vector<BlockId> ids = Take(3);
  EXPECT_EQ(ids, (std::vector<BlockId>{0, 1, 2}));  // a fresh allocator hands out 0, 1, 2
  ExpectCounts({{0, 1}, {1, 1}, {2, 1}});
}

TEST_F(BlockPoolTest, TakeZeroTakesNothing) {
  std::vector<BlockId> none;
  ASSERT_OK(pool_.Take(0, none));
  ExpectCounts({});
}

TEST_F(BlockPoolTest, AddRefAndReleaseCountReferences) {
  const std::vector<BlockId> ids = Take(2);
  ASSERT_OK(pool_.AddRef(ids));
  ExpectCounts({{0, 2}, {1, 2}});
  ASSERT_OK(pool_.AddRef(std::span<const BlockId>(ids.data(), 1)));
  ExpectCounts({{0, 3}, {1, 2}});
  ASSERT_OK(pool_.Release(ids));
  ExpectCounts({{0, 2}, {1, 1}});
}

TEST_F(BlockPoolTest, BlockReturnsToAllocatorOnlyAtZero) {
  const std::vector<BlockId> ids = Take(1);
  const BlockId b = ids[0];
  ASSERT_OK(pool_.AddRef(ids));
  ASSERT_OK(pool_.AddRef(ids));
  ExpectCounts({{b, 3}});
  ASSERT_EQ(pool_.free_blocks(), kNumBlocks - 1);

  ASSERT_OK(pool_.Release(ids));
  ExpectCounts({{b, 2}});
  EXPECT_EQ(pool_.free_blocks(), kNumBlocks - 1);
  ASSERT_OK(pool_.Release(ids));
  ExpectCounts({{b, 1}});
  EXPECT_EQ(pool_.free_blocks(), kNumBlocks - 1);
  ASSERT_OK(pool_.Release(ids));
  ExpectCounts({});
  EXPECT_EQ(pool_.free_blocks(), kNumBlocks);
}

TEST_F(BlockPoolTest, AddRefOfABlockListedTwiceAddsTwoReferences) {
  const std::vector<BlockId> ids = Take(1);
  const std::array<BlockId, 2> twice{ids[0], ids[0]};
  ASSERT_OK(pool_.AddRef(twice));
  ExpectCounts({{ids[0], 3}});
}

TEST_F(BlockPoolTest, ReleaseOfABlockListedTwiceDropsTwoReferences) {
  const std::vector<BlockId> ids = Take(2);  // 0, 1
  ASSERT_OK(pool_.AddRef(ids));
  ASSERT_OK(pool_.AddRef(std::span<const BlockId>(ids.data(), 1)));
  ExpectCounts({{0, 3}, {1, 2}});

  const std::array<BlockId, 2> zero_twice{0, 0};
  ASSERT_OK(pool_.Release(zero_twice));
  ExpectCounts({{0, 1}, {1, 2}});  // still held: nothing returned
}

TEST_F(BlockPoolTest, ReleaseReachingZeroThroughADuplicateReturnsTheBlockOnce) {
  const std::vector<BlockId> ids = Take(3);  // 0, 1, 2
  ASSERT_OK(pool_.AddRef(std::span<const BlockId>(ids.data() + 1, 1)));
  ExpectCounts({{0, 1}, {1, 2}, {2, 1}});

  const std::array<BlockId, 3> blocks{1, 2, 1};
  ASSERT_OK(pool_.Release(blocks));
  ExpectCounts({{0, 1}});
  EXPECT_EQ(pool_.free_blocks(), kNumBlocks - 1);  // 1 and 2 back, 1 only once

  // Every free block comes back exactly once: taking all of them gives distinct ids.
  std::vector<BlockId> rest = Take(kNumBlocks - 1);
  std::vector<bool> seen(kNumBlocks, false);
  for (const BlockId b : rest) {
    ASSERT_GE(b, 0);
    ASSERT_LT(b, kNumBlocks);
    EXPECT_FALSE(seen[static_cast<size_t>(b)]) << "block " << b << " handed out twice";
    seen[static_cast<size_t>(b)] = true;
  }
  EXPECT_FALSE(seen[0]);  // still held
  EXPECT_EQ(pool_.free_blocks(), 0);
  EXPECT_OK(pool_.CheckInvariants());
}

TEST_F(BlockPoolTest, ReleaseBelowZeroFailsAndChangesNothing) {
  const std::vector<BlockId> ids = Take(3);  // 0, 1, 2
  ASSERT_OK(pool_.AddRef(std::span<const BlockId>(ids.data(), 1)));
  ExpectCounts({{0, 2}, {1, 1}, {2, 1}});

  // 0 and 1 come before the bad one, and 1 would have reached 0 on its first sighting.
  const std::array<BlockId, 4> blocks{0, 1, 1, 2};
  EXPECT_CODE(pool_.Release(blocks), StatusCode::kFailedPrecondition);
  ExpectCounts({{0, 2}, {1, 1}, {2, 1}});

  // A block listed more often than it has references, at the end of the span.
  const std::array<BlockId, 4> thrice{2, 0, 0, 0};
  EXPECT_CODE(pool_.Release(thrice), StatusCode::kFailedPrecondition);
  ExpectCounts({{0, 2}, {1, 1}, {2, 1}});
}

TEST_F(BlockPoolTest, ReleaseOfAFreeBlockFailsAndChangesNothing) {
  const std::vector<BlockId> ids = Take(2);  // 0, 1; 2.. are free
  const std::array<BlockId, 3> blocks{0, 1, 5};
  EXPECT_CODE(pool_.Release(blocks), StatusCode::kFailedPrecondition);
  ExpectCounts({{0, 1}, {1, 1}});
  const std::array<BlockId, 1> free_only{7};
  EXPECT_CODE(pool_.Release(free_only), StatusCode::kFailedPrecondition);
  ExpectCounts({{0, 1}, {1, 1}});
}

TEST_F(BlockPoolTest, ReleaseOfAnInvalidIdIsOutOfRangeAndChangesNothing) {
  const std::vector<BlockId> ids = Take(2);
  for (const BlockId bad : {kNoBlock, -7, kNumBlocks, kNumBlocks + 100}) {
    const std::array<BlockId, 3> blocks{0, 1, bad};
    EXPECT_CODE(pool_.Release(blocks), StatusCode::kOutOfRange) << "id " << bad;
    ExpectCounts({{0, 1}, {1, 1}});
  }
}

TEST_F(BlockPoolTest, ReleaseOfNothingIsOk) {
  const std::vector<BlockId> ids = Take(1);
  ASSERT_OK(pool_.Release(std::span<const BlockId>()));
  ExpectCounts({{0, 1}});
}

TEST_F(BlockPoolTest, AddRefOfAFreeBlockFailsAndChangesNothing) {
  const std::vector<BlockId> ids = Take(2);  // 0, 1
  const std::array<BlockId, 3> blocks{0, 1, 3};
  EXPECT_CODE(pool_.AddRef(blocks), StatusCode::kFailedPrecondition);
  ExpectCounts({{0, 1}, {1, 1}});

  // A block that was held and went back is free again: it cannot be shared either.
  ASSERT_OK(pool_.Release(std::span<const BlockId>(ids.data() + 1, 1)));
  ExpectCounts({{0, 1}});
  EXPECT_CODE(pool_.AddRef(ids), StatusCode::kFailedPrecondition);
  ExpectCounts({{0, 1}});
}

TEST_F(BlockPoolTest, AddRefOfAnInvalidIdIsOutOfRangeAndChangesNothing) {
  const std::vector<BlockId> ids = Take(2);
  for (const BlockId bad : {kNoBlock, kNumBlocks}) {
    const std::array<BlockId, 3> blocks{0, bad, 1};
    EXPECT_CODE(pool_.AddRef(blocks), StatusCode::kOutOfRange) << "id " << bad;
    ExpectCounts({{0, 1}, {1, 1}});
  }
}

TEST_F(BlockPoolTest, TakeMoreThanFreeIsResourceExhaustedAndChangesNothing) {
  const std::vector<BlockId> ids = Take(5);
  ExpectCounts({{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}});
  std::vector<BlockId> out(4, kNoBlock);
  EXPECT_CODE(pool_.Take(4, out), StatusCode::kResourceExhausted);
  ExpectCounts({{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}});

  std::vector<BlockId> all(kNumBlocks + 1, kNoBlock);
  EXPECT_CODE(pool_.Take(kNumBlocks + 1, all), StatusCode::kResourceExhausted);
  ExpectCounts({{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}});

  // Exactly what is free still works.
  std::vector<BlockId> rest(3, kNoBlock);
  ASSERT_OK(pool_.Take(3, rest));
  ExpectCounts({{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}, {7, 1}});
  std::vector<BlockId> one(1, kNoBlock);
  EXPECT_CODE(pool_.Take(1, one), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool_.free_blocks(), 0);
  EXPECT_OK(pool_.CheckInvariants());
}

TEST_F(BlockPoolTest, TakeWithBadArgumentsIsInvalidArgumentAndChangesNothing) {
  std::vector<BlockId> out(2, kNoBlock);
  EXPECT_CODE(pool_.Take(-1, out), StatusCode::kInvalidArgument);
  ExpectCounts({});
  EXPECT_CODE(pool_.Take(3, out), StatusCode::kInvalidArgument);  // out too short
  ExpectCounts({});
}

TEST_F(BlockPoolTest, ReleasedBlockIsTakenAgainWithOneReference) {
  const std::vector<BlockId> ids = Take(kNumBlocks);
  ASSERT_OK(pool_.AddRef(std::span<const BlockId>(ids.data() + 3, 1)));
  const std::array<BlockId, 2> blocks{3, 3};
  ASSERT_OK(pool_.Release(blocks));
  EXPECT_EQ(pool_.free_blocks(), 1);
  const std::vector<BlockId> again = Take(1);
  EXPECT_EQ(again, std::vector<BlockId>{3});
  EXPECT_EQ(pool_.ref_count(3), 1);
  EXPECT_EQ(pool_.free_blocks(), 0);
  EXPECT_OK(pool_.CheckInvariants());
}

// ---- cached blocks and eviction ----------------------------------------------------------------

// Records the blocks the pool evicts, in order.
struct EvictionLog : BlockPool::EvictionListener {
  void OnEvict(int group, BlockId block) override {
    EXPECT_EQ(group, 0);
    evicted.push_back(block);
  }
  std::vector<BlockId> evicted;
};

TEST_F(BlockPoolTest, CachedBlockStaysUsedAndEvictableAtZero) {
  const std::vector<BlockId> ids = Take(2);
  pool_.MarkCached(ids[0], kDefaultRetentionPriority);
  ASSERT_OK(pool_.Release(ids));
  EXPECT_TRUE(pool_.is_evictable(ids[0]));
  EXPECT_FALSE(pool_.is_cached(ids[1]));
  EXPECT_TRUE(cache_->allocator(0).IsUsed(ids[0]));
  EXPECT_EQ(pool_.evictable_blocks(), 1);
  EXPECT_EQ(pool_.free_blocks(), kNumBlocks) << "evictable blocks count as free";
  EXPECT_OK(pool_.CheckInvariants());
}

TEST_F(BlockPoolTest, AddRefRevivesAnEvictableBlock) {
  const std::vector<BlockId> ids = Take(1);
  pool_.MarkCached(ids[0], 10);
  ASSERT_OK(pool_.Release(ids));
  ASSERT_OK(pool_.AddRef(ids));
  EXPECT_EQ(pool_.ref_count(ids[0]), 1);
  EXPECT_EQ(pool_.evictable_blocks(), 0);
  EXPECT_EQ(pool_.free_blocks(), kNumBlocks - 1);
  EXPECT_OK(pool_.CheckInvariants());
}

TEST_F(BlockPoolTest, TakeEvictsLowestPriorityThenLeastRecentlyUsed) {
  EvictionLog log;
  pool_.set_eviction_listener(&log);
  std::vector<BlockId> ids = Take(kNumBlocks);
  // Priorities: blocks 0..3 at 50, 4..5 at 20, 6..7 uncached.
  for (int i = 0; i < 6; ++i) pool_.MarkCached(ids[i], i < 4 ? 50 : 20);
  // Released in the order 2, 0, 5, 3, 4, 1, 6, 7: within a priority, oldest release first.
  for (BlockId b : {2, 0, 5, 3, 4, 1, 6, 7}) ASSERT_OK(pool_.Release(std::vector<BlockId>{b}));
  EXPECT_EQ(pool_.evictable_blocks(), 6);
  std::vector<BlockId> got(kNumBlocks, kNoBlock);
  ASSERT_OK(pool_.Take(kNumBlocks, got));
  // The allocator's 2 free blocks first (7 then 6, its stack), then evictions.
  EXPECT_EQ(log.evicted, (std::vector<BlockId>{5, 4, 2, 0, 3, 1}));
  EXPECT_EQ(pool_.evictable_blocks(), 0);
  for (BlockId b : got) EXPECT_FALSE(pool_.is_cached(b));
  EXPECT_OK(pool_.CheckInvariants());
  pool_.set_eviction_listener(nullptr);
}

TEST_F(BlockPoolTest, TakeBeyondFreePlusEvictableChangesNothing) {
  std::vector<BlockId> ids = Take(kNumBlocks);
  pool_.MarkCached(ids[0], 0);
  ASSERT_OK(pool_.Release(std::span(ids).first(1)));
  std::vector<BlockId> out(2, kNoBlock);
  EXPECT_CODE(pool_.Take(2, out), StatusCode::kResourceExhausted);
  EXPECT_TRUE(pool_.is_evictable(ids[0]));
  EXPECT_OK(pool_.CheckInvariants());
}

TEST_F(BlockPoolTest, UncacheReturnsAnEvictableBlockToTheAllocator) {
  std::vector<BlockId> ids = Take(2);
  pool_.MarkCached(ids[0], 0);
  pool_.MarkCached(ids[1], 0);
  ASSERT_OK(pool_.Release(std::span(ids).first(1)));
  pool_.Uncache(ids[0]);  // evictable: freed
  pool_.Uncache(ids[1]);  // held: only the mark goes
  EXPECT_FALSE(cache_->allocator(0).IsUsed(ids[0]));
  EXPECT_EQ(pool_.ref_count(ids[1]), 1);
  ASSERT_OK(pool_.Release(std::span(ids).subspan(1)));
  ExpectCounts({});
}

TEST_F(BlockPoolTest, MarkCachedKeepsTheHigherPriority) {
  std::vector<BlockId> ids = Take(1);
  pool_.MarkCached(ids[0], 60);
  pool_.MarkCached(ids[0], 30);
  EXPECT_EQ(pool_.priority(ids[0]), 60);
  pool_.MarkCached(ids[0], 90);
  EXPECT_EQ(pool_.priority(ids[0]), 90);
}

TEST(BlockPoolGroupsTest, PoolsOfTwoGroupsCountIndependently) {
  std::unique_ptr<BlockedKVCache> cache = MakeCache({SmallGroup(16), SmallGroup(32)}, kNumBlocks);
  ASSERT_NE(cache, nullptr);
  BlockPool a(cache.get(), 0);
  BlockPool b(cache.get(), 1);
  EXPECT_EQ(b.group(), 1);
  std::vector<BlockId> ids(3, kNoBlock);
  ASSERT_OK(a.Take(3, ids));
  EXPECT_EQ(a.free_blocks(), kNumBlocks - 3);
  EXPECT_EQ(b.free_blocks(), kNumBlocks);
  EXPECT_EQ(b.ref_count(0), 0);
  // Block 0 is held in group 0 only: group 1 cannot share or release it.
  EXPECT_CODE(b.AddRef(std::span<const BlockId>(ids.data(), 1)), StatusCode::kFailedPrecondition);
  EXPECT_CODE(b.Release(std::span<const BlockId>(ids.data(), 1)), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->free_blocks(), (std::vector<int32_t>{kNumBlocks - 3, kNumBlocks}));
  EXPECT_OK(a.CheckInvariants());
  EXPECT_OK(b.CheckInvariants());
  ASSERT_OK(a.Release(ids));
  EXPECT_EQ(cache->free_blocks(), (std::vector<int32_t>{kNumBlocks, kNumBlocks}));
  EXPECT_OK(a.CheckInvariants());
}

// Random Take / AddRef / Release (valid and not) against a plain array of counts.
TEST(BlockPoolRandomTest, MatchesReferenceCounts) {
  constexpr int32_t kBlocks = 32;
  constexpr uint64_t kSeed = 20240604;
  std::cout << "BlockPoolRandomTest seed " << kSeed << "\n";
  std::unique_ptr<BlockedKVCache> cache = MakeCache({SmallGroup()}, kBlocks);
  ASSERT_NE(cache, nullptr);
  BlockPool pool(cache.get(), 0);
  std::vector<int32_t> model(kBlocks, 0);
  std::mt19937_64 rng(kSeed);
  auto uniform = [&rng](int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int step = 0; step < 20'000; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    // Blocks drawn from every id, plus an occasional invalid one.
    std::vector<BlockId> blocks(static_cast<size_t>(uniform(0, 5)));
    for (BlockId& b : blocks) {
      b = static_cast<BlockId>(uniform(0, 40) == 0 ? (uniform(0, 1) == 0 ? kNoBlock : kBlocks)
                                                   : uniform(0, kBlocks - 1));
    }
    bool invalid = false;
    for (const BlockId b : blocks) invalid = invalid || b < 0 || b >= kBlocks;
    const int64_t op = uniform(0, 2);
    if (op == 0) {
      const auto n = static_cast<int32_t>(uniform(0, 6));
      std::vector<BlockId> out(static_cast<size_t>(n), kNoBlock);
      const int32_t free = static_cast<int32_t>(std::count(model.begin(), model.end(), 0));
      const Status s = pool.Take(n, out);
      if (n > free) {
        ASSERT_CODE(s, StatusCode::kResourceExhausted);
      } else {
        ASSERT_OK(s);
        for (const BlockId b : out) {
          ASSERT_EQ(model[static_cast<size_t>(b)], 0) << "took held block " << b;
          model[static_cast<size_t>(b)] = 1;
        }
      }
    } else if (op == 1) {
      bool held = true;
      for (const BlockId b : blocks) {
        held = held && (b < 0 || b >= kBlocks || model[static_cast<size_t>(b)] > 0);
      }
      const Status s = pool.AddRef(blocks);
      if (invalid && !held) {  // the contract does not say which of the two is named
        ASSERT_TRUE(s.code() == StatusCode::kOutOfRange ||
                    s.code() == StatusCode::kFailedPrecondition)
            << s;
      } else if (invalid) {
        ASSERT_CODE(s, StatusCode::kOutOfRange);
      } else if (!held) {
        ASSERT_CODE(s, StatusCode::kFailedPrecondition);
      } else {
        ASSERT_OK(s);
        for (const BlockId b : blocks) ++model[static_cast<size_t>(b)];
      }
    } else {
      std::vector<int32_t> after = model;
      bool enough = true;
      for (const BlockId b : blocks) {
        if (b >= 0 && b < kBlocks) enough = --after[static_cast<size_t>(b)] >= 0 && enough;
      }
      const Status s = pool.Release(blocks);
      if (invalid && !enough) {
        ASSERT_TRUE(s.code() == StatusCode::kOutOfRange ||
                    s.code() == StatusCode::kFailedPrecondition)
            << s;
      } else if (invalid) {
        ASSERT_CODE(s, StatusCode::kOutOfRange);
      } else if (!enough) {
        ASSERT_CODE(s, StatusCode::kFailedPrecondition);
      } else {
        ASSERT_OK(s);
        model = after;
      }
    }
    int32_t free = 0;
    for (BlockId b = 0; b < kBlocks; ++b) {
      ASSERT_EQ(pool.ref_count(b), model[static_cast<size_t>(b)]) << "block " << b;
      free += model[static_cast<size_t>(b)] == 0;
    }
    ASSERT_EQ(pool.free_blocks(), free);
    ASSERT_OK(pool.CheckInvariants());
  }
}

}  // namespace
}  // namespace blockkv
