// SPDX-License-Identifier: Apache-2.0
// BlockedKVCache::Create in RESERVE mode across the ranks of an mpirun: every rank plans against
// its own CpuDevice budget, and all of them end with the smallest plan, or all of them fail.
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mpi_test_util.h"

#include "blockkv/kv_cache.h"
#include "blockkv/mpi_communicator.h"

namespace blockkv {
namespace {

using ::blockkv::testing::WorldRank;
using ::blockkv::testing::WorldSize;

// 2 layers · 16 tokens · 2 · 2 heads · 32 dims · 2 bytes = 8 KiB per block.
std::vector<KVCacheConfig> SmallConfigs() {
  return {KVCacheConfig{.block_size = 16, .cache_shape = {2, 2, 32}}};
}

constexpr MemoryConfig kReserve{.mode = AllocationMode::kReserve, .size = 64 * 1024};

int64_t BytesPerBlock(const std::vector<KVCacheConfig>& configs) {
  int64_t total = 0;
  for (const KVCacheConfig& c : configs) total += *c.bytes_per_block();
  return total;
}

// Rank r's budget: room for 20 + 7·((r + 1) mod world) blocks plus a few stray bytes, so the
// smallest plan is on the last rank (never rank 0's own) and no two neighbours agree.
int64_t BudgetOf(int rank, int world, const std::vector<KVCacheConfig>& configs) {
  const int64_t blocks = 20 + 7 * ((rank + 1) % world);
  return kReserve.size + blocks * BytesPerBlock(configs) + 100 * rank;
}

// What the agreement must produce: the smallest local plan over all ranks, computed here
// independently of any communication.
int32_t ExpectedNumBlocks(int world, const std::vector<KVCacheConfig>& configs) {
  int32_t min = INT32_MAX;
  for (int r = 0; r < world; ++r) {
    Result<KVCachePlan> plan = PlanKVCache(configs, kReserve, BudgetOf(r, world, configs));
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (plan.ok()) min = std::min(min, plan->num_blocks);
  }
  return min;
}

std::unique_ptr<MpiCommunicator> World() {
  auto comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(*comm) : nullptr;
}

TEST(KVCacheMpiTest, EveryRankEndsWithTheSmallestPlan) {
  const int rank = WorldRank();
  const int world = WorldSize();
  std::unique_ptr<MpiCommunicator> comm = World();
  ASSERT_NE(comm, nullptr);
  const std::vector<KVCacheConfig> configs = SmallConfigs();
  const int64_t budget = BudgetOf(rank, world, configs);
  std::shared_ptr<Device> device = CpuDevice(budget);

  auto cache = BlockedKVCache::Create(configs, kReserve, device, comm.get());
  ASSERT_TRUE(cache.ok()) << cache.status();
  const int32_t expected = ExpectedNumBlocks(world, configs);
  EXPECT_EQ((*cache)->num_blocks(), expected);
  EXPECT_EQ((*cache)->free_blocks(), std::vector<int32_t>{expected});
  EXPECT_EQ((*cache)->plan().total_bytes, expected * BytesPerBlock(configs));
  // The storage is the agreed size, not this rank's own (larger) plan.
  EXPECT_EQ(device->available_memory(), budget - expected * BytesPerBlock(configs));
  EXPECT_TRUE((*cache)->CheckInvariants().ok());

  // Every rank really holds the same number: the minimum and the maximum agree.
  int32_t local = (*cache)->num_blocks();
  int32_t max = 0;
  MPI_Allreduce(&local, &max, 1, MPI_INT32_T, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(max, expected);
}

TEST(KVCacheMpiTest, SeveralGroupsShareTheAgreedNumBlocks) {
  const int rank = WorldRank();
  const int world = WorldSize();
  std::unique_ptr<MpiCommunicator> comm = World();
  ASSERT_NE(comm, nullptr);
  std::vector<KVCacheConfig> configs = SmallConfigs();
  configs.push_back(KVCacheConfig{.block_size = 16, .cache_shape = {1, 4, 16}});
  std::shared_ptr<Device> device = CpuDevice(BudgetOf(rank, world, configs));

  auto cache = BlockedKVCache::Create(configs, kReserve, device, comm.get());
  ASSERT_TRUE(cache.ok()) << cache.status();
  const int32_t expected = ExpectedNumBlocks(world, configs);
  EXPECT_EQ((*cache)->num_blocks(), expected);
  EXPECT_EQ((*cache)->free_blocks(), (std::vector<int32_t>{expected, expected}));
  EXPECT_TRUE((*cache)->CheckInvariants().ok());
}

// Each rank in turn is the one that cannot fit a single block; every rank must fail, and none
// may hang (the ctest TIMEOUT turns a hang into a failure).
TEST(KVCacheMpiTest, OneRankTooSmallFailsEveryRankWithResourceExhausted) {
  const int rank = WorldRank();
  const int world = WorldSize();
  std::unique_ptr<MpiCommunicator> comm = World();
  ASSERT_NE(comm, nullptr);
  const std::vector<KVCacheConfig> configs = SmallConfigs();
  for (int small = 0; small < world; ++small) {
    SCOPED_TRACE("rank " + std::to_string(small) + " is too small");
    const int64_t budget =
        rank == small ? kReserve.size + BytesPerBlock(configs) - 1 : BudgetOf(rank, world, configs);
    auto cache = BlockedKVCache::Create(configs, kReserve, CpuDevice(budget), comm.get());
    ASSERT_FALSE(cache.ok());
    EXPECT_EQ(cache.status().code(), StatusCode::kResourceExhausted) << cache.status();
    if (rank == small) {
      EXPECT_NE(cache.status().message().find("insufficient memory"), std::string::npos)
          << cache.status();
    } else {
      EXPECT_NE(cache.status().message().find("another rank"), std::string::npos) << cache.status();
    }
  }
  // The group is still in step: a collective after the failures completes.
  EXPECT_TRUE(comm->Barrier().ok());
}

// A rank whose own arguments are wrong reports its own error; the others still fail together.
TEST(KVCacheMpiTest, OneRankWithABadConfigFailsEveryRank) {
  const int rank = WorldRank();
  const int world = WorldSize();
  std::unique_ptr<MpiCommunicator> comm = World();
  ASSERT_NE(comm, nullptr);
  std::vector<KVCacheConfig> configs = SmallConfigs();
  const int64_t budget = BudgetOf(rank, world, configs);
  const int bad = world - 1;
  if (rank == bad) configs[0].block_size = 0;
  auto cache = BlockedKVCache::Create(configs, kReserve, CpuDevice(budget), comm.get());
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(),
            rank == bad ? StatusCode::kInvalidArgument : StatusCode::kResourceExhausted)
      << cache.status();
  EXPECT_TRUE(comm->Barrier().ok());
}

TEST(KVCacheMpiTest, OneRankWithoutADeviceFailsEveryRank) {
  const int rank = WorldRank();
  const int world = WorldSize();
  std::unique_ptr<MpiCommunicator> comm = World();
  ASSERT_NE(comm, nullptr);
  const std::vector<KVCacheConfig> configs = SmallConfigs();
  std::shared_ptr<Device> device = rank == 0 ? nullptr : CpuDevice(BudgetOf(rank, world, configs));
  auto cache = BlockedKVCache::Create(configs, kReserve, device, comm.get());
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(),
            rank == 0 ? StatusCode::kInvalidArgument : StatusCode::kResourceExhausted)
      << cache.status();
  EXPECT_TRUE(comm->Barrier().ok());
}

// Reports plenty of memory but cannot allocate any: a rank whose allocation fails after the
// ranks agreed on num_blocks.
class DeviceThatCannotAllocate final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int ordinal() const override { return 0; }
  std::string name() const override { return "cpu (cannot allocate)"; }
  int64_t total_memory() const override { return int64_t{1} << 30; }
  int64_t available_memory() const override { return int64_t{1} << 30; }
  Result<DeviceBuffer> Allocate(int64_t bytes) override {
    return ResourceExhaustedError("cannot allocate " + std::to_string(bytes) + " bytes");
  }
  void EmptyCache() override {}

 protected:
  void Deallocate(void* /*data*/, int64_t /*bytes*/) override {}
};

TEST(KVCacheMpiTest, OneRankWhoseAllocationFailsFailsEveryRank) {
  const int rank = WorldRank();
  const int world = WorldSize();
  std::unique_ptr<MpiCommunicator> comm = World();
  ASSERT_NE(comm, nullptr);
  const std::vector<KVCacheConfig> configs = SmallConfigs();
  const int64_t budget = BudgetOf(rank, world, configs);
  std::shared_ptr<Device> device =
      rank == world - 1 ? std::make_shared<DeviceThatCannotAllocate>() : CpuDevice(budget);
  auto cache = BlockedKVCache::Create(configs, kReserve, device, comm.get());
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), StatusCode::kResourceExhausted) << cache.status();
  if (rank != world - 1) {
    EXPECT_EQ(device->available_memory(), budget);  // its buffers were released
  }
  EXPECT_TRUE(comm->Barrier().ok());
}

// ALLOCATE mode asks for an exact number of blocks: there is nothing to agree on, no collective
// is entered, and each rank gets what it asked for (DeepSpeed's behaviour).
TEST(KVCacheMpiTest, AllocateModeIsPerRank) {
  const int rank = WorldRank();
  std::unique_ptr<MpiCommunicator> comm = World();
  ASSERT_NE(comm, nullptr);
  const MemoryConfig memory{.mode = AllocationMode::kAllocate, .size = 10 + rank};
  auto cache = BlockedKVCache::Create(SmallConfigs(), memory, CpuDevice(1 << 20), comm.get());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ((*cache)->num_blocks(), 10 + rank);
  EXPECT_TRUE(comm->Barrier().ok());
}

// Agreement within a tensor-parallel group that is a sub-communicator (even / odd world ranks).
TEST(KVCacheMpiTest, AgreesWithinASplitCommunicatorOnly) {
  const int rank = WorldRank();
  const int world = WorldSize();
  MPI_Comm group = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &group), MPI_SUCCESS);
  const std::vector<KVCacheConfig> configs = SmallConfigs();
  {
    auto comm = MpiCommunicator::Create(group);
    ASSERT_TRUE(comm.ok()) << comm.status();
    auto cache = BlockedKVCache::Create(configs, kReserve,
                                        CpuDevice(BudgetOf(rank, world, configs)), comm->get());
    ASSERT_TRUE(cache.ok()) << cache.status();
    int32_t expected = INT32_MAX;
    for (int r = rank % 2; r < world; r += 2) {
      expected = std::min(expected,
                          PlanKVCache(configs, kReserve, BudgetOf(r, world, configs))->num_blocks);
    }
    EXPECT_EQ((*cache)->num_blocks(), expected);
  }
  MPI_Comm_free(&group);
}

}  // namespace
}  // namespace blockkv
