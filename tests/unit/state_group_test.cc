// SPDX-License-Identifier: Apache-2.0
// STATE cache groups (KVCacheType::kState, issue 21): a fixed state per sequence (Mamba's conv +
// SSM state) in a slot of its own pool (MemoryConfig::state_slots, one per tracked sequence by
// default), planned before the blocks. A Jamba-like manager (a DENSE group and a STATE group)
// gives each sequence one slot whatever its length (its table entry 0 in the STATE group), frees
// it with the sequence, copies it on a fork, carries it through preemption and snapshots, and
// refuses to roll back (a state cannot un-apply tokens). A model-based random test checks every
// slot's contents against a reference state per sequence.
#include "blockkv/state_manager.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "blockkv/kv_cache.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

constexpr int64_t kStateFloats = 4;  // per layer and sequence: 16 bytes of fp32

KVCacheConfig Dense(int32_t block_size) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {1, 1, 1},
                       .cache_dtype = DType::kFloat32,
                       .max_blocks_per_allocation_group = 32};
}

KVCacheConfig State(int64_t layers = 2) {
  return KVCacheConfig{.cache_shape = {layers, 1, kStateFloats},
                       .cache_dtype = DType::kFloat32,
                       .type = KVCacheType::kState,
                       .state_bytes = kStateFloats * 4};
}

StateManagerConfig Config(int32_t blocks, int32_t tracked = 8, bool offload = false) {
  StateManagerConfig c;
  c.max_tracked_sequences = tracked;
  c.max_ragged_batch_size = 64;
  c.max_ragged_sequence_count = tracked;
  c.max_context = 64;
  c.memory_config = {.mode = AllocationMode::kAllocate, .size = blocks};
  c.offload = offload;
  if (offload) c.offload_config.host_blocks = blocks;
  return c;
}

std::unique_ptr<StateManager> Make(StateManagerConfig config, std::vector<KVCacheConfig> groups) {
  auto m = StateManager::Create(std::move(config), std::move(groups), CpuDevice(16 << 20));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

// The state of `uid` in layer `layer` of group 1 (its slot's floats).
float* StateOf(const StateManager& m, SeqId uid, int64_t layer) {
  const TensorView view = *m.GetCache(layer, 1);
  const BlockId slot = m.GetSequence(uid)->block_table(1)[0];
  return static_cast<float*>(view.data) + slot * view.stride(0);
}

// The model's forward over `tokens` new tokens: every layer's state absorbs them.
// A fresh slot's contents are unspecified: the first forward starts from a zero state.
void Forward(const StateManager& m, SeqId uid, int64_t tokens, float salt) {
  const bool first = m.GetSequence(uid)->seen_tokens() == 0;
  for (int64_t layer = 0; layer < 2; ++layer) {
    float* state = StateOf(m, uid, layer);
    for (int64_t i = 0; i < kStateFloats; ++i) {
      state[i] = (first ? 0.0F : state[i]) * 0.5F + salt + static_cast<float>(tokens);
    }
  }
}

Status Step(StateManager& m, SeqId uid, int64_t tokens, float salt = 1) {
  const SeqId uids[] = {uid};
  const int64_t lengths[] = {tokens};
  BLOCKKV_RETURN_IF_ERROR(m.Schedule({.uids = uids, .lengths = lengths}));
  Forward(m, uid, tokens, salt);
  return m.PostForward(uids);
}

std::vector<float> Snapshot(const StateManager& m, SeqId uid) {
  std::vector<float> out;
  for (int64_t layer = 0; layer < 2; ++layer) {
    const float* s = StateOf(m, uid, layer);
    out.insert(out.end(), s, s + kStateFloats);
  }
  return out;
}

TEST(StateGroup, SlotsArePlannedBeforeTheBlocks) {
  // RESERVE: 1 MiB usable, 8 slots of 2 x 16 bytes first, the rest in 4-byte x 4-token blocks.
  const std::vector<KVCacheConfig> groups = {Dense(4), State()};
  const MemoryConfig memory{.mode = AllocationMode::kReserve, .size = 1, .state_slots = 8};
  Result<KVCachePlan> plan = PlanKVCache(groups, memory, (1 << 20) + 1);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->state_slots, 8);
  EXPECT_EQ(plan->state_bytes, 8 * 2 * 16);
  EXPECT_EQ(plan->bytes_per_block, 4 * 2 * 4);  // block 4 x K and V x fp32
  EXPECT_EQ(plan->num_blocks, ((1 << 20) - 8 * 2 * 16) / 32);
  EXPECT_EQ(plan->total_bytes, plan->num_blocks * 32 + 256);
  auto cache = BlockedKVCache::Create(groups, memory, CpuDevice(1 << 22));
  ASSERT_OK(cache);
  EXPECT_EQ((*cache)->num_blocks(1), 8);
  Result<TensorView> layer1 = (*cache)->GetCache(1, 1);
  ASSERT_OK(layer1);
  EXPECT_EQ(layer1->ndim, 2);
  EXPECT_EQ(layer1->shape[0], 8);
  EXPECT_EQ(layer1->shape[1], kStateFloats);
  EXPECT_EQ((*cache)->free_blocks()[1], 8);
  ASSERT_OK((*cache)->CheckInvariants());
  // No slots, or nothing but states: refused.
  Result<std::unique_ptr<BlockedKVCache>> none = BlockedKVCache::Create(
      groups, MemoryConfig{.mode = AllocationMode::kAllocate, .size = 4}, CpuDevice(1 << 22));
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument) << none.status();
  EXPECT_NE(none.status().message().find("cache group 1 is STATE: MemoryConfig.state_slots"),
            std::string::npos)
      << none.status();
  const std::vector<KVCacheConfig> only_state = {State()};
  EXPECT_CODE(PlanKVCache(only_state, memory, 1 << 20).status(), StatusCode::kInvalidArgument);
}

TEST(StateGroup, EachSequenceHoldsOneSlotWhateverItsLength) {
  auto m = Make(Config(40), {Dense(4), State()});
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{40, 8}));  // one slot per tracked sequence
  ASSERT_OK(Step(*m, 1, 13));
  ASSERT_OK(Step(*m, 2, 1));
  for (int t = 0; t < 20; ++t) ASSERT_OK(Step(*m, 1, 1));
  const Sequence& one = *m->GetSequence(1);
  EXPECT_EQ(one.cur_allocated_blocks(0), 9);  // 33 tokens in blocks of 4
  EXPECT_EQ(one.cur_allocated_blocks(1), 1);  // one slot
  EXPECT_NE(one.block_table(1)[0], m->GetSequence(2)->block_table(1)[0]);
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{30, 6}));
  ASSERT_OK(m->FlushSequence(1));
  EXPECT_EQ(m->free_blocks(), (std::vector<int32_t>{39, 7}));
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateGroup, ForkCopiesTheStateAndTheCopiesDiverge) {
  auto m = Make(Config(40), {Dense(4), State()});
  ASSERT_OK(Step(*m, 1, 6, 3));
  const std::vector<float> parent = Snapshot(*m, 1);
  ASSERT_OK(m->Fork(1, 2));
  EXPECT_NE(m->GetSequence(2)->block_table(1)[0], m->GetSequence(1)->block_table(1)[0]);
  EXPECT_EQ(Snapshot(*m, 2), parent);
  ASSERT_OK(Step(*m, 2, 1, 7));
  EXPECT_EQ(Snapshot(*m, 1), parent);  // the parent's state is its own
  EXPECT_NE(Snapshot(*m, 2), parent);
  EXPECT_EQ(m->free_blocks()[1], 6);
  ASSERT_OK(m->CheckInvariants());
}

TEST(StateGroup, RollbackAndRejectedDraftsAreRefusedAndChangeNothing) {
  auto m = Make(Config(40), {Dense(4), State()});
  ASSERT_OK(Step(*m, 1, 6));
  const std::vector<float> state = Snapshot(*m, 1);
  Status s = m->Rollback(1, 2);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("cache group 1 is STATE, and a state cannot un-apply tokens"),
            std::string::npos)
      << s;
  EXPECT_OK(m->Rollback(1, 0));  // nothing to un-apply
  const SeqId uids[] = {1};
  const int64_t three[] = {3};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = three}));
  const int64_t one[] = {1};
  s = m->PostForward(uids, one);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(m->GetSequence(1)->in_flight_tokens(), 3);
  EXPECT_OK(m->PostForward(uids, three));  // keeping every token is fine
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 9);
  s = m->FreeLeadingBlocks(1, 1, 1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(m->free_blocks()[1], 7);
  ASSERT_OK(m->CheckInvariants());
}

// ---- model-based random test ------------------------------------------------------------------

uint64_t Seed() {
  const char* env = std::getenv("BLOCKKV_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 0) : 0x57a7eULL;
}

TEST(StateGroupModel, RandomStepsForksFlushesPreemptionsAndSnapshotsKeepEveryState) {
  const uint64_t seed = Seed();
  std::cout << "BLOCKKV_TEST_SEED=" << seed << "\n";
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto m = Make(Config(48, 6, /*offload=*/true), {Dense(4), State(), Dense(2)});
  std::map<SeqId, std::vector<float>> states;  // the reference: each sequence's state
  std::map<SeqId, int64_t> lengths;
  std::map<SeqId, bool> preempted;
  SeqId next = 1;
  int forks = 0;
  int snapshots = 0;
  int preemptions = 0;
  int refusals = 0;
  auto any = [&]() -> SeqId {
    if (states.empty()) return -1;
    auto it = states.begin();
    std::advance(it, pick(0, static_cast<int>(states.size()) - 1));
    return it->first;
  };
  for (int step = 0; step < 3000; ++step) {
    const int op = pick(0, 99);
    const SeqId uid = any();
    if (op < 15 || uid < 0) {  // a new sequence's first chunk
      const SeqId fresh = next++;
      const int64_t n = pick(1, 12);
      const Status s = Step(*m, fresh, n, static_cast<float>(fresh));
      if (!s.ok()) {
        ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
        ++refusals;
        continue;
      }
      states[fresh] = Snapshot(*m, fresh);
      lengths[fresh] = n;
      preempted[fresh] = false;
    } else if (op < 60) {  // a step of 1..4 tokens
      if (preempted[uid]) continue;
      const int64_t n = pick(1, 4);
      const std::vector<float> before = Snapshot(*m, uid);
      const Status s = Step(*m, uid, n, 0.25F);
      if (!s.ok()) {
        ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
        ASSERT_EQ(Snapshot(*m, uid), before);
        ++refusals;
        continue;
      }
      std::vector<float>& want = states[uid];
      for (float& x : want) x = x * 0.5F + 0.25F + static_cast<float>(n);
      lengths[uid] += n;
    } else if (op < 70) {  // fork
      if (preempted[uid]) continue;
      const SeqId child = next++;
      const Status s = m->Fork(uid, child);
      if (!s.ok()) {
        ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
        ++refusals;
        continue;
      }
      states[child] = states[uid];
      lengths[child] = lengths[uid];
      preempted[child] = false;
      ++forks;
    } else if (op < 80) {  // flush
      ASSERT_OK(m->FlushSequence(uid));
      states.erase(uid);
      lengths.erase(uid);
      preempted.erase(uid);
    } else if (op < 92) {  // preempt or resume
      Result<OffloadTicket> t = preempted[uid] ? m->ResumeSequence(uid) : m->PreemptSequence(uid);
      if (!t.ok()) {
        ASSERT_EQ(t.status().code(), StatusCode::kResourceExhausted) << t.status();
        continue;
      }
      ASSERT_OK(t->Wait());
      preempted[uid] = !preempted[uid];
      preemptions += preempted[uid] ? 1 : 0;
      if (!preempted[uid]) {
        ASSERT_OK(m->Rollback(uid, 0));  // settles the resume
      }
    } else {  // snapshot round trip (everything resident first)
      for (auto& [u, p] : preempted) {
        if (!p) continue;
        Result<OffloadTicket> t = m->ResumeSequence(u);
        if (!t.ok()) break;
        ASSERT_OK(t->Wait());
        ASSERT_OK(m->Rollback(u, 0));
        p = false;
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
    int32_t resident = 0;
    for (const auto& [u, want] : states) {
      const Sequence* seq = m->GetSequence(u);
      ASSERT_NE(seq, nullptr) << "sequence " << u;
      ASSERT_EQ(seq->seen_tokens(), lengths[u]) << "sequence " << u;
      if (preempted[u]) continue;
      ++resident;
      ASSERT_EQ(seq->cur_allocated_blocks(1), 1) << "sequence " << u;
      ASSERT_EQ(Snapshot(*m, u), want) << "state of sequence " << u << " at step " << step;
    }
    ASSERT_EQ(m->free_blocks()[1], 6 - resident)
        << "step " << step << " (op " << op << "), " << states.size() << " sequences, "
        << m->n_tracked_sequences() << " tracked";
  }
  EXPECT_GT(forks, 0);
  EXPECT_GT(snapshots, 0);
  EXPECT_GT(preemptions, 0);
  EXPECT_GT(refusals, 0);
  std::cout << forks << " forks, " << snapshots << " snapshots, " << preemptions << " preemptions, "
            << refusals << " refusals\n";
}

}  // namespace
}  // namespace blockkv
