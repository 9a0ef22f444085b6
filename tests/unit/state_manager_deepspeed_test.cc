// SPDX-License-Identifier: Apache-2.0
// StateManager's DeepSpeed-shaped step: AllocateBlocks, ExtendSequence, FreeBlocks, PreForward
// (what blockkv.deepspeed's allocate_blocks / extend_kv_cache / pre_forward call), and the holes
// DeepSpeed leaves there: a table overflow, ids that were never allocated, too few blocks for
// the tokens in flight.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"

namespace blockkv {
namespace {

std::unique_ptr<StateManager> Make(int32_t num_blocks, int32_t block_size = 4,
                                   int32_t max_blocks = 4, int64_t max_context = 8192) {
  KVCacheConfig kv;
  kv.block_size = block_size;
  kv.cache_shape = {1, 1, 8};
  kv.max_blocks_per_allocation_group = max_blocks;
  StateManagerConfig config;
  config.max_tracked_sequences = 4;
  config.max_ragged_batch_size = 64;
  config.max_ragged_sequence_count = 4;
  config.max_context = max_context;
  config.memory_config.mode = AllocationMode::kAllocate;
  config.memory_config.size = num_blocks;
  auto m = StateManager::Create(config, {kv}, CpuDevice(16 << 20));
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(m).value();
}

std::vector<BlockId> Allocate(StateManager& m, int32_t n) {
  std::vector<BlockId> out(static_cast<size_t>(n));
  EXPECT_TRUE(m.AllocateBlocks(out).ok());
  return out;
}

TEST(StateManagerDeepSpeed, EngineV2StepRunsThroughTheBatch) {
  auto m = Make(8);
  ASSERT_TRUE(m->GetOrCreateSequence(5).ok());
  const std::vector<BlockId> blocks = Allocate(*m, 2);
  EXPECT_EQ(blocks, (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(m->free_blocks()[0], 6);
  EXPECT_EQ(m->engine_held_blocks(), 2);
  ASSERT_TRUE(m->CheckInvariants().ok()) << m->CheckInvariants();
  ASSERT_TRUE(m->ExtendSequence(5, blocks).ok());
  EXPECT_EQ(m->engine_held_blocks(), 0);
  ASSERT_TRUE(m->PreForward(5, 7).ok());
  const Sequence* seq = m->GetSequence(5);
  EXPECT_EQ(seq->in_flight_tokens(), 7);
  EXPECT_EQ(seq->cur_allocated_blocks(), 2);
  ASSERT_TRUE(m->CheckInvariants().ok()) << m->CheckInvariants();

  auto batch = RaggedBatch::Create(*m);
  ASSERT_TRUE(batch.ok());
  const std::vector<TokenId> tokens = {1, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE((*batch)->InsertSequence(*seq, tokens).ok());
  ASSERT_TRUE((*batch)->Finalize().ok());
  ASSERT_TRUE(m->PostForward(**batch).ok());
  EXPECT_EQ(seq->seen_tokens(), 7);
  ASSERT_TRUE(m->FlushSequence(5).ok());
  EXPECT_EQ(m->free_blocks()[0], 8);
  EXPECT_TRUE(m->CheckInvariants().ok()) << m->CheckInvariants();
}

TEST(StateManagerDeepSpeed, AllocateMoreThanFreeTakesNothing) {
  auto m = Make(4);
  std::vector<BlockId> out(5);
  EXPECT_EQ(m->AllocateBlocks(out).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(m->free_blocks()[0], 4);
  EXPECT_EQ(m->engine_held_blocks(), 0);
  EXPECT_EQ(m->AllocateBlocks(out, 1).code(), StatusCode::kOutOfRange);
}

TEST(StateManagerDeepSpeed, ExtendPastTheTableChangesNothing) {
  // DeepSpeed's extend_kv_cache overflows its table row (a torch shape error) and leaks the
  // blocks it was given.
  auto m = Make(8, /*block_size=*/4, /*max_blocks=*/2);
  ASSERT_TRUE(m->GetOrCreateSequence(1).ok());
  const std::vector<BlockId> blocks = Allocate(*m, 3);
  const Status s = m->ExtendSequence(1, blocks);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 0);
  EXPECT_EQ(m->engine_held_blocks(), 3);
  ASSERT_TRUE(m->FreeBlocks(blocks).ok());
  EXPECT_EQ(m->free_blocks()[0], 8);
  EXPECT_TRUE(m->CheckInvariants().ok()) << m->CheckInvariants();
}

TEST(StateManagerDeepSpeed, ExtendRefusesBlocksTheEngineDoesNotHold) {
  auto m = Make(8);
  ASSERT_TRUE(m->GetOrCreateSequence(1).ok());
  ASSERT_TRUE(m->GetOrCreateSequence(2).ok());
  const std::vector<BlockId> blocks = Allocate(*m, 2);
  ASSERT_TRUE(m->ExtendSequence(1, blocks).ok());
  // Given to sequence 1 already, never allocated, repeated, out of range: refused, unchanged.
  const std::vector<BlockId> held = Allocate(*m, 1);
  for (const std::vector<BlockId>& bad :
       {std::vector<BlockId>{held[0], blocks[0]}, std::vector<BlockId>{held[0], 7},
        std::vector<BlockId>{held[0], held[0]}, std::vector<BlockId>{held[0], 8}}) {
    const Status s = m->ExtendSequence(2, bad);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(m->GetSequence(2)->cur_allocated_blocks(), 0);
    EXPECT_EQ(m->engine_held_blocks(), 1);
    EXPECT_TRUE(m->CheckInvariants().ok()) << m->CheckInvariants();
  }
  EXPECT_EQ(m->ExtendSequence(2, std::vector<BlockId>{held[0], held[0]}).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->ExtendSequence(2, std::vector<BlockId>{8}).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(m->ExtendSequence(9, held).code(), StatusCode::kNotFound);
  EXPECT_EQ(m->FreeBlocks(blocks).code(), StatusCode::kFailedPrecondition);  // sequence 1's
  ASSERT_TRUE(m->ExtendSequence(2, held).ok());
  EXPECT_TRUE(m->CheckInvariants().ok()) << m->CheckInvariants();
}

TEST(StateManagerDeepSpeed, PreForwardNeedsTheBlocksAndMaxContext) {
  auto m = Make(8, /*block_size=*/4, /*max_blocks=*/4, /*max_context=*/10);
  ASSERT_TRUE(m->GetOrCreateSequence(1).ok());
  // DeepSpeed's pre_forward accepts tokens its blocks cannot hold: their writes go through stale
  // table entries.
  EXPECT_EQ(m->PreForward(1, 1).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(m->ExtendSequence(1, Allocate(*m, 3)).ok());
  EXPECT_EQ(m->PreForward(1, 11).code(), StatusCode::kOutOfRange);  // max_context 10
  EXPECT_EQ(m->PreForward(1, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 0);
  ASSERT_TRUE(m->PreForward(1, 10).ok());
  ASSERT_TRUE(m->PreForward(1, 3).ok());  // replaces, as DeepSpeed's
  EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 3);
  EXPECT_TRUE(m->CheckInvariants().ok()) << m->CheckInvariants();
}

TEST(StateManagerDeepSpeed, SnapshotWaitsForEngineHeldBlocks) {
  auto m = Make(8);
  const std::vector<BlockId> blocks = Allocate(*m, 1);
  EXPECT_EQ(m->SaveSnapshot().status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(m->FreeBlocks(blocks).ok());
  EXPECT_TRUE(m->SaveSnapshot().ok());
}

}  // namespace
}  // namespace blockkv
