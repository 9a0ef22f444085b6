// SPDX-License-Identifier: Apache-2.0
// StateManager scenarios: DeepSpeed's config cases and scheduling arithmetic, and the holes
// blockkv closes (working CanSchedule, duplicate uids, max_context, table capacity,
// all-or-nothing scheduling, partial freeing, fork).
#include "blockkv/state_manager.h"

#include "blockkv/ragged_batch.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace blockkv {
namespace {

KVCacheConfig SmallModel(int32_t block_size = 64, int32_t max_blocks = 64) {
  KVCacheConfig c;
  c.block_size = block_size;
  c.cache_shape = {2, 2, 8};
  c.cache_dtype = DType::kFloat16;
  c.max_blocks_per_allocation_group = max_blocks;
  return c;
}

StateManagerConfig Config(int32_t num_blocks, int32_t tracked = 16, int32_t batch = 768,
                          int32_t seq_count = 16) {
  StateManagerConfig c;
  c.max_tracked_sequences = tracked;
  c.max_ragged_batch_size = batch;
  c.max_ragged_sequence_count = seq_count;
  c.memory_config.mode = AllocationMode::kAllocate;
  c.memory_config.size = num_blocks;
  return c;
}

std::unique_ptr<StateManager> Make(StateManagerConfig config,
                                   std::vector<KVCacheConfig> kv = {SmallModel()}) {
  auto m = StateManager::Create(std::move(config), std::move(kv), CpuDevice(64 << 20));
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(m).value();
}

// Schedules `n` tokens of `uid` and completes the forward.
void RunStep(StateManager& m, SeqId uid, int64_t n) {
  const SeqId uids[] = {uid};
  const int64_t lengths[] = {n};
  ASSERT_TRUE(m.Schedule({.uids = uids, .lengths = lengths}).ok());
  ASSERT_TRUE(m.PostForward(uids).ok());
  ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

// ---- config -----------------------------------------------------------------------------------

TEST(StateManagerConfig, DefaultsAreDeepSpeeds) {
  StateManagerConfig c;
  EXPECT_EQ(c.max_tracked_sequences, 2048);
  EXPECT_EQ(c.max_ragged_batch_size, 768);
  EXPECT_EQ(c.max_ragged_sequence_count, 512);
  EXPECT_EQ(c.max_context, 8192);
  EXPECT_FALSE(c.offload);
  EXPECT_TRUE(c.Validate().ok());
}

TEST(StateManagerConfig, RejectsNonPositiveCounts) {
  for (int32_t bad : {-1, 0}) {
    StateManagerConfig a;
    a.max_tracked_sequences = bad;
    StateManagerConfig b;
    b.max_ragged_batch_size = bad;
    StateManagerConfig c;
    c.max_ragged_sequence_count = bad;
    StateManagerConfig d;
    d.max_context = bad;
    for (const StateManagerConfig& config : {a, b, c, d}) {
      const Status s = config.Validate();
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find(std::to_string(bad)), std::string::npos) << s;
    }
  }
}

TEST(StateManagerConfig, RejectsSequenceCountAboveBatchOrTracked) {
  StateManagerConfig over_batch;
  over_batch.max_ragged_batch_size = 512;
  over_batch.max_ragged_sequence_count = 1024;
  EXPECT_EQ(over_batch.Validate().code(), StatusCode::kInvalidArgument);
  StateManagerConfig over_tracked;
  over_tracked.max_tracked_sequences = 512;
  over_tracked.max_ragged_sequence_count = 1024;
  over_tracked.max_ragged_batch_size = 2048;
  const Status s = over_tracked.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("max_tracked_sequences (512)"), std::string::npos) << s;
}

// The batch pads its tokens; a capacity that pads past int32 is refused by the config, before
// Create sizes the block tables from the other fields (the tool's `--max-seqs 1048576
// --token-budget 2147483647` allocated 17 GB of tables before the batch refused it).
TEST(StateManagerConfig, RejectsABatchSizeThatPadsPastInt32) {
  StateManagerConfig c;
  c.max_ragged_batch_size = std::numeric_limits<int32_t>::max();
  const Status s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("max_ragged_batch_size 2147483647 pads to"), std::string::npos) << s;
  c.max_ragged_batch_size = std::numeric_limits<int32_t>::max() - 127;  // 128 · k: not padded
  EXPECT_EQ(PaddedTokenCount(c.max_ragged_batch_size), c.max_ragged_batch_size);
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
}

TEST(StateManagerCreate, RejectsOffloadWithoutATierAndSeveralAllocationGroups) {
  StateManagerConfig offload = Config(8);
  offload.offload = true;  // and no host tier size in offload_config
  EXPECT_EQ(StateManager::Create(offload, {SmallModel()}, CpuDevice(1 << 20)).status().code(),
            StatusCode::kInvalidArgument);
  KVCacheConfig two = SmallModel();
  two.num_allocation_groups = 2;
  EXPECT_EQ(StateManager::Create(Config(8), {two}, CpuDevice(1 << 20)).status().code(),
            StatusCode::kUnimplemented);
}

// ---- sequences --------------------------------------------------------------------------------

TEST(StateManager, CreatesLooksUpAndFlushesSequences) {
  auto m = Make(Config(16, /*tracked=*/2, 768, 2));
  EXPECT_EQ(m->kv_block_size(), 64);
  EXPECT_EQ(m->GetSequence(7), nullptr);
  auto a = m->GetOrCreateSequence(7);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->uid(), 7);
  EXPECT_EQ((*a)->seen_tokens(), 0);
  EXPECT_EQ(*m->GetOrCreateSequence(7), *a);  // same descriptor
  ASSERT_TRUE(m->GetOrCreateSequence(8).ok());
  EXPECT_EQ(m->n_tracked_sequences(), 2);
  const auto full = m->GetOrCreateSequence(9);
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(m->FlushSequence(123).code(), StatusCode::kNotFound);
  EXPECT_TRUE(m->FlushSequence(7).ok());
  EXPECT_EQ(m->GetSequence(7), nullptr);
  EXPECT_TRUE(m->GetOrCreateSequence(9).ok());
  EXPECT_TRUE(m->CheckInvariants().ok());
}

TEST(StateManager, FlushReturnsEveryBlock) {
  auto m = Make(Config(16));
  RunStep(*m, 1, 300);  // 5 blocks of 64
  EXPECT_EQ(m->free_blocks()[0], 11);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 5);
  ASSERT_TRUE(m->FlushSequence(1).ok());
  EXPECT_EQ(m->free_blocks()[0], 16);
  EXPECT_TRUE(m->CheckInvariants().ok());
}

// ---- scheduling arithmetic --------------------------------------------------------------------

TEST(KVRequirement, MatchesDeepSpeedGoldenValues) {
  auto r = ComputeKVRequirement(0, 0, {.max_new_tokens = 100, .max_new_blocks = 10}, 64);
  EXPECT_EQ(r.tokens, 100);
  EXPECT_EQ(r.blocks, 2);
  r = ComputeKVRequirement(0, 0, {.max_new_tokens = 100, .max_new_blocks = 1}, 64);
  EXPECT_EQ(r.tokens, 64);
  EXPECT_EQ(r.blocks, 1);
  r = ComputeKVRequirement(60, 1, {.max_new_tokens = 10, .max_new_blocks = 0}, 64);
  EXPECT_EQ(r.tokens, 4);
  EXPECT_EQ(r.blocks, 0);
  r = ComputeKVRequirement(10, 1, {.max_new_tokens = 5, .max_new_blocks = 0}, 64);
  EXPECT_EQ(r.tokens, 5);
  EXPECT_EQ(r.blocks, 0);
}

TEST(StateManagerQuery, AnswersWithDeepSpeedArithmetic) {
  auto m = Make(Config(16));
  auto q = m->Query(1, {.max_new_tokens = 100, .max_new_blocks = 10});
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->tokens, 100);
  EXPECT_EQ(q->blocks, 2);
  q = m->Query(1, {.max_new_tokens = 100, .max_new_blocks = 1});
  EXPECT_EQ(q->tokens, 64);
  EXPECT_EQ(q->blocks, 1);
  RunStep(*m, 1, 60);
  q = m->Query(1, {.max_new_tokens = 10, .max_new_blocks = 0});
  EXPECT_EQ(q->tokens, 4);
  EXPECT_EQ(q->blocks, 0);
  RunStep(*m, 2, 10);
  q = m->Query(2, {.max_new_tokens = 5, .max_new_blocks = 0});
  EXPECT_EQ(q->tokens, 5);
  EXPECT_EQ(q->blocks, 0);
  EXPECT_EQ(m->Query(1, {.max_new_tokens = -1, .max_new_blocks = 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Query(1, {.max_new_tokens = 1, .max_new_blocks = 1}, /*group=*/3).status().code(),
            StatusCode::kOutOfRange);
}

TEST(StateManagerQuery, UnknownUidWithEveryslotTakenGetsNothing) {
  auto m = Make(Config(16, /*tracked=*/1, 768, 1));
  ASSERT_TRUE(m->GetOrCreateSequence(1).ok());
  auto q = m->Query(2, {.max_new_tokens = 100, .max_new_blocks = 10});
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->tokens, 0);
  EXPECT_EQ(q->blocks, 0);
}

TEST(StateManagerQuery, IsCappedByMaxContext) {
  StateManagerConfig c = Config(64);
  c.max_context = 100;
  auto m = Make(c);
  auto q = m->Query(1, {.max_new_tokens = 1000, .max_new_blocks = 64});
  EXPECT_EQ(q->tokens, 100);
  EXPECT_EQ(q->blocks, 2);
}

TEST(StateManagerRemainingCapacity, IsSeenModuloBlockSize) {
  auto m = Make(Config(16));
  EXPECT_EQ(m->RemainingBlockCapacity(1), 0);
  RunStep(*m, 1, 70);
  EXPECT_EQ(m->RemainingBlockCapacity(1), 6);
  RunStep(*m, 1, 58);
  EXPECT_EQ(m->RemainingBlockCapacity(1), 0);
}

// ---- CanSchedule ------------------------------------------------------------------------------

TEST(StateManagerCanSchedule, ReportsEachLimit) {
  auto m = Make(Config(/*blocks=*/4, /*tracked=*/3, /*batch=*/200, /*seq_count=*/2));
  const SeqId two[] = {1, 2};
  const SeqId three[] = {1, 2, 3};
  const int64_t small2[] = {10, 10};
  const int64_t small3[] = {10, 10, 10};
  EXPECT_EQ(*m->CanSchedule({.uids = two, .lengths = small2}), SchedulingResult::kSuccess);
  EXPECT_EQ(*m->CanSchedule({.uids = three, .lengths = small3}),
            SchedulingResult::kBatchSequenceLimitExceeded);
  const int64_t many_tokens[] = {100, 101};  // 4 blocks fit, 201 tokens do not
  EXPECT_EQ(*m->CanSchedule({.uids = two, .lengths = many_tokens}),
            SchedulingResult::kBatchTokenLimitExceeded);
  const int64_t too_much_kv[] = {190, 90};  // 3 + 2 blocks of 4
  EXPECT_EQ(*m->CanSchedule({.uids = two, .lengths = too_much_kv}),
            SchedulingResult::kKVCacheLimitExceeded);
  RunStep(*m, 1, 1);
  RunStep(*m, 2, 1);
  const Status s = m->GetOrCreateSequence(3).status();
  ASSERT_TRUE(s.ok());
  const SeqId new_pair[] = {3, 4};
  EXPECT_EQ(*m->CanSchedule({.uids = new_pair, .lengths = small2}),
            SchedulingResult::kEngineSequenceLimitExceeded);
}

TEST(StateManagerCanSchedule, EnforcesMaxContextAndTableCapacity) {
  StateManagerConfig c = Config(64);
  c.max_context = 100;
  auto m = Make(c, {SmallModel(64, /*max_blocks=*/64)});
  const SeqId uid[] = {1};
  const int64_t over_context[] = {101};
  EXPECT_EQ(*m->CanSchedule({.uids = uid, .lengths = over_context}),
            SchedulingResult::kSequenceTokenLimitExceeded);
  auto table = Make(Config(64), {SmallModel(64, /*max_blocks=*/2)});
  const int64_t over_table[] = {129};
  const int64_t at_table[] = {128};
  EXPECT_EQ(*table->CanSchedule({.uids = uid, .lengths = over_table}),
            SchedulingResult::kSequenceTokenLimitExceeded);
  EXPECT_EQ(*table->CanSchedule({.uids = uid, .lengths = at_table}), SchedulingResult::kSuccess);
}

TEST(StateManagerCanSchedule, RejectsDuplicatesAndBadArguments) {
  auto m = Make(Config(16));
  RunStep(*m, 1, 5);
  const SeqId dup_known[] = {1, 1};
  const SeqId dup_new[] = {2, 3, 2};
  const int64_t two[] = {1, 1};
  const int64_t three[] = {1, 1, 1};
  EXPECT_EQ(m->CanSchedule({.uids = dup_known, .lengths = two}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(m->CanSchedule({.uids = dup_new, .lengths = three}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(m->CanSchedule({.uids = dup_new, .lengths = two}).status().code(),
            StatusCode::kInvalidArgument);
  const SeqId one[] = {1};
  const int64_t negative[] = {-1};
  EXPECT_EQ(m->CanSchedule({.uids = one, .lengths = negative}).status().code(),
            StatusCode::kInvalidArgument);
  // The duplicate check does not remember earlier calls.
  const SeqId pair[] = {1, 2};
  EXPECT_EQ(*m->CanSchedule({.uids = pair, .lengths = two}), SchedulingResult::kSuccess);
  EXPECT_EQ(*m->CanSchedule({.uids = pair, .lengths = two}), SchedulingResult::kSuccess);
}

// ---- Schedule ---------------------------------------------------------------------------------

TEST(StateManagerSchedule, FailsAndChangesNothingWhenOneSequenceDoesNotFit) {
  auto m = Make(Config(4));
  RunStep(*m, 1, 70);  // 2 blocks
  const SeqId uids[] = {1, 2, 3};
  const int64_t lengths[] = {60, 10, 64};  // 1 + 1 + 1 = 3 blocks, 2 free
  SchedulingResult result = SchedulingResult::kSuccess;
  const Status s = m->Schedule({.uids = uids, .lengths = lengths}, &result);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(result, SchedulingResult::kKVCacheLimitExceeded);
  EXPECT_NE(s.message().find("KVCacheLimitExceeded"), std::string::npos) << s;
  EXPECT_EQ(m->free_blocks()[0], 2);
  EXPECT_EQ(m->n_tracked_sequences(), 1);
  EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 0);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 2);
  EXPECT_TRUE(m->CheckInvariants().ok());
}

TEST(StateManagerSchedule, ReservesExactlyTheBlocksEachSequenceNeeds) {
  auto m = Make(Config(16));
  const SeqId uids[] = {1, 2};
  const int64_t prompts[] = {64, 65};
  SchedulingResult result = SchedulingResult::kKVCacheLimitExceeded;
  ASSERT_TRUE(m->Schedule({.uids = uids, .lengths = prompts}, &result).ok());
  EXPECT_EQ(result, SchedulingResult::kSuccess);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 1);
  EXPECT_EQ(m->GetSequence(2)->cur_allocated_blocks(), 2);
  EXPECT_EQ(m->GetSequence(2)->in_flight_tokens(), 65);
  ASSERT_TRUE(m->PostForward(uids).ok());
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 65);
  EXPECT_EQ(m->GetSequence(2)->in_flight_tokens(), 0);
  // Decode: sequence 1 crosses into a new block, sequence 2 does not.
  const int64_t one_each[] = {1, 1};
  ASSERT_TRUE(m->Schedule({.uids = uids, .lengths = one_each}).ok());
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 2);
  EXPECT_EQ(m->GetSequence(2)->cur_allocated_blocks(), 2);
  EXPECT_EQ(m->free_blocks()[0], 12);
  EXPECT_TRUE(m->CheckInvariants().ok());
}

TEST(StateManagerSchedule, AllocatesInEveryCacheGroup) {
  auto m = Make(Config(16), {SmallModel(64), SmallModel(16)});
  RunStep(*m, 1, 100);
  const Sequence* seq = m->GetSequence(1);
  EXPECT_EQ(seq->cur_allocated_blocks(0), 2);
  EXPECT_EQ(seq->cur_allocated_blocks(1), 7);
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{14, 9}));
  // Group 1 runs out first.
  const SeqId uid[] = {2};
  const int64_t len[] = {150};
  EXPECT_EQ(*m->CanSchedule({.uids = uid, .lengths = len}),
            SchedulingResult::kKVCacheLimitExceeded);
}

TEST(StateManagerPostForward, UnknownUidChangesNothing) {
  auto m = Make(Config(16));
  const SeqId uids[] = {1};
  const int64_t lengths[] = {10};
  ASSERT_TRUE(m->Schedule({.uids = uids, .lengths = lengths}).ok());
  const SeqId with_unknown[] = {1, 99};
  EXPECT_EQ(m->PostForward(with_unknown).code(), StatusCode::kNotFound);
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 0);
  EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 10);
}

// ---- partial freeing --------------------------------------------------------------------------

TEST(StateManagerFreeLeadingBlocks, ReleasesOldestBlocksKeepingPositions) {
  auto m = Make(Config(16));
  RunStep(*m, 1, 200);  // blocks for [0,64) [64,128) [128,192) [192,200)
  const std::vector<BlockId> before(m->GetSequence(1)->block_table().begin(),
                                    m->GetSequence(1)->block_table().end());
  ASSERT_TRUE(m->FreeLeadingBlocks(1, 2).ok());
  const Sequence* seq = m->GetSequence(1);
  EXPECT_EQ(seq->released_blocks(), 2);
  EXPECT_EQ(seq->cur_allocated_blocks(), 4);
  EXPECT_EQ(seq->block_table()[0], kNoBlock);
  EXPECT_EQ(seq->block_table()[1], kNoBlock);
  EXPECT_EQ(seq->block_table()[2], before[2]);
  EXPECT_EQ(seq->block_table()[3], before[3]);
  EXPECT_EQ(m->free_blocks()[0], 14);
  // Block 2 is full, block 3 holds unfinished tokens: only one more may go.
  const Status s = m->FreeLeadingBlocks(1, 2);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("at most 1"), std::string::npos) << s;
  EXPECT_TRUE(m->FreeLeadingBlocks(1, 1).ok());
  EXPECT_EQ(m->FreeLeadingBlocks(9, 1).code(), StatusCode::kNotFound);
  EXPECT_EQ(m->FreeLeadingBlocks(1, -1).code(), StatusCode::kInvalidArgument);
  RunStep(*m, 1, 100);  // appending still maps positions to the same table indices
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 5);
  ASSERT_TRUE(m->FlushSequence(1).ok());
  EXPECT_EQ(m->free_blocks()[0], 16);
  EXPECT_TRUE(m->CheckInvariants().ok());
}

// ---- fork -------------------------------------------------------------------------------------

TEST(StateManagerFork, SharesFullBlocksAndCopiesThePartialTail) {
  auto m = Make(Config(16));
  RunStep(*m, 1, 150);  // 2 full blocks + a tail of 22 tokens
  const Sequence* parent = m->GetSequence(1);
  const BlockId tail = parent->block_table()[2];
  // Mark the tail block's bytes in every layer.
  for (int64_t layer = 0; layer < 2; ++layer) {
    auto cache = m->GetCache(layer);
    ASSERT_TRUE(cache.ok());
    const int64_t block_bytes = cache->stride(0) * 2;
    std::memset(static_cast<char*>(cache->data) + tail * block_bytes,
                static_cast<int>(0x40 + layer), static_cast<size_t>(block_bytes));
  }
  ASSERT_TRUE(m->Fork(1, 2).ok());
  const Sequence* child = m->GetSequence(2);
  parent = m->GetSequence(1);
  EXPECT_EQ(child->seen_tokens(), 150);
  EXPECT_EQ(child->cur_allocated_blocks(), 3);
  EXPECT_EQ(child->block_table()[0], parent->block_table()[0]);
  EXPECT_EQ(child->block_table()[1], parent->block_table()[1]);
  const BlockId copy = child->block_table()[2];
  EXPECT_NE(copy, tail);
  EXPECT_EQ(m->pool().ref_count(parent->block_table()[0]), 2);
  EXPECT_EQ(m->pool().ref_count(tail), 1);
  EXPECT_EQ(m->pool().ref_count(copy), 1);
  for (int64_t layer = 0; layer < 2; ++layer) {
    auto cache = m->GetCache(layer);
    const int64_t block_bytes = cache->stride(0) * 2;
    const auto* bytes = static_cast<const unsigned char*>(cache->data) + copy * block_bytes;
    for (int64_t i = 0; i < block_bytes; ++i) ASSERT_EQ(bytes[i], 0x40 + layer);
  }
  EXPECT_EQ(m->free_blocks()[0], 12);
  // Both go on independently; the shared blocks outlive the parent.
  RunStep(*m, 2, 10);
  ASSERT_TRUE(m->FlushSequence(1).ok());
  EXPECT_EQ(m->pool().ref_count(child->block_table()[0]), 1);
  EXPECT_EQ(m->free_blocks()[0], 13);
  ASSERT_TRUE(m->FlushSequence(2).ok());
  EXPECT_EQ(m->free_blocks()[0], 16);
  EXPECT_TRUE(m->CheckInvariants().ok());
}

TEST(StateManagerFork, OfFullBlocksNeedsNoCopy) {
  auto m = Make(Config(4));
  RunStep(*m, 1, 128);
  ASSERT_TRUE(m->Fork(1, 2).ok());
  EXPECT_EQ(m->free_blocks()[0], 2);
  EXPECT_EQ(m->GetSequence(2)->block_table()[1], m->GetSequence(1)->block_table()[1]);
  EXPECT_TRUE(m->CheckInvariants().ok());
}

TEST(StateManagerFork, FailsAndChangesNothing) {
  auto m = Make(Config(3, /*tracked=*/3, 768, 3));
  RunStep(*m, 1, 150);  // all 3 blocks
  EXPECT_EQ(m->Fork(9, 2).code(), StatusCode::kNotFound);
  ASSERT_TRUE(m->GetOrCreateSequence(2).ok());
  EXPECT_EQ(m->Fork(1, 2).code(), StatusCode::kAlreadyExists);
  const Status no_block = m->Fork(1, 3);
  EXPECT_EQ(no_block.code(), StatusCode::kResourceExhausted) << no_block;
  EXPECT_EQ(m->GetSequence(3), nullptr);
  EXPECT_EQ(m->n_tracked_sequences(), 2);
  EXPECT_EQ(m->pool().ref_count(m->GetSequence(1)->block_table()[0]), 1);
  const SeqId uids[] = {2};
  const int64_t lengths[] = {0};
  ASSERT_TRUE(m->Schedule({.uids = uids, .lengths = lengths}).ok());
  const SeqId one[] = {1};
  const int64_t zero[] = {0};
  ASSERT_TRUE(m->Schedule({.uids = one, .lengths = zero}).ok());
  ASSERT_TRUE(m->FlushSequence(2).ok());
  EXPECT_TRUE(m->CheckInvariants().ok());
}

TEST(StateManagerFork, RefusesAParentWithTokensInFlight) {
  auto m = Make(Config(8));
  const SeqId uids[] = {1};
  const int64_t lengths[] = {10};
  ASSERT_TRUE(m->Schedule({.uids = uids, .lengths = lengths}).ok());
  EXPECT_EQ(m->Fork(1, 2).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->n_tracked_sequences(), 1);
}

TEST(StateManagerFork, AfterPartialFreeSharesOnlyHeldBlocks) {
  auto m = Make(Config(16));
  RunStep(*m, 1, 200);
  ASSERT_TRUE(m->FreeLeadingBlocks(1, 1).ok());
  ASSERT_TRUE(m->Fork(1, 2).ok());
  EXPECT_EQ(m->GetSequence(2)->released_blocks(), 1);
  EXPECT_EQ(m->GetSequence(2)->block_table()[0], kNoBlock);
  EXPECT_TRUE(m->CheckInvariants().ok()) << m->CheckInvariants();
  ASSERT_TRUE(m->FlushSequence(1).ok());
  ASSERT_TRUE(m->FlushSequence(2).ok());
  EXPECT_EQ(m->free_blocks()[0], 16);
}

}  // namespace
}  // namespace blockkv

namespace blockkv {
namespace {

// Records the collectives one rank enters; the other rank offers `other_blocks`.
class RecordingCommunicator final : public Communicator {
 public:
  int world_size() const override { return 2; }
  int rank() const override { return 0; }
  Result<int64_t> AllReduceMin(int64_t value) override {
    reduced.push_back(value);
    return std::min<int64_t>(value, 1 << 20);
  }
  Status Barrier() override {
    ++barriers;
    return Status::Ok();
  }
  std::vector<int64_t> reduced;
  int barriers = 0;
};

TEST(StateManagerCreate, ARankWithABadConfigStillEntersTheCollectives) {
  RecordingCommunicator comm;
  StateManagerConfig config = Config(8);
  config.memory_config.mode = AllocationMode::kReserve;
  config.memory_config.size = 1024;
  config.offload = true;  // without a host tier size: invalid
  const auto m = StateManager::Create(config, {SmallModel()}, CpuDevice(1 << 20), &comm);
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(comm.barriers, 1);
  EXPECT_EQ(comm.reduced, (std::vector<int64_t>{0}));  // "I can hold nothing": the others fail
}

TEST(StateManagerCreate, ValidatesBeforeTheAllocationGroupCheck) {
  KVCacheConfig zero = SmallModel();
  zero.num_allocation_groups = 0;
  const auto m = StateManager::Create(Config(8), {zero}, CpuDevice(1 << 20));
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("cache group 0"), std::string::npos) << m.status();
}

TEST(StateManagerCreate, RefusesBlockTablesLargerThanHostMemory) {
  StateManagerConfig config = Config(8, /*tracked=*/1 << 20, 1 << 20, 16);
  const auto m =
      StateManager::Create(config, {SmallModel(16, /*max_blocks=*/1 << 30)}, CpuDevice(1 << 20));
  EXPECT_EQ(m.status().code(), StatusCode::kResourceExhausted) << m.status();
  EXPECT_NE(m.status().message().find("host memory"), std::string::npos) << m.status();
}

// ---- PostForward(batch) ------------------------------------------------------------------------

TEST(StateManagerPostForwardBatch, AdvancesEverySequenceOfTheBatch) {
  auto m = Make(Config(8));
  const SeqId uids[] = {1, 2};
  const int64_t lengths[] = {3, 5};
  ASSERT_TRUE(m->Schedule({.uids = uids, .lengths = lengths}).ok());
  auto batch = RaggedBatch::Create(*m);
  ASSERT_TRUE(batch.ok());
  const std::vector<TokenId> tokens(5, 9);
  ASSERT_TRUE((*batch)->InsertSequence(*m->GetSequence(1), std::span(tokens).first(3)).ok());
  ASSERT_TRUE((*batch)->InsertSequence(*m->GetSequence(2), tokens).ok());
  ASSERT_TRUE(m->PostForward(**batch).ok());
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 3);
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 5);
  EXPECT_EQ(m->GetSequence(2)->in_flight_tokens(), 0);
  EXPECT_TRUE(m->CheckInvariants().ok());
}

TEST(StateManagerPostForwardBatch, ASequenceChangedSinceInsertionChangesNothing) {
  auto m = Make(Config(8));
  const SeqId uids[] = {1, 2};
  const int64_t lengths[] = {3, 3};
  ASSERT_TRUE(m->Schedule({.uids = uids, .lengths = lengths}).ok());
  auto batch = RaggedBatch::Create(*m);
  const std::vector<TokenId> tokens(3, 9);
  ASSERT_TRUE((*batch)->InsertSequence(*m->GetSequence(1), tokens).ok());
  ASSERT_TRUE((*batch)->InsertSequence(*m->GetSequence(2), tokens).ok());
  ASSERT_TRUE(m->PostForward(std::span(uids).subspan(1)).ok());  // 2 advanced behind its back
  const Status s = m->PostForward(**batch);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 0) << "nothing changed";
  EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 3);
}

TEST(StateManagerPostForwardBatch, AnotherManagersBatchIsInvalidArgument) {
  auto a = Make(Config(8));
  auto b = Make(Config(8));
  const SeqId uids[] = {1};
  const int64_t lengths[] = {2};
  ASSERT_TRUE(a->Schedule({.uids = uids, .lengths = lengths}).ok());
  ASSERT_TRUE(b->Schedule({.uids = uids, .lengths = lengths}).ok());
  auto batch = RaggedBatch::Create(*a);
  const std::vector<TokenId> tokens(2, 9);
  ASSERT_TRUE((*batch)->InsertSequence(*a->GetSequence(1), tokens).ok());
  EXPECT_EQ(b->PostForward(**batch).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b->GetSequence(1)->seen_tokens(), 0);
}

}  // namespace
}  // namespace blockkv
