// SPDX-License-Identifier: Apache-2.0
// One engine decode step through the state manager and the ragged batch, against a bare
// baseline doing the same bookkeeping without any checks, in the same binary.
//
// A step, for N running sequences that each add one token:
//   blockkv:  StateManager::Schedule (duplicate check, limits, KV requirement, all-or-nothing
//             block reservation) → RaggedBatch Clear / InsertSequence ×N / Finalize (input ids,
//             token→sequence map, descriptors, dense block tables, CSR, slot mapping) →
//             PostForward(batch) (no uid lookups).
//   baseline: per sequence, a block from a bare free-list stack when the token crosses a block
//             boundary, then the same output arrays written in one pass, no validation at all.
// Goal (issue 4): ≤ 20 µs per step at N = 1,024 on this machine, and a cost linear in N
// (reported at N = 256, 1,024, 4,096 as ns per sequence).
//
// Every 64 steps the sequences are flushed and prefilled again with the timer paused, so the
// pool never runs out and the state stays the same from one run to the next.
//
// speculative_step/blockkv_k4: the fused step with 4 drafts per sequence and random accept
// counts (PostForward(batch, accepted)), reported per committed token.
//
// hybrid_admission/gemma2_like: not a timing. A Gemma-2 shaped manager (a DENSE and a LOCAL
// group of equal layers, window 4,096, context 8,192, block 16) in a fixed byte budget, with a
// pool per group (DeepSpeed's layout, the baseline) and with MemoryConfig::shared_pool; sequences
// are admitted one after another and prefilled in chunks of 512 tokens to the full context until
// the cache refuses one. Counters: the sequences each layout holds at full context, the blocks
// one holds, and shared_vs_separate, the ratio of sequences.
//
// state_checkpoint/*: a Jamba-like manager (4 attention layers of 8 KV heads × 128 fp16 in blocks
// of 16; a STATE group of 28 Mamba layers of 320 KiB each, 8.75 MiB a sequence), requests of a
// 4,096-token prompt and 64 tokens of their own, prefilled in chunks of 512, the manager's calls
// only (no model). prefix_off: prefix caching off, all a STATE model had before checkpoints.
// saving_misses: checkpoints every 512 tokens, every prompt different, so each request saves 8
// checkpoints (8 state copies) and hits nothing: the cost of saving. hit: every request shares
// the prompt and resumes from the checkpoint at 4,096 (one state copy). Counter computed_tokens:
// the tokens the model would compute per request. memcpy_one_state: the baseline, one memcpy of
// a sequence's state.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "bench_util.h"
#include "blockkv/blockkv.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"

namespace {

using blockkv_bench::Check;

using blockkv::BlockId;
using blockkv::SeqId;
using blockkv::TokenId;

constexpr int32_t kBlockSize = 16;
constexpr int kStepsPerRound = 64;
constexpr int64_t kMaxPrompt = 1000;

std::vector<int64_t> Prompts(int n) {
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<int64_t> len(100, kMaxPrompt);
  std::vector<int64_t> prompts(static_cast<size_t>(n));
  for (auto& p : prompts) p = len(rng);
  return prompts;
}

// Blocks a sequence may hold: its prompt and a round of steps of `step_tokens` tokens each.
int32_t MaxBlocks(int step_tokens = 1) {
  return static_cast<int32_t>((kMaxPrompt + int64_t{kStepsPerRound} * step_tokens) / kBlockSize +
                              2);
}

int32_t PoolBlocks(int n, int step_tokens = 1) {
  return static_cast<int32_t>(int64_t{n} * MaxBlocks(step_tokens));
}

// ---- blockkv ----------------------------------------------------------------------------------

struct Engine {
  std::unique_ptr<blockkv::StateManager> manager;
  std::unique_ptr<blockkv::RaggedBatch> batch;
  std::vector<SeqId> uids;
  std::vector<int64_t> prompts;
  std::vector<int64_t> ones;
  std::vector<TokenId> token;   // the one token id every sequence gets
  std::vector<TokenId> tokens;  // that token, once per sequence
  // With prefix caching: every sequence's prompt tokens, and the sampled token appended per step.
  bool prefix_cache = false;
  std::vector<std::vector<blockkv::TokenId>> prompt_tokens;

  // step_tokens: the most tokens a sequence adds per step (sizes its table and the pool).
  explicit Engine(int n, bool with_prefix_cache = false, int step_tokens = 1)
      : prompts(Prompts(n)), prefix_cache(with_prefix_cache) {
    blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
    blockkv::KVCacheConfig kv;
    kv.block_size = kBlockSize;
    kv.cache_shape = {1, 1, 8};  // bookkeeping is what is measured: keep the storage tiny
    kv.max_blocks_per_allocation_group = MaxBlocks(step_tokens);
    blockkv::StateManagerConfig config;
    config.max_tracked_sequences = n;
    config.max_ragged_sequence_count = n;
    config.max_ragged_batch_size = std::max<int>(n * step_tokens, static_cast<int>(kMaxPrompt));
    config.memory_config.mode = blockkv::AllocationMode::kAllocate;
    config.memory_config.size = PoolBlocks(n, step_tokens);
    config.prefix_cache.enabled = prefix_cache;
    auto m = blockkv::StateManager::Create(config, {kv}, blockkv::CpuDevice());
    Check(m.status(), "StateManager::Create");
    manager = std::move(*m);
    auto b = blockkv::RaggedBatch::Create(*manager);
    Check(b.status(), "RaggedBatch::Create");
    batch = std::move(*b);
    uids.resize(static_cast<size_t>(n));
    std::iota(uids.begin(), uids.end(), SeqId{1000});
    ones.assign(static_cast<size_t>(n), 1);
    token.assign(1, 7);
    tokens.assign(static_cast<size_t>(n), 7);
    if (prefix_cache) {
      std::mt19937 rng(7);
      for (const int64_t length : prompts) {
        prompt_tokens.emplace_back(static_cast<size_t>(length));
        for (auto& t : prompt_tokens.back()) t = static_cast<blockkv::TokenId>(rng() % 32000);
      }
    }
    Prefill();
  }

  // Every sequence gets its prompt, one sequence per forward (prompts are up to 1,000 tokens).
  void Prefill() {
    for (size_t i = 0; i < uids.size(); ++i) {
      const std::span<const SeqId> uid(&uids[i], 1);
      if (prefix_cache) Check(manager->AddSequence(uids[i], prompt_tokens[i]).status(), "Add");
      Check(manager->Schedule({.uids = uid, .lengths = std::span<const int64_t>(&prompts[i], 1)}),
            "prefill");
      Check(manager->PostForward(uid), "prefill PostForward");
    }
  }

  void Flush() {
    for (const SeqId uid : uids) Check(manager->FlushSequence(uid), "FlushSequence");
  }

  void Step() {
    Check(manager->Schedule({.uids = uids, .lengths = ones}), "Schedule");
    BuildBatch();
    Check(manager->PostForward(*batch), "PostForward");
    if (prefix_cache) benchmark::DoNotOptimize(manager->DrainCacheEvents());  // a router's feed
  }

  void BuildBatch() {
    batch->Clear();
    for (const SeqId uid : uids) {
      Check(batch->InsertSequence(*manager->GetSequence(uid), token), "InsertSequence");
    }
    Check(batch->Finalize(/*padding=*/false), "Finalize");
  }
};

// A step with prefix caching on: PostForward(batch) records each sequence's new token, and
// every block a step fills is keyed and published (every 16th step per sequence). Prompts come back
// each round, so their prefills hit, and the pool is kept full of evictable cached blocks. The
// step drains the cache events, as an engine feeding a router does.
struct PrefixCached : Engine {
  explicit PrefixCached(int n) : Engine(n, /*with_prefix_cache=*/true) {}
};

// The same step in one call: ScheduleBatch (schedule and build the batch in one pass), then
// PostForward(batch).
struct Fused : Engine {
  using Engine::Engine;
  void Step() {
    Check(manager->ScheduleBatch({.uids = uids, .lengths = ones}, tokens, *batch), "ScheduleBatch");
    Check(manager->PostForward(*batch), "PostForward");
  }
};

// The manager's share of a step: Schedule and PostForward, no batch.
struct ManagerOnly : Engine {
  using Engine::Engine;
  void Step() {
    Check(manager->Schedule({.uids = uids, .lengths = ones}), "Schedule");
    Check(manager->PostForward(uids), "PostForward");
  }
};

// Speculative decoding (issue 21): each sequence runs its verified token plus kDrafts drafts
// (ScheduleBatch of kDrafts + 1 tokens) and keeps a random 1 .. kDrafts + 1 of them
// (PostForward(batch, accepted)), so most steps give blocks back. Compared per committed token
// with decode_step/blockkv_fused, the plain step that commits one token per sequence.
constexpr int kDrafts = 4;

struct Speculative : Engine {
  explicit Speculative(int n) : Engine(n, /*with_prefix_cache=*/false, kDrafts + 1) {
    lengths.assign(static_cast<size_t>(n), kDrafts + 1);
    draft_tokens.assign(static_cast<size_t>(n) * (kDrafts + 1), 7);
    std::mt19937_64 rng(21);
    std::uniform_int_distribution<int64_t> keep(1, kDrafts + 1);
    accepted.resize(kStepsPerRound);
    for (auto& counts : accepted) {
      counts.resize(static_cast<size_t>(n));
      for (int64_t& a : counts) a = keep(rng);
    }
  }
  void Step() {
    Check(manager->ScheduleBatch({.uids = uids, .lengths = lengths}, draft_tokens, *batch),
          "ScheduleBatch");
    const std::vector<int64_t>& kept = accepted[static_cast<size_t>(step % kStepsPerRound)];
    Check(manager->PostForward(*batch, kept), "PostForward");
    committed += std::accumulate(kept.begin(), kept.end(), int64_t{0});
    ++step;
  }
  void Flush() {
    Engine::Flush();
    step = 0;
  }
  std::vector<int64_t> lengths;
  std::vector<TokenId> draft_tokens;
  std::vector<std::vector<int64_t>> accepted;  // [kStepsPerRound, n], each in [1, kDrafts + 1]
  int step = 0;
  int64_t committed = 0;  // tokens kept over the timed steps
};

// Times impl.Step(); every kStepsPerRound steps, untimed, the sequences are flushed and prefilled
// again, so every round starts from the same state. Sets the us_per_step counter.
template <class Impl>
void TimeSteps(benchmark::State& state, Impl& impl) {
  int steps = 0;
  for (auto _ : state) {
    impl.Step();
    if (++steps == kStepsPerRound) {
      state.PauseTiming();
      impl.Flush();
      impl.Prefill();
      steps = 0;
      state.ResumeTiming();
    }
  }
  state.counters["us_per_step"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 1e-6,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_SpeculativeStep(benchmark::State& state) {
  Speculative impl(static_cast<int>(state.range(0)));
  TimeSteps(state, impl);
  // Comparable with decode_step's ns_per_seq, which commits one token per sequence.
  state.counters["ns_per_committed_token"] =
      benchmark::Counter(static_cast<double>(impl.committed) * 1e-9,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// ---- baseline ---------------------------------------------------------------------------------

struct Baseline {
  int n;
  std::vector<int32_t> free_stack;
  std::vector<int64_t> seen;
  std::vector<std::vector<int32_t>> tables;
  std::vector<int64_t> prompts;
  // Outputs, as the ragged batch writes them.
  std::vector<int64_t> input_ids, slot_mapping;
  std::vector<int32_t> tokens_to_seq, descriptors, dense, indptr, indices, last_page_len;
  int32_t max_blocks;

  explicit Baseline(int sequences)
      : n(sequences), prompts(Prompts(sequences)), max_blocks(MaxBlocks()) {
    const auto s = static_cast<size_t>(n);
    input_ids.resize(s);
    slot_mapping.resize(s);
    tokens_to_seq.resize(s);
    descriptors.resize(4 * s);
    dense.resize(s * static_cast<size_t>(max_blocks));
    indptr.resize(s + 1);
    indices.resize(s * static_cast<size_t>(max_blocks));
    last_page_len.resize(s);
    tables.resize(s);
    for (auto& t : tables) t.reserve(static_cast<size_t>(max_blocks));
    seen.resize(s);
    free_stack.resize(static_cast<size_t>(PoolBlocks(n)));
    std::iota(free_stack.rbegin(), free_stack.rend(), 0);
    Prefill();
  }

  void Prefill() {
    for (int i = 0; i < n; ++i) {
      seen[i] = prompts[i];
      for (int64_t b = 0; b < (prompts[i] + kBlockSize - 1) / kBlockSize; ++b) {
        tables[i].push_back(free_stack.back());
        free_stack.pop_back();
      }
    }
  }

  void Flush() {
    for (auto& t : tables) {
      for (const int32_t b : t) free_stack.push_back(b);
      t.clear();
    }
  }

  void Step() {
    int32_t csr = 0;
    for (int i = 0; i < n; ++i) {
      std::vector<int32_t>& table = tables[i];
      const int64_t pos = seen[i];
      if (pos % kBlockSize == 0) {
        table.push_back(free_stack.back());
        free_stack.pop_back();
      }
      input_ids[i] = 7;
      tokens_to_seq[i] = i;
      int32_t* d = &descriptors[4 * static_cast<size_t>(i)];
      d[0] = i;
      d[1] = 1;
      d[2] = static_cast<int32_t>(pos);
      d[3] = 0;
      int32_t* row = &dense[static_cast<size_t>(i) * static_cast<size_t>(max_blocks)];
      std::copy(table.begin(), table.end(), row);
      std::fill(row + table.size(), row + max_blocks, -1);
      indptr[i] = csr;
      std::copy(table.begin(), table.end(), indices.begin() + csr);
      csr += static_cast<int32_t>(table.size());
      last_page_len[i] = static_cast<int32_t>(pos % kBlockSize) + 1;
      slot_mapping[i] = int64_t{table.back()} * kBlockSize + pos % kBlockSize;
      seen[i] = pos + 1;
    }
    indptr[n] = csr;
    benchmark::DoNotOptimize(slot_mapping.data());
    benchmark::DoNotOptimize(indices.data());
    benchmark::ClobberMemory();
  }
};

template <class Impl>
void BM_DecodeStep(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  Impl impl(n);
  TimeSteps(state, impl);
  state.counters["ns_per_seq"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * n * 1e-9,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// N = 256, 1,024, 4,096 sequences; medians of 5 repetitions.
void DecodeStepArgs(benchmark::internal::Benchmark* b) {
  b->Arg(256)->Arg(1024)->Arg(4096);
  b->Unit(benchmark::kMicrosecond)->Repetitions(5)->ReportAggregatesOnly(true);
}

BENCHMARK_TEMPLATE(BM_DecodeStep, Engine)->Name("decode_step/blockkv")->Apply(DecodeStepArgs);
BENCHMARK_TEMPLATE(BM_DecodeStep, Fused)->Name("decode_step/blockkv_fused")->Apply(DecodeStepArgs);
BENCHMARK_TEMPLATE(BM_DecodeStep, PrefixCached)
    ->Name("decode_step/blockkv_prefix_cache")
    ->Apply(DecodeStepArgs);
BENCHMARK_TEMPLATE(BM_DecodeStep, ManagerOnly)
    ->Name("decode_step/blockkv_manager_only")
    ->Apply(DecodeStepArgs);
BENCHMARK_TEMPLATE(BM_DecodeStep, Baseline)->Name("decode_step/baseline")->Apply(DecodeStepArgs);
BENCHMARK(BM_SpeculativeStep)->Name("speculative_step/blockkv_k4")->Apply(DecodeStepArgs);

struct Admitted {
  int64_t sequences = 0;
  double blocks_per_sequence = 0;  // held at full context, both groups
};

// Sequences a Gemma-2 shaped manager holds at its full context (see the header).
Admitted AdmitAtFullContext(bool shared) {
  constexpr int64_t kContext = 8192;
  constexpr int64_t kWindow = 4096;
  constexpr int64_t kChunk = 512;
  constexpr int64_t kBudget = int64_t{64} << 20;
  // One layer of one KV head of 8, fp16: 512 bytes a block per group; 15,408 blocks in each of
  // two pools, or 30,816 in one (what `blockkv plan --model Gemma-2-9B --memory 80GiB` finds
  // for the real shape: the same number of blocks).
  constexpr int64_t kUsable = int64_t{15408} * 2 * 512;
  blockkv::KVCacheConfig dense{.block_size = kBlockSize,
                               .cache_shape = {1, 1, 8},
                               .cache_dtype = blockkv::DType::kFloat16,
                               .max_blocks_per_allocation_group = kContext / kBlockSize};
  blockkv::KVCacheConfig local = dense;
  local.type = blockkv::KVCacheType::kLocal;
  local.local_window = kWindow;
  blockkv::StateManagerConfig config;
  config.max_tracked_sequences = 64;
  config.max_ragged_batch_size = kChunk;
  config.max_ragged_sequence_count = 1;
  config.max_context = kContext;
  config.memory_config = {
      .mode = blockkv::AllocationMode::kReserve, .size = kBudget - kUsable, .shared_pool = shared};
  auto m = blockkv::StateManager::Create(config, {dense, local}, blockkv::CpuDevice(kBudget));
  Check(m.status(), "StateManager::Create");
  Admitted out;
  int64_t held = 0;
  for (SeqId uid = 1; uid <= config.max_tracked_sequences; ++uid) {
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {kChunk};
    bool full = true;
    for (int64_t seen = 0; seen < kContext && full; seen += kChunk) {
      full = (*m)->Schedule({.uids = uids, .lengths = lengths}).ok();
      if (full) Check((*m)->PostForward(uids), "PostForward");
    }
    if (!full) break;
    const blockkv::Sequence& seq = *(*m)->GetSequence(uid);
    for (int g = 0; g < 2; ++g) held += seq.cur_allocated_blocks(g) - seq.released_blocks(g);
    ++out.sequences;
  }
  out.blocks_per_sequence =
      out.sequences > 0 ? static_cast<double>(held) / static_cast<double>(out.sequences) : 0;
  return out;
}

void BM_HybridAdmission(benchmark::State& state) {
  Admitted separate;
  Admitted shared;
  for (auto _ : state) {
    separate = AdmitAtFullContext(false);
    shared = AdmitAtFullContext(true);
  }
  state.counters["sequences_separate"] = static_cast<double>(separate.sequences);
  state.counters["sequences_shared"] = static_cast<double>(shared.sequences);
  state.counters["blocks_per_seq_separate"] = separate.blocks_per_sequence;
  state.counters["blocks_per_seq_shared"] = shared.blocks_per_sequence;
  state.counters["shared_vs_separate"] =
      static_cast<double>(shared.sequences) / static_cast<double>(separate.sequences);
}
BENCHMARK(BM_HybridAdmission)
    ->Name("hybrid_admission/gemma2_like")
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

enum class CheckpointCase { kPrefixOff, kSavingMisses, kHit };

void BM_StateCheckpoint(benchmark::State& state, CheckpointCase which) {
  constexpr int64_t kPrompt = 4096;
  constexpr int64_t kOwn = 64;
  constexpr int64_t kChunk = 512;
  constexpr int64_t kStateFloats = 320 * 1024 / 2;  // per layer, fp16
  const blockkv::KVCacheConfig attention{.block_size = kBlockSize,
                                         .cache_shape = {4, 8, 128},
                                         .cache_dtype = blockkv::DType::kFloat16,
                                         .max_blocks_per_allocation_group = 512};
  const blockkv::KVCacheConfig mamba{.cache_shape = {28, 1, kStateFloats},
                                     .cache_dtype = blockkv::DType::kFloat16,
                                     .type = blockkv::KVCacheType::kState,
                                     .state_bytes = kStateFloats * 2};
  blockkv::StateManagerConfig config;
  config.max_tracked_sequences = 4;
  config.max_ragged_batch_size = kChunk;
  config.max_ragged_sequence_count = 4;
  config.max_context = 8192;
  config.memory_config = {
      .mode = blockkv::AllocationMode::kAllocate, .size = 1024, .state_slots = 16};
  config.prefix_cache.enabled = which != CheckpointCase::kPrefixOff;
  config.prefix_cache.state_checkpoint_tokens = config.prefix_cache.enabled ? kChunk : 0;
  auto m = blockkv::StateManager::Create(config, {attention, mamba},
                                         blockkv::CpuDevice(int64_t{512} << 20));
  Check(m.status(), "StateManager::Create");
  std::vector<TokenId> prompt(kPrompt + kOwn);
  std::iota(prompt.begin(), prompt.end(), 0);
  SeqId uid = 0;
  int64_t computed = 0;
  int64_t requests = 0;
  auto serve = [&] {
    ++uid;
    if (which == CheckpointCase::kSavingMisses) prompt[0] = static_cast<TokenId>(uid);
    std::fill(prompt.end() - kOwn, prompt.end(), static_cast<TokenId>(uid));
    Check((*m)->AddSequence(uid, prompt).status(), "AddSequence");
    const SeqId uids[] = {uid};
    const blockkv::Sequence* seq = *(*m)->GetOrCreateSequence(uid);
    while (seq->seen_tokens() < std::ssize(prompt)) {
      const int64_t lengths[] = {std::min(kChunk, std::ssize(prompt) - seq->seen_tokens())};
      Check((*m)->Schedule({.uids = uids, .lengths = lengths}), "Schedule");
      computed += seq->in_flight_tokens();
      Check((*m)->PostForward(uids), "PostForward");
    }
    Check((*m)->FlushSequence(uid), "FlushSequence");
  };
  serve();  // the first request computes (and with checkpoints, saves) the shared prompt
  computed = 0;
  for (auto _ : state) {
    serve();
    ++requests;
  }
  state.counters["computed_tokens"] = static_cast<double>(computed) / static_cast<double>(requests);
  state.SetItemsProcessed(requests);
}
// The baseline of the copies: one memcpy of a sequence's state (28 × 320 KiB).
void BM_StateCopyBaseline(benchmark::State& state) {
  std::vector<std::byte> from(size_t{28} * 320 * 1024, std::byte{1});
  std::vector<std::byte> into(from.size());
  for (auto _ : state) {
    std::memcpy(into.data(), from.data(), from.size());
    benchmark::DoNotOptimize(into.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * std::ssize(from));
}
BENCHMARK(BM_StateCopyBaseline)
    ->Name("state_checkpoint/memcpy_one_state")
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_StateCheckpoint, prefix_off, CheckpointCase::kPrefixOff)
    ->Name("state_checkpoint/prefix_off")
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_StateCheckpoint, saving_misses, CheckpointCase::kSavingMisses)
    ->Name("state_checkpoint/saving_misses")
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_StateCheckpoint, hit, CheckpointCase::kHit)
    ->Name("state_checkpoint/hit")
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
