// SPDX-License-Identifier: Apache-2.0
// Speculative decoding in StateManager: PostForward with accepted counts and Rollback of
// committed tokens. Scenarios (errors change nothing, blocks come back, forks and the prefix
// cache are never written through, a decode step of k + 1 tokens), then a model-based random
// test: random steps of k drafts with random accept counts (through ScheduleBatch +
// PostForward(batch, accepted) and AppendTokens + Schedule + PostForward(uids, accepted)),
// random Rollback calls, forks, flushes and prompts that hit the prefix cache, and in two more
// setups preemption to the host tier and FreeLeadingBlocks (sliding windows), and Gemma-2
// style DENSE + LOCAL managers (a LOCAL group releases what leaves its window), against a
// reference of each sequence's tokens. Every forward writes each token's id into its KV slot;
// after every operation each sequence's KV reads back exactly its accepted tokens, every
// prefix hit's blocks hold the prompt's tokens, no published block (BlockStored) carries a
// rejected token, blocks per sequence and free blocks are the model's, and CheckInvariants()
// passes. Now and then the whole manager goes through SaveSnapshot / LoadSnapshot and goes on.
#include "blockkv/state_manager.h"

#include "blockkv/ragged_batch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "unit/test_util.h"

namespace blockkv {
namespace {

constexpr TokenId kRejectedBase = 1000;  // draft tokens the test rejects are >= this

// One layer, one KV head of one fp32 value: each token slot holds its K as a float.
KVCacheConfig Group(int32_t block_size, int32_t max_blocks = 64) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {1, 1, 1},
                       .cache_dtype = DType::kFloat32,
                       .max_blocks_per_allocation_group = max_blocks};
}

// A LOCAL (sliding-window) group of the same shape.
KVCacheConfig Local(int32_t block_size, int64_t window) {
  KVCacheConfig c = Group(block_size);
  c.type = KVCacheType::kLocal;
  c.local_window = window;
  return c;
}

StateManagerConfig Config(int32_t num_blocks, bool prefix = false) {
  StateManagerConfig c;
  c.max_tracked_sequences = 32;
  c.max_ragged_batch_size = 256;
  c.max_ragged_sequence_count = 16;
  c.max_context = 1024;
  c.memory_config = {.mode = AllocationMode::kAllocate, .size = num_blocks};
  c.prefix_cache.enabled = prefix;
  return c;
}

std::unique_ptr<StateManager> Make(StateManagerConfig config, std::vector<KVCacheConfig> groups) {
  auto m = StateManager::Create(std::move(config), std::move(groups), CpuDevice(16 << 20));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

// The K slot of token `pos` of `seq` in `group`.
float* Slot(const StateManager& m, const Sequence& seq, int64_t pos, int group = 0) {
  const TensorView view = *m.GetCache(0, group);
  const int32_t bs = m.kv_block_size(group);
  const BlockId block = seq.block_table(group)[static_cast<size_t>(pos / bs)];
  return static_cast<float*>(view.data) + block * view.stride(0) + (pos % bs) * view.stride(1);
}

// The model's forward: writes each in-flight token's id into its KV slot in every group.
void WriteKV(const StateManager& m, SeqId uid, std::span<const TokenId> tokens) {
  const Sequence& seq = *m.GetSequence(uid);
  ASSERT_EQ(std::ssize(tokens), seq.in_flight_tokens());
  for (int g = 0; g < m.num_groups(); ++g) {
    for (size_t t = 0; t < tokens.size(); ++t) {
      *Slot(m, seq, seq.seen_tokens() + static_cast<int64_t>(t), g) = static_cast<float>(tokens[t]);
    }
  }
}

// The KV `uid` holds for positions [from, seen) of `group`, as token ids.
std::vector<TokenId> ReadKV(const StateManager& m, SeqId uid, int group = 0, int64_t from = 0) {
  const Sequence& seq = *m.GetSequence(uid);
  std::vector<TokenId> out;
  for (int64_t p = from; p < seq.seen_tokens(); ++p) {
    out.push_back(static_cast<TokenId>(*Slot(m, seq, p, group)));
  }
  return out;
}

// Schedules `tokens` for `uid` (one forward), writes their KV and keeps `accepted` of them.
Status Step(StateManager& m, SeqId uid, std::vector<TokenId> tokens, int64_t accepted) {
  const SeqId uids[] = {uid};
  const int64_t lengths[] = {std::ssize(tokens)};
  BLOCKKV_RETURN_IF_ERROR(m.Schedule({.uids = uids, .lengths = lengths}));
  WriteKV(m, uid, tokens);
  const int64_t kept[] = {accepted};
  return m.PostForward(uids, kept);
}

std::vector<TokenId> Iota(int n, TokenId first = 0) {
  std::vector<TokenId> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

// ---- PostForward with accepted counts ---------------------------------------------------------

TEST(SpeculativePostForward, KeepsAcceptedTokensAndFreesBlocksPastTheNewEnd) {
  auto m = Make(Config(16), {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(3), 3));  // seen 3, one block
  const int32_t free_before = m->free_blocks()[0];
  // The verified token plus 6 drafts: positions 3..9, three blocks in all.
  const SeqId uids[] = {1};
  const int64_t lengths[] = {7};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 3);
  const uint64_t version = m->GetSequence(1)->table_version();
  const BlockId second = m->GetSequence(1)->block_table()[1];
  const int64_t kept[] = {2};  // seen 5: ceil(5 / 4) = 2 blocks
  ASSERT_OK(m->PostForward(uids, kept));
  const Sequence& seq = *m->GetSequence(1);
  EXPECT_EQ(seq.seen_tokens(), 5);
  EXPECT_EQ(seq.in_flight_tokens(), 0);
  EXPECT_EQ(seq.cur_allocated_blocks(), 2);
  EXPECT_EQ(seq.block_table()[1], second);
  EXPECT_EQ(m->block_tables()[seq.tracking_slot() * 64 + 2], kNoBlock);
  EXPECT_NE(seq.table_version(), version);
  EXPECT_EQ(m->free_blocks()[0], free_before - 1);
  ASSERT_OK(m->CheckInvariants());
}

TEST(SpeculativePostForward, KeepingEveryTokenIsPlainPostForward) {
  auto m = Make(Config(16), {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(6), 6));
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 6);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 2);
  ASSERT_OK(Step(*m, 1, Iota(1), 0));  // a decode step that keeps nothing
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 6);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 2);
  ASSERT_OK(m->CheckInvariants());
}

TEST(SpeculativePostForward, RejectsBadCountsAndChangesNothing) {
  auto m = Make(Config(16), {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(2), 2));
  ASSERT_OK(Step(*m, 2, Iota(2), 2));
  const SeqId uids[] = {1, 2};
  const int64_t lengths[] = {5, 1};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  const std::vector<int32_t> free_before = m->free_blocks();
  auto unchanged = [&] {
    EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 2);
    EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 5);
    EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 2);
    EXPECT_EQ(m->GetSequence(2)->in_flight_tokens(), 1);
    EXPECT_EQ(m->free_blocks(), free_before);
    EXPECT_OK(m->CheckInvariants());
  };
  const int64_t too_many[] = {6, 1};
  Status s = m->PostForward(uids, too_many);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("accepted 6 tokens of 5"), std::string::npos) << s;
  EXPECT_NE(s.message().find("[0, 5]"), std::string::npos) << s;
  unchanged();
  const int64_t negative[] = {1, -1};  // the second is bad: the first is not applied either
  s = m->PostForward(uids, negative);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("-1"), std::string::npos) << s;
  unchanged();
  const int64_t one[] = {1};
  s = m->PostForward(uids, one);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("1 accepted counts for 2 sequences"), std::string::npos) << s;
  unchanged();
  const SeqId twice[] = {1, 1};
  const int64_t counts[] = {1, 1};
  EXPECT_CODE(m->PostForward(twice, counts), StatusCode::kInvalidArgument);
  unchanged();
  const SeqId unknown[] = {1, 9};
  EXPECT_CODE(m->PostForward(unknown, counts), StatusCode::kNotFound);
  unchanged();
  const int64_t ok[] = {3, 1};
  ASSERT_OK(m->PostForward(uids, ok));
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 5);
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 3);
}

// A decoding sequence carries the verified token plus k drafts in one ragged batch entry, and
// PostForward(batch, accepted) keeps some of them.
TEST(SpeculativePostForward, BatchCarriesKPlusOneTokensPerDecodingSequence) {
  StateManagerConfig config = Config(32);
  auto m = Make(config, {Group(4)});
  auto batch = std::move(RaggedBatch::Create(*m)).value();
  ASSERT_OK(Step(*m, 1, Iota(5), 5));
  ASSERT_OK(Step(*m, 2, Iota(1), 1));  // T = 1 sequence
  const SeqId uids[] = {1, 2};
  const int64_t lengths[] = {5, 5};  // 1 verified + 4 drafts each
  const std::vector<TokenId> tokens = {7, 8, 9, 10, 11, 3, 4, 5, 6, 7};
  ASSERT_OK(m->ScheduleBatch({.uids = uids, .lengths = lengths}, tokens, *batch));
  EXPECT_EQ(batch->current_tokens(), 10);
  EXPECT_EQ(batch->current_sequences(), 2);
  const int64_t accepted[] = {1, 5};
  ASSERT_OK(m->PostForward(*batch, accepted));
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 6);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 2);
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 6);
  EXPECT_EQ(m->GetSequence(2)->cur_allocated_blocks(), 2);
  // The batch is stale now: a second PostForward of it is refused.
  EXPECT_CODE(m->PostForward(*batch, accepted), StatusCode::kFailedPrecondition);
  const int64_t wrong[] = {1};
  ASSERT_OK(m->ScheduleBatch({.uids = uids, .lengths = lengths}, tokens, *batch));
  EXPECT_CODE(m->PostForward(*batch, wrong), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 5);
  ASSERT_OK(m->CheckInvariants());
}

// ---- Rollback of committed tokens -------------------------------------------------------------

TEST(Rollback, ShrinksToTheNewEnd) {
  auto m = Make(Config(16), {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(10), 10));
  const int32_t free_before = m->free_blocks()[0];
  ASSERT_OK(m->Rollback(1, 5));
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 5);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 2);
  EXPECT_EQ(m->free_blocks()[0], free_before + 1);
  ASSERT_OK(m->Rollback(1, 0));
  ASSERT_OK(m->Rollback(1, 5));  // everything
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 0);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 0);
  EXPECT_EQ(m->free_blocks()[0], 16);
  ASSERT_OK(m->CheckInvariants());
  ASSERT_OK(Step(*m, 1, Iota(1), 1));  // T = 1 after a full rollback
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 1);
}

TEST(Rollback, RejectsBadArgumentsAndChangesNothing) {
  auto m = Make(Config(16), {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(6), 6));
  Status s = m->Rollback(1, 7);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("roll back 7 tokens"), std::string::npos) << s;
  EXPECT_NE(s.message().find("it has 6"), std::string::npos) << s;
  s = m->Rollback(1, -1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("-1"), std::string::npos) << s;
  EXPECT_CODE(m->Rollback(2, 1), StatusCode::kNotFound);
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 6);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 2);
  // Tokens in flight: a clear error, the step is left as it was.
  const SeqId uids[] = {1};
  const int64_t lengths[] = {3};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  s = m->Rollback(1, 1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("3 tokens in flight"), std::string::npos) << s;
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 6);
  EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 3);
  ASSERT_OK(m->CheckInvariants());
}

// Rolling one fork back into the block both share gives it a private copy: the sibling's KV
// and table are untouched, and later writes go to the copy.
TEST(Rollback, ForkRollingBackIntoASharedBlockCopiesIt) {
  auto m = Make(Config(16), {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(8), 8));
  ASSERT_OK(m->Fork(1, 2));
  const BlockId shared = m->GetSequence(1)->block_table()[1];
  ASSERT_EQ(m->GetSequence(2)->block_table()[1], shared);
  ASSERT_OK(m->Rollback(2, 2));  // 6 tokens: block 1 is partial now
  const Sequence& child = *m->GetSequence(2);
  EXPECT_EQ(child.cur_allocated_blocks(), 2);
  EXPECT_NE(child.block_table()[1], shared);
  EXPECT_EQ(m->pool().ref_count(shared), 1);
  EXPECT_EQ(ReadKV(*m, 2), Iota(6));  // the copy holds the shared tokens
  ASSERT_OK(Step(*m, 2, {50, 51}, 2));
  EXPECT_EQ(ReadKV(*m, 1), Iota(8));
  EXPECT_EQ(ReadKV(*m, 2), (std::vector<TokenId>{0, 1, 2, 3, 4, 5, 50, 51}));
  // Rolling the parent back past the shared block drops only its reference.
  const BlockId first = m->GetSequence(1)->block_table()[0];
  ASSERT_OK(m->Rollback(1, 8));
  EXPECT_EQ(m->pool().ref_count(first), 1);
  EXPECT_EQ(ReadKV(*m, 2), (std::vector<TokenId>{0, 1, 2, 3, 4, 5, 50, 51}));
  ASSERT_OK(m->CheckInvariants());
}

TEST(Rollback, ACopyWithoutAFreeBlockIsResourceExhaustedAndChangesNothing) {
  auto m = Make(Config(2), {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(8), 8));
  ASSERT_OK(m->Fork(1, 2));
  const Status s = m->Rollback(2, 1);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 8);
  EXPECT_EQ(m->pool().ref_count(m->GetSequence(2)->block_table()[1]), 2);
  ASSERT_OK(m->Rollback(2, 4));  // a block boundary needs no copy
  EXPECT_EQ(m->GetSequence(2)->cur_allocated_blocks(), 1);
  ASSERT_OK(m->CheckInvariants());
}

// A rolled-back published block stays cached (its tokens were right) and later hits; the
// sequence's new tokens never reach it.
TEST(Rollback, PublishedBlocksStayValidCacheEntries) {
  auto m = Make(Config(16, /*prefix=*/true), {Group(4)});
  const std::vector<TokenId> prompt = Iota(9);
  ASSERT_TRUE(m->AddSequence(1, prompt).ok());
  ASSERT_OK(Step(*m, 1, prompt, 9));  // publishes blocks 0 and 1
  ASSERT_TRUE(m->pool().is_cached(m->GetSequence(1)->block_table()[1]));
  ASSERT_FALSE(m->pool().is_cached(m->GetSequence(1)->block_table()[2]));
  const BlockId published = m->GetSequence(1)->block_table()[1];
  ASSERT_OK(m->Rollback(1, 3));  // 6 tokens: inside the published block 1
  EXPECT_NE(m->GetSequence(1)->block_table()[1], published);
  ASSERT_OK(m->AppendTokens(1, std::vector<TokenId>{60, 61, 62}));
  ASSERT_OK(Step(*m, 1, {60, 61, 62}, 3));
  EXPECT_EQ(ReadKV(*m, 1), (std::vector<TokenId>{0, 1, 2, 3, 4, 5, 60, 61, 62}));
  // The original prompt still hits both blocks, whose KV is the prompt's.
  ASSERT_TRUE(m->AddSequence(2, prompt).ok());
  const SeqId uids[] = {2};
  const int64_t lengths[] = {9};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  EXPECT_EQ(m->GetSequence(2)->cached_prefix_tokens(), 8);
  EXPECT_EQ(m->GetSequence(2)->block_table()[1], published);
  // And the new branch's own block 1 ({4, 5, 60, 61}) was published under its own key.
  std::vector<TokenId> branch = {0, 1, 2, 3, 4, 5, 60, 61, 62};
  ASSERT_TRUE(m->AddSequence(3, branch).ok());
  const SeqId third[] = {3};
  ASSERT_OK(m->Schedule({.uids = third, .lengths = lengths}));
  EXPECT_EQ(m->GetSequence(3)->cached_prefix_tokens(), 8);
  EXPECT_EQ(m->GetSequence(3)->block_table()[1], m->GetSequence(1)->block_table()[1]);
  ASSERT_OK(m->CheckInvariants());
}

// Rolling back below a prefix hit lowers cached_prefix_tokens to what the sequence still holds;
// the manager then saves and loads (LoadSnapshot refuses cached > seen).
TEST(Rollback, BelowAPrefixHitLowersCachedPrefixTokensAndSnapshotsLoad) {
  auto m = Make(Config(16, /*prefix=*/true), {Group(4)});
  ASSERT_TRUE(m->AddSequence(1, Iota(9)).ok());
  ASSERT_OK(Step(*m, 1, Iota(9), 9));
  ASSERT_TRUE(m->AddSequence(2, Iota(9)).ok());
  const SeqId uids[] = {2};
  const int64_t lengths[] = {9};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  ASSERT_EQ(m->GetSequence(2)->cached_prefix_tokens(), 8);
  WriteKV(*m, 2, std::vector<TokenId>{8});
  ASSERT_OK(m->PostForward(uids));
  ASSERT_OK(m->Rollback(2, 6));
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 3);
  EXPECT_EQ(m->GetSequence(2)->cached_prefix_tokens(), 3);
  Result<std::vector<std::byte>> bytes = m->SaveSnapshot();
  ASSERT_OK(bytes);
  ASSERT_OK(m->LoadSnapshot(*bytes));
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 3);
  EXPECT_EQ(ReadKV(*m, 2), Iota(3));
  ASSERT_OK(m->CheckInvariants());
}

// A sliding-window group whose leading blocks were released keeps a whole block before the new
// end; rolling back further is a clear error.
TEST(Rollback, SlidingWindowKeepsABlockBeforeTheNewEnd) {
  auto m = Make(Config(16), {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(12), 12));
  ASSERT_OK(m->FreeLeadingBlocks(1, 1));
  const Status s = m->Rollback(1, 5);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("at most 4 of its 12 tokens, asked for 5"), std::string::npos) << s;
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 12);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 3);
  ASSERT_OK(m->Rollback(1, 3));
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 9);
  EXPECT_EQ(m->GetSequence(1)->released_blocks(), 1);
  ASSERT_OK(m->CheckInvariants());
  ASSERT_OK(Step(*m, 1, {90, 91, 92, 93}, 2));  // speculation after partial freeing
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 11);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 3);
  ASSERT_OK(m->CheckInvariants());
}

TEST(Rollback, PreemptedSequenceIsRefusedUntilResumed) {
  StateManagerConfig config = Config(16);
  config.offload = true;
  config.offload_config.host_blocks = 8;
  auto m = Make(config, {Group(4)});
  ASSERT_OK(Step(*m, 1, Iota(7), 7));
  Result<OffloadTicket> out = m->PreemptSequence(1);
  ASSERT_OK(out);
  ASSERT_OK(out->Wait());
  const Status s = m->Rollback(1, 2);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 7);
  ASSERT_OK(m->CheckInvariants());
  Result<OffloadTicket> in = m->ResumeSequence(1);
  ASSERT_OK(in);
  ASSERT_OK(m->Rollback(1, 4));  // waits for the resume
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 3);
  EXPECT_EQ(m->GetSequence(1)->cur_allocated_blocks(), 1);
  EXPECT_EQ(ReadKV(*m, 1), Iota(3));
  ASSERT_OK(m->CheckInvariants());
}

// Rejected drafts are never published: a block is published once all its tokens are kept.
TEST(SpeculativePostForward, NeverPublishesABlockHoldingARejectedToken) {
  auto m = Make(Config(16, /*prefix=*/true), {Group(4)});
  auto batch = std::move(RaggedBatch::Create(*m)).value();
  ASSERT_TRUE(m->AddSequence(1, Iota(2)).ok());
  const SeqId uids[] = {1};
  const int64_t two[] = {2};
  ASSERT_OK(m->ScheduleBatch({.uids = uids, .lengths = two}, Iota(2), *batch));
  ASSERT_OK(m->PostForward(*batch));
  m->DrainCacheEvents();
  // Positions 2..7: kept 2, 3; rejected 1002.. (which would fill blocks 0 and 1).
  const std::vector<TokenId> step = {2, 3, 1002, 1003, 1004, 1005};
  const int64_t six[] = {6};
  ASSERT_OK(m->ScheduleBatch({.uids = uids, .lengths = six}, step, *batch));
  const int64_t kept[] = {2};
  ASSERT_OK(m->PostForward(*batch, kept));
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 4);
  CacheEventBatch events = m->DrainCacheEvents();
  ASSERT_EQ(events.events.size(), 1u);  // block 0 = {0, 1, 2, 3}
  EXPECT_EQ(std::get<BlockStored>(events.events[0]).tokens, Iota(4));
  // The same with the drafts appended before scheduling (the AppendTokens flow): known tokens
  // past the kept ones are forgotten.
  ASSERT_OK(m->AppendTokens(1, std::vector<TokenId>{4, 1005, 1006, 1007}));
  const int64_t four[] = {4};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = four}));
  const int64_t one[] = {1};
  ASSERT_OK(m->PostForward(uids, one));
  EXPECT_TRUE(m->DrainCacheEvents().events.empty());
  ASSERT_OK(m->AppendTokens(1, std::vector<TokenId>{5, 6, 7}));
  const int64_t three[] = {3};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = three}));
  ASSERT_OK(m->PostForward(uids));
  events = m->DrainCacheEvents();
  ASSERT_EQ(events.events.size(), 1u);  // block 1 = {4, 5, 6, 7}
  EXPECT_EQ(std::get<BlockStored>(events.events[0]).tokens, Iota(4, 4));
  ASSERT_OK(m->CheckInvariants());
}

// ---- LOCAL groups (sliding-window layers) ------------------------------------------------------

// A LOCAL group releases the blocks wholly before seen - W after each forward; the DENSE group
// beside it keeps everything. No FreeLeadingBlocks call.
TEST(LocalGroup, ReleasesBlocksThatLeaveTheWindowAtPostForward) {
  auto m = Make(Config(40), {Group(4), Local(4, 6)});
  ASSERT_OK(Step(*m, 1, Iota(9), 9));  // 9 - 6 = 3: no whole block before position 3
  EXPECT_EQ(m->GetSequence(1)->released_blocks(1), 0);
  ASSERT_OK(Step(*m, 1, Iota(1, 9), 1));  // 10 - 6 = 4: block 0 is out
  const Sequence& seq = *m->GetSequence(1);
  EXPECT_EQ(seq.released_blocks(0), 0);
  EXPECT_EQ(seq.released_blocks(1), 1);
  EXPECT_EQ(seq.block_table(1)[0], kNoBlock);
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{37, 38}));
  for (int t = 10; t < 30; ++t) ASSERT_OK(Step(*m, 1, {t}, 1));
  EXPECT_EQ(seq.released_blocks(1), 6);  // (30 - 6) / 4
  EXPECT_EQ(seq.cur_allocated_blocks(1), 8);
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{32, 38}));
  EXPECT_EQ(ReadKV(*m, 1, 1, 24), Iota(6, 24));  // the window's KV is intact
  EXPECT_EQ(ReadKV(*m, 1, 0), Iota(30));
  // A fork carries the released entries; rolling back into the window is refused.
  ASSERT_OK(m->Fork(1, 2));
  EXPECT_EQ(m->GetSequence(2)->released_blocks(1), 6);
  const Status s = m->Rollback(1, 1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("out of its local_window"), std::string::npos) << s;
  EXPECT_NE(s.message().find("at most 0 of its 30 tokens, asked for 1"), std::string::npos) << s;
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 30);
  ASSERT_OK(m->CheckInvariants());
}

// A prompt's prefix hit is a length both groups serve: the DENSE group every block, the LOCAL
// group only the window's blocks before it, and a snapshot carries the released entries.
TEST(LocalGroup, PrefixHitTakesOnlyTheWindowsBlocks) {
  auto m = Make(Config(40, /*prefix=*/true), {Group(4), Local(4, 6)});
  const std::vector<TokenId> prompt = Iota(21);
  for (const SeqId uid : {1, 2}) {
    ASSERT_OK(m->AddSequence(uid, prompt));
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {std::ssize(prompt)};
    ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
    const int64_t seen = m->GetSequence(uid)->seen_tokens();  // the hit
    WriteKV(*m, uid, std::span<const TokenId>(prompt).subspan(static_cast<size_t>(seen)));
    ASSERT_OK(m->PostForward(uids));
  }
  const Sequence& hit = *m->GetSequence(2);
  EXPECT_EQ(hit.cached_prefix_tokens(), 20);  // the last token is recomputed
  EXPECT_EQ(hit.released_blocks(1), 3);       // (21 - 6) / 4 after the forward
  EXPECT_EQ(ReadKV(*m, 2, 1, 12), Iota(9, 12));
  EXPECT_EQ(ReadKV(*m, 2, 0), prompt);
  Result<std::vector<std::byte>> bytes = m->SaveSnapshot();
  ASSERT_OK(bytes);
  ASSERT_OK(m->LoadSnapshot(*bytes));
  EXPECT_EQ(m->GetSequence(2)->released_blocks(1), 3);
  ASSERT_OK(m->CheckInvariants());
  // A manager whose LOCAL group has another window does not take it.
  auto other = Make(Config(40, /*prefix=*/true), {Group(4), Local(4, 8)});
  const Status s = other->LoadSnapshot(*bytes);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("sliding_windows[1]"), std::string::npos) << s;
  EXPECT_EQ(other->n_tracked_sequences(), 0);
}

TEST(LocalGroup, APrefixCacheWindowMustRepeatTheGroupsWindow) {
  StateManagerConfig config = Config(16, /*prefix=*/true);
  config.prefix_cache.sliding_windows = {0, 8};
  Result<std::unique_ptr<StateManager>> m =
      StateManager::Create(config, {Group(4), Local(4, 6)}, CpuDevice(16 << 20));
  ASSERT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("prefix_cache.sliding_windows[1] is 8 but cache group 1 is "
                                      "LOCAL with local_window=6"),
            std::string::npos)
      << m.status();
  config.prefix_cache.sliding_windows = {0, 6};
  EXPECT_OK(StateManager::Create(config, {Group(4), Local(4, 6)}, CpuDevice(16 << 20)).status());
}

// ---- model-based random test ------------------------------------------------------------------

uint64_t Seed() {
  const char* env = std::getenv("BLOCKKV_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 0) : 0x5bec'd0c5ULL;
}

struct ModelSetup {
  std::string name;
  std::vector<KVCacheConfig> groups;
  int32_t num_blocks;
  bool prefix;
  bool offload = false;  // preempt / resume through a host tier (and the prefix cache's host level)
  bool window = false;   // FreeLeadingBlocks (one cache group)
  bool shared = false;   // MemoryConfig::shared_pool: every group draws from one pool
};

class RollbackModel {
 public:
  RollbackModel(const ModelSetup& setup, uint64_t seed) : setup_(setup), rng_(seed) {
    StateManagerConfig config = Config(setup.num_blocks, setup.prefix);
    config.memory_config.shared_pool = setup.shared;
    if (setup.offload) {
      config.offload = true;
      config.offload_config.host_blocks = setup.num_blocks;
    }
    m_ = Make(config, setup.groups);
    batch_ = std::move(RaggedBatch::Create(*m_)).value();
  }

  ::testing::AssertionResult Run(int steps) {
    for (int step = 0; step < steps; ++step) {
      const int op = Pick(0, 99);
      std::string what;
      if (op < 12) {
        what = "add";
        Add();
      } else if (op < 58) {
        what = "speculative step";
        SpeculativeStep();
      } else if (op < 76) {
        what = "rollback";
        RollbackOne();
      } else if (op < 84) {
        what = "fork";
        ForkOne();
      } else if (op < 90) {
        what = "flush";
        FlushOne();
      } else if (op < 92) {
        what = "rollback in flight";
        RollbackInFlight();
      } else if (op < 94) {
        what = "snapshot round trip";
        SnapshotRoundTrip();
      } else if (op < 97) {
        what = "preempt or resume";
        if (setup_.offload) PreemptOrResume();
      } else {
        what = "free leading blocks";
        if (setup_.window) FreeLeading();
      }
      if (::testing::Test::HasFailure()) {
        return ::testing::AssertionFailure() << "step " << step << " (" << what << ")";
      }
      if (auto ok = Agrees(); !ok) return ok << " after step " << step << " (" << what << ")";
    }
    return ::testing::AssertionSuccess();
  }

  int64_t hits() const { return hits_; }
  int64_t rejected() const { return rejected_; }
  int64_t rollbacks() const { return rollbacks_; }
  int64_t copies() const { return copies_; }
  int64_t snapshots() const { return snapshots_; }
  int64_t preemptions() const { return preemptions_; }
  int64_t window_refusals() const { return window_refusals_; }

 private:
  int Pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  TokenId Kept() { return static_cast<TokenId>(Pick(0, 3)); }
  SeqId AnySequence() {
    if (model_.empty()) return -1;
    auto it = model_.begin();
    std::advance(it, Pick(0, static_cast<int>(model_.size()) - 1));
    return it->first;
  }
  // A sequence that is not preempted, or -1.
  SeqId Resident() {
    for (int tries = 0; tries < 4; ++tries) {
      if (const SeqId uid = AnySequence(); uid >= 0 && !preempted_.contains(uid)) return uid;
    }
    return -1;
  }
  int64_t Released(SeqId uid, int g = 0) const {
    const auto it = released_.find({uid, g});
    return it == released_.end() ? 0 : it->second;
  }
  int64_t Window(int g) const {
    const KVCacheConfig& c = setup_.groups[static_cast<size_t>(g)];
    return c.type == KVCacheType::kLocal ? c.local_window : 0;
  }
  // After a forward of `uid`: a LOCAL group has released every block wholly before seen - W.
  void ReleaseOutOfWindow(SeqId uid) {
    const auto seen = std::ssize(model_[uid]);
    for (int g = 0; g < m_->num_groups(); ++g) {
      if (Window(g) == 0 || seen <= Window(g)) continue;
      const int64_t out = (seen - Window(g)) / m_->kv_block_size(g);
      if (out > Released(uid, g)) released_[{uid, g}] = out;
    }
  }

  void Add() {
    if (model_.size() >= 12) return;
    const SeqId uid = next_uid_++;
    std::vector<TokenId> prompt;
    if (const SeqId other = AnySequence(); other >= 0 && Pick(0, 1) == 0) {
      const std::vector<TokenId>& theirs = model_[other];
      prompt.assign(theirs.begin(), theirs.begin() + Pick(0, static_cast<int>(theirs.size())));
    }
    for (int n = Pick(1, 6); n > 0; --n) prompt.push_back(Kept());
    ASSERT_OK(m_->AddSequence(uid, prompt));
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {std::ssize(prompt)};
    const Status s = m_->ScheduleBatch({.uids = uids, .lengths = lengths}, prompt, *batch_);
    if (!s.ok()) {
      ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      ASSERT_OK(m_->FlushSequence(uid));
      return;
    }
    const Sequence& seq = *m_->GetSequence(uid);
    // A hit's blocks hold exactly the prompt's tokens: nothing rejected was ever cached.
    if (seq.cached_prefix_tokens() > 0) {
      ++hits_;
      for (int g = 0; g < m_->num_groups(); ++g) {
        // A LOCAL group holds only the window's blocks of the hit.
        const int64_t from = std::max<int64_t>(0, seq.seen_tokens() - Window(g)) /
                             m_->kv_block_size(g) * m_->kv_block_size(g) * (Window(g) > 0);
        EXPECT_EQ(seq.released_blocks(g), from / m_->kv_block_size(g));
        const std::vector<TokenId> kv = ReadKV(*m_, uid, g, from);
        ASSERT_EQ(
            kv, std::vector<TokenId>(prompt.begin() + from, prompt.begin() + from + std::ssize(kv)))
            << "prefix hit of sequence " << uid << " group " << g;
      }
    }
    WriteKV(*m_, uid,
            std::span<const TokenId>(prompt).subspan(static_cast<size_t>(seq.seen_tokens())));
    ASSERT_OK(m_->PostForward(*batch_));
    model_[uid] = prompt;
    ReleaseOutOfWindow(uid);
  }

  // 1-3 sequences each run the verified token plus k drafts and keep a random number of them;
  // rejected ones carry ids >= kRejectedBase.
  void SpeculativeStep() {
    std::set<SeqId> chosen;
    for (int n = Pick(1, 3); n > 0; --n) {
      if (const SeqId uid = Resident(); uid >= 0) chosen.insert(uid);
    }
    if (chosen.empty()) return;
    const std::vector<SeqId> uids(chosen.begin(), chosen.end());
    std::vector<int64_t> lengths;
    std::vector<int64_t> accepted;
    std::vector<TokenId> tokens;
    for (size_t i = 0; i < uids.size(); ++i) {
      const int k = Pick(0, 4);
      const int keep = Pick(0, k + 1);
      lengths.push_back(k + 1);
      accepted.push_back(keep);
      for (int t = 0; t <= k; ++t) {
        tokens.push_back(t < keep ? Kept() : static_cast<TokenId>(kRejectedBase + Pick(0, 99)));
      }
    }
    const ScheduleRequest request{.uids = uids, .lengths = lengths};
    const bool through_batch = Pick(0, 1) == 0;
    if (through_batch) {
      const Status s = m_->ScheduleBatch(request, tokens, *batch_);
      if (!s.ok()) {
        ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
        return;
      }
    } else {
      // The AppendTokens flow: the engine appends its drafts, then schedules them.
      Result<SchedulingResult> fits = m_->CanSchedule(request);
      ASSERT_OK(fits);
      if (*fits != SchedulingResult::kSuccess) return;
      size_t at = 0;
      for (size_t i = 0; i < uids.size(); ++i) {
        if (setup_.prefix) {
          ASSERT_OK(m_->AppendTokens(uids[i], std::span<const TokenId>(tokens).subspan(
                                                  at, static_cast<size_t>(lengths[i]))));
        }
        at += static_cast<size_t>(lengths[i]);
      }
      ASSERT_OK(m_->Schedule(request));
    }
    size_t at = 0;
    for (size_t i = 0; i < uids.size(); ++i) {
      const std::span<const TokenId> mine =
          std::span<const TokenId>(tokens).subspan(at, static_cast<size_t>(lengths[i]));
      WriteKV(*m_, uids[i], mine);
      at += mine.size();
    }
    ASSERT_OK(through_batch ? m_->PostForward(*batch_, accepted) : m_->PostForward(uids, accepted));
    at = 0;
    for (size_t i = 0; i < uids.size(); ++i) {
      std::vector<TokenId>& mine = model_[uids[i]];
      mine.insert(
          mine.end(), tokens.begin() + static_cast<std::ptrdiff_t>(at),
          tokens.begin() + static_cast<std::ptrdiff_t>(at + static_cast<size_t>(accepted[i])));
      rejected_ += lengths[i] - accepted[i];
      at += static_cast<size_t>(lengths[i]);
      ReleaseOutOfWindow(uids[i]);
    }
  }

  void RollbackOne() {
    const SeqId uid = AnySequence();
    if (uid < 0) return;
    std::vector<TokenId>& mine = model_[uid];
    const int n = Pick(0, static_cast<int>(mine.size()) + 1);
    const std::vector<int32_t> free_before = m_->free_blocks();
    std::vector<BlockId> table_before;
    for (int g = 0; g < m_->num_groups(); ++g) {
      const std::span<const BlockId> t = m_->GetSequence(uid)->block_table(g);
      table_before.insert(table_before.end(), t.begin(), t.end());
    }
    const Status s = m_->Rollback(uid, n);
    const int64_t end = std::ssize(mine) - n;
    if (preempted_.contains(uid)) {
      ASSERT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    } else if (n > std::ssize(mine)) {
      ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    } else if (n > 0 && WindowRefuses(uid, end)) {
      // The window's blocks are gone.
      ASSERT_EQ(s.code(), StatusCode::kFailedPrecondition)
          << s << ": sequence " << uid << " of " << mine.size() << " tokens, n " << n
          << ", released " << Released(uid, 0) << " / " << m_->GetSequence(uid)->released_blocks(0)
          << " blocks of group 0";
      ++window_refusals_;
    } else if (s.code() == StatusCode::kResourceExhausted) {
      // Only a private copy can fail, and only with no block to take (a shared pool: fewer
      // free blocks than groups, each of which may need a copy).
      if (setup_.shared) {
        ASSERT_LT(free_before[0], m_->num_groups()) << s;
      } else {
        ASSERT_TRUE(std::find(free_before.begin(), free_before.end(), 0) != free_before.end()) << s;
      }
    } else {
      ASSERT_OK(s);
      ++rollbacks_;
      for (int g = 0; g < m_->num_groups(); ++g) {
        const int32_t bs = m_->kv_block_size(g);
        if (end % bs != 0 && m_->GetSequence(uid)->block_table(g)[end / bs] !=
                                 table_before[static_cast<size_t>(end / bs)]) {
          ++copies_;
        }
        table_before.erase(table_before.begin(),
                           table_before.begin() + (std::ssize(mine) + bs - 1) / bs);
      }
      mine.resize(mine.size() - static_cast<size_t>(n));
      return;
    }
    ASSERT_EQ(m_->free_blocks(), free_before);  // failed: nothing changed (Agrees checks more)
  }

  // A group that released leading blocks keeps a whole block before the new end, and a LOCAL
  // group's window before it too.
  bool WindowRefuses(SeqId uid, int64_t end) const {
    for (int g = 0; g < m_->num_groups(); ++g) {
      const int64_t r = Released(uid, g);
      if (r == 0) continue;
      const int64_t bs = m_->kv_block_size(g);
      if (end < std::max((r + 1) * bs, r * bs + Window(g))) return true;
    }
    return false;
  }

  void ForkOne() {
    const SeqId parent = AnySequence();
    if (parent < 0 || model_.size() >= 12) return;
    const SeqId child = next_uid_++;
    const Status s = m_->Fork(parent, child);
    if (preempted_.contains(parent)) {
      ASSERT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
      return;
    }
    if (!s.ok()) {
      ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      return;
    }
    model_[child] = model_[parent];
    for (int g = 0; g < m_->num_groups(); ++g) {
      if (Released(parent, g) > 0) released_[{child, g}] = Released(parent, g);
    }
  }

  void FlushOne() {
    const SeqId uid = AnySequence();
    if (uid < 0) return;
    ASSERT_OK(m_->FlushSequence(uid));
    model_.erase(uid);
    preempted_.erase(uid);
    for (int g = 0; g < m_->num_groups(); ++g) released_.erase({uid, g});
  }

  void RollbackInFlight() {
    const SeqId uid = Resident();
    if (uid < 0) return;
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {1};
    if (!m_->Schedule({.uids = uids, .lengths = lengths}).ok()) return;
    ASSERT_CODE(m_->Rollback(uid, 0), StatusCode::kFailedPrecondition);
    const int64_t none[] = {0};
    ASSERT_OK(m_->PostForward(uids, none));
  }

  // A snapshot after rollbacks loads back (LoadSnapshot checks every sequence's published
  // blocks and chain against the cache) and the run goes on from it.
  void SnapshotRoundTrip() {
    // A resume is settled by the next call naming the sequence (Rollback(uid, 0) here); a
    // snapshot refuses an unsettled one.
    for (const SeqId uid : resumed_) {
      if (m_->GetSequence(uid) != nullptr && !preempted_.contains(uid)) {
        ASSERT_OK(m_->Rollback(uid, 0));
      }
    }
    resumed_.clear();
    Result<std::vector<std::byte>> bytes = m_->SaveSnapshot();
    if (!preempted_.empty()) {  // a snapshot does not hold the offload tiers
      ASSERT_EQ(bytes.status().code(), StatusCode::kFailedPrecondition) << bytes.status();
      // Now and then resume them all (flush those whose blocks are not there), so that
      // snapshots happen.
      if (Pick(0, 1) == 0) return;
      for (const SeqId uid : std::vector<SeqId>(preempted_.begin(), preempted_.end())) {
        Result<OffloadTicket> ticket = m_->ResumeSequence(uid);
        if (!ticket.ok()) {
          ASSERT_EQ(ticket.status().code(), StatusCode::kResourceExhausted) << ticket.status();
          ASSERT_OK(m_->FlushSequence(uid));
          model_.erase(uid);
          preempted_.erase(uid);
          for (int g = 0; g < m_->num_groups(); ++g) released_.erase({uid, g});
          continue;
        }
        ASSERT_OK(ticket->Wait());
        ASSERT_OK(m_->Rollback(uid, 0));
        preempted_.erase(uid);
      }
      bytes = m_->SaveSnapshot();
    }
    ASSERT_OK(bytes);
    ASSERT_OK(m_->LoadSnapshot(*bytes));
    ++snapshots_;
  }

  // Preempts a resident sequence to the host tier, or resumes a preempted one; waits for the copy
  // so that the KV can be read back.
  void PreemptOrResume() {
    const SeqId uid = AnySequence();
    if (uid < 0) return;
    const bool resume = preempted_.contains(uid);
    Result<OffloadTicket> ticket = resume ? m_->ResumeSequence(uid) : m_->PreemptSequence(uid);
    if (!ticket.ok()) {
      ASSERT_EQ(ticket.status().code(), StatusCode::kResourceExhausted) << ticket.status();
      return;
    }
    ASSERT_OK(ticket->Wait());
    if (resume) {
      preempted_.erase(uid);
      resumed_.insert(uid);
    } else {
      preempted_.insert(uid);
      ++preemptions_;
    }
  }

  // Releases a resident sequence's oldest held block when one lies wholly before seen_tokens.
  void FreeLeading() {
    const SeqId uid = Resident();
    if (uid < 0) return;
    if ((Released(uid) + 1) * m_->kv_block_size(0) > std::ssize(model_[uid])) return;
    ASSERT_OK(m_->FreeLeadingBlocks(uid, 1));
    ++released_[{uid, 0}];
  }

  ::testing::AssertionResult Agrees() {
    if (Status s = m_->CheckInvariants(); !s.ok()) {
      return ::testing::AssertionFailure() << "CheckInvariants: " << s;
    }
    MODEL_CHECK(m_->n_tracked_sequences() == std::ssize(model_));
    std::set<BlockId> pool_held;  // with a shared pool: what every group holds, each block once
    int64_t pool_entries = 0;
    for (int g = 0; g < m_->num_groups(); ++g) {
      const int32_t bs = m_->kv_block_size(g);
      std::set<BlockId> held;
      for (const auto& [uid, tokens] : model_) {
        const Sequence* seq = m_->GetSequence(uid);
        MODEL_CHECK(seq != nullptr) << "sequence " << uid;
        MODEL_CHECK(seq->seen_tokens() == std::ssize(tokens))
            << "sequence " << uid << ": " << seq->seen_tokens() << " vs " << tokens.size();
        MODEL_CHECK(seq->in_flight_tokens() == 0) << "sequence " << uid;
        MODEL_CHECK(seq->preempted() == preempted_.contains(uid)) << "sequence " << uid;
        MODEL_CHECK(seq->cur_allocated_blocks(g) == (std::ssize(tokens) + bs - 1) / bs)
            << "sequence " << uid << " group " << g << " holds " << seq->cur_allocated_blocks(g);
        if (seq->preempted()) continue;  // its blocks are in the host tier
        MODEL_CHECK(seq->released_blocks(g) == Released(uid, g))
            << "sequence " << uid << " group " << g << " released " << seq->released_blocks(g);
        const int64_t from = Released(uid, g) * bs;
        MODEL_CHECK(
            ReadKV(*m_, uid, g, from) ==
            std::vector<TokenId>(tokens.begin() + std::min(from, std::ssize(tokens)), tokens.end()))
            << "KV of sequence " << uid << " group " << g;
        for (const BlockId b : seq->block_table(g)) {
          if (b != kNoBlock) held.insert(b);
        }
      }
      if (m_->offload_store() != nullptr) {  // copies not yet applied hold their blocks
        for (const BlockId b : m_->offload_store()->held_blocks(g)) held.insert(b);
      }
      if (setup_.shared) {
        pool_held.insert(held.begin(), held.end());
        pool_entries += std::ssize(held);
        continue;
      }
      MODEL_CHECK(m_->free_blocks()[static_cast<size_t>(g)] == setup_.num_blocks - std::ssize(held))
          << "group " << g << ": " << m_->free_blocks()[static_cast<size_t>(g)] << " free, "
          << held.size() << " held";
    }
    if (setup_.shared) {
      // No block is held by two groups, and every group sees the one pool's free count.
      MODEL_CHECK(std::ssize(pool_held) == pool_entries)
          << pool_entries - std::ssize(pool_held) << " blocks held by two groups";
      for (int g = 0; g < m_->num_groups(); ++g) {
        MODEL_CHECK(m_->free_blocks()[static_cast<size_t>(g)] ==
                    setup_.num_blocks - std::ssize(pool_held))
            << "group " << g << ": " << m_->free_blocks()[static_cast<size_t>(g)] << " free, "
            << pool_held.size() << " held in the shared pool";
      }
    }
    for (const CacheEvent& event : m_->DrainCacheEvents().events) {
      if (const auto* stored = std::get_if<BlockStored>(&event)) {
        for (const TokenId t : stored->tokens) {
          MODEL_CHECK(t < kRejectedBase) << "published a block holding rejected token " << t;
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  ModelSetup setup_;
  std::mt19937_64 rng_;
  std::unique_ptr<StateManager> m_;
  std::unique_ptr<RaggedBatch> batch_;
  std::map<SeqId, std::vector<TokenId>> model_;
  SeqId next_uid_ = 1;
  int64_t hits_ = 0;
  int64_t rejected_ = 0;
  int64_t rollbacks_ = 0;
  int64_t copies_ = 0;
  int64_t snapshots_ = 0;
  int64_t preemptions_ = 0;
  int64_t window_refusals_ = 0;
  std::set<SeqId> preempted_;
  std::set<SeqId> resumed_;  // resumed since the last snapshot (maybe not settled)
  // Leading blocks released per (sequence, group): by FreeLeadingBlocks (group 0) or out of a
  // LOCAL group's window.
  std::map<std::pair<SeqId, int>, int64_t> released_;
};

TEST(RollbackModel, RandomSpeculationRollbackForksAndPrefixHitsMatchTheReference) {
  const uint64_t seed = Seed();
  std::cout << "BLOCKKV_TEST_SEED=" << seed << "\n";
  const std::vector<ModelSetup> setups = {
      {.name = "prefix, block 4", .groups = {Group(4)}, .num_blocks = 40, .prefix = true},
      {.name = "prefix, groups of block 2 and 4",
       .groups = {Group(2), Group(4)},
       .num_blocks = 60,
       .prefix = true},
      {.name = "no prefix, block 1", .groups = {Group(1, 64)}, .num_blocks = 96, .prefix = false},
      {.name = "prefix, offload, block 4",
       .groups = {Group(4)},
       .num_blocks = 40,
       .prefix = true,
       .offload = true},
      {.name = "sliding window, block 4",
       .groups = {Group(4)},
       .num_blocks = 48,
       .prefix = false,
       .window = true},
      // Gemma-2 style: a full-attention group and a LOCAL group (window 5, not a whole number of
      // blocks) in one manager.
      {.name = "prefix, DENSE block 4 + LOCAL block 2 window 5",
       .groups = {Group(4), Local(2, 5)},
       .num_blocks = 60,
       .prefix = true},
      {.name = "prefix, offload, DENSE block 2 + LOCAL block 2 window 4",
       .groups = {Group(2), Local(2, 4)},
       .num_blocks = 80,
       .prefix = true,
       .offload = true},
      // vLLM's hybrid allocator: the DENSE and LOCAL groups draw from one pool, and layer 0 of
      // both is one buffer (a block written by both groups would read back wrong).
      {.name = "prefix, shared pool, DENSE block 4 + LOCAL block 4 window 6",
       .groups = {Group(4), Local(4, 6)},
       .num_blocks = 60,
       .prefix = true,
       .shared = true},
      {.name = "no prefix, shared pool, DENSE block 2 + LOCAL block 2 window 3",
       .groups = {Group(2), Local(2, 3)},
       .num_blocks = 70,
       .prefix = false,
       .shared = true},
      {.name = "prefix, offload, shared pool, DENSE block 2 + LOCAL block 2 window 4",
       .groups = {Group(2), Local(2, 4)},
       .num_blocks = 80,
       .prefix = true,
       .offload = true,
       .shared = true},
  };
  for (const ModelSetup& setup : setups) {
    RollbackModel model(setup, seed);
    EXPECT_TRUE(model.Run(3000)) << setup.name << ", seed " << seed;
    // The run exercised what it is for.
    EXPECT_GT(model.rejected(), 0) << setup.name;
    EXPECT_GT(model.rollbacks(), 0) << setup.name;
    EXPECT_GT(model.snapshots(), 0) << setup.name;
    if (setup.offload) {
      EXPECT_GT(model.preemptions(), 0) << setup.name;
    }
    const bool local = std::any_of(setup.groups.begin(), setup.groups.end(),
                                   [](const KVCacheConfig& c) { return c.local_window > 0; });
    if (setup.window || local) {
      EXPECT_GT(model.window_refusals(), 0) << setup.name;
    }
    if (setup.prefix) {
      EXPECT_GT(model.hits(), 0) << setup.name;
      EXPECT_GT(model.copies(), 0) << setup.name;
    }
    std::cout << setup.name << ": " << model.hits() << " prefix hits, " << model.rejected()
              << " rejected tokens, " << model.rollbacks() << " rollbacks, " << model.copies()
              << " private copies, " << model.snapshots() << " snapshots, " << model.preemptions()
              << " preemptions, " << model.window_refusals() << " window refusals\n";
  }
}

}  // namespace
}  // namespace blockkv
