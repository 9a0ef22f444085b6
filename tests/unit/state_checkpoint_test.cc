// SPDX-License-Identifier: Apache-2.0
// Prefix caching with a STATE group (issue 21): a state resumes only from a checkpoint, the state
// saved when a forward ended at a multiple of prefix_cache.state_checkpoint_tokens (vLLM's
// "align" mode). A hit is the longest prefix every group serves: whole blocks of the attention
// group and a checkpoint of the state. The tests drive a Jamba-like manager (a DENSE group and a
// STATE group) with a model whose state is an exact function of the tokens it absorbed, and
// which checks, before every forward, that the state it resumes from is that function of the
// sequence's tokens so far: a wrong checkpoint, or a right one in the wrong slot, fails.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "blockkv/kv_cache.h"
#include "blockkv/prefix_cache.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

constexpr int64_t kLayers = 2;
constexpr int64_t kWords = 4;  // per layer and sequence: 16 bytes

KVCacheConfig Dense(int32_t block_size) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {1, 1, 1},
                       .cache_dtype = DType::kFloat32,
                       .max_blocks_per_allocation_group = 64};
}

KVCacheConfig State(int64_t layers = kLayers) {
  return KVCacheConfig{.cache_shape = {layers, 1, kWords},
                       .cache_dtype = DType::kFloat32,
                       .type = KVCacheType::kState,
                       .state_bytes = kWords * 4};
}

StateManagerConfig Config(int64_t every, int32_t tracked = 8, int32_t slots = 16) {
  StateManagerConfig c;
  c.max_tracked_sequences = tracked;
  c.max_ragged_batch_size = 512;
  c.max_ragged_sequence_count = tracked;
  c.max_context = 256;
  c.memory_config = {.mode = AllocationMode::kAllocate, .size = 200, .state_slots = slots};
  c.prefix_cache.enabled = true;
  c.prefix_cache.state_checkpoint_tokens = every;
  return c;
}

std::unique_ptr<StateManager> Make(StateManagerConfig config,
                                   std::vector<KVCacheConfig> groups = {Dense(4), State()}) {
  auto m = StateManager::Create(std::move(config), std::move(groups), CpuDevice(16 << 20));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

// The model's state after absorbing `tokens`, in layer `layer`: a count and two rolling hashes.
std::vector<uint32_t> Reference(std::span<const TokenId> tokens, int64_t layer) {
  uint32_t a = 17 + static_cast<uint32_t>(layer);
  uint32_t b = 5;
  for (const TokenId t : tokens) {
    a = a * 31 + static_cast<uint32_t>(t);
    b = (b ^ static_cast<uint32_t>(t)) * 16777619U;
  }
  return {static_cast<uint32_t>(tokens.size()), a, b, static_cast<uint32_t>(layer)};
}

std::byte* SlotOf(const StateManager& m, SeqId uid, int64_t layer) {
  const TensorView view = *m.GetCache(layer, 1);
  const BlockId slot = m.GetSequence(uid)->block_table(1)[0];
  return static_cast<std::byte*>(view.data) + slot * view.stride(0) * 4;
}

std::vector<uint32_t> StateOf(const StateManager& m, SeqId uid, int64_t layer) {
  std::vector<uint32_t> words(kWords);
  std::memcpy(words.data(), SlotOf(m, uid, layer), kWords * 4);
  return words;
}

// The forward over a sequence's tokens in flight (`all`: every token it will have). A sequence
// at position 0 starts from a zero state whatever its fresh slot holds; past 0 its slot must
// hold the state of its tokens so far, else the forward fails the test.
::testing::AssertionResult Forward(const StateManager& m, SeqId uid, std::span<const TokenId> all) {
  const Sequence& seq = *m.GetSequence(uid);
  const auto seen = static_cast<size_t>(seq.seen_tokens());
  const auto end = seen + static_cast<size_t>(seq.in_flight_tokens());
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    if (seen > 0 && StateOf(m, uid, layer) != Reference(all.first(seen), layer)) {
      return ::testing::AssertionFailure() << "sequence " << uid << " resumes at " << seen
                                           << " from a wrong state in layer " << layer;
    }
    const std::vector<uint32_t> next = Reference(all.first(end), layer);
    std::memcpy(SlotOf(m, uid, layer), next.data(), kWords * 4);
  }
  return ::testing::AssertionSuccess();
}

std::vector<TokenId> Prompt(int64_t n, TokenId base) {
  std::vector<TokenId> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = base + static_cast<TokenId>(i);
  return out;
}

// Adds `uid` with `prompt` and runs it in chunks of `chunk` tokens to its end; returns the
// tokens its first schedule took from the cache.
int64_t Prefill(StateManager& m, SeqId uid, const std::vector<TokenId>& prompt, int64_t chunk,
                const SequenceOptions& options = {}) {
  EXPECT_OK(m.AddSequence(uid, prompt, options).status());
  const SeqId uids[] = {uid};
  int64_t cached = -1;
  while (true) {
    const Sequence* seq = m.GetSequence(uid);
    const int64_t left = std::ssize(prompt) - (seq != nullptr ? seq->seen_tokens() : 0);
    if (left <= 0) break;
    const int64_t lengths[] = {std::min(chunk, left)};
    EXPECT_OK(m.Schedule({.uids = uids, .lengths = lengths}));
    if (cached < 0) cached = m.GetSequence(uid)->seen_tokens();
    EXPECT_TRUE(Forward(m, uid, prompt));
    EXPECT_OK(m.PostForward(uids));
  }
  EXPECT_OK(m.CheckInvariants());
  return cached;
}

int64_t Checkpoints(const StateManager& m) { return m.prefix_cache()->cached_blocks(1); }

TEST(StateCheckpoint, ASecondPromptResumesFromTheLatestCheckpoint) {
  auto m = Make(Config(16));
  const std::vector<TokenId> prompt = Prompt(50, 100);
  EXPECT_EQ(Prefill(*m, 1, prompt, 16), 0);
  EXPECT_EQ(Checkpoints(*m), 3);  // at 16, 32 and 48 tokens
  // The same prompt: 48 tokens from the cache (49 is the most; the last is always computed).
  EXPECT_EQ(Prefill(*m, 2, prompt, 16), 48);
  EXPECT_NE(m->GetSequence(2)->block_table(1)[0], m->GetSequence(1)->block_table(1)[0]);
  // A prompt sharing 40 tokens resumes from the checkpoint at 32, although 40 are cached in the
  // attention group.
  std::vector<TokenId> other = prompt;
  other.resize(45);
  other[40] = 7;
  EXPECT_EQ(Prefill(*m, 3, other, 16), 32);
  // A short prompt within the first interval: nothing to resume from.
  EXPECT_EQ(Prefill(*m, 4, Prompt(15, 100), 16), 0);
  // Sequence 3 ended at 45 tokens, between checkpoints: it saved none.
  EXPECT_EQ(Checkpoints(*m), 3);
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateCheckpoint, ForwardsThatEndBetweenCheckpointsSaveNone) {
  auto m = Make(Config(16));
  const std::vector<TokenId> prompt = Prompt(50, 100);
  EXPECT_EQ(Prefill(*m, 1, prompt, 10), 0);
  EXPECT_EQ(Checkpoints(*m), 0);
  EXPECT_GT(m->prefix_cache()->cached_blocks(0), 0);  // the attention blocks are cached
  EXPECT_EQ(Prefill(*m, 2, prompt, 10), 0);           // but the state cannot resume
  // Decoding past a multiple of the interval saves a checkpoint of the known tokens.
  const SeqId uids[] = {2};
  const int64_t one[] = {1};
  std::vector<TokenId> all = prompt;
  for (TokenId t = 0; t < 14; ++t) {
    all.push_back(t);
    ASSERT_OK(m->AppendTokens(2, std::span(&all.back(), 1)));
    ASSERT_OK(m->Schedule({.uids = uids, .lengths = one}));
    ASSERT_TRUE(Forward(*m, 2, all));
    ASSERT_OK(m->PostForward(uids));
  }
  EXPECT_EQ(Checkpoints(*m), 1);  // at 64 tokens
  all.push_back(99);
  EXPECT_EQ(Prefill(*m, 3, all, 64), 64);
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateCheckpoint, TenantsAndAdaptersNeverShareACheckpoint) {
  auto m = Make(Config(16));
  const std::vector<TokenId> prompt = Prompt(40, 100);
  EXPECT_EQ(Prefill(*m, 1, prompt, 16, {.keys = {.ns = "a"}}), 0);
  EXPECT_EQ(Prefill(*m, 2, prompt, 16, {.keys = {.ns = "b"}}), 0);
  EXPECT_EQ(Prefill(*m, 3, prompt, 16, {.keys = {.ns = "a", .adapter_id = 3}}), 0);
  EXPECT_EQ(Prefill(*m, 4, prompt, 16, {.keys = {.ns = "a"}}), 32);
}

TEST(StateCheckpoint, CheckpointsTakeFreeSlotsEvictingTheLeastRecent) {
  // Two sequences at once, three slots: one is left for checkpoints.
  auto m = Make(Config(16, /*tracked=*/2, /*slots=*/3));
  const std::vector<TokenId> prompt = Prompt(40, 100);
  EXPECT_EQ(Prefill(*m, 9, Prompt(8, 500), 16), 0);
  EXPECT_EQ(Prefill(*m, 1, prompt, 16), 0);
  EXPECT_EQ(Checkpoints(*m), 1);      // the one at 32 took the slot of the one at 16
  EXPECT_EQ(m->free_blocks()[1], 1);  // a cached checkpoint counts as free
  ASSERT_OK(m->FlushSequence(9));
  ASSERT_OK(m->FlushSequence(1));
  std::vector<TokenId> short_prompt = prompt;
  short_prompt.resize(20);
  EXPECT_EQ(Prefill(*m, 2, short_prompt, 16), 0);  // the checkpoint at 16 is gone
  EXPECT_EQ(Checkpoints(*m), 2);                   // and saved again, in a free slot
  EXPECT_EQ(Prefill(*m, 3, prompt, 16), 32);
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateCheckpoint, ACheckpointDueWithoutAFreeSlotIsSkipped) {
  auto m = Make(Config(16, /*tracked=*/2, /*slots=*/2));
  EXPECT_EQ(Prefill(*m, 9, Prompt(8, 500), 16), 0);
  EXPECT_EQ(Prefill(*m, 1, Prompt(40, 100), 16), 0);
  EXPECT_EQ(Checkpoints(*m), 0);
  EXPECT_EQ(m->free_blocks()[1], 0);
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateCheckpoint, AHitNeverEvictsItsOwnCheckpoint) {
  // Two slots: sequence 1 holds one, its checkpoint at 32 the other.
  auto m = Make(Config(16, /*tracked=*/2, /*slots=*/2));
  const std::vector<TokenId> prompt = Prompt(40, 100);
  EXPECT_EQ(Prefill(*m, 1, prompt, 16), 0);
  EXPECT_EQ(Checkpoints(*m), 1);
  // Sequence 2 would resume from it, but its own slot would have to be that one: refused, and
  // nothing changes.
  ASSERT_OK(m->AddSequence(2, prompt).status());
  const SeqId two[] = {2};
  const int64_t lengths[] = {40};
  Result<SchedulingResult> verdict = m->CanSchedule({.uids = two, .lengths = lengths});
  ASSERT_OK(verdict);
  EXPECT_EQ(*verdict, SchedulingResult::kKVCacheLimitExceeded);
  EXPECT_EQ(m->Schedule({.uids = two, .lengths = lengths}).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Checkpoints(*m), 1);
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 0);
  ASSERT_OK(m->CheckInvariants());
  ASSERT_OK(m->FlushSequence(1));
  const SeqId uids[] = {2};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 32);
  EXPECT_TRUE(Forward(*m, 2, prompt));
  ASSERT_OK(m->PostForward(uids));
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateCheckpoint, TwoSequencesInOneBatchResumeFromOneCheckpoint) {
  auto m = Make(Config(16));
  const std::vector<TokenId> prompt = Prompt(40, 100);
  EXPECT_EQ(Prefill(*m, 1, prompt, 16), 0);
  ASSERT_OK(m->FlushSequence(1));
  ASSERT_OK(m->AddSequence(2, prompt).status());
  ASSERT_OK(m->AddSequence(3, prompt).status());
  const SeqId uids[] = {2, 3};
  const int64_t lengths[] = {40, 40};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  for (const SeqId uid : uids) {
    EXPECT_EQ(m->GetSequence(uid)->seen_tokens(), 32);
    EXPECT_TRUE(Forward(*m, uid, prompt));
  }
  ASSERT_OK(m->PostForward(uids));
  EXPECT_NE(m->GetSequence(2)->block_table(1)[0], m->GetSequence(3)->block_table(1)[0]);
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateCheckpoint, ARaggedBatchResumesFromTheCheckpoint) {
  auto m = Make(Config(16));
  const std::vector<TokenId> prompt = Prompt(40, 100);
  EXPECT_EQ(Prefill(*m, 1, prompt, 16), 0);
  ASSERT_OK(m->AddSequence(2, prompt).status());
  auto batch = RaggedBatch::Create(*m);
  ASSERT_OK(batch);
  const SeqId uids[] = {2};
  const int64_t lengths[] = {40};
  ASSERT_OK(m->ScheduleBatch({.uids = uids, .lengths = lengths}, prompt, **batch));
  EXPECT_EQ(m->GetSequence(2)->seen_tokens(), 32);
  EXPECT_EQ((*batch)->current_tokens(), 8);
  EXPECT_TRUE(Forward(*m, 2, prompt));
  ASSERT_OK(m->PostForward(**batch));
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateCheckpoint, ForksKeepTheirOwnStateAndCheckpoints) {
  auto m = Make(Config(16));
  const std::vector<TokenId> prompt = Prompt(24, 100);
  EXPECT_EQ(Prefill(*m, 1, prompt, 16), 0);  // a checkpoint at 16
  ASSERT_OK(m->Fork(1, 2));
  std::vector<TokenId> a = prompt;
  std::vector<TokenId> b = prompt;
  for (int i = 0; i < 8; ++i) {
    a.push_back(1);
    b.push_back(2);
  }
  for (const auto& [uid, all] : {std::pair<SeqId, std::vector<TokenId>*>{1, &a}, {2, &b}}) {
    ASSERT_OK(m->AppendTokens(uid, std::span(*all).subspan(24)));
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {8};
    ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
    ASSERT_TRUE(Forward(*m, uid, *all));
    ASSERT_OK(m->PostForward(uids));
  }
  EXPECT_EQ(Checkpoints(*m), 3);  // 16, and each fork's 32
  a.push_back(5);
  b.push_back(5);
  EXPECT_EQ(Prefill(*m, 3, a, 64), 32);
  EXPECT_EQ(Prefill(*m, 4, b, 64), 32);
}

TEST(StateCheckpoint, SnapshotsKeepCheckpointsAndCheckTheInterval) {
  auto m = Make(Config(16));
  const std::vector<TokenId> prompt = Prompt(40, 100);
  EXPECT_EQ(Prefill(*m, 1, prompt, 16), 0);
  Result<std::vector<std::byte>> bytes = m->SaveSnapshot();
  ASSERT_OK(bytes);
  auto loaded = Make(Config(16));
  ASSERT_OK(loaded->LoadSnapshot(*bytes));
  EXPECT_EQ(Checkpoints(*loaded), 2);
  EXPECT_EQ(Prefill(*loaded, 2, prompt, 16), 32);
  // Sequence 1 goes on where it was, and saves its next checkpoint.
  std::vector<TokenId> longer = prompt;
  for (TokenId t = 0; t < 8; ++t) longer.push_back(t);
  ASSERT_OK(loaded->AppendTokens(1, std::span(longer).subspan(40)));
  const SeqId uids[] = {1};
  const int64_t lengths[] = {8};
  ASSERT_OK(loaded->Schedule({.uids = uids, .lengths = lengths}));
  ASSERT_TRUE(Forward(*loaded, 1, longer));
  ASSERT_OK(loaded->PostForward(uids));
  EXPECT_EQ(Checkpoints(*loaded), 3);
  // Another interval: the snapshot's checkpoints mean nothing there.
  auto other = Make(Config(32));
  const Status s = other->LoadSnapshot(*bytes);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("prefix_cache.state_checkpoint_tokens"), std::string::npos) << s;
  EXPECT_EQ(Checkpoints(*other), 0);
}

TEST(StateCheckpoint, TheIntervalIsCheckedAndDefaultsToWholeBlocks) {
  auto code = [](StateManagerConfig c, std::vector<KVCacheConfig> groups) {
    return StateManager::Create(std::move(c), std::move(groups), CpuDevice(16 << 20)).status();
  };
  Status s = code(Config(6), {Dense(4), State()});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("state_checkpoint_tokens is 6, not a multiple of cache group 0's "
                             "block_size 4"),
            std::string::npos)
      << s;
  s = code(Config(512), {Dense(4), State()});
  EXPECT_NE(s.message().find("past max_context=256"), std::string::npos) << s;
  s = code(Config(-1), {Dense(4), State()});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  s = code(Config(16), {Dense(4)});
  EXPECT_NE(s.message().find("no cache group is STATE"), std::string::npos) << s;
  s = code(Config(16), {Dense(4), State(), State()});
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("cache groups 1 and 2 are both STATE"), std::string::npos) << s;
  // The default: whole blocks of every group, 512 tokens or max_context if less.
  EXPECT_EQ(Make(Config(0), {Dense(4), State()})->config().prefix_cache.state_checkpoint_tokens,
            256);
  StateManagerConfig big = Config(0);
  big.max_context = 4096;
  EXPECT_EQ(Make(big, {Dense(48), State()})->config().prefix_cache.state_checkpoint_tokens, 528);
  // Without prefix caching the interval means nothing and is not checked.
  StateManagerConfig off = Config(6);
  off.prefix_cache.enabled = false;
  EXPECT_OK(code(off, {Dense(4), State()}));
}

// ---- model-based random test ------------------------------------------------------------------

uint64_t Seed() {
  const char* env = std::getenv("BLOCKKV_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
}

// Random prompts from a few shared stems, prefilled in aligned or unaligned chunks, decoded,
// forked, flushed, preempted and resumed, saved and loaded, on a manager short of slots. Every
// forward checks the state it resumes from; every hit is a multiple of the interval; the invariants
// hold after every step.
TEST(StateCheckpointModel, EveryResumedStateIsTheStateOfItsTokens) {
  const uint64_t seed = Seed();
  std::cout << "BLOCKKV_TEST_SEED=" << seed << "\n";
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (const int32_t block : {4, 8}) {
    StateManagerConfig config = Config(16, /*tracked=*/6, /*slots=*/9);
    config.offload = true;
    config.offload_config.host_blocks = 200;
    auto m = Make(config, {Dense(block), State()});
    ASSERT_NE(m, nullptr);
    const std::vector<std::vector<TokenId>> stems = {Prompt(64, 0), Prompt(64, 1000),
                                                     Prompt(64, 2000)};
    std::map<SeqId, std::vector<TokenId>> live;  // every token each sequence will have
    std::set<SeqId> parked;                      // preempted
    SeqId next = 1;
    int64_t hits = 0;
    int64_t preemptions = 0;
    int64_t snapshots = 0;
    auto any_live = [&] {
      auto it = live.begin();
      std::advance(it, pick(0, std::ssize(live) - 1));
      return it;
    };
    for (int step = 0; step < 1500; ++step) {
      const int64_t op = pick(0, 10);
      if (op <= 3 && std::ssize(live) < 5) {  // a new prompt, prefilled
        std::vector<TokenId> prompt = stems[static_cast<size_t>(pick(0, 2))];
        prompt.resize(static_cast<size_t>(pick(1, 64)));
        for (int64_t t = pick(0, 6); t > 0; --t) prompt.push_back(static_cast<TokenId>(pick(0, 9)));
        const int64_t chunk = pick(0, 1) != 0 ? 16 * pick(1, 3) : pick(1, 40);
        const SeqId uid = next++;
        ASSERT_OK(m->AddSequence(uid, prompt).status());
        const SeqId uids[] = {uid};
        const int64_t lengths[] = {std::min<int64_t>(chunk, std::ssize(prompt))};
        Result<SchedulingResult> verdict = m->CanSchedule({.uids = uids, .lengths = lengths});
        ASSERT_OK(verdict);
        if (*verdict != SchedulingResult::kSuccess) {
          ASSERT_OK(m->FlushSequence(uid));
          continue;
        }
        ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
        const int64_t cached = m->GetSequence(uid)->seen_tokens();
        ASSERT_EQ(cached % 16, 0) << "step " << step;
        hits += cached > 0;
        ASSERT_TRUE(Forward(*m, uid, prompt)) << "step " << step;
        ASSERT_OK(m->PostForward(uids));
        live[uid] = prompt;
      } else if (op <= 6 && !live.empty()) {  // a chunk or a decode step of a live sequence
        auto it = any_live();
        if (parked.contains(it->first)) continue;
        const auto& [uid, all] = *it;
        const Sequence& seq = *m->GetSequence(uid);
        int64_t left = std::ssize(all) - seq.seen_tokens();
        if (left == 0) {
          if (std::ssize(all) >= 200) continue;
          const auto t = static_cast<TokenId>(pick(0, 9));
          it->second.push_back(t);
          ASSERT_OK(m->AppendTokens(uid, std::span(&t, 1)));
          left = 1;
        }
        const SeqId uids[] = {uid};
        const int64_t lengths[] = {std::min(left, pick(0, 1) != 0 ? 16 : pick(1, 20))};
        Result<SchedulingResult> verdict = m->CanSchedule({.uids = uids, .lengths = lengths});
        ASSERT_OK(verdict);
        if (*verdict != SchedulingResult::kSuccess) continue;
        ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
        ASSERT_TRUE(Forward(*m, uid, it->second)) << "step " << step;
        ASSERT_OK(m->PostForward(uids));
      } else if (op == 7 && !live.empty() && std::ssize(live) < 5) {  // a fork
        auto it = any_live();
        if (parked.contains(it->first)) continue;
        const SeqId child = next++;
        if (!m->Fork(it->first, child).ok()) continue;  // no slot: fine
        // The child knows the parent's tokens, those not yet computed included.
        live[child] = it->second;
      } else if (op == 8 && !live.empty()) {  // a flush
        auto it = any_live();
        ASSERT_OK(m->FlushSequence(it->first));
        parked.erase(it->first);
        live.erase(it);
      } else if (op == 9 && !live.empty()) {  // a preemption or a resume: the state goes along
        const SeqId uid = any_live()->first;
        const bool resume = parked.contains(uid);
        Result<OffloadTicket> t = resume ? m->ResumeSequence(uid) : m->PreemptSequence(uid);
        if (!t.ok()) {
          ASSERT_EQ(t.status().code(), StatusCode::kResourceExhausted) << t.status();
          continue;
        }
        ASSERT_OK(t->Wait());
        if (resume) {
          parked.erase(uid);
          ASSERT_OK(m->Rollback(uid, 0));  // settles the resume
        } else {
          parked.insert(uid);
          ++preemptions;
        }
      } else if (op == 10) {  // a snapshot round trip, everything resident first
        for (auto it = parked.begin(); it != parked.end();) {
          Result<OffloadTicket> t = m->ResumeSequence(*it);
          if (!t.ok()) break;
          ASSERT_OK(t->Wait());
          ASSERT_OK(m->Rollback(*it, 0));
          it = parked.erase(it);
        }
        Result<std::vector<std::byte>> bytes = m->SaveSnapshot();
        if (!bytes.ok()) {
          ASSERT_EQ(bytes.status().code(), StatusCode::kFailedPrecondition) << bytes.status();
          continue;
        }
        ASSERT_OK(m->LoadSnapshot(*bytes));
        ++snapshots;
      }
      ASSERT_OK(m->CheckInvariants()) << "step " << step;
    }
    // The test exercised what it is about.
    EXPECT_GT(hits, 10) << "block " << block;
    EXPECT_GT(preemptions, 5) << "block " << block;
    EXPECT_GT(snapshots, 5) << "block " << block;
  }
}

}  // namespace
}  // namespace blockkv
