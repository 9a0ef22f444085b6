// SPDX-License-Identifier: Apache-2.0
// Prefix caching through the StateManager: hits on shared prompts, partial blocks never shared,
// namespace and adapter isolation, eviction order (LRU within priority), exact token comparison
// under a colliding hash, hash stability, events, stats and Reset. Every test checks the
// manager's invariants (pools, tables, keys) after each step.
#include "blockkv/prefix_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <variant>
#include <vector>

#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

constexpr int32_t kBlock = 4;  // tokens per block

KVCacheConfig Model(int32_t block_size = kBlock) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {1, 1, 8},
                       .cache_dtype = DType::kFloat16,
                       .max_blocks_per_allocation_group = 64};
}

StateManagerConfig Config(int32_t num_blocks, PrefixCacheConfig prefix = {.enabled = true}) {
  StateManagerConfig c;
  c.max_tracked_sequences = 16;
  c.max_ragged_batch_size = 1024;
  c.max_ragged_sequence_count = 16;
  c.memory_config = {.mode = AllocationMode::kAllocate, .size = num_blocks};
  c.prefix_cache = prefix;
  return c;
}

std::vector<TokenId> Tokens(int32_t n, TokenId first = 100) {
  std::vector<TokenId> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

class PrefixCacheTest : public ::testing::Test {
 protected:
  void Make(int32_t num_blocks, PrefixCacheConfig prefix = {.enabled = true},
            std::vector<KVCacheConfig> groups = {Model()}) {
    auto m = StateManager::Create(Config(num_blocks, prefix), std::move(groups),
                                  CpuDevice(/*memory_budget=*/16 << 20));
    ASSERT_OK(m);
    mgr_ = std::move(m).value();
  }

  // Adds `uid` with `prompt`, schedules the whole prompt, runs the forward; returns the tokens
  // taken from the cache.
  int64_t Prefill(SeqId uid, const std::vector<TokenId>& prompt, SequenceOptions options = {}) {
    EXPECT_OK(mgr_->AddSequence(uid, prompt, options));
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {static_cast<int64_t>(prompt.size())};
    EXPECT_OK(mgr_->Schedule({.uids = uids, .lengths = lengths}));
    const Sequence* seq = mgr_->GetSequence(uid);
    EXPECT_EQ(seq->seen_tokens() + seq->in_flight_tokens(), static_cast<int64_t>(prompt.size()));
    EXPECT_OK(mgr_->PostForward(uids));
    EXPECT_OK(mgr_->CheckInvariants());
    return seq->cached_prefix_tokens();
  }

  void Flush(SeqId uid) {
    EXPECT_OK(mgr_->FlushSequence(uid));
    EXPECT_OK(mgr_->CheckInvariants());
  }

  std::vector<BlockId> Table(SeqId uid, int group = 0) const {
    const auto t = mgr_->GetSequence(uid)->block_table(group);
    return {t.begin(), t.end()};
  }

  std::unique_ptr<StateManager> mgr_;
};

// ---- keys -------------------------------------------------------------------------------------

TEST(BlockHashTest, GoldenValueForAFixedTokenListAndSeed) {
  // The documented encoding of block 0 = {1, 2, 3, 4} (version 1, no parent, adapter 0, no
  // namespace, no bytes), hashed independently with `xxhsum -H2` (XXH3-128, seed 0), which prints
  // the high half first as ToString does:
  //   01 00 | 16 × 00 | 8 × 00 | 04 00 00 00 | 01 00 00 00 02 00 00 00 03 00 00 00 04 00 00 00
  //   | 00 00 00 00 | 00 00 00 00
  // If this changes, every router's index and every persisted key changes: bump the encoding's
  // version byte instead of editing the value.
  const std::vector<TokenId> tokens = {1, 2, 3, 4};
  EXPECT_EQ(ToString(HashBlock(nullptr, tokens, {}, 0, /*seed=*/0)),
            "cca424a19bb5b82046acdc1d376c9bce");
  EXPECT_EQ(HashBlock(nullptr, tokens, {}, 0, 42), HashBlock(nullptr, tokens, {}, 0, 42));
}

TEST(BlockHashTest, EveryKeyPartChangesTheHash) {
  const std::vector<TokenId> tokens = {1, 2, 3, 4};
  const BlockHash base = HashBlock(nullptr, tokens, {}, 0, 0);
  EXPECT_NE(base, HashBlock(nullptr, tokens, {}, 0, 1)) << "seed";
  EXPECT_NE(base, HashBlock(nullptr, std::vector<TokenId>{1, 2, 3, 5}, {}, 0, 0)) << "tokens";
  EXPECT_NE(base, HashBlock(nullptr, tokens, {.ns = "a"}, 0, 0)) << "namespace";
  EXPECT_NE(base, HashBlock(nullptr, tokens, {.adapter_id = 7}, 0, 0)) << "adapter";
  EXPECT_NE(base, HashBlock(nullptr, tokens, {.block_bytes = {"img"}}, 0, 0)) << "bytes";
  EXPECT_NE(base, HashBlock(&base, tokens, {}, 1, 0)) << "parent";
  // The namespace keys block 0 only; later blocks inherit it through the chain.
  EXPECT_EQ(HashBlock(&base, tokens, {.ns = "a"}, 1, 0), HashBlock(&base, tokens, {}, 1, 0));
}

// ---- hits -------------------------------------------------------------------------------------

TEST_F(PrefixCacheTest, SharedSystemPromptHitsItsFullBlocks) {
  Make(32);
  std::vector<TokenId> a = Tokens(10);  // blocks [0,4) [4,8) full, [8,10) partial
  EXPECT_EQ(Prefill(1, a), 0);
  std::vector<TokenId> b = Tokens(8);
  b.push_back(7);
  b.push_back(9);
  b.push_back(11);  // same first 8 tokens, different tail
  EXPECT_EQ(Prefill(2, b), 8);
  EXPECT_EQ(Table(2)[0], Table(1)[0]);
  EXPECT_EQ(Table(2)[1], Table(1)[1]);
  EXPECT_NE(Table(2)[2], Table(1)[2]) << "the partial block is never shared";
  EXPECT_EQ(mgr_->pool().ref_count(Table(1)[0]), 2);
  const PrefixCacheStats s = mgr_->prefix_cache()->stats("");
  EXPECT_EQ(s.lookups, 2);
  EXPECT_EQ(s.queried_tokens, 21);
  EXPECT_EQ(s.hit_tokens, 8);
}

TEST_F(PrefixCacheTest, LastPromptTokenIsAlwaysRecomputed) {
  Make(32);
  EXPECT_EQ(Prefill(1, Tokens(8)), 0);
  // The same 8 tokens: both blocks are cached, but the engine needs the logits of token 7.
  EXPECT_EQ(Prefill(2, Tokens(8)), 4);
  EXPECT_EQ(mgr_->GetSequence(2)->in_flight_tokens(), 0);
  EXPECT_EQ(mgr_->GetSequence(2)->seen_tokens(), 8);
}

TEST_F(PrefixCacheTest, HitSchedulesOnlyTheRestAndChunkedPrefillKeepsItsChunk) {
  Make(32);
  Prefill(1, Tokens(16));
  ASSERT_OK(mgr_->AddSequence(2, Tokens(20)));
  const SeqId uids[] = {2};
  const int64_t chunk[] = {3};  // a chunk smaller than the hit: 3 tokens after the hit
  ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = chunk}));
  EXPECT_EQ(mgr_->GetSequence(2)->seen_tokens(), 16);
  EXPECT_EQ(mgr_->GetSequence(2)->in_flight_tokens(), 3);
  ASSERT_OK(mgr_->PostForward(uids));
  const int64_t rest[] = {1};
  ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = rest}));
  EXPECT_EQ(mgr_->GetSequence(2)->seen_tokens(), 19) << "only the first schedule looks up";
  ASSERT_OK(mgr_->PostForward(uids));
  EXPECT_OK(mgr_->CheckInvariants());
}

TEST_F(PrefixCacheTest, DecodedTokensArePublishedWhenAppended) {
  Make(32);
  Prefill(1, Tokens(6));
  // Decode two tokens: the engine appends each sampled token, then schedules it.
  const SeqId uids[] = {1};
  const int64_t one[] = {1};
  for (TokenId t : {106, 107}) {
    ASSERT_OK(mgr_->AppendTokens(1, std::vector<TokenId>{t}));
    ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = one}));
    ASSERT_OK(mgr_->PostForward(uids));
  }
  EXPECT_EQ(mgr_->prefix_cache()->cached_blocks(0), 2);
  Flush(1);
  EXPECT_EQ(Prefill(2, Tokens(9)), 8);
}

TEST_F(PrefixCacheTest, PostForwardOfABatchRecordsItsTokensSoDecodeNeedsNoAppend) {
  Make(32);
  ASSERT_OK(mgr_->AddSequence(1, Tokens(6)));
  auto batch = RaggedBatch::Create(*mgr_);
  ASSERT_OK(batch);
  const std::vector<TokenId> prompt = Tokens(6);
  std::vector<TokenId> ids(prompt.begin(), prompt.end());
  const SeqId uids[] = {1};
  for (int64_t step = 0; step < 3; ++step) {
    const int64_t lengths[] = {static_cast<int64_t>(ids.size())};
    ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = lengths}));
    (*batch)->Clear();
    ASSERT_OK((*batch)->InsertSequence(*mgr_->GetSequence(1), ids));
    ASSERT_OK((*batch)->Finalize());
    ASSERT_OK(mgr_->PostForward(**batch));
    ASSERT_OK(mgr_->CheckInvariants());
    ids = {static_cast<TokenId>(106 + step)};  // the next token: positions 6, 7, 8
  }
  EXPECT_EQ(mgr_->prefix_cache()->cached_blocks(0), 2);  // tokens 100..107 in two full blocks
  Flush(1);
  EXPECT_EQ(Prefill(2, Tokens(9)), 8);
}

TEST_F(PrefixCacheTest, PostForwardOfABatchRejectsTokenIdsThatCannotBeKeys) {
  Make(32);
  ASSERT_OK(mgr_->AddSequence(1, Tokens(2)));
  auto batch = RaggedBatch::Create(*mgr_);
  const SeqId uids[] = {1};
  const int64_t two[] = {2};
  ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = two}));
  ASSERT_OK((*batch)->InsertSequence(*mgr_->GetSequence(1), std::vector<TokenId>{100, 101}));
  ASSERT_OK(mgr_->PostForward(**batch));
  const int64_t one[] = {1};
  ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = one}));
  (*batch)->Clear();
  // A negative id (the batch takes any TokenId; a key needs one >= 0).
  ASSERT_OK((*batch)->InsertSequence(*mgr_->GetSequence(1), std::vector<TokenId>{-5}));
  EXPECT_CODE(mgr_->PostForward(**batch), StatusCode::kFailedPrecondition);
  EXPECT_EQ(mgr_->GetSequence(1)->seen_tokens(), 2);
  EXPECT_OK(mgr_->CheckInvariants());
}

TEST_F(PrefixCacheTest, NamespacesNeverShareAndAdaptersAreKeptApart) {
  Make(64);
  const std::vector<TokenId> prompt = Tokens(9);
  Prefill(1, prompt, {.keys = {.ns = "tenant-a"}});
  EXPECT_EQ(Prefill(2, prompt, {.keys = {.ns = "tenant-b"}}), 0);
  EXPECT_EQ(Prefill(3, prompt), 0) << "the default namespace is a namespace too";
  EXPECT_EQ(Prefill(4, prompt, {.keys = {.ns = "tenant-a"}}), 8);
  EXPECT_EQ(Prefill(5, prompt, {.keys = {.ns = "tenant-a", .adapter_id = 3}}), 0);
  EXPECT_EQ(Prefill(6, prompt, {.keys = {.ns = "tenant-a", .adapter_id = 3}}), 8);
  EXPECT_EQ(mgr_->prefix_cache()->stats("tenant-a").hit_tokens, 16);
  EXPECT_EQ(mgr_->prefix_cache()->stats("tenant-b").hit_tokens, 0);
  EXPECT_EQ(mgr_->prefix_cache()->total_stats().lookups, 6);
}

TEST_F(PrefixCacheTest, PerBlockBytesAreCompared) {
  Make(64);
  const std::vector<TokenId> prompt = Tokens(9);
  Prefill(1, prompt, {.keys = {.block_bytes = {"", "image-1"}}});
  EXPECT_EQ(Prefill(2, prompt, {.keys = {.block_bytes = {"", "image-2"}}}), 4)
      << "block 1 stands for another image";
  EXPECT_EQ(Prefill(3, prompt, {.keys = {.block_bytes = {"", "image-1"}}}), 8);
}

BlockHash Colliding(std::span<const std::byte>, uint64_t) { return {1, 2}; }

TEST_F(PrefixCacheTest, ColludingHashNeverHandsOutAnotherPromptsBlocks) {
  Make(64, {.enabled = true, .hash_function = Colliding});
  const std::vector<TokenId> a = Tokens(9, 0);
  Prefill(1, a);
  EXPECT_EQ(Prefill(2, Tokens(9, 1000)), 0) << "same hash, other tokens";
  // Same second block's tokens behind another first block: the parent is compared too.
  std::vector<TokenId> c = a;
  c[0] = 999;
  EXPECT_EQ(Prefill(3, c), 0);
  EXPECT_EQ(Prefill(4, a, {.keys = {.ns = "x"}}), 0);
  EXPECT_EQ(Prefill(5, a), 8) << "the true prefix still hits";
}

TEST_F(PrefixCacheTest, AnExactCopyOfABlockLeadsToTheChildrenOfEveryCopy) {
  // Found by prefix_cache_bench: a prompt sent again recomputes its last block and publishes a
  // second copy; the children of the first copy must still be found through it.
  Make(32, {.enabled = true, .max_events = 64});
  const std::vector<TokenId> a = Tokens(8);
  Prefill(1, a);
  const SeqId one[] = {1};
  const int64_t step[] = {1};
  for (TokenId t : {200, 201, 202, 203}) {  // decode a third block: 200..203
    ASSERT_OK(mgr_->AppendTokens(1, std::vector<TokenId>{t}));
    ASSERT_OK(mgr_->Schedule({.uids = one, .lengths = step}));
    ASSERT_OK(mgr_->PostForward(one));
  }
  Flush(1);
  EXPECT_EQ(Prefill(2, a), 4);  // block 1 recomputed: a second copy of it
  Flush(2);
  (void)mgr_->DrainCacheEvents();
  std::vector<TokenId> follow_up = a;
  for (TokenId t : {200, 201, 202, 203, 9}) follow_up.push_back(t);
  EXPECT_EQ(Prefill(3, follow_up), 12);
}

TEST_F(PrefixCacheTest, ASecondCopyOfAKeyIsNotAnnouncedAgain) {
  Make(32, {.enabled = true, .max_events = 64});
  Prefill(1, Tokens(8));
  Flush(1);
  (void)mgr_->DrainCacheEvents();
  EXPECT_EQ(Prefill(2, Tokens(8)), 4);  // publishes a second copy of block 1
  EXPECT_TRUE(mgr_->DrainCacheEvents().events.empty());
  EXPECT_EQ(mgr_->prefix_cache()->cached_blocks(0), 3);
}

// ---- eviction ---------------------------------------------------------------------------------

TEST_F(PrefixCacheTest, FlushedBlocksStayCachedAndCountAsFree) {
  Make(8);
  Prefill(1, Tokens(9));  // 3 blocks, 2 full
  Flush(1);
  EXPECT_EQ(mgr_->pool().evictable_blocks(), 2);
  EXPECT_EQ(mgr_->free_blocks()[0], 8);
  EXPECT_EQ(Prefill(2, Tokens(9)), 8) << "revived from the eviction list";
  EXPECT_EQ(mgr_->pool().evictable_blocks(), 0);
}

TEST_F(PrefixCacheTest, EvictionTakesLeastRecentlyUsedAndChainEndsFirst) {
  Make(6);
  Prefill(1, Tokens(8, 0));    // blocks A0 A1 (full, then a 0-token tail: 2 blocks)
  Prefill(2, Tokens(8, 100));  // B0 B1
  const std::vector<BlockId> a = Table(1);
  const std::vector<BlockId> b = Table(2);
  Flush(1);  // A1 then A0 join the list (chain ends first)
  Flush(2);  // then B1, B0
  // A new 11-token prompt needs 3 blocks: 2 free + the least recently used evictable: A1.
  Prefill(3, Tokens(11, 500));
  EXPECT_EQ(Table(3)[2], a[1]);
  EXPECT_TRUE(mgr_->pool().is_evictable(b[0]));
  EXPECT_TRUE(mgr_->pool().is_evictable(b[1]));
  EXPECT_EQ(Prefill(4, Tokens(8, 0)), 4) << "A0 still hits";
}

TEST_F(PrefixCacheTest, LowerPriorityIsEvictedFirst) {
  Make(6);
  Prefill(1, Tokens(8, 0), {.priority = 80});
  Prefill(2, Tokens(8, 100), {.priority = 10});
  const std::vector<BlockId> a = Table(1);
  const std::vector<BlockId> b = Table(2);
  Flush(1);
  Flush(2);                     // B is more recent but of lower priority
  Prefill(3, Tokens(15, 500));  // 4 blocks: 2 free + B's 2
  const std::vector<BlockId> c = Table(3);
  EXPECT_EQ(std::count(c.begin(), c.end(), b[0]) + std::count(c.begin(), c.end(), b[1]), 2);
  EXPECT_TRUE(mgr_->pool().is_evictable(a[0]));
  EXPECT_TRUE(mgr_->pool().is_evictable(a[1]));
  EXPECT_EQ(mgr_->prefix_cache()->stats("").evictions, 2);
  Flush(3);
  EXPECT_EQ(Prefill(4, Tokens(9, 0)), 8) << "A survived";
}

TEST_F(PrefixCacheTest, AHitRaisesABlocksPriorityToTheHittingRequests) {
  Make(8);
  Prefill(1, Tokens(9), {.priority = 10});
  const std::vector<BlockId> a = Table(1);
  EXPECT_EQ(Prefill(2, Tokens(9), {.priority = 90}), 8);
  EXPECT_EQ(mgr_->pool().priority(a[0]), 90);
  EXPECT_EQ(mgr_->pool().priority(a[1]), 90);
}

TEST_F(PrefixCacheTest, HitBlocksAreNeverEvictedToServeTheirOwnRequest) {
  Make(3);
  Prefill(1, Tokens(8));
  Flush(1);  // 2 evictable, 1 free
  // 12 tokens: a 4-token... hit of 8 (both evictable blocks revived) + 1 new block.
  EXPECT_EQ(Prefill(2, Tokens(12)), 8);
  EXPECT_EQ(mgr_->free_blocks()[0], 0);
}

TEST_F(PrefixCacheTest, FailedScheduleLeavesCachedBlocksAlone) {
  Make(3);
  Prefill(1, Tokens(8));
  Flush(1);
  ASSERT_OK(mgr_->AddSequence(2, Tokens(17)));  // hit 8, then needs 3 more: 2 + 3 > 3
  const SeqId uids[] = {2};
  const int64_t lengths[] = {17};
  SchedulingResult why;
  EXPECT_CODE(mgr_->Schedule({.uids = uids, .lengths = lengths}, &why),
              StatusCode::kResourceExhausted);
  EXPECT_EQ(why, SchedulingResult::kKVCacheLimitExceeded);
  EXPECT_EQ(mgr_->pool().evictable_blocks(), 2);
  EXPECT_EQ(mgr_->GetSequence(2)->seen_tokens(), 0);
  EXPECT_EQ(mgr_->prefix_cache()->stats("").lookups, 1) << "only a schedule that happens counts";
  EXPECT_OK(mgr_->CheckInvariants());
}

TEST_F(PrefixCacheTest, TwoSequencesInOneBatchReviveTheSameEvictableBlocksOnce) {
  Make(4);
  Prefill(1, Tokens(8));
  Flush(1);  // 2 evictable + 2 free
  ASSERT_OK(mgr_->AddSequence(2, Tokens(9)));
  ASSERT_OK(mgr_->AddSequence(3, Tokens(9)));
  const SeqId uids[] = {2, 3};
  const int64_t lengths[] = {9, 9};
  ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = lengths}));  // 2 revived once + 1 new each
  EXPECT_EQ(Table(2)[0], Table(3)[0]);
  EXPECT_EQ(mgr_->pool().ref_count(Table(2)[0]), 2);
  EXPECT_OK(mgr_->CheckInvariants());
}

// ---- several groups ---------------------------------------------------------------------------

TEST_F(PrefixCacheTest, SeveralGroupsHitTheLongestPrefixAllHold) {
  Make(32, {.enabled = true}, {Model(4), Model(8)});
  Prefill(1, Tokens(13));  // group 0: 3 full blocks (12 tokens); group 1: 1 full (8)
  EXPECT_EQ(Prefill(2, Tokens(13)), 8) << "a multiple of both block sizes";
  EXPECT_EQ(Table(2, 0)[1], Table(1, 0)[1]);
  EXPECT_EQ(Table(2, 1)[0], Table(1, 1)[0]);
  EXPECT_NE(Table(2, 0)[2], Table(1, 0)[2]);
}

TEST_F(PrefixCacheTest, SlidingWindowGroupNeedsOnlyTheBlocksInsideItsWindow) {
  // Group 0 full attention, group 1 a window of 8 tokens; 8 blocks each.
  Make(8, {.enabled = true, .sliding_windows = {0, 8}}, {Model(4), Model(4)});
  Prefill(1, Tokens(20));
  ASSERT_OK(mgr_->FreeLeadingBlocks(1, 3, /*group=*/1));  // out of the window: evictable
  Flush(1);
  // 16 new tokens take 4 blocks a group: 3 free and 1 evicted — group 0's last block (4),
  // group 1's oldest released one (0).
  Prefill(2, Tokens(16, 900));
  Flush(2);
  EXPECT_EQ(Prefill(3, Tokens(21)), 16);
  const Sequence& seq = *mgr_->GetSequence(3);
  EXPECT_EQ(seq.released_blocks(1), 2) << "group 1 holds only blocks 2 and 3 of the hit";
  EXPECT_EQ(seq.released_blocks(0), 0);
  EXPECT_EQ(Table(3, 1)[0], kNoBlock);
  EXPECT_NE(Table(3, 1)[2], kNoBlock);
}

TEST_F(PrefixCacheTest, WithoutAWindowAnEvictedLeadingBlockEndsTheHit) {
  Make(8, {.enabled = true}, {Model(4), Model(4)});
  Prefill(1, Tokens(20));
  ASSERT_OK(mgr_->FreeLeadingBlocks(1, 3, /*group=*/1));
  Flush(1);
  Prefill(2, Tokens(16, 900));
  Flush(2);
  EXPECT_EQ(Prefill(3, Tokens(21)), 0);
}

TEST(PrefixCacheConfigTest, BadSlidingWindowsAreRejected) {
  for (const std::vector<int64_t>& windows :
       {std::vector<int64_t>{-1}, std::vector<int64_t>{0, 0}}) {
    auto m = StateManager::Create(Config(8, {.enabled = true, .sliding_windows = windows}),
                                  {Model()}, CpuDevice(1 << 20));
    EXPECT_CODE(m, StatusCode::kInvalidArgument);
  }
}

// ---- events, reset, fork ----------------------------------------------------------------------

TEST_F(PrefixCacheTest, EventsTellRoutersWhatIsStoredAndRemoved) {
  Make(4, {.enabled = true, .max_events = 16});
  Prefill(1, Tokens(8), {.keys = {.ns = "t", .adapter_id = 5}});
  CacheEventBatch batch = mgr_->DrainCacheEvents();
  ASSERT_EQ(batch.events.size(), 2u);
  const auto& first = std::get<BlockStored>(batch.events[0]);
  const auto& second = std::get<BlockStored>(batch.events[1]);
  EXPECT_FALSE(first.has_parent);
  EXPECT_TRUE(second.has_parent);
  EXPECT_EQ(second.parent, first.hash);
  EXPECT_EQ(first.tokens, Tokens(4));
  EXPECT_EQ(first.ns, "t");
  EXPECT_EQ(first.adapter_id, 5);
  EXPECT_EQ(batch.dropped, 0u);
  Flush(1);
  Prefill(2, Tokens(16, 900));  // needs all 4 blocks: both cached ones evicted
  batch = mgr_->DrainCacheEvents();
  int removed = 0;
  for (const CacheEvent& e : batch.events) removed += std::holds_alternative<BlockRemoved>(e);
  EXPECT_EQ(removed, 2);
  Flush(2);
  EXPECT_EQ(mgr_->ResetPrefixCache(), 4);
  batch = mgr_->DrainCacheEvents();
  ASSERT_FALSE(batch.events.empty());
  EXPECT_TRUE(std::holds_alternative<AllCleared>(batch.events.back()));
  EXPECT_EQ(mgr_->free_blocks()[0], 4);
  EXPECT_EQ(mgr_->pool().evictable_blocks(), 0);
}

TEST_F(PrefixCacheTest, EventOverflowDropsTheOldestAndCountsThem) {
  Make(32, {.enabled = true, .max_events = 2});
  Prefill(1, Tokens(16));  // 4 BlockStored
  const CacheEventBatch batch = mgr_->DrainCacheEvents();
  ASSERT_EQ(batch.events.size(), 2u);
  EXPECT_EQ(batch.dropped, 2u);
  EXPECT_EQ(std::get<BlockStored>(batch.events[0]).tokens, Tokens(4, 108));
}

TEST_F(PrefixCacheTest, RemovedOnlyWhenTheLastCopyGoes) {
  Make(8, {.enabled = true, .max_events = 64});
  // Two sequences compute the same prompt in one batch: two copies of each block.
  ASSERT_OK(mgr_->AddSequence(1, Tokens(5)));
  ASSERT_OK(mgr_->AddSequence(2, Tokens(5)));
  const SeqId uids[] = {1, 2};
  const int64_t lengths[] = {5, 5};
  ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = lengths}));
  ASSERT_OK(mgr_->PostForward(uids));
  EXPECT_EQ(mgr_->prefix_cache()->cached_blocks(0), 2);
  Flush(1);
  Flush(2);
  (void)mgr_->DrainCacheEvents();
  Prefill(3, Tokens(28, 500));  // 7 blocks: evicts one copy, then...
  CacheEventBatch batch = mgr_->DrainCacheEvents();
  for (const CacheEvent& e : batch.events) {
    EXPECT_FALSE(std::holds_alternative<BlockRemoved>(e)) << "a copy is still cached";
  }
  Flush(3);
  Prefill(4, Tokens(32, 900));  // all 8
  batch = mgr_->DrainCacheEvents();
  int removed = 0;
  for (const CacheEvent& e : batch.events) removed += std::holds_alternative<BlockRemoved>(e);
  EXPECT_GE(removed, 1);
}

TEST_F(PrefixCacheTest, ResetKeepsReferencedBlocks) {
  Make(16);
  Prefill(1, Tokens(9));
  Prefill(2, Tokens(9, 300));
  Flush(2);
  EXPECT_EQ(mgr_->ResetPrefixCache(), 2);
  EXPECT_EQ(mgr_->prefix_cache()->cached_blocks(0), 2) << "sequence 1 still holds its blocks";
  EXPECT_EQ(Prefill(3, Tokens(9)), 8);
  EXPECT_EQ(Prefill(4, Tokens(9, 300)), 0);
}

TEST_F(PrefixCacheTest, ForkedChildrenPublishOnce) {
  Make(32);
  Prefill(1, Tokens(6));
  ASSERT_OK(mgr_->Fork(1, 2));
  EXPECT_OK(mgr_->CheckInvariants());
  for (SeqId uid : {1, 2}) {
    ASSERT_OK(mgr_->AppendTokens(uid, std::vector<TokenId>{106, 107}));
    const SeqId uids[] = {uid};
    const int64_t two[] = {2};
    ASSERT_OK(mgr_->Schedule({.uids = uids, .lengths = two}));
    ASSERT_OK(mgr_->PostForward(uids));
    EXPECT_OK(mgr_->CheckInvariants());
  }
  EXPECT_EQ(mgr_->prefix_cache()->cached_blocks(0), 3) << "block 0 once, block 1 per child";
}

TEST_F(PrefixCacheTest, DisabledCacheNeverHits) {
  Make(16, {.enabled = false});
  Prefill(1, Tokens(9));
  Flush(1);
  EXPECT_EQ(Prefill(2, Tokens(9)), 0);
  EXPECT_EQ(mgr_->prefix_cache(), nullptr);
  EXPECT_OK(mgr_->AppendTokens(2, std::vector<TokenId>{1}));
}

TEST_F(PrefixCacheTest, BadInputIsRejectedAndChangesNothing) {
  Make(16);
  EXPECT_CODE(mgr_->AddSequence(1, std::vector<TokenId>{1, -1}), StatusCode::kInvalidArgument);
  EXPECT_CODE(mgr_->AddSequence(1, Tokens(4), {.priority = 101}), StatusCode::kInvalidArgument);
  EXPECT_EQ(mgr_->n_tracked_sequences(), 0);
  ASSERT_OK(mgr_->AddSequence(1, Tokens(4)));
  EXPECT_CODE(mgr_->AddSequence(1, Tokens(4)), StatusCode::kAlreadyExists);
  EXPECT_CODE(mgr_->AppendTokens(9, Tokens(1)), StatusCode::kNotFound);
  EXPECT_CODE(mgr_->AppendTokens(1, std::vector<TokenId>{-5}), StatusCode::kInvalidArgument);
  ASSERT_OK(mgr_->GetOrCreateSequence(2));
  EXPECT_CODE(mgr_->AppendTokens(2, Tokens(1)), StatusCode::kFailedPrecondition);
  EXPECT_OK(mgr_->CheckInvariants());
}

}  // namespace
}  // namespace blockkv
