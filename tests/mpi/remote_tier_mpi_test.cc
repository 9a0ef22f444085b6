// SPDX-License-Identifier: Apache-2.0
// Tensor-parallel ranks agree on their remote tier hits over MPI (StateManager::AgreeRemotePrefix,
// docs/remote_tier.md "Tensor parallelism"): rank r's tier holds fewer blocks of the prompt the
// higher r is, and every rank's first Schedule takes the blocks the last rank holds.
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "mpi_test_util.h"
#include "unit/redis_server.h"

#include "blockkv/mpi_communicator.h"
#include "blockkv/state_manager.h"

namespace blockkv {
namespace {

using ::blockkv::testing::RedisServer;
using ::blockkv::testing::WorldRank;
using ::blockkv::testing::WorldSize;

constexpr int32_t kBlockSize = 4;

std::unique_ptr<StateManager> Engine(const RedisServer& server) {
  StateManagerConfig config;
  config.max_tracked_sequences = 8;
  config.max_ragged_sequence_count = 8;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = 32};
  config.prefix_cache.enabled = true;
  config.remote_tier = RemoteTierConfig{
      .url = server.url(), .model_id = "m", .tp_rank = WorldRank(), .tp_size = WorldSize()};
  auto mgr = StateManager::Create(
      config,
      {KVCacheConfig{
          .block_size = kBlockSize, .cache_shape = {2, 2, 8}, .cache_dtype = DType::kFloat32}},
      CpuDevice(16 << 20));
  EXPECT_TRUE(mgr.ok()) << mgr.status();
  return mgr.ok() ? std::move(*mgr) : nullptr;
}

// This rank's shard of the block holding `tokens` (what its kernel would write).
float Value(std::span<const TokenId> tokens, int layer) {
  auto v = static_cast<float>(WorldRank() * 1000 + layer);
  for (const TokenId t : tokens) v += static_cast<float>(t);
  return v;
}

// Schedules `prompt` as uid on `mgr`, writes every block it computes, and returns the tokens the
// cache gave.
int64_t Prefill(StateManager& mgr, SeqId uid, std::span<const TokenId> prompt) {
  const SeqId uids[] = {uid};
  const int64_t lengths[] = {static_cast<int64_t>(prompt.size())};
  EXPECT_TRUE(mgr.Schedule({.uids = uids, .lengths = lengths}).ok());
  const Sequence* seq = mgr.GetSequence(uid);
  const int64_t cached = seq->seen_tokens();
  const std::span<const BlockId> table = seq->block_table(0);
  for (auto b = static_cast<size_t>(cached / kBlockSize); b < table.size(); ++b) {
    if (prompt.size() < (b + 1) * kBlockSize) continue;
    for (int layer = 0; layer < 2; ++layer) {
      const TensorView view = *mgr.GetCache(layer, 0);
      const auto per_block = static_cast<size_t>(view.stride(0));
      auto* block = static_cast<float*>(view.data) + static_cast<size_t>(table[b]) * per_block;
      const float v = Value(prompt.subspan(b * kBlockSize, kBlockSize), layer);
      std::fill_n(block, per_block, v);
    }
  }
  EXPECT_TRUE(mgr.PostForward(uids).ok());
  return cached;
}

TEST(RemoteTierMpiTest, EveryRankTakesTheBlocksTheLastRankHolds) {
  auto comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  RedisServer server;  // each rank's own: its shard's keys
  std::vector<TokenId> prompt(33);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(50 + i);
  const int32_t held = 8 - 2 * WorldRank();  // blocks this rank's tier holds
  {
    std::unique_ptr<StateManager> writer = Engine(server);
    ASSERT_NE(writer, nullptr);
    const std::span<const TokenId> stored(prompt.data(), static_cast<size_t>(held * 4 + 1));
    ASSERT_TRUE(writer->AddSequence(1, stored).ok());
    EXPECT_EQ(Prefill(*writer, 1, stored), 0);
    writer->FlushRemoteTier();
  }
  std::unique_ptr<StateManager> reader = Engine(server);
  ASSERT_NE(reader, nullptr);
  ASSERT_TRUE(reader->AddSequence(7, prompt).ok());
  ASSERT_TRUE(reader->FetchRemotePrefix(7).ok());
  const SeqId uids[] = {7};
  const Result<std::vector<int32_t>> agreed = reader->AgreeRemotePrefix(uids, **comm);
  ASSERT_TRUE(agreed.ok()) << agreed.status();
  const int32_t last = 8 - 2 * (WorldSize() - 1);
  EXPECT_EQ(*agreed, std::vector<int32_t>{last});
  EXPECT_EQ(Prefill(*reader, 7, prompt), int64_t{last} * kBlockSize);
  const std::span<const BlockId> table = reader->GetSequence(7)->block_table(0);
  for (int32_t b = 0; b < last; ++b) {
    const TensorView view = *reader->GetCache(1, 0);
    const auto per_block = static_cast<size_t>(view.stride(0));
    const float got =
        static_cast<const float*>(view.data)[(static_cast<size_t>(table[b]) + 1) * per_block - 1];
    EXPECT_EQ(got, Value(std::span(prompt).subspan(static_cast<size_t>(b) * 4, 4), 1));
  }
  EXPECT_EQ(reader->remote_tier_stats().misses_other_rank, WorldRank() == WorldSize() - 1 ? 0 : 1);
  EXPECT_TRUE((*comm)->Barrier().ok());
}

TEST(RemoteTierMpiTest, OneRanksRefusalFailsEveryRankInsteadOfHangingThem) {
  auto comm = MpiCommunicator::Create(MPI_COMM_WORLD);
  ASSERT_TRUE(comm.ok()) << comm.status();
  RedisServer server;
  std::unique_ptr<StateManager> reader = Engine(server);
  ASSERT_NE(reader, nullptr);
  const std::vector<TokenId> prompt(17, 3);
  ASSERT_TRUE(reader->AddSequence(7, prompt).ok());
  const SeqId uids[] = {WorldRank() == 1 ? SeqId{8} : SeqId{7}};  // rank 1 names an unknown one
  const Result<std::vector<int32_t>> agreed = reader->AgreeRemotePrefix(uids, **comm);
  EXPECT_EQ(agreed.status().code(),
            WorldRank() == 1 ? StatusCode::kNotFound : StatusCode::kFailedPrecondition)
      << agreed.status();
  EXPECT_TRUE((*comm)->Barrier().ok());
}

}  // namespace
}  // namespace blockkv
