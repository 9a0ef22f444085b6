// SPDX-License-Identifier: Apache-2.0
// BlockedAllocator: every scenario of DeepSpeed-FastGen's allocator tests
// (tests/unit/inference/v2/ragged/test_blocked_allocator.py), the golden LIFO orders of
// DESIGN.md §3, and the cases DeepSpeed gets wrong (a duplicate id inside one Free).
#include "blockkv/block_allocator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

BlockedAllocator MakeAllocator(int32_t num_blocks) {
  Result<BlockedAllocator> allocator = BlockedAllocator::Create(num_blocks);
  EXPECT_OK(allocator);
  return std::move(allocator).value();  // aborts, after the message above, on failure
}

std::vector<BlockId> AllocateOrDie(BlockedAllocator& allocator, int32_t n) {
  Result<std::vector<BlockId>> ids = allocator.Allocate(n);
  EXPECT_OK(ids);
  return ids.ok() ? *std::move(ids) : std::vector<BlockId>{};
}

// The allocator's observable state, to show that a failed call changed nothing.
struct Snapshot {
  int32_t free_blocks;
  std::vector<bool> used;
  bool operator==(const Snapshot&) const = default;
};

Snapshot Snap(const BlockedAllocator& allocator) {
  Snapshot s{allocator.free_blocks(), {}};
  for (BlockId id = 0; id < allocator.num_blocks(); ++id) s.used.push_back(allocator.IsUsed(id));
  return s;
}

TEST(BlockedAllocatorTest, CreateRejectsZeroAndNegativeSizes) {
  for (int32_t size : {0, -1, INT32_MIN}) {
    Result<BlockedAllocator> allocator = BlockedAllocator::Create(size);
    ASSERT_CODE(allocator, StatusCode::kInvalidArgument);
    EXPECT_THAT(allocator.status().message(), HasSubstr(std::to_string(size)));
  }
}

TEST(BlockedAllocatorTest, FreshAllocatorIsAllFree) {
  BlockedAllocator allocator = MakeAllocator(16);
  EXPECT_EQ(allocator.num_blocks(), 16);
  EXPECT_EQ(allocator.free_blocks(), 16);
  EXPECT_EQ(allocator.used_blocks(), 0);
  for (BlockId id = 0; id < 16; ++id) EXPECT_FALSE(allocator.IsUsed(id));
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, AllocateSequenceCountsDownAndThenFails) {
  BlockedAllocator allocator = MakeAllocator(16);
  std::vector<BlockId> all;
  const std::array<int32_t, 5> sizes{4, 2, 2, 2, 6};
  const std::array<int32_t, 5> free_after{12, 10, 8, 6, 0};
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<BlockId> ids = AllocateOrDie(allocator, sizes[i]);
    EXPECT_EQ(ids.size(), static_cast<size_t>(sizes[i]));
    EXPECT_EQ(allocator.free_blocks(), free_after[i]);
    EXPECT_OK(allocator.CheckInvariants());
    all.insert(all.end(), ids.begin(), ids.end());
  }
  Result<std::vector<BlockId>> more = allocator.Allocate(1);
  EXPECT_CODE(more, StatusCode::kResourceExhausted);
  EXPECT_EQ(allocator.free_blocks(), 0);
  EXPECT_OK(allocator.CheckInvariants());

  const std::set<BlockId> unique(all.begin(), all.end());
  EXPECT_EQ(unique.size(), 16u);
  EXPECT_EQ(*unique.begin(), 0);
  EXPECT_EQ(*unique.rbegin(), 15);
  for (BlockId id : all) EXPECT_TRUE(allocator.IsUsed(id));
}

TEST(BlockedAllocatorTest, AllocateMoreThanPoolFailsAndNamesTheNumbers) {
  BlockedAllocator allocator = MakeAllocator(16);
  Result<std::vector<BlockId>> ids = allocator.Allocate(17);
  ASSERT_CODE(ids, StatusCode::kResourceExhausted);
  EXPECT_THAT(ids.status().message(), HasSubstr("17"));
  EXPECT_THAT(ids.status().message(), HasSubstr("16"));
  EXPECT_EQ(allocator.free_blocks(), 16);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, AllocateFailsAndChangesNothingWhenShort) {
  BlockedAllocator allocator = MakeAllocator(8);
  const std::vector<BlockId> first = AllocateOrDie(allocator, 5);
  const Snapshot before = Snap(allocator);
  EXPECT_CODE(allocator.Allocate(4), StatusCode::kResourceExhausted);
  EXPECT_EQ(Snap(allocator), before);
  EXPECT_OK(allocator.CheckInvariants());
  // The failed call did not disturb the order: the next ids are still 5, 6, 7.
  EXPECT_THAT(AllocateOrDie(allocator, 3), ElementsAre(5, 6, 7));
}

TEST(BlockedAllocatorTest, FreeAllReturnsEveryBlock) {
  BlockedAllocator allocator = MakeAllocator(16);
  const std::vector<BlockId> ids = AllocateOrDie(allocator, 16);
  EXPECT_EQ(allocator.free_blocks(), 0);
  ASSERT_OK(allocator.Free(ids));
  EXPECT_EQ(allocator.free_blocks(), 16);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, FreeInChunksAndFreeingAChunkTwiceFails) {
  BlockedAllocator allocator = MakeAllocator(16);
  ASSERT_OK(allocator.Free(AllocateOrDie(allocator, 16)));
  const std::vector<BlockId> ids = AllocateOrDie(allocator, 16);
  ASSERT_EQ(allocator.free_blocks(), 0);
  const std::span<const BlockId> first(ids.data(), 4);
  const std::span<const BlockId> second(ids.data() + 4, 4);

  ASSERT_OK(allocator.Free(first));
  EXPECT_EQ(allocator.free_blocks(), 4);
  EXPECT_OK(allocator.CheckInvariants());
  ASSERT_OK(allocator.Free(second));
  EXPECT_EQ(allocator.free_blocks(), 8);
  EXPECT_OK(allocator.CheckInvariants());

  const Snapshot before = Snap(allocator);
  Status again = allocator.Free(first);
  EXPECT_CODE(again, StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.message(), HasSubstr(std::to_string(ids[0])));
  EXPECT_CODE(allocator.Free(second), StatusCode::kFailedPrecondition);
  EXPECT_EQ(Snap(allocator), before);
  EXPECT_EQ(allocator.free_blocks(), 8);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, FreeOutOfRangeIdFailsOnOneBlockAllocator) {
  BlockedAllocator allocator = MakeAllocator(1);
  for (BlockId bad : {-1, 2}) {
    const std::vector<BlockId> ids{bad};
    Status s = allocator.Free(ids);
    EXPECT_CODE(s, StatusCode::kOutOfRange);
    EXPECT_THAT(s.message(), HasSubstr(std::to_string(bad)));
    EXPECT_EQ(allocator.free_blocks(), 1);
    EXPECT_OK(allocator.CheckInvariants());
  }
}

TEST(BlockedAllocatorTest, MixedValidAndInvalidFreeChangesNothing) {
  BlockedAllocator allocator = MakeAllocator(1);
  EXPECT_THAT(AllocateOrDie(allocator, 1), ElementsAre(0));
  ASSERT_EQ(allocator.free_blocks(), 0);
  for (const std::vector<BlockId>& ids : {std::vector<BlockId>{0, -1}, {0, 2}}) {
    EXPECT_CODE(allocator.Free(ids), StatusCode::kOutOfRange);
    EXPECT_EQ(allocator.free_blocks(), 0);
    EXPECT_TRUE(allocator.IsUsed(0));
    EXPECT_OK(allocator.CheckInvariants());
  }
  const std::vector<BlockId> zero{0};
  ASSERT_OK(allocator.Free(zero));
  EXPECT_EQ(allocator.free_blocks(), 1);
  EXPECT_FALSE(allocator.IsUsed(0));
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, FreeReportsTheFirstBadIdInOrder) {
  BlockedAllocator allocator = MakeAllocator(4);
  const std::vector<BlockId> ids = AllocateOrDie(allocator, 2);  // 0, 1
  // 3 is free (kFailedPrecondition) and comes before 9 (kOutOfRange).
  const std::vector<BlockId> free_first{0, 3, 9};
  EXPECT_CODE(allocator.Free(free_first), StatusCode::kFailedPrecondition);
  const std::vector<BlockId> range_first{1, 9, 3};
  EXPECT_CODE(allocator.Free(range_first), StatusCode::kOutOfRange);
  EXPECT_TRUE(allocator.IsUsed(0));
  EXPECT_TRUE(allocator.IsUsed(1));
  EXPECT_EQ(allocator.free_blocks(), 2);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, RandomAllocateFreeKeepsAccounting) {
  constexpr int32_t kBlocks = 128;
  constexpr int kSteps = 8192;
  constexpr uint32_t kSeed = 20240611;
  SCOPED_TRACE(::testing::Message() << "seed " << kSeed);
  std::mt19937 rng(kSeed);
  BlockedAllocator allocator = MakeAllocator(kBlocks);

  std::vector<std::vector<BlockId>> live;
  int64_t allocs = 0, frees = 0, blocks_allocated = 0, blocks_freed = 0;
  for (int step = 0; step < kSteps; ++step) {
    if (live.empty() || rng() % 2 == 0) {
      const int32_t n = std::uniform_int_distribution<int32_t>(1, 24)(rng);
      const int32_t free_before = allocator.free_blocks();
      Result<std::vector<BlockId>> ids = allocator.Allocate(n);
      if (n <= free_before) {
        ASSERT_OK(ids) << "step " << step;
        ASSERT_EQ(ids->size(), static_cast<size_t>(n));
        live.push_back(*std::move(ids));
        ++allocs;
        blocks_allocated += n;
      } else {
        ASSERT_CODE(ids, StatusCode::kResourceExhausted) << "step " << step;
        ASSERT_EQ(allocator.free_blocks(), free_before);
      }
    } else {
      const size_t victim = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
      ASSERT_OK(allocator.Free(live[victim])) << "step " << step;
      blocks_freed += static_cast<int64_t>(live[victim].size());
      ++frees;
      live[victim] = std::move(live.back());
      live.pop_back();
    }

    ASSERT_OK(allocator.CheckInvariants()) << "step " << step;
    std::set<BlockId> unique;
    size_t total = 0;
    for (const std::vector<BlockId>& ids : live) {
      for (BlockId id : ids) {
        ASSERT_TRUE(allocator.IsUsed(id));
        unique.insert(id);
      }
      total += ids.size();
    }
    ASSERT_EQ(unique.size(), total) << "a block is live twice at step " << step;
    ASSERT_EQ(static_cast<int64_t>(total), kBlocks - allocator.free_blocks()) << "step " << step;
  }
  EXPECT_EQ(allocs, frees + static_cast<int64_t>(live.size()));
  EXPECT_EQ(blocks_allocated, blocks_freed + (kBlocks - allocator.free_blocks()));
  EXPECT_GT(allocs, 1000);
  EXPECT_GT(frees, 1000);
}

TEST(BlockedAllocatorTest, GoldenOrderReusesFreedIdsLastInFirstOut) {
  BlockedAllocator allocator = MakeAllocator(8);
  const std::vector<BlockId> ids = AllocateOrDie(allocator, 3);
  EXPECT_THAT(ids, ElementsAre(0, 1, 2));
  ASSERT_OK(allocator.Free(ids));
  EXPECT_THAT(AllocateOrDie(allocator, 4), ElementsAre(2, 1, 0, 3));
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, GoldenOrderFreedIdsComeBeforeNeverUsedOnes) {
  BlockedAllocator allocator = MakeAllocator(4);
  EXPECT_THAT(AllocateOrDie(allocator, 4), ElementsAre(0, 1, 2, 3));
  const std::vector<BlockId> some{1, 3};
  ASSERT_OK(allocator.Free(some));
  EXPECT_THAT(AllocateOrDie(allocator, 2), ElementsAre(3, 1));
  EXPECT_EQ(allocator.free_blocks(), 0);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, DuplicateIdInOneFreeFailsAndChangesNothing) {
  BlockedAllocator allocator = MakeAllocator(4);
  EXPECT_THAT(AllocateOrDie(allocator, 2), ElementsAre(0, 1));
  const Snapshot before = Snap(allocator);
  const std::vector<BlockId> twice{1, 1};
  Status s = allocator.Free(twice);
  EXPECT_CODE(s, StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("1"));
  EXPECT_EQ(Snap(allocator), before);
  EXPECT_OK(allocator.CheckInvariants());

  const std::vector<BlockId> once{1};
  ASSERT_OK(allocator.Free(once));
  EXPECT_EQ(allocator.free_blocks(), 3);
  EXPECT_OK(allocator.CheckInvariants());
  EXPECT_THAT(AllocateOrDie(allocator, 1), ElementsAre(1));
}

TEST(BlockedAllocatorTest, DuplicateAfterOtherValidIdsUnmarksThemAll) {
  BlockedAllocator allocator = MakeAllocator(6);
  EXPECT_THAT(AllocateOrDie(allocator, 5), ElementsAre(0, 1, 2, 3, 4));
  const std::vector<BlockId> ids{4, 0, 2, 0};
  EXPECT_CODE(allocator.Free(ids), StatusCode::kFailedPrecondition);
  for (BlockId id = 0; id < 5; ++id) EXPECT_TRUE(allocator.IsUsed(id)) << id;
  EXPECT_OK(allocator.CheckInvariants());
  const std::vector<BlockId> good{4, 0, 2};
  ASSERT_OK(allocator.Free(good));
  EXPECT_THAT(AllocateOrDie(allocator, 4), ElementsAre(2, 0, 4, 5));
}

TEST(BlockedAllocatorTest, FreeOfEmptySpanIsOk) {
  BlockedAllocator allocator = MakeAllocator(2);
  ASSERT_OK(allocator.Free(std::span<const BlockId>()));
  EXPECT_EQ(allocator.free_blocks(), 2);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, AllocateZeroGivesEmpty) {
  BlockedAllocator allocator = MakeAllocator(4);
  Result<std::vector<BlockId>> ids = allocator.Allocate(0);
  ASSERT_OK(ids);
  EXPECT_TRUE(ids->empty());
  EXPECT_EQ(allocator.free_blocks(), 4);
  // Also when nothing is free.
  AllocateOrDie(allocator, 4);
  ASSERT_OK(allocator.Allocate(0));
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, AllocateNegativeIsInvalidArgument) {
  BlockedAllocator allocator = MakeAllocator(4);
  Result<std::vector<BlockId>> ids = allocator.Allocate(-1);
  ASSERT_CODE(ids, StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(), HasSubstr("-1"));
  std::array<BlockId, 4> out{};
  EXPECT_CODE(allocator.Allocate(-1, out), StatusCode::kInvalidArgument);
  EXPECT_EQ(allocator.free_blocks(), 4);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, SpanAllocateFillsTheFirstNAndLeavesTheRest) {
  BlockedAllocator allocator = MakeAllocator(8);
  std::array<BlockId, 5> out;
  out.fill(kNoBlock);
  ASSERT_OK(allocator.Allocate(3, out));
  EXPECT_THAT(out, ElementsAre(0, 1, 2, kNoBlock, kNoBlock));
  EXPECT_EQ(allocator.free_blocks(), 5);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, SpanTooSmallIsInvalidArgumentAndChangesNothing) {
  BlockedAllocator allocator = MakeAllocator(8);
  std::array<BlockId, 2> out{kNoBlock, kNoBlock};
  const Snapshot before = Snap(allocator);
  Status s = allocator.Allocate(3, out);
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("3"));
  EXPECT_THAT(out, ElementsAre(kNoBlock, kNoBlock));
  EXPECT_EQ(Snap(allocator), before);
  EXPECT_OK(allocator.CheckInvariants());
}

TEST(BlockedAllocatorTest, SpanAllocateWhenShortIsResourceExhausted) {
  BlockedAllocator allocator = MakeAllocator(2);
  std::array<BlockId, 3> out{kNoBlock, kNoBlock, kNoBlock};
  EXPECT_CODE(allocator.Allocate(3, out), StatusCode::kResourceExhausted);
  EXPECT_THAT(out, ElementsAre(kNoBlock, kNoBlock, kNoBlock));
  EXPECT_EQ(allocator.free_blocks(), 2);
}

TEST(BlockedAllocatorTest, IsUsedIsFalseOutOfRangeAndTracksState) {
  BlockedAllocator allocator = MakeAllocator(3);
  EXPECT_FALSE(allocator.IsUsed(-1));
  EXPECT_FALSE(allocator.IsUsed(3));
  EXPECT_FALSE(allocator.IsUsed(INT32_MAX));
  AllocateOrDie(allocator, 2);
  EXPECT_TRUE(allocator.IsUsed(0));
  EXPECT_TRUE(allocator.IsUsed(1));
  EXPECT_FALSE(allocator.IsUsed(2));
  const std::vector<BlockId> zero{0};
  ASSERT_OK(allocator.Free(zero));
  EXPECT_FALSE(allocator.IsUsed(0));
  EXPECT_EQ(allocator.used_blocks(), 1);
}

TEST(BlockedAllocatorTest, MovedAllocatorKeepsItsState) {
  BlockedAllocator a = MakeAllocator(4);
  AllocateOrDie(a, 3);
  BlockedAllocator b = std::move(a);
  EXPECT_EQ(b.free_blocks(), 1);
  EXPECT_EQ(b.num_blocks(), 4);
  EXPECT_OK(b.CheckInvariants());
  EXPECT_THAT(AllocateOrDie(b, 1), ElementsAre(3));
}

}  // namespace
}  // namespace blockkv

namespace blockkv {
namespace {

TEST(BlockedAllocatorHugeRequest, FailsWithoutSizingAVector) {
  auto allocator = BlockedAllocator::Create(16);
  ASSERT_TRUE(allocator.ok());
  // 2^31 - 1 ids would be an 8 GiB vector: the check must come first.
  const auto ids = allocator->Allocate(std::numeric_limits<int32_t>::max());
  EXPECT_EQ(ids.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(allocator->free_blocks(), 16);
}

}  // namespace
}  // namespace blockkv
