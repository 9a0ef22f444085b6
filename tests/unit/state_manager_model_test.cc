// SPDX-License-Identifier: Apache-2.0
// Model-based random test of StateManager: random programs of GetOrCreateSequence, Schedule or
// ScheduleBatch (after CanSchedule; ScheduleBatch's batch is checked against the model's tables,
// and left as it was when the call fails), PostForward, Fork, FreeLeadingBlocks, FlushSequence,
// Query, and, with offload on, PreemptSequence, ResumeSequence and waits or polls of their tickets,
// run against a plain reference model, over several configurations small enough that blocks,
// tracking slots, context, batch limits and the host (and, in one setup, disk) tier run out often.
// After every operation the manager passes CheckInvariants() and agrees with the model on every
// sequence (seen, in flight, preempted, table per cache group, released prefix, slot and address),
// every block's reference count equals the tables holding it plus the offload copies in flight
// reading it, free
// + referenced = total, the store's held device blocks, free host and disk slots and live handles
// are the model's, and flushing everything leaves every block free and no handle live. Fork is
// also checked on the data: the child's partial tail is a byte copy of the parent's in every
// layer, its full blocks are the parent's ids. Every block a sequence takes is filled with its own
// pattern, and a resumed sequence's new blocks hold, once the copy is done, exactly the patterns
// its blocks held when it was preempted.
//
// Copies run on the store's worker thread and their effects (device blocks going back, host and
// disk slots freed) are applied whenever the manager next calls into the store, so when that
// happens is up to timing. The model keeps the copies in flight in submission order and, after
// every call, applies those the store's stats() say are done (they are done in order); a decision
// the manager makes after such a call inside the same operation (PreemptSequence's tier choice
// after settling a resume) is accepted for any number of them applied.
//
// The seed is fixed and printed; BLOCKKV_TEST_SEED=<n> replays another. With offload on, where a
// copy has finished by the next call decides some outcomes (a block still held or free again),
// so a replay makes the same draws but may take another path after the first such point.
#include "blockkv/state_manager.h"

#include "blockkv/ragged_batch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>

#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;

constexpr uint64_t kDefaultSeed = 0x5eed'b10c'4b5ULL;

uint64_t Seed() {
  const char* env = std::getenv("BLOCKKV_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 0) : kDefaultSeed;
}

// One cache group: `layers` layers of 1 head of 4 fp16 values.
KVCacheConfig Group(int32_t block_size, int64_t layers, int32_t max_blocks) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {layers, 1, 4},
                       .cache_dtype = DType::kFloat16,
                       .max_blocks_per_allocation_group = max_blocks};
}

struct ModelSetup {
  std::string name;
  std::vector<KVCacheConfig> groups;
  int32_t num_blocks = 0;
  int32_t max_tracked = 0;
  int32_t max_batch_tokens = 0;
  int32_t max_batch_sequences = 0;
  int64_t max_context = 0;
  int steps = 0;
  // Offload tiers, in blocks of every group: host_blocks = 0 leaves offload off.
  int32_t host_blocks = 0;
  int32_t disk_blocks = 0;
};

void PrintTo(const ModelSetup& setup, std::ostream* os) { *os << setup.name; }

// A sequence holds at most min(max_context, max_blocks · block_size of every group) tokens; the
// setups differ in which of these binds.
std::vector<ModelSetup> Setups() {
  return {
      // Capacity 192 from the table (12 blocks of 16) below max_context 256. A host tier of 16
      // blocks: two long sequences fill it.
      {"OneGroupBs16", {Group(16, 2, 12)}, 48, 8, 200, 6, 256, 55'000, /*host_blocks=*/16},
      // Capacity 300 from max_context; tables hold 384 and 320 tokens. A host tier of 12 blocks
      // and a disk tier of 24: a group's blocks go to disk when the host tier cannot take them.
      {"TwoGroupsBs16Bs32",
       {Group(16, 2, 24), Group(32, 3, 10)},
       128,
       16,
       400,
       8,
       300,
       55'000,
       /*host_blocks=*/12,
       /*disk_blocks=*/24},
      // Many slots, larger pool; capacity 500 from max_context. A host tier of 40 blocks.
      {"OneGroupBs32", {Group(32, 2, 64)}, 160, 32, 600, 16, 500, 50'000, /*host_blocks=*/40},
      // Capacity 256 from group 0's table (8 blocks of 32); max_context 1000. Offload off.
      {"TwoGroupsBs32Bs16", {Group(32, 2, 8), Group(16, 2, 20)}, 64, 12, 256, 12, 1000, 50'000},
  };
}

// ---- reference model --------------------------------------------------------------------------

struct ModelSequence {
  int64_t seen = 0;
  int64_t in_flight = 0;
  // Per cache group, the logical table; kNoBlock marks the released prefix.
  std::vector<std::vector<BlockId>> tables;
  std::vector<int32_t> released;
  // What the manager must keep stable until the sequence is flushed.
  const Sequence* address = nullptr;
  int32_t slot = -1;
  // Offload. While preempted every table entry is kNoBlock (the logical length stays) and its
  // blocks are handles: per group their tier and the patterns the blocks held.
  bool preempted = false;
  bool resuming = false;  // resumed, not yet settled by a call naming it
  std::vector<Tier> tiers;
  std::vector<std::vector<uint32_t>> parked_salts;  // [group][entry - released]
};

struct ReferenceModel {
  std::map<SeqId, ModelSequence> sequences;
  std::vector<std::vector<int32_t>> refs;  // [group][block]

  const ModelSequence* Find(SeqId uid) const {
    const auto it = sequences.find(uid);
    return it == sequences.end() ? nullptr : &it->second;
  }
  int32_t FreeBlocks(int g) const {
    return static_cast<int32_t>(std::count(refs[g].begin(), refs[g].end(), 0));
  }
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Drives one StateManager and one ReferenceModel with the same random operations.
class ModelDriver {
 public:
  ModelDriver(ModelSetup setup, uint64_t seed) : setup_(std::move(setup)), rng_(seed) {}

  AssertionResult Init() {
    StateManagerConfig config{
        .max_tracked_sequences = setup_.max_tracked,
        .max_ragged_batch_size = setup_.max_batch_tokens,
        .max_ragged_sequence_count = setup_.max_batch_sequences,
        .max_context = setup_.max_context,
        .memory_config = {.mode = AllocationMode::kAllocate, .size = setup_.num_blocks}};
    if (setup_.host_blocks > 0) {
      config.offload = true;
      config.offload_config.host_blocks = setup_.host_blocks;
      if (setup_.disk_blocks > 0) {
        disk_path_ = (std::filesystem::temp_directory_path() /
                      ("blockkv_sm_model_" + std::to_string(::getpid()) + "_" + setup_.name))
                         .string();
        config.offload_config.disk_path = disk_path_;
        config.offload_config.disk_blocks = setup_.disk_blocks;
      }
    }
    Result<std::unique_ptr<StateManager>> mgr =
        StateManager::Create(config, setup_.groups, CpuDevice(/*memory_budget=*/64 << 20));
    MODEL_CHECK(mgr.ok()) << mgr.status();
    mgr_ = std::move(mgr).value();
    Result<std::unique_ptr<RaggedBatch>> batch = RaggedBatch::Create(*mgr_);
    MODEL_CHECK(batch.ok()) << batch.status();
    batch_ = std::move(batch).value();
    num_groups_ = static_cast<int>(setup_.groups.size());
    MODEL_CHECK(mgr_->num_groups() == num_groups_);
    MODEL_CHECK((mgr_->offload_store() != nullptr) == offload());
    model_.refs.assign(setup_.groups.size(),
                       std::vector<int32_t>(static_cast<size_t>(setup_.num_blocks), 0));
    salts_.assign(setup_.groups.size(),
                  std::vector<uint32_t>(static_cast<size_t>(setup_.num_blocks), 0));
    host_used_.assign(setup_.groups.size(), 0);
    disk_used_.assign(setup_.groups.size(), 0);
    capacity_ = setup_.max_context;
    for (const KVCacheConfig& c : setup_.groups) {
      capacity_ = std::min(capacity_, int64_t{c.max_blocks_per_allocation_group} * c.block_size);
    }
    return Verify();
  }

  // One random operation, then the full comparison.
  AssertionResult Step() {
    struct WeightedOp {
      AssertionResult (ModelDriver::*run)();
      int64_t weight;
    };
    static constexpr std::array<WeightedOp, 12> kOps{{
        {&ModelDriver::ScheduleOp, 340},
        {&ModelDriver::PostForwardOp, 200},
        {&ModelDriver::ForkOp, 100},
        {&ModelDriver::FreeLeadingBlocksOp, 90},
        {&ModelDriver::FlushOp, 120},
        {&ModelDriver::QueryOp, 70},
        {&ModelDriver::QueryThenCanScheduleOp, 35},
        {&ModelDriver::GetOrCreateOp, 45},
        {&ModelDriver::PreemptOp, 45},
        {&ModelDriver::ResumeOp, 45},
        {&ModelDriver::WaitOp, 25},
        {&ModelDriver::FlushAllAndCheckNoLeak, 2},
    }};
    static constexpr int64_t kTotal = [] {
      int64_t total = 0;
      for (const WeightedOp& op : kOps) total += op.weight;
      return total;
    }();
    ++step_;
    int64_t r = Uniform(0, kTotal - 1);
    size_t pick = 0;
    while (r >= kOps[pick].weight) r -= kOps[pick++].weight;
    AssertionResult result = (this->*kOps[pick].run)();
    if (!result) return result;
    return Verify();
  }

  AssertionResult FlushAllAndCheckNoLeak() {
    op_ = "FlushAll";
    while (!model_.sequences.empty()) {
      const SeqId uid = model_.sequences.begin()->first;
      const Status s = mgr_->FlushSequence(uid);
      MODEL_CHECK(s.ok()) << "flush " << uid << ": " << s;
      AssertionResult synced = Sync();
      if (!synced) return synced;
      MODEL_CHECK(mgr_->CheckInvariants().ok()) << mgr_->CheckInvariants();
      FlushInModel(model_.sequences.begin());
    }
    MODEL_CHECK(mgr_->n_tracked_sequences() == 0);
    // Flushing waits for every copy of the sequences it drops: nothing is left in flight, and
    // no handle is live (prefix caching is off, so nothing is cached on the host level).
    MODEL_CHECK(jobs_.empty()) << jobs_.size() << " copies still in flight after flushing all";
    if (const OffloadStore* store = mgr_->offload_store()) {
      MODEL_CHECK(store->live_handles() == 0) << store->live_handles() << " handles leak";
      for (int g = 0; g < num_groups_; ++g) {
        MODEL_CHECK(store->held_blocks(g).empty()) << "group " << g;
        MODEL_CHECK(store->free_host_blocks(g) == setup_.host_blocks) << "group " << g;
        MODEL_CHECK(store->free_disk_blocks(g) == setup_.disk_blocks) << "group " << g;
        MODEL_CHECK(host_used_[g] == 0 && disk_used_[g] == 0) << "model group " << g;
      }
    }
    for (int g = 0; g < num_groups_; ++g) {
      MODEL_CHECK(mgr_->free_blocks()[g] == setup_.num_blocks)
          << "group " << g << " leaks " << setup_.num_blocks - mgr_->free_blocks()[g] << " blocks";
      for (BlockId b = 0; b < setup_.num_blocks; ++b) {
        MODEL_CHECK(mgr_->pool(g).ref_count(b) == 0) << "block " << b << " of group " << g;
        MODEL_CHECK(model_.refs[g][b] == 0) << "model block " << b << " of group " << g;
      }
    }
    Count("flush_all");
    return AssertionSuccess();
  }

  // A fork that finds no block for its partial tail, on purpose. Whether the random program
  // gets there depends on when the store's worker finishes its copies (they free blocks), so a
  // quiet machine could miss it: from an empty manager, a parent with one token and fillers
  // that take the free blocks of a group, then the fork.
  AssertionResult ForkWithoutAFreeBlock() {
    AssertionResult done = FlushAllAndCheckNoLeak();
    if (!done) return done;
    op_ = "ForkWithoutAFreeBlock";
    const SeqId parent = UnknownUid();
    auto then = [&](AssertionResult step) { return step ? Verify() : step; };
    if (!(done = then(ScheduleThese({parent}, {1})))) return done;
    if (!(done = then(PostForwardThese({parent}, /*unknown=*/false)))) return done;
    auto exhausted = [&] {
      for (int g = 0; g < num_groups_; ++g) {
        if (FreeBlocks(g) == 0) return true;
      }
      return false;
    };
    while (!exhausted()) {
      int64_t fits = std::min<int64_t>(capacity_, setup_.max_batch_tokens);
      for (int g = 0; g < num_groups_; ++g) {
        fits = std::min<int64_t>(fits, int64_t{FreeBlocks(g)} * block_size(g));
      }
      const int32_t free_before = FreeBlocks(0);
      if (!(done = then(ScheduleThese({UnknownUid()}, {fits})))) return done;
      MODEL_CHECK(FreeBlocks(0) < free_before) << "a filler of " << fits << " tokens took nothing";
    }
    return then(ForkThese(parent, UnknownUid()));
  }

  const std::string& op() const { return op_; }
  int64_t step() const { return step_; }
  const std::map<std::string, int64_t>& stats() const { return stats_; }

 private:
  // A copy on the store's worker thread, kept until the store applies it.
  struct ModelJob {
    uint64_t id = 0;  // submission order, from 1
    bool offload = false;
    int group = 0;                  // an offload's group
    std::vector<BlockId> blocks{};  // an offload's device blocks: the store holds them until then
    std::vector<int32_t> host{};    // a restore's handles per group on the host tier
    std::vector<int32_t> disk{};    // ... and on the disk tier
    SeqId uid = 0;                  // a restore's sequence
    int64_t count = 0;              // blocks copied
    // A restore's new blocks of each group and the pattern each must then hold.
    std::vector<std::tuple<int, BlockId, uint32_t>> expect{};
  };
  struct KeptTicket {
    OffloadTicket ticket;
    uint64_t last_job = 0;  // the last copy it covers; 0: none
  };

  // ---- randomness ----

  // Draws are portable: mt19937_64's output is fixed by the standard, the <random>
  // distributions are not. The modulo bias is far below anything that matters here.
  int64_t Uniform(int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + static_cast<int64_t>(rng_() % (static_cast<uint64_t>(hi - lo) + 1));
  }
  bool Chance(int percent) { return Uniform(0, 99) < percent; }
  SeqId RandomUid() { return Uniform(0, 3 * int64_t{setup_.max_tracked} - 1); }
  SeqId KnownUid() {  // REQUIRES: a tracked sequence
    auto it = model_.sequences.begin();
    std::advance(it, Uniform(0, static_cast<int64_t>(model_.sequences.size()) - 1));
    return it->first;
  }
  SeqId UnknownUid() {  // the uid space is 3x the slots, so one is always free
    SeqId uid = RandomUid();
    while (model_.Find(uid) != nullptr) uid = RandomUid();
    return uid;
  }
  SeqId MostlyKnownUid(int percent_known) {
    return !model_.sequences.empty() && Chance(percent_known) ? KnownUid() : RandomUid();
  }
  // The same, but a preempted sequence only now and then: scheduling one is an error.
  SeqId MostlyRunnableUid(int percent_known) {
    SeqId uid = MostlyKnownUid(percent_known);
    for (int tries = 0; tries < 3; ++tries) {
      const ModelSequence* m = model_.Find(uid);
      if (m == nullptr || !m->preempted || Chance(10)) break;
      uid = MostlyKnownUid(percent_known);
    }
    return uid;
  }
  int32_t RandomGroup() {  // 4%: an invalid one
    if (Chance(4)) return Chance(50) ? -1 : num_groups_;
    return static_cast<int32_t>(Uniform(0, num_groups_ - 1));
  }

  // A length for `uid`: mostly decode steps and prefills that fit, some at or past the limit,
  // rarely a negative one.
  int64_t RandomLength(SeqId uid) {
    const ModelSequence* m = model_.Find(uid);
    const int64_t left = std::max<int64_t>(capacity_ - (m ? m->seen : 0), 0);
    const int64_t r = Uniform(0, 99);
    if (r < 45) return Uniform(1, 4);
    if (r < 65) return Uniform(0, 3 * int64_t{block_size(num_groups_ - 1)});
    if (r < 80) return Uniform(0, left);
    if (r < 86) return std::max<int64_t>(left + Uniform(-1, 1), 0);
    if (r < 92) {
      // Just what group 0's free blocks hold, give or take a token: the KV limit's edge, and
      // the way to a pool with no free block.
      const int64_t allocated = m ? static_cast<int64_t>(m->tables[0].size()) : 0;
      const int64_t fill = (allocated + FreeBlocks(0)) * block_size(0) - (m ? m->seen : 0);
      return std::max<int64_t>(fill + Uniform(-1, 1), 0);
    }
    if (r < 97) return left + Uniform(1, 2 * capacity_);
    if (r < 99) return -Uniform(1, 3);
    return Chance(50) ? 0 : std::numeric_limits<int64_t>::max();
  }

  int32_t block_size(int g) const { return setup_.groups[g].block_size; }
  int32_t max_blocks(int g) const { return setup_.groups[g].max_blocks_per_allocation_group; }
  int32_t FreeBlocks(int g) const { return model_.FreeBlocks(g); }
  void Count(const std::string& what) { ++stats_[what]; }

  // ---- data in blocks ----

  // Bytes of one block of one layer of group g, and where that block starts.
  Result<std::span<uint8_t>> BlockBytes(int g, int64_t layer, BlockId block) const {
    BLOCKKV_ASSIGN_OR_RETURN(TensorView view, mgr_->GetCache(layer, g));
    const auto bytes = static_cast<size_t>(view.stride(0)) * ElementSize(view.dtype);
    return std::span<uint8_t>(static_cast<uint8_t*>(view.data) + static_cast<size_t>(block) * bytes,
                              bytes);
  }
  static uint8_t Pattern(uint32_t salt, int64_t layer, size_t i) {
    return static_cast<uint8_t>(salt * 131 + static_cast<uint32_t>(layer) * 31 + i * 7 + 1);
  }
  AssertionResult FillBlock(int g, BlockId block, uint32_t salt) {
    for (int64_t layer = 0; layer < setup_.groups[g].num_caches(); ++layer) {
      const Result<std::span<uint8_t>> found = BlockBytes(g, layer, block);
      MODEL_CHECK(found.ok()) << found.status();
      const std::span<uint8_t> bytes = *found;
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = Pattern(salt, layer, i);
    }
    return AssertionSuccess();
  }
  AssertionResult BlockHolds(int g, BlockId block, uint32_t salt) const {
    for (int64_t layer = 0; layer < setup_.groups[g].num_caches(); ++layer) {
      const Result<std::span<uint8_t>> found = BlockBytes(g, layer, block);
      MODEL_CHECK(found.ok()) << found.status();
      const std::span<const uint8_t> bytes = *found;
      for (size_t i = 0; i < bytes.size(); ++i) {
        MODEL_CHECK(bytes[i] == Pattern(salt, layer, i))
            << "block " << block << " of group " << g << " layer " << layer << " byte " << i;
      }
    }
    return AssertionSuccess();
  }

  // ---- operations ----

  // DeepSpeed's can_schedule order, on the model. REQUIRES: valid arguments.
  SchedulingResult ModelVerdict(const std::vector<SeqId>& uids,
                                const std::vector<int64_t>& lengths) const {
    if (static_cast<int64_t>(uids.size()) > setup_.max_batch_sequences) {
      return SchedulingResult::kBatchSequenceLimitExceeded;
    }
    std::vector<int64_t> free(static_cast<size_t>(num_groups_));
    for (int g = 0; g < num_groups_; ++g) free[g] = FreeBlocks(g);
    auto tracked = static_cast<int64_t>(model_.sequences.size());
    int64_t tokens = 0;
    for (size_t i = 0; i < uids.size(); ++i) {
      const ModelSequence* m = model_.Find(uids[i]);
      const int64_t seen = m ? m->seen : 0;
      if (m == nullptr) ++tracked;
      if (lengths[i] > std::max<int64_t>(capacity_ - seen, 0)) {
        return SchedulingResult::kSequenceTokenLimitExceeded;
      }
      for (int g = 0; g < num_groups_; ++g) {
        const int64_t allocated = m ? static_cast<int64_t>(m->tables[g].size()) : 0;
        const int64_t needed =
            std::max<int64_t>(CeilDiv(seen + lengths[i], block_size(g)) - allocated, 0);
        if (needed > free[g]) return SchedulingResult::kKVCacheLimitExceeded;
        free[g] -= needed;
      }
      tokens += lengths[i];
    }
    if (tracked > setup_.max_tracked) return SchedulingResult::kEngineSequenceLimitExceeded;
    if (tokens > setup_.max_batch_tokens) return SchedulingResult::kBatchTokenLimitExceeded;
    return SchedulingResult::kSuccess;
  }

  // Adds a tracked sequence the manager just created to the model.
  AssertionResult AddToModel(SeqId uid, ModelSequence** out) {
    const Sequence* seq = mgr_->GetSequence(uid);
    MODEL_CHECK(seq != nullptr) << "sequence " << uid << " was not created";
    ModelSequence& m = model_.sequences[uid];
    m.tables.assign(static_cast<size_t>(num_groups_), {});
    m.released.assign(static_cast<size_t>(num_groups_), 0);
    m.address = seq;
    m.slot = seq->tracking_slot();
    *out = &m;
    return AssertionSuccess();
  }

  // Blocks [from, to) of `uid`'s table in group g must be fresh: free in the model until now.
  // With `fill`, each gets a pattern of its own, as a forward would write it.
  AssertionResult TakeFresh(SeqId uid, int g, size_t from, size_t to, ModelSequence& m,
                            bool fill = true) {
    const std::span<const BlockId> table = mgr_->GetSequence(uid)->block_table(g);
    MODEL_CHECK(table.size() == to) << "sequence " << uid << " group " << g;
    for (size_t j = from; j < to; ++j) {
      const BlockId b = table[j];
      MODEL_CHECK(b >= 0 && b < setup_.num_blocks) << "block " << b;
      MODEL_CHECK(model_.refs[g][b] == 0)
          << "sequence " << uid << " got block " << b << " of group " << g << " which has "
          << model_.refs[g][b] << " owners";
      model_.refs[g][b] = 1;
      m.tables[g].push_back(b);
      if (!fill) continue;
      salts_[g][b] = ++last_salt_;
      const AssertionResult filled = FillBlock(g, b, salts_[g][b]);
      if (!filled) return filled;
    }
    return AssertionSuccess();
  }

  AssertionResult ScheduleOp() {
    op_ = "Schedule";
    const int64_t r = Uniform(0, 99);
    const int64_t max_seqs = setup_.max_batch_sequences;
    const int64_t k = r < 85   ? Uniform(1, std::min<int64_t>(4, max_seqs))
                      : r < 97 ? Uniform(0, max_seqs)
                               : max_seqs + Uniform(1, 2);
    std::vector<SeqId> uids;
    std::vector<int64_t> lengths;
    std::set<SeqId> distinct;
    for (int64_t i = 0; i < k; ++i) {
      SeqId uid = MostlyRunnableUid(65);
      if (!uids.empty() && Chance(2)) {
        uid = uids[static_cast<size_t>(Uniform(0, static_cast<int64_t>(uids.size()) - 1))];
      } else {
        for (int tries = 0; tries < 8 && distinct.count(uid) != 0; ++tries) {
          uid = MostlyRunnableUid(65);
        }
      }
      uids.push_back(uid);
      distinct.insert(uid);
      lengths.push_back(RandomLength(uid));
    }
    return ScheduleThese(uids, lengths);
  }

  // Schedule(uids, lengths) against the model.
  AssertionResult ScheduleThese(const std::vector<SeqId>& uids,
                                const std::vector<int64_t>& lengths) {
    const std::set<SeqId> distinct(uids.begin(), uids.end());
    const bool negative =
        std::any_of(lengths.begin(), lengths.end(), [](int64_t n) { return n < 0; });
    const bool invalid = distinct.size() != uids.size() || negative;
    const bool preempted = std::any_of(uids.begin(), uids.end(), [&](SeqId uid) {
      const ModelSequence* m = model_.Find(uid);
      return m != nullptr && m->preempted;
    });

    // CanSchedule settles nothing: it decides on the state the model last synced to.
    const Result<SchedulingResult> can = mgr_->CanSchedule({.uids = uids, .lengths = lengths});
    std::optional<SchedulingResult> want_can;
    if (!invalid && !preempted) want_can = ModelVerdict(uids, lengths);
    SchedulingResult result = SchedulingResult::kSuccess;
    // Every other schedule through ScheduleBatch (taking no draw from rng_, so the random
    // programs stay those whose coverage the counts check), which must leave its batch as it was
    // when it fails. Lengths far past every limit, which test the verdict, get no tokens:
    // Schedule takes them.
    constexpr int64_t kMostTokens = 1 << 16;
    const bool via_batch =
        schedules_++ % 2 == 1 &&
        std::all_of(lengths.begin(), lengths.end(), [](int64_t n) { return n < kMostTokens; });
    const BatchState batch_before = ReadBatch();
    std::vector<TokenId> tokens;
    for (size_t i = 0; via_batch && i < uids.size(); ++i) {
      for (int64_t t = 0; t < lengths[i]; ++t) {
        tokens.push_back(static_cast<TokenId>(uids[i] * 1000 + t));
      }
    }
    const Status s = via_batch
                         ? mgr_->ScheduleBatch({.uids = uids, .lengths = lengths}, tokens, *batch_,
                                               /*padding=*/schedules_ % 4 == 0, &result)
                         : mgr_->Schedule({.uids = uids, .lengths = lengths}, &result);
    if (via_batch && !s.ok()) {
      MODEL_CHECK(ReadBatch() == batch_before) << "a failed ScheduleBatch changed its batch: " << s;
    }
    // Schedule first settles the resumes among its uids (applying the copies done by then),
    // whatever it decides next, and decides on that state.
    for (const SeqId uid : uids) Settle(uid);
    const AssertionResult synced = Sync();
    if (!synced) return synced;
    if (invalid || preempted) {
      // Negative lengths are checked first; a repeated uid and a preempted one in uid order.
      std::set<StatusCode> codes;
      if (invalid) codes.insert(StatusCode::kInvalidArgument);
      if (preempted && !negative) codes.insert(StatusCode::kFailedPrecondition);
      MODEL_CHECK(codes.count(can.status().code()) != 0)
          << "CanSchedule gave " << can.status() << "; allowed: " << ErrorNames(codes);
      MODEL_CHECK(codes.count(s.code()) != 0)
          << "Schedule gave " << s << "; allowed: " << ErrorNames(codes);
      Count(s.code() == StatusCode::kInvalidArgument ? "schedule/InvalidArgument"
                                                     : "schedule/preempted");
      return AssertionSuccess();  // Verify() then checks that nothing changed
    }
    MODEL_CHECK(can.ok()) << can.status();
    MODEL_CHECK(*can == *want_can) << "CanSchedule said " << SchedulingResultName(*can)
                                   << ", model " << SchedulingResultName(*want_can);
    const SchedulingResult want = ModelVerdict(uids, lengths);
    MODEL_CHECK(result == want) << "Schedule said " << SchedulingResultName(result) << ", model "
                                << SchedulingResultName(want);
    Count(std::string("schedule/") + std::string(SchedulingResultName(want)));
    if (want != SchedulingResult::kSuccess) {
      MODEL_CHECK(s.code() == StatusCode::kResourceExhausted) << s;
      return AssertionSuccess();
    }
    MODEL_CHECK(s.ok()) << s;
    for (size_t i = 0; i < uids.size(); ++i) {
      ModelSequence* m = nullptr;
      const auto it = model_.sequences.find(uids[i]);
      if (it != model_.sequences.end()) {
        m = &it->second;
      } else {
        const AssertionResult added = AddToModel(uids[i], &m);
        if (!added) return added;
      }
      for (int g = 0; g < num_groups_; ++g) {
        const size_t allocated = m->tables[g].size();
        const auto needed = static_cast<size_t>(std::max<int64_t>(
            CeilDiv(m->seen + lengths[i], block_size(g)) - static_cast<int64_t>(allocated), 0));
        const AssertionResult fresh = TakeFresh(uids[i], g, allocated, allocated + needed, *m);
        if (!fresh) return fresh;
      }
      m->in_flight = lengths[i];
    }
    if (via_batch) return CheckBatch(uids, lengths);
    return AssertionSuccess();
  }

  // What a ScheduleBatch must leave unchanged when it fails.
  struct BatchState {
    bool finalized = false;
    int32_t sequences = 0;
    int32_t tokens = 0;
    std::vector<int64_t> input_ids;
    std::vector<int32_t> descriptors;
    std::vector<int64_t> slot_mapping;
    bool operator==(const BatchState&) const = default;
  };

  template <class T>
  static std::vector<T> Read(const Result<TensorView>& view) {
    if (!view.ok()) return {};
    const auto* data = static_cast<const T*>(view->data);
    return std::vector<T>(data, data + view->numel());
  }

  BatchState ReadBatch() const {
    BatchState state;
    state.finalized = batch_->finalized();
    state.sequences = batch_->current_sequences();
    state.tokens = batch_->current_tokens();
    if (state.finalized) {
      state.input_ids = Read<int64_t>(batch_->input_ids());
      state.descriptors = Read<int32_t>(batch_->inflight_seq_descriptors());
      state.slot_mapping = Read<int64_t>(batch_->slot_mapping());
    }
    return state;
  }

  // After a successful ScheduleBatch(uids, lengths) (the model already updated): the batch holds
  // the uids in order with their tokens, descriptors, and per group the model's tables as CSR
  // and slots.
  AssertionResult CheckBatch(const std::vector<SeqId>& uids, const std::vector<int64_t>& lengths) {
    MODEL_CHECK(batch_->finalized());
    MODEL_CHECK(batch_->current_sequences() == std::ssize(uids));
    const std::vector<int64_t> ids = Read<int64_t>(batch_->input_ids());
    const std::vector<int32_t> descriptors = Read<int32_t>(batch_->inflight_seq_descriptors());
    int64_t start = 0;
    for (size_t i = 0; i < uids.size(); ++i) {
      const ModelSequence& m = model_.sequences.at(uids[i]);
      MODEL_CHECK(descriptors[4 * i] == start && descriptors[4 * i + 1] == lengths[i] &&
                  descriptors[4 * i + 2] == m.seen && descriptors[4 * i + 3] == 0)
          << "batch entry " << i << " (uid " << uids[i] << ")";
      for (int64_t t = 0; t < lengths[i]; ++t) {
        MODEL_CHECK(ids[static_cast<size_t>(start + t)] == uids[i] * 1000 + t)
            << "input id " << t << " of uid " << uids[i];
      }
      start += lengths[i];
    }
    MODEL_CHECK(batch_->current_tokens() == start);
    for (int g = 0; g < num_groups_; ++g) {
      const std::vector<int32_t> indptr = Read<int32_t>(batch_->kv_indptr(g));
      const std::vector<int32_t> indices = Read<int32_t>(batch_->kv_indices(g));
      const std::vector<int64_t> slots = Read<int64_t>(batch_->slot_mapping(g));
      int64_t token = 0;
      for (size_t i = 0; i < uids.size(); ++i) {
        const ModelSequence& m = model_.sequences.at(uids[i]);
        const std::vector<BlockId>& table = m.tables[static_cast<size_t>(g)];
        const int64_t used = CeilDiv(m.seen + lengths[i], block_size(g));
        MODEL_CHECK(indptr[i + 1] - indptr[i] == used) << "group " << g << " entry " << i;
        MODEL_CHECK(std::equal(table.begin(), table.begin() + used, indices.begin() + indptr[i]))
            << "group " << g << " CSR of uid " << uids[i];
        for (int64_t t = 0; t < lengths[i]; ++t, ++token) {
          const int64_t pos = m.seen + t;
          MODEL_CHECK(slots[static_cast<size_t>(token)] ==
                      int64_t{table[static_cast<size_t>(pos / block_size(g))]} * block_size(g) +
                          pos % block_size(g))
              << "group " << g << " slot of token " << t << " of uid " << uids[i];
        }
      }
    }
    Count("schedule_batch/checked");
    return AssertionSuccess();
  }

  AssertionResult PostForwardOp() {
    op_ = "PostForward";
    std::vector<SeqId> uids;
    const int64_t r = Uniform(0, 99);
    for (const auto& [uid, m] : model_.sequences) {
      if (r < 70 ? m.in_flight > 0 : Chance(50)) uids.push_back(uid);
    }
    const bool unknown = r >= 90;
    if (!uids.empty() && Chance(5)) {  // a uid listed twice moves it once
      uids.push_back(uids[static_cast<size_t>(Uniform(0, static_cast<int64_t>(uids.size()) - 1))]);
    }
    if (unknown) {
      const auto at = static_cast<std::ptrdiff_t>(Uniform(0, static_cast<int64_t>(uids.size())));
      uids.insert(uids.begin() + at, UnknownUid());
    }
    return PostForwardThese(uids, unknown);
  }

  // PostForward(uids) against the model; `unknown`: one of them is not tracked.
  AssertionResult PostForwardThese(const std::vector<SeqId>& uids, bool unknown) {
    const Status s = mgr_->PostForward(uids);
    if (unknown) {
      MODEL_CHECK(s.code() == StatusCode::kNotFound) << s;
      Count("post_forward/NotFound");
      return AssertionSuccess();
    }
    MODEL_CHECK(s.ok()) << s;
    for (const SeqId uid : uids) {
      ModelSequence& m = model_.sequences[uid];
      m.seen += m.in_flight;
      m.in_flight = 0;
    }
    Count("post_forward/ok");
    return AssertionSuccess();
  }

  AssertionResult ForkOp() {
    op_ = "Fork";
    SeqId parent = MostlyKnownUid(88);
    // Prefer a parent with nothing in flight, as an engine forks after a forward.
    for (int tries = 0; tries < 4 && Chance(80); ++tries) {
      const ModelSequence* p = model_.Find(parent);
      if (p == nullptr || p->in_flight == 0) break;
      parent = KnownUid();
    }
    const SeqId child = Chance(90) ? UnknownUid() : MostlyKnownUid(50);
    return ForkThese(parent, child);
  }

  // Fork(parent, child) against the model.
  AssertionResult ForkThese(SeqId parent, SeqId child) {
    const ModelSequence* p = model_.Find(parent);
    // New bytes in the parent's partial tails, so the copy is seen to be one; not while the
    // parent's resume copy may still be writing them (Fork waits for it).
    const bool restoring = p != nullptr && RestoreInFlight(parent);
    bool any_tail = false;
    if (p != nullptr && !p->preempted) {
      for (int g = 0; g < num_groups_; ++g) {
        if (p->seen % block_size(g) == 0) continue;
        any_tail = true;
        const BlockId tail = p->tables[g][static_cast<size_t>(p->seen / block_size(g))];
        MODEL_CHECK(tail != kNoBlock) << "model: the partial tail was released";
        if (restoring) continue;
        salts_[g][tail] = ++last_salt_;
        const AssertionResult filled = FillBlock(g, tail, salts_[g][tail]);
        if (!filled) return filled;
      }
    }
    const Status s = mgr_->Fork(parent, child);
    // Fork settles the parent's resume first, then decides on that state.
    Settle(parent);
    const AssertionResult synced = Sync();
    if (!synced) return synced;
    // Every error the contract allows for this state; OK only when there is none.
    std::set<StatusCode> errors;
    if (p == nullptr) errors.insert(StatusCode::kNotFound);
    if (model_.Find(child) != nullptr) errors.insert(StatusCode::kAlreadyExists);
    if (p != nullptr && p->in_flight != 0) errors.insert(StatusCode::kFailedPrecondition);
    if (static_cast<int32_t>(model_.sequences.size()) >= setup_.max_tracked) {
      errors.insert(StatusCode::kResourceExhausted);
    }
    for (int g = 0; g < num_groups_ && p != nullptr; ++g) {
      if (p->seen % block_size(g) != 0 && FreeBlocks(g) == 0) {
        errors.insert(StatusCode::kResourceExhausted);
      }
    }
    // A preempted parent is refused right after the lookup.
    if (p != nullptr && p->preempted) errors = {StatusCode::kFailedPrecondition};
    if (!errors.empty()) {
      MODEL_CHECK(errors.count(s.code()) != 0) << "Fork(" << parent << ", " << child << ") gave "
                                               << s << "; allowed: " << ErrorNames(errors);
      std::string what = "fork/" + std::string(StatusCodeName(s.code()));
      if (p != nullptr && p->preempted) what = "fork/preempted";
      if (s.code() == StatusCode::kResourceExhausted) {
        what += static_cast<int32_t>(model_.sequences.size()) < setup_.max_tracked ? "/blocks"
                                                                                   : "/slots";
      }
      Count(what);
      return AssertionSuccess();
    }
    MODEL_CHECK(s.ok()) << "Fork(" << parent << ", " << child << ") gave " << s;
    Count(any_tail ? "fork/ok_with_tail_copy" : "fork/ok_all_shared");
    ModelSequence* c = nullptr;
    const AssertionResult added = AddToModel(child, &c);
    if (!added) return added;
    p = model_.Find(parent);  // the map may have rebalanced; the element did not move
    c->seen = p->seen;
    for (int g = 0; g < num_groups_; ++g) {
      const auto full = static_cast<size_t>(p->seen / block_size(g));
      MODEL_CHECK(static_cast<size_t>(p->released[g]) <= full);
      c->tables[g].assign(p->tables[g].begin(),
                          p->tables[g].begin() + static_cast<std::ptrdiff_t>(full));
      c->released[g] = p->released[g];
      for (const BlockId b : c->tables[g]) {
        if (b != kNoBlock) ++model_.refs[g][b];
      }
      if (p->seen % block_size(g) == 0) {
        MODEL_CHECK(mgr_->GetSequence(child)->block_table(g).size() == full);
        continue;
      }
      const AssertionResult fresh = TakeFresh(child, g, full, full + 1, *c, /*fill=*/false);
      if (!fresh) return fresh;
      // Copy-on-write: the child's tail holds the parent's bytes; the parent's are intact.
      const uint32_t salt = salts_[g][p->tables[g][full]];
      salts_[g][c->tables[g][full]] = salt;
      AssertionResult copied = BlockHolds(g, c->tables[g][full], salt);
      if (!copied) return copied << " (child " << child << "'s tail copy)";
      AssertionResult kept = BlockHolds(g, p->tables[g][full], salt);
      if (!kept) return kept << " (parent " << parent << "'s tail)";
    }
    return AssertionSuccess();
  }

  static std::string ErrorNames(const std::set<StatusCode>& codes) {
    std::string names;
    for (const StatusCode code : codes) names += std::string(StatusCodeName(code)) + " ";
    return names;
  }

  AssertionResult FreeLeadingBlocksOp() {
    op_ = "FreeLeadingBlocks";
    const SeqId uid = MostlyKnownUid(90);
    const int32_t g = RandomGroup();
    const bool group_ok = g >= 0 && g < num_groups_;
    ModelSequence* m = model_.sequences.count(uid) ? &model_.sequences[uid] : nullptr;
    int64_t full = 0;
    if (m != nullptr && group_ok) {
      full = std::min<int64_t>(m->seen / block_size(g), static_cast<int64_t>(m->tables[g].size()));
    }
    const int64_t room = m != nullptr && group_ok ? full - m->released[g] : 0;
    const auto n =
        static_cast<int32_t>(Chance(3) ? -1 : Uniform(0, std::max<int64_t>(room, 0) + 2));
    std::set<StatusCode> errors;
    if (!group_ok) errors.insert(StatusCode::kOutOfRange);
    if (n < 0) errors.insert(StatusCode::kInvalidArgument);
    if (m == nullptr) errors.insert(StatusCode::kNotFound);
    if (m != nullptr && group_ok && n > room) errors.insert(StatusCode::kOutOfRange);
    // The arguments, the lookup, settling a resume, then a preempted sequence is refused.
    const bool reaches_sequence = m != nullptr && group_ok && n >= 0;
    if (reaches_sequence && m->preempted) errors = {StatusCode::kFailedPrecondition};
    const Status s = mgr_->FreeLeadingBlocks(uid, n, g);
    if (reaches_sequence) Settle(uid);
    const AssertionResult synced = Sync();
    if (!synced) return synced;
    if (!errors.empty()) {
      MODEL_CHECK(errors.count(s.code()) != 0)
          << "FreeLeadingBlocks(" << uid << ", " << n << ", " << g << ") gave " << s
          << "; allowed: " << ErrorNames(errors);
      Count(reaches_sequence && m->preempted
                ? "free_leading/preempted"
                : "free_leading/" + std::string(StatusCodeName(s.code())));
      return AssertionSuccess();
    }
    MODEL_CHECK(s.ok()) << "FreeLeadingBlocks(" << uid << ", " << n << ", " << g << ") gave " << s;
    for (int32_t i = 0; i < n; ++i) {
      BlockId& b = m->tables[g][static_cast<size_t>(m->released[g]) + static_cast<size_t>(i)];
      --model_.refs[g][b];
      b = kNoBlock;
    }
    m->released[g] += n;
    Count(n > 0 ? "free_leading/ok" : "free_leading/ok_zero");
    return AssertionSuccess();
  }

  AssertionResult FlushOp() {
    op_ = "FlushSequence";
    const SeqId uid = MostlyKnownUid(85);
    const bool restoring = model_.Find(uid) != nullptr && RestoreInFlight(uid);
    const Status s = mgr_->FlushSequence(uid);
    // Flushing waits for the sequence's copies in flight (a resume's, or a preemption's whose
    // handles it drops), applying every copy done by then.
    const AssertionResult synced = Sync();
    if (!synced) return synced;
    const auto it = model_.sequences.find(uid);
    if (it == model_.sequences.end()) {
      MODEL_CHECK(s.code() == StatusCode::kNotFound) << s;
      Count("flush/NotFound");
      return AssertionSuccess();
    }
    MODEL_CHECK(s.ok()) << "flush " << uid << ": " << s;
    MODEL_CHECK(mgr_->GetSequence(uid) == nullptr);
    Count(it->second.preempted ? "flush/preempted" : restoring ? "flush/resuming" : "flush/ok");
    FlushInModel(it);
    return AssertionSuccess();
  }

  // A flushed sequence's blocks go back; a preempted one's handles are dropped (their slots are
  // free at once; the device blocks of a copy still in flight go back when it is applied).
  void FlushInModel(std::map<SeqId, ModelSequence>::iterator it) {
    ModelSequence& m = it->second;
    for (int g = 0; g < num_groups_; ++g) {
      for (const BlockId b : m.tables[g]) {
        if (b != kNoBlock) --model_.refs[g][b];
      }
      if (m.preempted) {
        const auto held = static_cast<int32_t>(m.parked_salts[g].size());
        (m.tiers[g] == Tier::kHost ? host_used_ : disk_used_)[g] -= held;
      }
    }
    model_.sequences.erase(it);
  }

  AssertionResult GetOrCreateOp() {
    op_ = "GetOrCreateSequence";
    const SeqId uid = RandomUid();
    const Result<Sequence*> seq = mgr_->GetOrCreateSequence(uid);
    if (const ModelSequence* m = model_.Find(uid)) {
      MODEL_CHECK(seq.ok()) << seq.status();
      MODEL_CHECK(*seq == m->address) << "sequence " << uid << " moved";
      Count("get_or_create/existing");
      return AssertionSuccess();
    }
    if (static_cast<int32_t>(model_.sequences.size()) == setup_.max_tracked) {
      MODEL_CHECK(seq.status().code() == StatusCode::kResourceExhausted) << seq.status();
      Count("get_or_create/ResourceExhausted");
      return AssertionSuccess();
    }
    MODEL_CHECK(seq.ok()) << seq.status();
    ModelSequence* m = nullptr;
    const AssertionResult added = AddToModel(uid, &m);
    if (!added) return added;
    MODEL_CHECK(*seq == m->address);
    Count("get_or_create/created");
    return AssertionSuccess();
  }

  // The model's get_kv_requirements, written from DeepSpeed's formula.
  static KVRequirement ModelRequirement(int64_t seen, int64_t allocated, int64_t tokens,
                                        int64_t max_blocks, int64_t block_size) {
    const int64_t required = CeilDiv(seen + tokens, block_size) - allocated;
    if (required <= max_blocks) return {tokens, static_cast<int32_t>(required)};
    return {(max_blocks + allocated) * block_size - seen, static_cast<int32_t>(max_blocks)};
  }

  AssertionResult QueryOp() {
    op_ = "Query";
    const SeqId uid = MostlyKnownUid(70);
    const int32_t g = RandomGroup();
    const int64_t max_tokens = Chance(3)   ? -Uniform(1, 5)
                               : Chance(2) ? std::numeric_limits<int64_t>::max()
                                           : Uniform(0, 2 * capacity_);
    const auto max_new_blocks = Chance(3)   ? -1
                                : Chance(2) ? std::numeric_limits<int32_t>::max()
                                            : static_cast<int32_t>(Uniform(0, setup_.num_blocks));
    const Result<KVRequirement> q =
        mgr_->Query(uid, {.max_new_tokens = max_tokens, .max_new_blocks = max_new_blocks}, g);
    std::set<StatusCode> errors;
    if (g < 0 || g >= num_groups_) errors.insert(StatusCode::kOutOfRange);
    if (max_tokens < 0 || max_new_blocks < 0) errors.insert(StatusCode::kInvalidArgument);
    if (!errors.empty()) {
      MODEL_CHECK(errors.count(q.status().code()) != 0)
          << q.status() << "; allowed: " << ErrorNames(errors);
      Count("query/" + std::string(StatusCodeName(q.status().code())));
      return AssertionSuccess();
    }
    MODEL_CHECK(q.ok()) << q.status();
    const ModelSequence* m = model_.Find(uid);
    if (m == nullptr && static_cast<int32_t>(model_.sequences.size()) == setup_.max_tracked) {
      MODEL_CHECK(q->tokens == 0 && q->blocks == 0)
          << "unknown uid with no slot: (" << q->tokens << ", " << q->blocks << ")";
      Count("query/no_slot");
      return AssertionSuccess();
    }
    const int64_t seen = m ? m->seen : 0;
    const int32_t allocated = m ? static_cast<int32_t>(m->tables[g].size()) : 0;
    const int64_t tokens = std::min(max_tokens, std::max<int64_t>(capacity_ - seen, 0));
    const KVRequirement want =
        ModelRequirement(seen, allocated, tokens, max_new_blocks, block_size(g));
    const KVRequirement formula = ComputeKVRequirement(
        seen, allocated, {.max_new_tokens = tokens, .max_new_blocks = max_new_blocks},
        block_size(g));
    MODEL_CHECK(formula.tokens == want.tokens && formula.blocks == want.blocks)
        << "ComputeKVRequirement(" << seen << ", " << allocated << ", " << tokens << ", "
        << max_new_blocks << ", " << block_size(g) << ") = (" << formula.tokens << ", "
        << formula.blocks << "), model (" << want.tokens << ", " << want.blocks << ")";
    MODEL_CHECK(q->tokens == want.tokens && q->blocks == want.blocks)
        << "Query(" << uid << ", " << max_tokens << ", " << max_new_blocks << ", " << g << ") = ("
        << q->tokens << ", " << q->blocks << "), model (" << want.tokens << ", " << want.blocks
        << ")";
    Count(q->tokens < max_tokens ? "query/capped" : "query/all");
    return AssertionSuccess();
  }

  // What Query says fits within the free blocks of every group, CanSchedule must not refuse for
  // blocks or context.
  AssertionResult QueryThenCanScheduleOp() {
    op_ = "QueryThenCanSchedule";
    const SeqId uid = MostlyKnownUid(80);
    const int64_t want_tokens = Uniform(1, capacity_);
    int64_t tokens = want_tokens;
    for (int g = 0; g < num_groups_; ++g) {
      const Result<KVRequirement> q =
          mgr_->Query(uid, {.max_new_tokens = want_tokens, .max_new_blocks = FreeBlocks(g)}, g);
      MODEL_CHECK(q.ok()) << q.status();
      tokens = std::min(tokens, q->tokens);
    }
    if (tokens <= 0) {
      Count("query_fits/nothing");
      return AssertionSuccess();
    }
    const std::array<SeqId, 1> uids{uid};
    const std::array<int64_t, 1> lengths{tokens};
    const Result<SchedulingResult> can = mgr_->CanSchedule({.uids = uids, .lengths = lengths});
    if (const ModelSequence* m = model_.Find(uid); m != nullptr && m->preempted) {
      MODEL_CHECK(can.status().code() == StatusCode::kFailedPrecondition) << can.status();
      Count("query_fits/preempted");
      return AssertionSuccess();
    }
    MODEL_CHECK(can.ok()) << can.status();
    MODEL_CHECK(*can != SchedulingResult::kKVCacheLimitExceeded &&
                *can != SchedulingResult::kSequenceTokenLimitExceeded)
        << "Query allowed " << tokens << " tokens for " << uid << " but CanSchedule said "
        << SchedulingResultName(*can);
    Count("query_fits/" + std::string(SchedulingResultName(*can)));
    return AssertionSuccess();
  }

  // ---- offload ----

  bool offload() const { return setup_.host_blocks > 0; }
  ModelSequence* FindSequence(SeqId uid) {
    const auto it = model_.sequences.find(uid);
    return it == model_.sequences.end() ? nullptr : &it->second;
  }
  // Blocks of group g that `m` holds (or, preempted, has handles for).
  static int32_t Held(const ModelSequence& m, int g) {
    return static_cast<int32_t>(m.tables[g].size()) - m.released[g];
  }
  // A call naming a resumed sequence settles its resume (waits for the copy).
  void Settle(SeqId uid) {
    ModelSequence* m = FindSequence(uid);
    if (m != nullptr && !m->preempted) m->resuming = false;
  }
  bool RestoreInFlight(SeqId uid) const {
    return std::any_of(jobs_.begin(), jobs_.end(),
                       [&](const ModelJob& job) { return !job.offload && job.uid == uid; });
  }
  bool AppliedThrough(uint64_t job) const { return jobs_.empty() || jobs_.front().id > job; }

  // Applies, in submission order, the copies the store has applied since the last call: its
  // stats() count the blocks of every applied copy (none fails here). `exact` = false when the
  // call may have applied copies the model does not know yet (its own, queued first).
  AssertionResult Sync(bool exact = true) {
    const OffloadStore* store = mgr_->offload_store();
    if (store == nullptr) return AssertionSuccess();
    const OffloadStats& stats = store->stats();
    MODEL_CHECK(stats.failed_copies == 0) << stats.failed_copies << " copies failed";
    while (!jobs_.empty()) {
      const ModelJob& job = jobs_.front();
      int64_t& applied = job.offload ? offloaded_ : restored_;
      if (applied + job.count > (job.offload ? stats.offloaded_blocks : stats.restored_blocks)) {
        break;
      }
      applied += job.count;
      const AssertionResult done = Apply(job);
      if (!done) return done;
      jobs_.pop_front();
    }
    if (!exact) return AssertionSuccess();
    MODEL_CHECK(offloaded_ == stats.offloaded_blocks && restored_ == stats.restored_blocks)
        << "the store applied " << stats.offloaded_blocks << " offloaded and "
        << stats.restored_blocks << " restored blocks, the model's copies in order " << offloaded_
        << " and " << restored_;
    return AssertionSuccess();
  }

  // An offload done gives its device blocks back; a restore done frees its slots, and the
  // resumed blocks hold what the preempted sequence's blocks held.
  AssertionResult Apply(const ModelJob& job) {
    if (job.offload) {
      for (const BlockId b : job.blocks) --model_.refs[job.group][b];
      return AssertionSuccess();
    }
    for (int g = 0; g < num_groups_; ++g) {
      host_used_[g] -= job.host[g];
      disk_used_[g] -= job.disk[g];
    }
    for (const auto& [g, b, salt] : job.expect) {
      AssertionResult held = BlockHolds(g, b, salt);
      if (!held) return held << " (sequence " << job.uid << " resumed into it)";
    }
    Count("resume/data_checked");
    return AssertionSuccess();
  }

  // Where PreemptSequence puts each group's blocks once the first k copies in flight are
  // applied: the host tier, else the disk tier, else nowhere (nullopt).
  std::optional<std::vector<Tier>> TiersAt(const ModelSequence& m, size_t k) const {
    std::vector<Tier> tiers;
    for (int g = 0; g < num_groups_; ++g) {
      int32_t host_free = setup_.host_blocks - host_used_[g];
      int32_t disk_free = setup_.disk_blocks - disk_used_[g];
      for (size_t j = 0; j < k; ++j) {
        if (jobs_[j].offload) continue;
        host_free += jobs_[j].host[g];
        disk_free += jobs_[j].disk[g];
      }
      const int32_t held = Held(m, g);
      if (host_free >= held) {
        tiers.push_back(Tier::kHost);
      } else if (disk_free >= held) {
        tiers.push_back(Tier::kDisk);
      } else {
        return std::nullopt;
      }
    }
    return tiers;
  }

  // Waits for the copies of `ticket` now (they and every earlier one are then applied), or keeps
  // it for WaitOp. `submitted`: the operation queued copies, the last of them last_job_.
  AssertionResult WaitNowOrLater(OffloadTicket ticket, bool submitted) {
    const uint64_t last = submitted ? last_job_ : 0;
    if (!Chance(40)) {
      tickets_.push_back({ticket, last});
      if (tickets_.size() > 16) tickets_.pop_front();  // an engine may never wait for one
      return AssertionSuccess();
    }
    const Status waited = ticket.Wait();
    MODEL_CHECK(waited.ok()) << waited;
    const AssertionResult synced = Sync();
    if (!synced) return synced;
    MODEL_CHECK(AppliedThrough(last)) << "a waited copy is not applied";
    Count("wait/at_once");
    return AssertionSuccess();
  }

  AssertionResult PreemptOp() {
    op_ = "PreemptSequence";
    SeqId uid = MostlyKnownUid(90);
    for (int tries = 0; tries < 4 && Chance(85); ++tries) {  // mostly one that can be preempted
      const ModelSequence* m = model_.Find(uid);
      if (m == nullptr || (!m->preempted && m->in_flight == 0)) break;
      uid = KnownUid();
    }
    ModelSequence* m = FindSequence(uid);
    StatusCode want = StatusCode::kOk;
    if (!offload()) {
      want = StatusCode::kFailedPrecondition;
    } else if (m == nullptr) {
      want = StatusCode::kNotFound;
    } else if (m->preempted || m->in_flight != 0) {
      want = StatusCode::kFailedPrecondition;
    }
    // The tiers it may choose: settling a resume of `uid` first applies between none and all of
    // the copies in flight; otherwise it decides on the state the model last synced to.
    std::vector<std::optional<std::vector<Tier>>> decisions;
    if (want == StatusCode::kOk) {
      for (size_t k = 0; k <= jobs_.size(); ++k) decisions.push_back(TiersAt(*m, k));
    }
    const bool settles = m != nullptr && !m->preempted && m->resuming;
    const size_t in_flight = jobs_.size();
    Result<OffloadTicket> ticket = mgr_->PreemptSequence(uid);
    if (offload()) Settle(uid);
    // The offload of one group applies what is done of the earlier ones, its own included: the
    // earlier copies first, its own once the model has queued them.
    const AssertionResult synced = Sync(/*exact=*/false);
    if (!synced) return synced;
    const size_t applied = in_flight - jobs_.size();
    if (want != StatusCode::kOk) {
      MODEL_CHECK(ticket.status().code() == want) << ticket.status() << ", expected " << want;
      Count(!offload() ? "preempt/offload_off"
                       : "preempt/" + std::string(StatusCodeName(ticket.status().code())));
      return Sync();
    }
    const size_t last = settles ? applied : 0;
    if (!ticket.ok()) {
      const AssertionResult exact = Sync();
      if (!exact) return exact;
      MODEL_CHECK(ticket.status().code() == StatusCode::kResourceExhausted) << ticket.status();
      MODEL_CHECK(std::any_of(decisions.begin(), decisions.begin() + last + 1,
                              [](const auto& tiers) { return !tiers.has_value(); }))
          << "PreemptSequence(" << uid << ") gave " << ticket.status()
          << " but the tiers can take its blocks";
      Count("preempt/RESOURCE_EXHAUSTED");
      return AssertionSuccess();
    }
    // The tier each group went to, by the slots it took.
    const OffloadStore& store = *mgr_->offload_store();
    std::vector<Tier> chosen;
    for (int g = 0; g < num_groups_; ++g) {
      const int32_t held = Held(*m, g);
      const int32_t host_free = setup_.host_blocks - host_used_[g];
      const int32_t disk_free = setup_.disk_blocks - disk_used_[g];
      if (store.free_host_blocks(g) == host_free - held && store.free_disk_blocks(g) == disk_free) {
        chosen.push_back(Tier::kHost);
      } else if (store.free_host_blocks(g) == host_free &&
                 store.free_disk_blocks(g) == disk_free - held) {
        chosen.push_back(Tier::kDisk);
      } else {
        return AssertionFailure() << "group " << g << ": " << held << " blocks preempted, "
                                  << store.free_host_blocks(g) << " host and "
                                  << store.free_disk_blocks(g) << " disk slots free; the model "
                                  << host_free << " and " << disk_free << " before";
      }
    }
    const bool allowed =
        std::any_of(decisions.begin(), decisions.begin() + last + 1, [&](const auto& tiers) {
          if (!tiers.has_value()) return false;
          for (int g = 0; g < num_groups_; ++g) {
            if (Held(*m, g) > 0 && (*tiers)[g] != chosen[g]) return false;
          }
          return true;
        });
    MODEL_CHECK(allowed) << "PreemptSequence(" << uid << ") chose tiers the model does not allow"
                         << " (host first, disk when the host tier cannot take a group)";
    // The store holds the blocks until the copies are applied; the table keeps its length.
    bool to_disk = false;
    const uint64_t job_before = last_job_;
    m->tiers = chosen;
    m->parked_salts.assign(static_cast<size_t>(num_groups_), {});
    for (int g = 0; g < num_groups_; ++g) {
      const int32_t held = Held(*m, g);
      if (held == 0) continue;
      to_disk = to_disk || chosen[g] == Tier::kDisk;
      (chosen[g] == Tier::kHost ? host_used_ : disk_used_)[g] += held;
      ModelJob job{.id = ++last_job_, .offload = true, .group = g, .count = held};
      for (auto i = static_cast<size_t>(m->released[g]); i < m->tables[g].size(); ++i) {
        const BlockId b = m->tables[g][i];
        job.blocks.push_back(b);
        m->parked_salts[g].push_back(salts_[g][b]);
        m->tables[g][i] = kNoBlock;
      }
      jobs_.push_back(std::move(job));
    }
    m->preempted = true;
    const AssertionResult exact = Sync();
    if (!exact) return exact;
    Count(to_disk ? "preempt/ok_disk" : "preempt/ok_host");
    if (settles) Count("preempt/settled_resume");
    return WaitNowOrLater(*ticket, last_job_ > job_before);
  }

  AssertionResult ResumeOp() {
    op_ = "ResumeSequence";
    std::vector<SeqId> preempted;
    for (const auto& [uid, m] : model_.sequences) {
      if (m.preempted) preempted.push_back(uid);
    }
    const SeqId uid =
        !preempted.empty() && Chance(85)
            ? preempted[static_cast<size_t>(Uniform(0, static_cast<int64_t>(preempted.size()) - 1))]
            : MostlyKnownUid(80);
    ModelSequence* m = FindSequence(uid);
    // Decided before any copy is applied: the free blocks the model last synced to.
    StatusCode want = StatusCode::kOk;
    if (!offload()) {
      want = StatusCode::kFailedPrecondition;
    } else if (m == nullptr) {
      want = StatusCode::kNotFound;
    } else if (!m->preempted) {
      want = StatusCode::kFailedPrecondition;
    } else {
      for (int g = 0; g < num_groups_; ++g) {
        if (FreeBlocks(g) < Held(*m, g)) want = StatusCode::kResourceExhausted;
      }
    }
    Result<OffloadTicket> ticket = mgr_->ResumeSequence(uid);
    const AssertionResult synced = Sync();  // Restore applies the copies done before it takes
    if (!synced) return synced;
    if (want != StatusCode::kOk) {
      MODEL_CHECK(ticket.status().code() == want) << ticket.status() << ", expected " << want;
      Count(!offload() ? "resume/offload_off"
                       : "resume/" + std::string(StatusCodeName(ticket.status().code())));
      return AssertionSuccess();
    }
    MODEL_CHECK(ticket.ok()) << "ResumeSequence(" << uid << ") gave " << ticket.status();
    // Fresh blocks in the table's place, which hold the old blocks' bytes once copied.
    ModelJob job{.id = 0,
                 .offload = false,
                 .host = std::vector<int32_t>(static_cast<size_t>(num_groups_), 0),
                 .disk = std::vector<int32_t>(static_cast<size_t>(num_groups_), 0),
                 .uid = uid};
    const Sequence* seq = mgr_->GetSequence(uid);
    MODEL_CHECK(seq != nullptr && !seq->preempted()) << "sequence " << uid;
    for (int g = 0; g < num_groups_; ++g) {
      const std::span<const BlockId> table = seq->block_table(g);
      MODEL_CHECK(table.size() == m->tables[g].size()) << "sequence " << uid << " group " << g;
      const int32_t held = Held(*m, g);
      for (int32_t i = 0; i < held; ++i) {
        const auto at = static_cast<size_t>(m->released[g] + i);
        const BlockId b = table[at];
        MODEL_CHECK(b >= 0 && b < setup_.num_blocks) << "block " << b;
        MODEL_CHECK(model_.refs[g][b] == 0)
            << "sequence " << uid << " resumed into block " << b << " of group " << g
            << " which has " << model_.refs[g][b] << " owners";
        model_.refs[g][b] = 1;
        m->tables[g][at] = b;
        salts_[g][b] = m->parked_salts[g][static_cast<size_t>(i)];
        job.expect.emplace_back(g, b, salts_[g][b]);
      }
      (m->tiers[g] == Tier::kHost ? job.host : job.disk)[g] += held;
      job.count += held;
    }
    const bool submitted = job.count > 0;
    if (submitted) {
      job.id = ++last_job_;
      jobs_.push_back(std::move(job));
    }
    m->preempted = false;
    m->resuming = true;
    m->parked_salts.clear();
    Count("resume/ok");
    return WaitNowOrLater(*ticket, submitted);
  }

  // Waits for, or polls, a ticket kept from an earlier preemption or resume.
  AssertionResult WaitOp() {
    op_ = "WaitTicket";
    if (tickets_.empty()) {
      Count("wait/none");
      return AssertionSuccess();
    }
    const auto i = static_cast<size_t>(Uniform(0, static_cast<int64_t>(tickets_.size()) - 1));
    KeptTicket kept = tickets_[i];
    if (Chance(30)) {
      const bool done = kept.ticket.Poll();
      const AssertionResult synced = Sync();
      if (!synced) return synced;
      MODEL_CHECK(done == AppliedThrough(kept.last_job))
          << "Poll said " << done << " but its copies are " << (done ? "not " : "") << "applied";
      Count(done ? "poll/done" : "poll/pending");
      if (!done) return AssertionSuccess();
    } else {
      const Status waited = kept.ticket.Wait();
      MODEL_CHECK(waited.ok()) << waited;
      const AssertionResult synced = Sync();
      if (!synced) return synced;
      MODEL_CHECK(AppliedThrough(kept.last_job)) << "a waited copy is not applied";
      Count("wait/later");
    }
    tickets_.erase(tickets_.begin() + static_cast<std::ptrdiff_t>(i));
    return AssertionSuccess();
  }

  // ---- the comparison after every operation ----

  AssertionResult Verify() {
    const Status invariants = mgr_->CheckInvariants();
    MODEL_CHECK(invariants.ok()) << invariants;
    MODEL_CHECK(mgr_->n_tracked_sequences() == static_cast<int32_t>(model_.sequences.size()))
        << mgr_->n_tracked_sequences() << " tracked, model " << model_.sequences.size();
    occurrences_.assign(static_cast<size_t>(num_groups_),
                        std::vector<int32_t>(static_cast<size_t>(setup_.num_blocks), 0));
    held_.assign(static_cast<size_t>(num_groups_),
                 std::vector<int32_t>(static_cast<size_t>(setup_.num_blocks), 0));
    last_owner_.assign(static_cast<size_t>(num_groups_),
                       std::vector<int32_t>(static_cast<size_t>(setup_.num_blocks), -1));
    slot_used_.assign(static_cast<size_t>(setup_.max_tracked), false);
    for (const auto& [uid, m] : model_.sequences) {
      const Sequence* seq = mgr_->GetSequence(uid);
      MODEL_CHECK(seq != nullptr) << "sequence " << uid << " is missing";
      MODEL_CHECK(seq == m.address) << "sequence " << uid << " moved";
      MODEL_CHECK(seq->uid() == uid);
      MODEL_CHECK(seq->tracking_slot() == m.slot) << "sequence " << uid;
      MODEL_CHECK(m.slot >= 0 && m.slot < setup_.max_tracked && !slot_used_[m.slot])
          << "sequence " << uid << " slot " << m.slot;
      slot_used_[m.slot] = true;
      MODEL_CHECK(seq->seen_tokens() == m.seen && seq->in_flight_tokens() == m.in_flight)
          << "sequence " << uid << ": seen " << seq->seen_tokens() << " in flight "
          << seq->in_flight_tokens() << ", model " << m.seen << " / " << m.in_flight;
      MODEL_CHECK(seq->preempted() == m.preempted) << "sequence " << uid;
      for (int g = 0; g < num_groups_; ++g) {
        const AssertionResult group = VerifyGroup(uid, m, *seq, g);
        if (!group) return group;
      }
    }
    // The store holds one reference to each block an offload in flight reads.
    for (const ModelJob& job : jobs_) {
      for (const BlockId b : job.blocks) ++held_[job.group][b];
    }
    const std::vector<int32_t> free = mgr_->free_blocks();
    MODEL_CHECK(static_cast<int>(free.size()) == num_groups_);
    MODEL_CHECK(mgr_->kv_cache().free_blocks() == free);
    for (int g = 0; g < num_groups_; ++g) {
      const BlockPool& pool = mgr_->pool(g);
      int32_t referenced = 0;
      for (BlockId b = 0; b < setup_.num_blocks; ++b) {
        const int32_t owners = occurrences_[g][b] + held_[g][b];
        MODEL_CHECK(pool.ref_count(b) == owners && model_.refs[g][b] == owners)
            << "block " << b << " of group " << g << ": in " << occurrences_[g][b] << " tables and "
            << held_[g][b] << " copies in flight, ref_count " << pool.ref_count(b) << ", model "
            << model_.refs[g][b];
        // Two sequences hold one block only as a shared (forked) block.
        MODEL_CHECK(owners <= 1 || pool.ref_count(b) > 1);
        if (owners > 0) ++referenced;
      }
      MODEL_CHECK(free[g] + referenced == setup_.num_blocks)
          << "group " << g << ": " << free[g] << " free + " << referenced << " referenced";
      MODEL_CHECK(pool.free_blocks() == free[g] && FreeBlocks(g) == free[g]);
    }
    // A shared block is full and immutable: it lies wholly before seen_tokens of every holder,
    // so no sequence's next tokens (in flight or to come) can land in it.
    for (const auto& [uid, m] : model_.sequences) {
      for (int g = 0; g < num_groups_; ++g) {
        for (size_t i = 0; i < m.tables[g].size(); ++i) {
          const BlockId b = m.tables[g][i];
          if (b == kNoBlock || occurrences_[g][b] < 2) continue;
          MODEL_CHECK(static_cast<int64_t>(i + 1) * block_size(g) <= m.seen)
              << "sequence " << uid << " at " << m.seen << " tokens shares block " << b
              << " (entry " << i << ") of group " << g << " with " << occurrences_[g][b] - 1
              << " others";
        }
      }
    }
    const AssertionResult store = VerifyStore();
    if (!store) return store;
    // An unknown uid has no sequence and no capacity.
    const SeqId unknown = UnknownUid();
    MODEL_CHECK(mgr_->GetSequence(unknown) == nullptr);
    MODEL_CHECK(mgr_->RemainingBlockCapacity(unknown) == 0);
    return AssertionSuccess();
  }

  // The store holds exactly the device blocks of the offloads in flight, and its free slots and
  // live handles are those the model's preempted sequences and restores in flight leave.
  AssertionResult VerifyStore() {
    const OffloadStore* store = mgr_->offload_store();
    if (store == nullptr) return AssertionSuccess();
    int64_t handles = 0;
    for (int g = 0; g < num_groups_; ++g) {
      std::vector<BlockId> held = store->held_blocks(g);
      std::vector<BlockId> want;
      for (const ModelJob& job : jobs_) {
        if (job.offload && job.group == g) {
          want.insert(want.end(), job.blocks.begin(), job.blocks.end());
        }
      }
      std::sort(held.begin(), held.end());
      std::sort(want.begin(), want.end());
      MODEL_CHECK(held == want) << "group " << g << ": the store holds " << held.size()
                                << " device blocks, the model's offloads in flight " << want.size();
      MODEL_CHECK(store->free_host_blocks(g) == setup_.host_blocks - host_used_[g] &&
                  store->free_disk_blocks(g) == setup_.disk_blocks - disk_used_[g])
          << "group " << g << ": " << store->free_host_blocks(g) << " host and "
          << store->free_disk_blocks(g) << " disk slots free, the model "
          << setup_.host_blocks - host_used_[g] << " and " << setup_.disk_blocks - disk_used_[g];
      handles += host_used_[g] + disk_used_[g];
    }
    MODEL_CHECK(store->live_handles() == handles)
        << store->live_handles() << " live handles, the model " << handles;
    return AssertionSuccess();
  }

  AssertionResult VerifyGroup(SeqId uid, const ModelSequence& m, const Sequence& seq, int g) {
    const std::vector<BlockId>& want = m.tables[g];
    const std::span<const BlockId> table = seq.block_table(g);
    MODEL_CHECK(seq.cur_allocated_blocks(g) == static_cast<int32_t>(want.size()) &&
                table.size() == want.size())
        << "sequence " << uid << " group " << g << ": " << table.size() << " blocks, model "
        << want.size();
    MODEL_CHECK(seq.released_blocks(g) == m.released[g])
        << "sequence " << uid << " group " << g << ": released " << seq.released_blocks(g)
        << ", model " << m.released[g];
    MODEL_CHECK(std::equal(table.begin(), table.end(), want.begin()))
        << "sequence " << uid << " group " << g << " table differs from the model";
    MODEL_CHECK(mgr_->RemainingBlockCapacity(uid, g) == m.seen % block_size(g));
    // The table is the row `slot` of the group's array, kNoBlock past the allocated entries.
    const BlockId* row = mgr_->block_tables(g) + static_cast<size_t>(m.slot) * max_blocks(g);
    MODEL_CHECK(table.data() == row) << "sequence " << uid << " group " << g;
    for (auto i = static_cast<int32_t>(want.size()); i < max_blocks(g); ++i) {
      MODEL_CHECK(row[i] == kNoBlock) << "sequence " << uid << " group " << g << " entry " << i;
    }
    // Released entries are a prefix, held ones valid, none held twice by one sequence.
    for (size_t i = 0; i < want.size(); ++i) {
      const BlockId b = want[i];
      MODEL_CHECK((b == kNoBlock) == (m.preempted || i < static_cast<size_t>(m.released[g])))
          << "sequence " << uid << " group " << g << " entry " << i;
      if (b == kNoBlock) continue;
      MODEL_CHECK(last_owner_[g][b] != m.slot)
          << "sequence " << uid << " holds block " << b << " of group " << g << " twice";
      last_owner_[g][b] = m.slot;
      ++occurrences_[g][b];
    }
    return AssertionSuccess();
  }

  ModelSetup setup_;
  std::mt19937_64 rng_;
  std::unique_ptr<StateManager> mgr_;
  std::unique_ptr<RaggedBatch> batch_;  // ScheduleBatch's; destroyed before mgr_
  int64_t schedules_ = 0;               // Schedule ops that reached the call
  ReferenceModel model_;
  int num_groups_ = 0;
  int64_t capacity_ = 0;  // tokens one sequence may hold
  int64_t step_ = 0;
  std::string op_ = "Init";
  std::map<std::string, int64_t> stats_;
  // Offload: the copies in flight in submission order, what the store applied, the slots in use
  // per group (preempted sequences' handles and restores in flight), kept tickets.
  std::string disk_path_;
  std::deque<ModelJob> jobs_;
  uint64_t last_job_ = 0;
  int64_t offloaded_ = 0;
  int64_t restored_ = 0;
  std::vector<int32_t> host_used_;
  std::vector<int32_t> disk_used_;
  std::deque<KeptTicket> tickets_;
  // The pattern each block was last filled with ([group][block]; 0: none).
  std::vector<std::vector<uint32_t>> salts_;
  uint32_t last_salt_ = 0;
  // Verify()'s scratch.
  std::vector<std::vector<int32_t>> held_;
  std::vector<std::vector<int32_t>> occurrences_;
  std::vector<std::vector<int32_t>> last_owner_;
  std::vector<bool> slot_used_;
};

class StateManagerModelTest : public ::testing::TestWithParam<ModelSetup> {};

TEST_P(StateManagerModelTest, RandomLifecyclesMatchReference) {
  const ModelSetup& setup = GetParam();
  uint64_t seed = Seed();
  for (const char ch : setup.name) seed = seed * 31 + static_cast<unsigned char>(ch);
  std::cout << "[ seed     ] " << setup.name << ": " << seed << " (BLOCKKV_TEST_SEED=" << Seed()
            << " replays)\n";
  ModelDriver driver(setup, seed);
  ASSERT_TRUE(driver.Init());
  for (int i = 0; i < setup.steps; ++i) {
    const AssertionResult step = driver.Step();
    ASSERT_TRUE(step) << setup.name << " seed " << seed << " step " << driver.step() << " ("
                      << driver.op() << ")";
  }
  ASSERT_TRUE(driver.ForkWithoutAFreeBlock()) << setup.name << " seed " << seed;
  ASSERT_TRUE(driver.FlushAllAndCheckNoLeak()) << setup.name << " seed " << seed;

  for (const auto& [what, count] : driver.stats()) {
    std::cout << "  " << what << ": " << count << "\n";
  }
  // The program must reach every limit and every path, or it tests less than it claims. Checked
  // for the default seed only: another seed replays a failure, it need not cover everything.
  if (Seed() != kDefaultSeed) return;
  for (const char* what : {"schedule/Success",
                           "schedule/EngineSequenceLimitExceeded",
                           "schedule/BatchSequenceLimitExceeded",
                           "schedule/BatchTokenLimitExceeded",
                           "schedule/KVCacheLimitExceeded",
                           "schedule/SequenceTokenLimitExceeded",
                           "schedule/InvalidArgument",
                           "post_forward/ok",
                           "post_forward/NotFound",
                           "fork/ok_with_tail_copy",
                           "fork/ok_all_shared",
                           "fork/NOT_FOUND",
                           "fork/ALREADY_EXISTS",
                           "fork/FAILED_PRECONDITION",
                           "fork/RESOURCE_EXHAUSTED/slots",
                           "fork/RESOURCE_EXHAUSTED/blocks",
                           "free_leading/ok",
                           "free_leading/OUT_OF_RANGE",
                           "free_leading/NOT_FOUND",
                           "free_leading/INVALID_ARGUMENT",
                           "flush/ok",
                           "flush/NotFound",
                           "flush_all",
                           "get_or_create/created",
                           "get_or_create/existing",
                           "get_or_create/ResourceExhausted",
                           "query/all",
                           "query/capped",
                           "query/no_slot",
                           "query_fits/Success"}) {
    const auto it = driver.stats().find(what);
    EXPECT_TRUE(it != driver.stats().end() && it->second > 0) << "never reached: " << what;
  }
  std::vector<std::string> offload = {"preempt/offload_off", "resume/offload_off"};
  if (setup.host_blocks > 0) {
    offload = {"preempt/ok_host",
               "preempt/RESOURCE_EXHAUSTED",
               "preempt/FAILED_PRECONDITION",
               "preempt/NOT_FOUND",
               "preempt/settled_resume",
               "resume/ok",
               "resume/data_checked",
               "resume/RESOURCE_EXHAUSTED",
               "resume/FAILED_PRECONDITION",
               "resume/NOT_FOUND",
               "wait/at_once",
               "wait/later",
               "poll/done",
               "schedule/preempted",
               "fork/preempted",
               "free_leading/preempted",
               "flush/preempted",
               "query_fits/preempted"};
    if (setup.disk_blocks > 0) offload.push_back("preempt/ok_disk");
  }
  for (const std::string& what : offload) {
    const auto it = driver.stats().find(what);
    EXPECT_TRUE(it != driver.stats().end() && it->second > 0) << "never reached: " << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Setups, StateManagerModelTest, ::testing::ValuesIn(Setups()),
                         [](const ::testing::TestParamInfo<ModelSetup>& param) {
                           return param.param.name;
                         });

// ---- Fork on the data -------------------------------------------------------------------------

TEST(StateManagerModelForkTest, ForkCopiesThePartialTailAndSharesFullBlocks) {
  // Group 0: 2 layers of 16-token blocks; group 1: 3 layers of 32-token blocks.
  StateManagerConfig config{.max_tracked_sequences = 4,
                            .max_ragged_batch_size = 256,
                            .max_ragged_sequence_count = 4,
                            .max_context = 256,
                            .memory_config = {.mode = AllocationMode::kAllocate, .size = 16}};
  Result<std::unique_ptr<StateManager>> created = StateManager::Create(
      config, {Group(16, 2, 16), Group(32, 3, 8)}, CpuDevice(/*memory_budget=*/1 << 20));
  ASSERT_OK(created);
  StateManager& mgr = **created;
  const std::array<SeqId, 1> parent{7};
  const std::array<int64_t, 1> length{40};  // group 0: 2 full + 8; group 1: 1 full + 8
  ASSERT_OK(mgr.Schedule({.uids = parent, .lengths = length}));
  ASSERT_OK(mgr.PostForward(parent));

  // A distinct byte pattern in every layer of every block the parent holds.
  auto fill = [&](int g, BlockId block, uint8_t salt) {
    for (int64_t layer = 0; layer < mgr.kv_cache().config(g).num_caches(); ++layer) {
      Result<TensorView> view = mgr.GetCache(layer, g);
      ASSERT_OK(view);
      const auto bytes = static_cast<size_t>(view->stride(0)) * ElementSize(view->dtype);
      auto* data = static_cast<uint8_t*>(view->data) + static_cast<size_t>(block) * bytes;
      for (size_t i = 0; i < bytes; ++i) {
        data[i] = static_cast<uint8_t>(salt + layer * 17 + static_cast<int64_t>(i % 251));
      }
    }
  };
  auto same_bytes = [&](int g, BlockId a, BlockId b) {
    for (int64_t layer = 0; layer < mgr.kv_cache().config(g).num_caches(); ++layer) {
      Result<TensorView> view = mgr.GetCache(layer, g);
      if (!view.ok()) return false;
      const auto bytes = static_cast<size_t>(view->stride(0)) * ElementSize(view->dtype);
      const auto* data = static_cast<const uint8_t*>(view->data);
      if (std::memcmp(data + static_cast<size_t>(a) * bytes, data + static_cast<size_t>(b) * bytes,
                      bytes) != 0) {
        return false;
      }
    }
    return true;
  };
  const Sequence* p = mgr.GetSequence(7);
  ASSERT_NE(p, nullptr);
  for (int g = 0; g < 2; ++g) {
    for (size_t i = 0; i < p->block_table(g).size(); ++i) {
      fill(g, p->block_table(g)[i], static_cast<uint8_t>(10 * static_cast<size_t>(g) + i + 1));
    }
  }
  const std::vector<int32_t> free_before = mgr.free_blocks();

  ASSERT_OK(mgr.Fork(7, 8));
  ASSERT_OK(mgr.CheckInvariants());
  const Sequence* c = mgr.GetSequence(8);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->seen_tokens(), 40);
  EXPECT_EQ(c->in_flight_tokens(), 0);
  EXPECT_EQ(mgr.free_blocks(), (std::vector<int32_t>{free_before[0] - 1, free_before[1] - 1}));
  const std::array<size_t, 2> full{2, 1};
  for (int g = 0; g < 2; ++g) {
    SCOPED_TRACE(::testing::Message() << "group " << g);
    const std::span<const BlockId> pt = p->block_table(g);
    const std::span<const BlockId> ct = c->block_table(g);
    ASSERT_EQ(pt.size(), full[g] + 1);
    ASSERT_EQ(ct.size(), full[g] + 1);
    for (size_t i = 0; i < full[g]; ++i) {
      EXPECT_EQ(ct[i], pt[i]) << "full block " << i << " is shared by id";
      EXPECT_EQ(mgr.pool(g).ref_count(pt[i]), 2);
    }
    const BlockId parent_tail = pt[full[g]];
    const BlockId child_tail = ct[full[g]];
    EXPECT_NE(child_tail, parent_tail) << "the partial tail is copied, not shared";
    EXPECT_EQ(mgr.pool(g).ref_count(parent_tail), 1);
    EXPECT_EQ(mgr.pool(g).ref_count(child_tail), 1);
    EXPECT_TRUE(same_bytes(g, child_tail, parent_tail)) << "every layer's bytes are copied";

    // Writing the child's copy leaves the parent's tail as it was.
    fill(g, child_tail, 200);
    EXPECT_FALSE(same_bytes(g, child_tail, parent_tail));
  }

  // Both append on their own: each gets its own new blocks past the shared prefix.
  const std::array<SeqId, 2> both{7, 8};
  const std::array<int64_t, 2> more{30, 30};  // 70 tokens: group 0 needs 5 blocks, group 1 3
  ASSERT_OK(mgr.Schedule({.uids = both, .lengths = more}));
  ASSERT_OK(mgr.CheckInvariants());
  for (int g = 0; g < 2; ++g) {
    const std::span<const BlockId> pt = p->block_table(g);
    const std::span<const BlockId> ct = c->block_table(g);
    ASSERT_EQ(pt.size(), ct.size());
    for (size_t i = full[g]; i < pt.size(); ++i) {
      EXPECT_NE(pt[i], ct[i]) << "group " << g << " entry " << i;
      EXPECT_EQ(mgr.pool(g).ref_count(pt[i]), 1);
      EXPECT_EQ(mgr.pool(g).ref_count(ct[i]), 1);
    }
  }

  // Flushing the parent keeps the shared blocks for the child; flushing both frees everything.
  ASSERT_OK(mgr.FlushSequence(7));
  ASSERT_OK(mgr.CheckInvariants());
  for (int g = 0; g < 2; ++g) {
    for (size_t i = 0; i < full[g]; ++i) EXPECT_EQ(mgr.pool(g).ref_count(c->block_table(g)[i]), 1);
  }
  ASSERT_OK(mgr.FlushSequence(8));
  ASSERT_OK(mgr.CheckInvariants());
  EXPECT_EQ(mgr.free_blocks(), (std::vector<int32_t>{16, 16}));
}

}  // namespace
}  // namespace blockkv
