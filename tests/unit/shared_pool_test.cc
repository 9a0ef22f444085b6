// SPDX-License-Identifier: Apache-2.0
// MemoryConfig::shared_pool (vLLM's hybrid allocator): every cache group draws its blocks from
// one pool, and layer i of every group is one buffer. A Gemma-2 style manager (a DENSE and a
// LOCAL group) serves more sequences from the same bytes than two pools of equal size do, the
// blocks a LOCAL group releases serve the DENSE group, every count of free blocks (Schedule,
// fork and rollback copies, resume) is the pool's, mismatched groups are refused naming them, and
// DeepSpeed's layout (a pool per group) stays the default. The random model runs with sharing
// on are in state_manager_rollback_test (RollbackModel).
#include "blockkv/state_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "blockkv/kv_cache.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

// One layer (or `layers`), one KV head of one fp32 value.
KVCacheConfig Dense(int32_t block_size, int64_t layers = 1, int64_t head_size = 1) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {layers, 1, head_size},
                       .cache_dtype = DType::kFloat32,
                       .max_blocks_per_allocation_group = 64};
}

KVCacheConfig Local(int32_t block_size, int64_t window, int64_t layers = 1, int64_t head = 1) {
  KVCacheConfig c = Dense(block_size, layers, head);
  c.type = KVCacheType::kLocal;
  c.local_window = window;
  return c;
}

StateManagerConfig Config(MemoryConfig memory, int64_t max_context = 1024) {
  StateManagerConfig c;
  c.max_tracked_sequences = 16;
  c.max_ragged_batch_size = 512;
  c.max_ragged_sequence_count = 16;
  c.max_context = max_context;
  c.memory_config = memory;
  return c;
}

MemoryConfig Blocks(int64_t n, bool shared) {
  return {.mode = AllocationMode::kAllocate, .size = n, .shared_pool = shared};
}

std::unique_ptr<StateManager> Make(StateManagerConfig config, std::vector<KVCacheConfig> groups,
                                   int64_t budget = 16 << 20) {
  auto m = StateManager::Create(std::move(config), std::move(groups), CpuDevice(budget));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

Status Step(StateManager& m, SeqId uid, int64_t tokens) {
  const SeqId uids[] = {uid};
  const int64_t lengths[] = {tokens};
  BLOCKKV_RETURN_IF_ERROR(m.Schedule({.uids = uids, .lengths = lengths}));
  return m.PostForward(uids);
}

// ---- BlockedKVCache --------------------------------------------------------------------------

TEST(SharedPool, GroupsViewOneBufferAndDrawFromOneAllocator) {
  const std::vector<KVCacheConfig> groups = {Dense(4, 2), Local(4, 8, 2)};
  auto cache = BlockedKVCache::Create(groups, Blocks(10, true), CpuDevice(1 << 20));
  ASSERT_OK(cache);
  BlockedKVCache& c = **cache;
  EXPECT_TRUE(c.shared_pool());
  EXPECT_EQ(c.num_pools(), 1);
  EXPECT_EQ(c.pool_of(1), 0);
  EXPECT_EQ(c.plan().bytes_per_block, 2 * 4 * 2 * 4);  // one group's: the pool's
  for (int64_t layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(c.GetCache(layer, 0)->data, c.GetCache(layer, 1)->data);
  }
  EXPECT_NE(c.GetCache(0, 0)->data, c.GetCache(1, 0)->data);
  Result<std::vector<BlockId>> taken = c.Reserve(3, 0);
  ASSERT_OK(taken);
  EXPECT_EQ(c.free_blocks(), (std::vector<int32_t>{7, 7}));
  Result<std::vector<BlockId>> more = c.Reserve(8, 1);  // group 1 sees the 7 left
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted) << more.status();
  ASSERT_OK(c.Free(*taken, 1));  // ids are the pool's, whichever group returns them
  EXPECT_EQ(c.free_blocks(), (std::vector<int32_t>{10, 10}));
  ASSERT_OK(c.CheckInvariants());
}

TEST(SharedPool, SeparatePoolsStayTheDefault) {
  const std::vector<KVCacheConfig> groups = {Dense(4), Dense(4)};
  auto cache = BlockedKVCache::Create(groups, Blocks(10, false), CpuDevice(1 << 20));
  ASSERT_OK(cache);
  EXPECT_FALSE((*cache)->shared_pool());
  EXPECT_EQ((*cache)->num_pools(), 2);
  EXPECT_NE((*cache)->GetCache(0, 0)->data, (*cache)->GetCache(0, 1)->data);
  ASSERT_OK((*cache)->Reserve(3, 0));
  EXPECT_EQ((*cache)->free_blocks(), (std::vector<int32_t>{7, 10}));
}

TEST(SharedPool, MismatchedGroupsAreRefusedNamingThem) {
  // Other bytes per block and layer: block 4 x head 1 vs block 4 x head 2.
  Result<std::unique_ptr<StateManager>> m =
      StateManager::Create(Config(Blocks(10, true)), {Dense(4), Local(4, 8, 1, 2)}, CpuDevice());
  ASSERT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("MemoryConfig.shared_pool: a block of one layer of cache "
                                      "group 1 is 64 bytes and one of cache group 0 is 32 bytes"),
            std::string::npos)
      << m.status();
  // Other layer counts.
  Result<std::unique_ptr<BlockedKVCache>> c =
      BlockedKVCache::Create({Dense(4, 2), Local(4, 8, 3)}, Blocks(10, true), CpuDevice());
  ASSERT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("cache group 1 has 3 layers (cache_shape[0]) and cache "
                                      "group 0 has 2"),
            std::string::npos)
      << c.status();
  // The same bytes in another shape share: block 8 x head 1 and block 4 x head 2.
  EXPECT_OK(
      StateManager::Create(Config(Blocks(10, true)), {Dense(8), Local(4, 8, 1, 2)}, CpuDevice())
          .status());
}

// ---- StateManager -----------------------------------------------------------------------------

// Gemma-2 style (a DENSE and a LOCAL group, window 64, block 16), sequences grown one after the
// other to max_context 512 in chunks of 64: from the same bytes, two pools of equal size (every
// group's blocks for the full context) hold 3 sequences, one shared pool 5 (32 DENSE blocks and
// at most 5 LOCAL ones per sequence).
TEST(SharedPool, GemmaLikeManagerServesMoreSequencesThanSeparatePools) {
  constexpr int64_t kBudget = 1 << 20;
  constexpr int64_t kBlockBytes =
      int64_t{2} * 16 * 2 * 1 * 8 * 4;  // 2 layers, block 16, 1 head of 8
  auto serve = [&](bool shared) {
    // Reserve mode, the same usable bytes either way: 100 blocks of both groups.
    const MemoryConfig memory{.mode = AllocationMode::kReserve,
                              .size = kBudget - int64_t{100} * 2 * kBlockBytes,
                              .shared_pool = shared};
    auto m = Make(Config(memory, 512), {Dense(16, 2, 8), Local(16, 64, 2, 8)}, kBudget);
    EXPECT_EQ(m->kv_cache().plan().total_bytes, int64_t{100} * 2 * kBlockBytes);
    int count = 0;
    for (SeqId uid = 1;; ++uid) {
      for (int64_t seen = 0; seen < 512; seen += 64) {
        const Status s = Step(*m, uid, 64);
        if (!s.ok()) {
          EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
          EXPECT_OK(m->CheckInvariants());
          return count;
        }
      }
      ++count;
      EXPECT_EQ(
          m->GetSequence(uid)->cur_allocated_blocks(1) - m->GetSequence(uid)->released_blocks(1),
          4);  // the window's blocks
    }
  };
  EXPECT_EQ(serve(false), 3);
  EXPECT_EQ(serve(true), 5);
}

// The block a LOCAL group releases is the next one the DENSE group takes (the pool hands out
// the last freed first), and both groups' KV stay apart although they share the layer's buffer.
TEST(SharedPool, LocalGroupsReleasedBlockServesTheDenseGroup) {
  auto m = Make(Config(Blocks(5, true)), {Dense(4), Local(4, 4)});
  const SeqId uids[] = {1};
  const int64_t eight[] = {8};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = eight}));  // DENSE 2 blocks, LOCAL 2
  const Sequence& seq = *m->GetSequence(1);
  const BlockId local0 = seq.block_table(1)[0];
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{1, 1}));
  ASSERT_OK(m->PostForward(uids));  // 8 - 4: LOCAL's block 0 leaves the window
  EXPECT_EQ(seq.released_blocks(1), 1);
  EXPECT_EQ(seq.block_table(1)[0], kNoBlock);
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{2, 2}));
  ASSERT_OK(Step(*m, 1, 4));  // DENSE and LOCAL one block each; DENSE takes LOCAL's old one
  EXPECT_EQ(seq.block_table(0)[2], local0);
  EXPECT_EQ(seq.released_blocks(1), 2);
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{1, 1}));
  // Separate pools of 5 blocks each would hold the same (twice the memory); one of 5 holds it.
  std::vector<BlockId> all;
  for (int g = 0; g < 2; ++g) {
    for (const BlockId b : seq.block_table(g)) {
      if (b != kNoBlock) all.push_back(b);
    }
  }
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());  // no block in two groups
  EXPECT_EQ(all.size(), 4u);                                         // DENSE 3 + LOCAL 1
  ASSERT_OK(m->CheckInvariants());
}

// Schedule counts every group's new blocks against the one pool: all or nothing.
TEST(SharedPool, ScheduleCountsTheGroupsNeedsAgainstThePool) {
  auto m = Make(Config(Blocks(5, true)), {Dense(4), Local(4, 8)});
  const SeqId uids[] = {1};
  const int64_t twelve[] = {12};  // 3 blocks in each group: 6 > 5
  Result<SchedulingResult> verdict = m->CanSchedule({.uids = uids, .lengths = twelve});
  ASSERT_OK(verdict);
  EXPECT_EQ(*verdict, SchedulingResult::kKVCacheLimitExceeded);
  const Status s = m->Schedule({.uids = uids, .lengths = twelve});
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("needs 3 blocks of cache group 1, 2 left for it (5 free in the pool "
                             "its groups share)"),
            std::string::npos)
      << s;
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{5, 5}));
  EXPECT_EQ(m->n_tracked_sequences(), 0);
  const int64_t eight[] = {8};  // 2 + 2 <= 5
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = eight}));
  ASSERT_OK(m->CheckInvariants());
}

// Fork copies the shared partial block of every group: with one pool they need two free blocks
// from it, checked before either is taken.
TEST(SharedPool, ForkCopiesNeedTheirBlocksFromThePool) {
  auto m = Make(Config(Blocks(5, true)), {Dense(4), Local(4, 8)});
  ASSERT_OK(Step(*m, 1, 6));  // 2 blocks each, partial: 1 free
  const Status s = m->Fork(1, 2);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(m->GetSequence(2), nullptr);
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{1, 1}));
  ASSERT_OK(m->CheckInvariants());
  auto roomy = Make(Config(Blocks(6, true)), {Dense(4), Local(4, 8)});
  ASSERT_OK(Step(*roomy, 1, 6));
  ASSERT_OK(roomy->Fork(1, 2));
  EXPECT_EQ(roomy->free_blocks(), (std::vector<int32_t>{0, 0}));
  ASSERT_OK(roomy->CheckInvariants());
}

// Each group saves the blocks it holds or cached; a loaded manager holds them again in one
// pool and saves the same bytes.
TEST(SharedPool, SnapshotsRoundTripEachGroupsOwnBlocks) {
  StateManagerConfig config = Config(Blocks(12, true));
  config.prefix_cache.enabled = true;
  auto m = Make(config, {Dense(4), Local(4, 4)});
  for (const SeqId uid : {1, 2}) {
    const std::vector<TokenId> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    ASSERT_OK(m->AddSequence(uid, prompt));
    ASSERT_OK(Step(*m, uid, uid == 1 ? 9 : 1));  // the second hits 8 cached tokens
  }
  ASSERT_OK(m->FlushSequence(1));  // its blocks stay cached, evictable
  Result<std::vector<std::byte>> bytes = m->SaveSnapshot();
  ASSERT_OK(bytes);
  auto loaded = Make(config, {Dense(4), Local(4, 4)});
  ASSERT_OK(loaded->LoadSnapshot(*bytes));
  ASSERT_OK(loaded->CheckInvariants());
  EXPECT_EQ(loaded->free_blocks(), m->free_blocks());
  for (int g = 0; g < 2; ++g) {
    const std::span<const BlockId> a = m->GetSequence(2)->block_table(g);
    const std::span<const BlockId> b = loaded->GetSequence(2)->block_table(g);
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << "group " << g;
  }
  Result<std::vector<std::byte>> again = loaded->SaveSnapshot();
  ASSERT_OK(again);
  EXPECT_EQ(*again, *bytes);
}

// A snapshot of a pool per group may hold one id in both groups: a shared pool refuses it, and
// nothing changes.
TEST(SharedPool, ASnapshotHoldingAnIdInTwoGroupsIsRefused) {
  auto separate = Make(Config(Blocks(8, false)), {Dense(4), Local(4, 8)});
  ASSERT_OK(Step(*separate, 1, 6));  // blocks 0 and 1 in both groups
  Result<std::vector<std::byte>> saved = separate->SaveSnapshot();
  ASSERT_OK(saved);
  auto m = Make(Config(Blocks(8, true)), {Dense(4), Local(4, 8)});
  ASSERT_OK(Step(*m, 7, 3));
  const Status s = m->LoadSnapshot(*saved);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("holds block 0 in cache groups 0 and 1, which share one pool"),
            std::string::npos)
      << s;
  EXPECT_EQ(m->GetSequence(7)->seen_tokens(), 3);
  EXPECT_EQ(m->GetSequence(1), nullptr);
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{6, 6}));
  ASSERT_OK(m->CheckInvariants());
}

}  // namespace
}  // namespace blockkv
