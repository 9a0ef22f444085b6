// SPDX-License-Identifier: Apache-2.0
// StateManager::Create across the ranks of an mpirun: a rank whose own manager config is invalid
// fails before it reaches the cache, yet must still enter the cache's collectives so that the
// other ranks fail too instead of waiting forever (the ctest TIMEOUT turns a hang into a failure).
#include <mpi.h>

#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "mpi_test_util.h"

#include "blockkv/mpi_communicator.h"
#include "blockkv/state_manager.h"

namespace blockkv {
namespace {

using ::blockkv::testing::WorldRank;

StateManagerConfig ReserveConfig() {
  StateManagerConfig config;
  config.max_tracked_sequences = 16;
  config.max_ragged_sequence_count = 16;
  config.memory_config = MemoryConfig{.mode = AllocationMode::kReserve, .size = 64 * 1024};
  return config;
}

TEST(StateManagerMpiTest, EveryRankAgreesOnTheCache) {
  auto comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const std::vector<KVCacheConfig> kv = {
      KVCacheConfig{.block_size = 16, .cache_shape = {2, 2, 32}}};
  // Rank r can hold 20 + 5r blocks of 8 KiB: everyone ends with rank 0's 20.
  const int64_t budget = 64 * 1024 + (20 + 5 * WorldRank()) * int64_t{8192};
  auto manager = StateManager::Create(ReserveConfig(), kv, CpuDevice(budget), comm->get());
  ASSERT_TRUE(manager.ok()) << manager.status();
  EXPECT_EQ((*manager)->kv_cache().num_blocks(), 20);
  EXPECT_TRUE((*comm)->Barrier().ok());
}

TEST(StateManagerMpiTest, OneRankWithAnInvalidManagerConfigFailsEveryRank) {
  auto comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  StateManagerConfig config = ReserveConfig();
  if (WorldRank() == 0) config.offload = true;  // no host tier size: rejected before the cache
  const std::vector<KVCacheConfig> kv = {
      KVCacheConfig{.block_size = 16, .cache_shape = {2, 2, 32}}};
  auto manager = StateManager::Create(config, kv, CpuDevice(8 << 20), comm->get());
  ASSERT_FALSE(manager.ok());
  EXPECT_EQ(manager.status().code(),
            WorldRank() == 0 ? StatusCode::kInvalidArgument : StatusCode::kResourceExhausted)
      << manager.status();
  EXPECT_TRUE((*comm)->Barrier().ok());
}

}  // namespace
}  // namespace blockkv
