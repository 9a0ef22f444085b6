// SPDX-License-Identifier: Apache-2.0
// BlockedAllocator against a trivially correct reference (block_allocator_model.h): a million
// random operations, valid and invalid, on allocators of 1 to 1024 blocks, with identical status
// codes, identical returned ids, identical counts and CheckInvariants() after every one.
#include "unit/block_allocator_model.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace blockkv_test {
namespace {

constexpr uint64_t kSeed = 0x626c6f636b6b76ULL;  // "blockkv"

TEST(BlockedAllocatorModelTest, MillionRandomOperationsMatchTheReference) {
  constexpr int64_t kOps = 1'000'000;
  std::printf("BlockedAllocatorModelTest seed: 0x%llx, %lld operations\n",
              static_cast<unsigned long long>(kSeed), static_cast<long long>(kOps));
  RandomSource source(kSeed);
  ModelStats stats;
  const auto start = std::chrono::steady_clock::now();
  const std::string failure = RunAllocatorModel(source, kOps, &stats);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(failure, "") << "seed 0x" << std::hex << kSeed;
  std::printf("%lld ops on %lld allocators (largest %lld blocks) in %.2f s\n",
              static_cast<long long>(stats.ops), static_cast<long long>(stats.pools),
              static_cast<long long>(stats.max_pool), seconds);
  EXPECT_EQ(stats.ops, kOps);

  // Every kind of outcome happened often, so the run was not vacuous.
  EXPECT_GT(stats.pools, 100);
  EXPECT_GT(stats.max_pool, 512);
  EXPECT_GT(stats.allocate_ok, 100'000);
  EXPECT_GT(stats.allocate_invalid, 10'000);
  EXPECT_GT(stats.allocate_exhausted, 10'000);
  EXPECT_GT(stats.span_allocates, 100'000);
  EXPECT_GT(stats.free_ok, 100'000);
  EXPECT_GT(stats.free_out_of_range, 10'000);
  EXPECT_GT(stats.free_failed_precondition, 10'000);
  EXPECT_GT(stats.create_rejected, 10);
}

TEST(BlockedAllocatorModelTest, ManySeedsAgreeWithTheReference) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    RandomSource source(seed);
    EXPECT_EQ(RunAllocatorModel(source, 10'000), "") << "seed " << seed;
  }
}

TEST(BlockedAllocatorModelTest, ByteSourceStopsWhenTheInputRunsOut) {
  const uint8_t bytes[] = {0, 0, 3, 7, 1, 200, 5, 9, 100, 12, 44, 0, 255, 255, 3, 1};
  ByteSource source(bytes, sizeof(bytes));
  ModelStats stats;
  EXPECT_EQ(RunAllocatorModel(source, 1'000'000, &stats), "");
  EXPECT_TRUE(source.exhausted());
  EXPECT_LT(stats.ops, 16);
  ByteSource empty(nullptr, 0);
  EXPECT_EQ(RunAllocatorModel(empty, 1'000'000, &stats), "");
}

// The reference itself follows DESIGN.md's golden order, so agreeing with it means something.
TEST(BlockedAllocatorModelTest, ReferenceFollowsTheGoldenOrder) {
  ReferenceAllocator ref(8);
  std::vector<blockkv::BlockId> ids;
  ASSERT_EQ(ref.Allocate(3, 3, &ids), blockkv::StatusCode::kOk);
  EXPECT_EQ(ids, (std::vector<blockkv::BlockId>{0, 1, 2}));
  ASSERT_EQ(ref.Free(std::vector<blockkv::BlockId>{0, 1, 2}), blockkv::StatusCode::kOk);
  ASSERT_EQ(ref.Allocate(4, 4, &ids), blockkv::StatusCode::kOk);
  EXPECT_EQ(ids, (std::vector<blockkv::BlockId>{2, 1, 0, 3}));
  EXPECT_EQ(ref.Free(std::vector<blockkv::BlockId>{1, 1}),
            blockkv::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ref.Free(std::vector<blockkv::BlockId>{8}), blockkv::StatusCode::kOutOfRange);
  EXPECT_EQ(ref.Allocate(5, 5, &ids), blockkv::StatusCode::kResourceExhausted);
  EXPECT_EQ(ref.Allocate(2, 1, &ids), blockkv::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace blockkv_test
