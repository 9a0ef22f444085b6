// SPDX-License-Identifier: Apache-2.0
// OffloadStore's synchronous copies for the prefix cache's host level: CopyToHost makes a host
// handle of a device block that stays the caller's, CopyToDevice writes a host handle's bytes
// into a device block and keeps the handle; both byte-exact, and every documented error leaves
// everything as it was.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "blockkv/offload.h"
#include "unit/offload_test_util.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::blockkv_test::Bytes;
using ::blockkv_test::FillRandom;
using ::blockkv_test::ReadBlock;
using ::blockkv_test::StoreState;
using ::blockkv_test::TempDir;

constexpr int32_t kBlocks = 16;

class OffloadSyncCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cache_ =
        blockkv_test::MakeCache({blockkv_test::SmallGroup(), blockkv_test::OddGroup()}, kBlocks);
    ASSERT_NE(cache_, nullptr);
    Result<std::unique_ptr<OffloadStore>> store = OffloadStore::Create(
        cache_.get(), {.host_blocks = 2, .disk_path = dir_.File("tier"), .disk_blocks = 2});
    ASSERT_OK(store);
    store_ = std::move(*store);
    Result<std::vector<BlockId>> blocks = cache_->Reserve(4, 1);
    ASSERT_OK(blocks);
    blocks_ = *blocks;
    for (BlockId b : blocks_) bytes_.push_back(FillRandom(*cache_, 1, b, rng_));
  }
  StoreState State() const { return StoreState::Of(*cache_, *store_); }

  std::mt19937_64 rng_{41};
  TempDir dir_;
  std::unique_ptr<BlockedKVCache> cache_;
  std::unique_ptr<OffloadStore> store_;
  std::vector<BlockId> blocks_;  // of group 1
  std::vector<Bytes> bytes_;
};

TEST_F(OffloadSyncCopyTest, CopiesAreByteExactAndKeepBlockAndHandle) {
  const StoreState before = State();
  Result<OffloadHandle> h = store_->CopyToHost(1, blocks_[0]);
  ASSERT_OK(h);
  EXPECT_EQ(*store_->tier(*h), Tier::kHost);
  EXPECT_FALSE(store_->busy(1, blocks_[0]));
  EXPECT_EQ(cache_->free_blocks(), before.cache_free);  // the block stays the caller's
  EXPECT_EQ(store_->free_host_blocks(1), 1);
  EXPECT_EQ(store_->free_host_blocks(0), 2);
  EXPECT_EQ(store_->stats().copied_to_host, 1);
  EXPECT_EQ(store_->stats().offloaded_blocks, 0);  // counted apart from Offload
  // The device block may change now: the handle holds the bytes of the moment of the copy.
  FillRandom(*cache_, 1, blocks_[0], rng_);
  ASSERT_OK(store_->CopyToDevice(*h, blocks_[1]));
  EXPECT_TRUE(ReadBlock(*cache_, 1, blocks_[1]) == bytes_[0]);
  EXPECT_EQ(*store_->tier(*h), Tier::kHost);  // the handle stays
  ASSERT_OK(store_->CopyToDevice(*h, blocks_[2]));
  EXPECT_TRUE(ReadBlock(*cache_, 1, blocks_[2]) == bytes_[0]);
  EXPECT_EQ(store_->stats().copied_to_device, 2);
  EXPECT_EQ(store_->stats().restored_blocks, 0);
  // It is an ordinary host handle: it spills and restores like any other.
  Result<OffloadTicket> spill = store_->Spill(std::span(&*h, 1));
  ASSERT_OK(spill);
  ASSERT_OK(spill->Wait());
  BlockId out = kNoBlock;
  Result<OffloadTicket> restore = store_->Restore(std::span(&*h, 1), 1, std::span(&out, 1));
  ASSERT_OK(restore);
  ASSERT_OK(restore->Wait());
  EXPECT_TRUE(ReadBlock(*cache_, 1, out) == bytes_[0]);
  EXPECT_EQ(store_->live_handles(), 0);
  EXPECT_OK(store_->CheckInvariants());
  EXPECT_OK(cache_->CheckInvariants());
}

TEST_F(OffloadSyncCopyTest, CopyToHostErrorsChangeNothing) {
  ASSERT_OK(store_->CopyToHost(1, blocks_[0]));
  ASSERT_OK(store_->CopyToHost(1, blocks_[1]));
  const StoreState before = State();
  EXPECT_CODE(store_->CopyToHost(1, blocks_[2]), StatusCode::kResourceExhausted);
  EXPECT_CODE(store_->CopyToHost(2, 0), StatusCode::kOutOfRange);
  EXPECT_CODE(store_->CopyToHost(-1, 0), StatusCode::kOutOfRange);
  EXPECT_CODE(store_->CopyToHost(0, -1), StatusCode::kOutOfRange);
  EXPECT_CODE(store_->CopyToHost(0, kBlocks), StatusCode::kOutOfRange);
  EXPECT_EQ(State(), before);
  EXPECT_OK(store_->CheckInvariants());
}

TEST_F(OffloadSyncCopyTest, CopyToDeviceErrorsChangeNothing) {
  Result<OffloadHandle> host = store_->CopyToHost(1, blocks_[0]);
  ASSERT_OK(host);
  std::vector<OffloadHandle> disk(1);
  Result<OffloadTicket> out = store_->Offload(std::span(&blocks_[3], 1), 1, disk, Tier::kDisk);
  ASSERT_OK(out);
  ASSERT_OK(out->Wait());
  const StoreState before = State();
  EXPECT_CODE(store_->CopyToDevice(disk[0], blocks_[1]), StatusCode::kFailedPrecondition);
  EXPECT_CODE(store_->CopyToDevice({host->index, host->generation + 1}, blocks_[1]),
              StatusCode::kNotFound);
  EXPECT_CODE(store_->CopyToDevice(*host, -1), StatusCode::kOutOfRange);
  EXPECT_CODE(store_->CopyToDevice(*host, kBlocks), StatusCode::kOutOfRange);
  EXPECT_EQ(State(), before);
  EXPECT_TRUE(ReadBlock(*cache_, 1, blocks_[1]) == bytes_[1]);
  EXPECT_OK(store_->CheckInvariants());
}

// A handle with a spill in flight is not read behind the worker's back.
TEST(OffloadSyncCopyInFlightTest, CopyToDeviceRefusesAHandleWithACopyInFlight) {
  std::mt19937_64 rng(42);
  TempDir dir;
  auto plan = std::make_shared<blockkv_test::FaultPlan>();
  std::unique_ptr<BlockedKVCache> cache = blockkv_test::MakeCache({blockkv_test::SmallGroup()}, 4);
  ASSERT_NE(cache, nullptr);
  Result<std::unique_ptr<OffloadStore>> store =
      OffloadStore::Create(cache.get(), {.host_blocks = 2,
                                         .disk_path = dir.File("tier"),
                                         .disk_blocks = 2,
                                         .open_file = blockkv_test::FaultyOpener(plan)});
  ASSERT_OK(store);
  const Bytes bytes = FillRandom(*cache, 0, 0, rng);
  Result<OffloadHandle> h = (*store)->CopyToHost(0, 0);
  ASSERT_OK(h);
  plan->Stall();
  Result<OffloadTicket> spill = (*store)->Spill(std::span(&*h, 1));
  ASSERT_OK(spill);
  plan->AwaitEntered(1);
  EXPECT_CODE((*store)->CopyToDevice(*h, 1), StatusCode::kFailedPrecondition);
  plan->Release();
  ASSERT_OK(spill->Wait());
  EXPECT_CODE((*store)->CopyToDevice(*h, 1), StatusCode::kFailedPrecondition);  // on disk now
  EXPECT_OK((*store)->CheckInvariants());
}

}  // namespace
}  // namespace blockkv
