// SPDX-License-Identifier: Apache-2.0
// What a caller of the C++ core can do wrong, or be unlucky with, and must get a Status for (issue
// 17): never an abort, and a failed call changes nothing (free blocks, handles, slots, bytes).
// Each test here was an abort, a stuck sequence or a silent loss before its fix.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "blockkv/kv_cache.h"
#include "blockkv/offload.h"
#include "unit/offload_test_util.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::blockkv_test::Bytes;
using ::blockkv_test::FaultPlan;
using ::blockkv_test::FillRandom;
using ::blockkv_test::ReadBlock;
using ::blockkv_test::StoreState;
using ::blockkv_test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int32_t kBlocks = 8;

// A cache of one group and a store over it with the cache as the owner (what Python's
// BlockedKVCache(offload=True) is), its disk file going through plan_ so a copy can be held in
// flight.
class OffloadMisuseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cache_ = blockkv_test::MakeCache({blockkv_test::SmallGroup()}, kBlocks);
    ASSERT_NE(cache_, nullptr);
    Result<std::unique_ptr<OffloadStore>> store =
        OffloadStore::Create(cache_.get(), {.host_blocks = 4,
                                            .disk_path = dir_.File("tier"),
                                            .disk_blocks = 4,
                                            .open_file = blockkv_test::FaultyOpener(plan_)});
    ASSERT_OK(store);
    store_ = std::move(*store);
  }

  std::vector<BlockId> Reserve(int32_t n) {
    Result<std::vector<BlockId>> blocks = cache_->Reserve(n);
    EXPECT_OK(blocks);
    for (const BlockId b : *blocks) bytes_.push_back(FillRandom(*cache_, 0, b, rng_));
    return *blocks;
  }

  // Nothing observable changed since `before`, and both still agree with themselves.
  void ExpectUnchanged(const StoreState& before, std::span<const BlockId> blocks) {
    EXPECT_EQ(StoreState::Of(*cache_, *store_), before);
    for (size_t i = 0; i < blocks.size(); ++i) {
      EXPECT_TRUE(ReadBlock(*cache_, 0, blocks[i]) == bytes_[i]) << "block " << blocks[i];
    }
    EXPECT_OK(store_->CheckInvariants());
    EXPECT_OK(cache_->CheckInvariants());
  }

  std::mt19937_64 rng_{17};
  TempDir dir_;
  std::shared_ptr<FaultPlan> plan_ = std::make_shared<FaultPlan>();
  std::unique_ptr<BlockedKVCache> cache_;
  std::unique_ptr<OffloadStore> store_;
  std::vector<Bytes> bytes_;
};

// Was: the copy ran, then giving the "offloaded" block back to the cache aborted
// ("check failed at src/offload.cc:59: block 0 is already free").
TEST_F(OffloadMisuseTest, OffloadOfABlockNeverReservedIsFailedPreconditionAndChangesNothing) {
  const StoreState before = StoreState::Of(*cache_, *store_);
  const BlockId never_reserved[] = {0};
  std::vector<OffloadHandle> handles(1);
  for (const Tier tier : {Tier::kHost, Tier::kDisk}) {
    const Result<OffloadTicket> ticket = store_->Offload(never_reserved, 0, handles, tier);
    EXPECT_CODE(ticket, StatusCode::kFailedPrecondition);
    EXPECT_THAT(ticket.status().message(), AllOf(HasSubstr("block 0"), HasSubstr("is free")));
    ExpectUnchanged(before, {});
  }
  // One bad block among held ones: none of them is taken.
  const std::vector<BlockId> held = Reserve(2);
  const StoreState with_two = StoreState::Of(*cache_, *store_);
  const BlockId mixed[] = {held[0], 5, held[1]};
  handles.resize(3);
  EXPECT_CODE(store_->Offload(mixed, 0, handles), StatusCode::kFailedPrecondition);
  ExpectUnchanged(with_two, held);
  EXPECT_OK(cache_->Free(held));  // still the caller's
}

// Was: the block went back to the free list at once, and again when the copy was reaped: abort.
TEST_F(OffloadMisuseTest, FreeOfABlockWhoseOffloadIsInFlightIsFailedPreconditionAndChangesNothing) {
  const std::vector<BlockId> blocks = Reserve(2);
  plan_->Stall();  // the disk write waits: the copy stays in flight
  std::vector<OffloadHandle> handles(2);
  Result<OffloadTicket> ticket = store_->Offload(blocks, 0, handles, Tier::kDisk);
  ASSERT_OK(ticket);
  plan_->AwaitEntered(1);
  const StoreState before = StoreState::Of(*cache_, *store_);
  const Status freed = cache_->Free(blocks);
  EXPECT_CODE(freed, StatusCode::kFailedPrecondition);
  EXPECT_THAT(freed.message(), AllOf(HasSubstr("block " + std::to_string(blocks[0])),
                                     HasSubstr("held by an offload store")));
  EXPECT_EQ(StoreState::Of(*cache_, *store_), before);
  EXPECT_TRUE(store_->busy(0, blocks[0]));
  plan_->Release();
  ASSERT_OK(ticket->Wait());
  // Once the copy is done the store gave the blocks back: they are free, and freeing them again
  // is the allocator's error, not an abort.
  EXPECT_EQ(cache_->free_blocks()[0], kBlocks);
  EXPECT_CODE(cache_->Free(blocks), StatusCode::kFailedPrecondition);
  std::vector<BlockId> back(2);
  ASSERT_OK(store_->Restore(handles, 0, back)->Wait());
  for (size_t i = 0; i < back.size(); ++i) EXPECT_TRUE(ReadBlock(*cache_, 0, back[i]) == bytes_[i]);
  EXPECT_OK(store_->CheckInvariants());
  EXPECT_OK(cache_->CheckInvariants());
}

// Was: both copies gave the block back to the cache: the second Free aborted.
TEST_F(OffloadMisuseTest, OffloadingTheSameBlocksTwiceWhileTheFirstCopyRunsIsFailedPrecondition) {
  const std::vector<BlockId> blocks = Reserve(2);
  plan_->Stall();
  std::vector<OffloadHandle> first(2);
  Result<OffloadTicket> ticket = store_->Offload(blocks, 0, first, Tier::kDisk);
  ASSERT_OK(ticket);
  plan_->AwaitEntered(1);
  const StoreState before = StoreState::Of(*cache_, *store_);
  std::vector<OffloadHandle> second(2);
  for (const Tier tier : {Tier::kHost, Tier::kDisk}) {
    const Result<OffloadTicket> again = store_->Offload(blocks, 0, second, tier);
    EXPECT_CODE(again, StatusCode::kFailedPrecondition);
    EXPECT_THAT(again.status().message(),
                AllOf(HasSubstr("block " + std::to_string(blocks[0])), HasSubstr("in flight")));
    EXPECT_EQ(StoreState::Of(*cache_, *store_), before);
  }
  plan_->Release();
  ASSERT_OK(ticket->Wait());
  EXPECT_EQ(cache_->free_blocks()[0], kBlocks);
  EXPECT_EQ(store_->live_handles(), 2);
  EXPECT_OK(store_->CheckInvariants());
  EXPECT_OK(cache_->CheckInvariants());
}

// A failed offload keeps its device blocks for its handles: they are the store's until a
// Restore hands them back, so freeing, offloading or overwriting them is refused.
TEST_F(OffloadMisuseTest, BlocksKeptByAFailedOffloadAreTheStoresUntilRestored) {
  const std::vector<BlockId> blocks = Reserve(2);
  {
    std::lock_guard lock(plan_->mu);
    plan_->writes_ok = 0;
    plan_->failing_writes = 2;
  }
  std::vector<OffloadHandle> handles(2);
  EXPECT_CODE(store_->Offload(blocks, 0, handles, Tier::kDisk)->Wait(),
              StatusCode::kResourceExhausted);
  ASSERT_EQ(*store_->tier(handles[0]), Tier::kDevice);
  const StoreState before = StoreState::Of(*cache_, *store_);
  EXPECT_CODE(cache_->Free(blocks), StatusCode::kFailedPrecondition);
  std::vector<OffloadHandle> again(2);
  EXPECT_CODE(store_->Offload(blocks, 0, again), StatusCode::kFailedPrecondition);
  ExpectUnchanged(before, blocks);
  // A host copy written over a kept block would change a handle's bytes.
  Result<OffloadHandle> host = store_->CopyToHost(0, Reserve(1)[0]);
  ASSERT_OK(host);
  const StoreState with_host = StoreState::Of(*cache_, *store_);
  const Status overwrite = store_->CopyToDevice(*host, blocks[0]);
  EXPECT_CODE(overwrite, StatusCode::kFailedPrecondition);
  EXPECT_THAT(overwrite.message(), HasSubstr("held by the store"));
  EXPECT_EQ(StoreState::Of(*cache_, *store_), with_host);
  ExpectUnchanged(with_host, blocks);
  // Restore hands them back: the caller's again, to free.
  std::vector<BlockId> back(2);
  ASSERT_OK(store_->Restore(handles, 0, back)->Wait());
  EXPECT_EQ(back, blocks);
  EXPECT_OK(cache_->Free(blocks));
  EXPECT_OK(store_->CheckInvariants());
  EXPECT_OK(cache_->CheckInvariants());
}

// Was: CopyToHost / CopyToDevice on a block with a copy in flight aborted (a REQUIRES).
TEST_F(OffloadMisuseTest, SyncCopiesOnABlockWithACopyInFlightAreFailedPrecondition) {
  const std::vector<BlockId> blocks = Reserve(2);
  Result<OffloadHandle> host = store_->CopyToHost(0, blocks[1]);
  ASSERT_OK(host);
  plan_->Stall();
  std::vector<OffloadHandle> handles(1);
  Result<OffloadTicket> ticket =
      store_->Offload(std::span(blocks).first(1), 0, handles, Tier::kDisk);
  ASSERT_OK(ticket);
  plan_->AwaitEntered(1);
  const StoreState before = StoreState::Of(*cache_, *store_);
  EXPECT_CODE(store_->CopyToHost(0, blocks[0]), StatusCode::kFailedPrecondition);
  const Status to_device = store_->CopyToDevice(*host, blocks[0]);
  EXPECT_CODE(to_device, StatusCode::kFailedPrecondition);
  EXPECT_THAT(to_device.message(), HasSubstr("in flight"));
  EXPECT_EQ(StoreState::Of(*cache_, *store_), before);
  plan_->Release();
  ASSERT_OK(ticket->Wait());
  EXPECT_TRUE(ReadBlock(*cache_, 0, blocks[1]) == bytes_[1]);
  EXPECT_OK(store_->CheckInvariants());
}

// Was: an abort (a REQUIRES); tickets of one store still join.
TEST_F(OffloadMisuseTest, JoiningTicketsOfTwoStoresIsInvalidArgument) {
  Result<std::unique_ptr<OffloadStore>> other =
      OffloadStore::Create(cache_.get(), {.host_blocks = 2});
  ASSERT_OK(other);
  const std::vector<BlockId> blocks = Reserve(2);
  std::vector<OffloadHandle> a(1);
  std::vector<OffloadHandle> b(1);
  Result<OffloadTicket> ta = store_->Offload(std::span(blocks).first(1), 0, a);
  Result<OffloadTicket> tb = (*other)->Offload(std::span(blocks).last(1), 0, b);
  ASSERT_OK(ta);
  ASSERT_OK(tb);
  const Result<OffloadTicket> joined = OffloadTicket::Join(*ta, *tb);
  EXPECT_CODE(joined, StatusCode::kInvalidArgument);
  EXPECT_THAT(joined.status().message(), HasSubstr("two stores"));
  EXPECT_OK(OffloadTicket::Join(*ta, *ta));
  EXPECT_OK(OffloadTicket::Join(OffloadTicket(), *tb));
  EXPECT_OK(ta->Wait());
  EXPECT_OK(tb->Wait());
}

// Two stores over one cache: a block one of them holds is not the caller's to give the other.
TEST_F(OffloadMisuseTest, ASecondStoreOverTheCacheCannotTakeABlockTheFirstHolds) {
  Result<std::unique_ptr<OffloadStore>> other =
      OffloadStore::Create(cache_.get(), {.host_blocks = 2});
  ASSERT_OK(other);
  const std::vector<BlockId> blocks = Reserve(1);
  plan_->Stall();
  std::vector<OffloadHandle> handles(1);
  Result<OffloadTicket> ticket = store_->Offload(blocks, 0, handles, Tier::kDisk);
  ASSERT_OK(ticket);
  plan_->AwaitEntered(1);
  const StoreState before = StoreState::Of(*cache_, **other);
  EXPECT_CODE((*other)->Offload(blocks, 0, handles), StatusCode::kFailedPrecondition);
  EXPECT_EQ(StoreState::Of(*cache_, **other), before);
  plan_->Release();
  ASSERT_OK(ticket->Wait());
  EXPECT_EQ(cache_->free_blocks()[0], kBlocks);
}

// Was: a handle of another store restored this store's block of the same index. A handle states
// its store: another store's is kInvalidArgument everywhere a handle is taken, changing nothing.
TEST(OffloadHandleTest, AHandleOfAnotherStoreIsInvalidArgumentAndChangesNothing) {
  std::mt19937_64 rng(23);
  auto cache_a = blockkv_test::MakeCache({blockkv_test::SmallGroup()}, kBlocks);
  auto cache_b = blockkv_test::MakeCache({blockkv_test::SmallGroup()}, kBlocks);
  TempDir dir;
  auto a = OffloadStore::Create(cache_a.get(), {.host_blocks = 4});
  auto b = OffloadStore::Create(
      cache_b.get(), {.host_blocks = 4, .disk_path = dir.File("tier"), .disk_blocks = 4});
  ASSERT_OK(a);
  ASSERT_OK(b);
  ASSERT_NE((*a)->id(), (*b)->id());
  // The same history in both, so the foreign handle's index is live in b too.
  std::vector<Bytes> bytes;
  std::vector<OffloadHandle> ha(1);
  std::vector<OffloadHandle> hb(1);
  const auto offload_one = [&](BlockedKVCache& cache, OffloadStore& store,
                               std::vector<OffloadHandle>& out) {
    const BlockId block = (*cache.Reserve(1))[0];
    bytes.push_back(FillRandom(cache, 0, block, rng));
    ASSERT_OK(store.Offload(std::span(&block, 1), 0, out)->Wait());
  };
  offload_one(*cache_a, **a, ha);
  offload_one(*cache_b, **b, hb);
  ASSERT_EQ(ha[0].index, hb[0].index);
  EXPECT_EQ(ha[0].store, (*a)->id());
  OffloadStore& store = **b;
  const StoreState before = StoreState::Of(*cache_b, store);
  std::vector<BlockId> out(1, kNoBlock);
  const Result<OffloadTicket> restored = store.Restore(ha, 0, out);
  EXPECT_CODE(restored, StatusCode::kInvalidArgument);
  EXPECT_THAT(
      restored.status().message(),
      AllOf(HasSubstr("handles[0]"), HasSubstr("of offload store " + std::to_string((*a)->id()))));
  EXPECT_EQ(out[0], kNoBlock);
  EXPECT_CODE(store.tier(ha[0]), StatusCode::kInvalidArgument);
  EXPECT_CODE(store.Spill(ha), StatusCode::kInvalidArgument);
  EXPECT_CODE(store.Drop(ha), StatusCode::kInvalidArgument);
  const BlockId target = (*cache_b->Reserve(1))[0];
  const Bytes target_bytes = ReadBlock(*cache_b, 0, target);
  const StoreState with_target = StoreState::Of(*cache_b, store);
  EXPECT_CODE(store.CopyToDevice(ha[0], target), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ReadBlock(*cache_b, 0, target) == target_bytes);
  EXPECT_EQ(StoreState::Of(*cache_b, store), with_target);
  // Rebuilt without its store (as Python's packed int64 is): known by its generation, which no
  // other store hands out.
  const OffloadHandle rebuilt{ha[0].index, ha[0].generation, 0};
  EXPECT_CODE(store.Restore(std::span(&rebuilt, 1), 0, out), StatusCode::kNotFound);
  EXPECT_EQ(StoreState::Of(*cache_b, store), with_target);
  ASSERT_OK(cache_b->Free(std::span(&target, 1)));
  EXPECT_EQ(StoreState::Of(*cache_b, store), before);
  EXPECT_OK(store.CheckInvariants());
  // Each store still restores its own.
  ASSERT_OK(store.Restore(hb, 0, out)->Wait());
  EXPECT_TRUE(ReadBlock(*cache_b, 0, out[0]) == bytes[1]);
  ASSERT_OK((*a)->Restore(std::span(&rebuilt, 1), 0, out)->Wait());  // store 0 is accepted
  EXPECT_TRUE(ReadBlock(*cache_a, 0, out[0]) == bytes[0]);
}

}  // namespace
}  // namespace blockkv
