// SPDX-License-Identifier: Apache-2.0
// allocator_bench: BlockedAllocator against a bare std::vector free-list stack, on two replayed
// workloads, reporting ns per block operation and the ratio blockkv / stack (goal: <= 2.0).
//
//   ./build/default/bench/allocator_bench     # ~15 s; Google Benchmark flags work as usual
//
// Defaults (a flag on the command line overrides them): --benchmark_repetitions=5 and
// --benchmark_enable_random_interleaving=true. After the runs it prints a summary table of the
// median ns per block op of each side and their ratio.
//
// A block operation is one block allocated or one block freed. Each workload is a trace of
// Allocate/Free calls generated once, before any timing, from a fixed seed; both implementations
// replay the same trace, and a lockstep check before the benchmarks confirms they hand out the
// same ids on every call (their LIFO semantics are identical), so they do exactly the same work.
//
//   churn        pool 65,536; 200,000 allocations of 1-16 blocks; after each, the oldest live
//                allocations are freed (FIFO) while more than 48,000 blocks are live.
//   decode_step  pool 65,536, block size 16; 1,024 sequences with prompts of 100-1,000 tokens;
//                each of 2,000 steps appends a token to every sequence (one new block when it
//                crosses a block boundary), then 8 random sequences finish (all their blocks in
//                one Free) and are replaced by new prompts (one Allocate each).
//
// Decisions, so that the ratio means what it says:
// - blockkv goes through the span path with every Status checked (abort if not OK); the stack
//   does no validation at all. Neither allocates on the heap inside the timed region.
// - One benchmark iteration replays the whole trace (1.4-3.4 M block ops, milliseconds) on a
//   fresh pool. Building and destroying the pool happens with the timer paused: the pause itself
//   adds about 0.2 us of timer reads to an iteration of 1-9 ms (< 0.03%), and the O(pool)
//   construction, which is not a block operation, stays out of ns/op.
// - The trace's id buffer escapes to the optimizer and memory is clobbered after each replay, so
//   the stack's inlined pushes and pops cannot be elided. There is no barrier per call: blockkv's
//   calls are opaque already, and a barrier would only slow the baseline.
// - Repetitions are randomly interleaved so that drift on a shared machine hits both sides, and
//   the summary uses the median of the repetitions (CPU time, which excludes time descheduled).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "blockkv/block_allocator.h"
#include "blockkv/status.h"

namespace blockkv {
namespace {

using blockkv_bench::UseColor;

constexpr int32_t kPoolBlocks = 65'536;
constexpr uint64_t kSeed = 20240601;

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "allocator_bench: %s\n", message.c_str());
  std::abort();
}

// One Allocate or Free call. Its ids live in trace-owned slots [offset, offset + count) of an id
// buffer: Allocate writes them there, Free reads them from there.
struct BlockCall {
  int32_t offset;
  int32_t count;
  bool free;
};

struct Trace {
  std::string name;
  std::vector<BlockCall> calls;
  int32_t id_slots = 0;     // size of the id buffer the calls address
  int64_t block_ops = 0;    // sum of count over all calls
  int32_t peak_live = 0;    // most blocks allocated at once
  int64_t allocations = 0;  // Allocate calls
};

// Fills in block_ops and peak_live, and dies unless every Free names slots that hold live ids,
// every Allocate writes into free slots, and the pool never runs out.
void Validate(Trace& trace) {
  std::vector<uint8_t> slot_live(static_cast<size_t>(trace.id_slots), 0);
  int64_t live = 0;
  for (const BlockCall& call : trace.calls) {
    if (call.count < 1 || call.offset < 0 || call.offset + call.count > trace.id_slots) {
      Die(trace.name + ": a call addresses slots outside the id buffer");
    }
    for (int32_t i = call.offset; i < call.offset + call.count; ++i) {
      if (slot_live[i] != (call.free ? 1 : 0)) Die(trace.name + ": slot " + std::to_string(i));
      slot_live[i] = call.free ? 0 : 1;
    }
    live += call.free ? -call.count : call.count;
    trace.block_ops += call.count;
    trace.allocations += call.free ? 0 : 1;
    trace.peak_live = std::max(trace.peak_live, static_cast<int32_t>(live));
  }
  if (trace.peak_live > kPoolBlocks) {
    Die(trace.name + ": peaks at " + std::to_string(trace.peak_live) + " live blocks, more than " +
        std::to_string(kPoolBlocks));
  }
}

// W1: the live allocations form a FIFO whose ids sit in a ring of slots; at most 48,016 blocks
// are live, so an allocation that would run past the end of the ring starts again at 0 without
// reaching the oldest live one.
Trace ChurnTrace() {
  constexpr int32_t kAllocations = 200'000;
  constexpr int32_t kMaxLive = 48'000;
  Trace trace;
  trace.name = "churn";
  trace.id_slots = kPoolBlocks;
  std::mt19937_64 rng(kSeed);
  std::uniform_int_distribution<int32_t> blocks(1, 16);
  std::vector<BlockCall> fifo;  // live allocations, oldest first from fifo_head
  size_t fifo_head = 0;
  int32_t live = 0;
  int32_t cursor = 0;
  for (int32_t a = 0; a < kAllocations; ++a) {
    const int32_t n = blocks(rng);
    if (cursor + n > trace.id_slots) cursor = 0;
    trace.calls.push_back({cursor, n, false});
    fifo.push_back({cursor, n, true});
    cursor += n;
    live += n;
    while (live > kMaxLive) {
      trace.calls.push_back(fifo[fifo_head]);
      live -= fifo[fifo_head++].count;
    }
  }
  return trace;
}

// W2: sequence s owns the slots [s * kMaxBlocksPerSeq, (s + 1) * kMaxBlocksPerSeq), its block
// table; a sequence grows at most kSteps tokens past its prompt.
Trace DecodeStepTrace() {
  constexpr int32_t kSequences = 1'024;
  constexpr int32_t kBlockSize = 16;
  constexpr int32_t kSteps = 2'000;
  constexpr int32_t kFinishPerStep = 8;
  constexpr int32_t kMinPrompt = 100;
  constexpr int32_t kMaxPrompt = 1'000;
  constexpr int32_t kMaxBlocksPerSeq = (kMaxPrompt + kSteps + kBlockSize - 1) / kBlockSize;
  Trace trace;
  trace.name = "decode_step";
  trace.id_slots = kSequences * kMaxBlocksPerSeq;
  std::mt19937_64 rng(kSeed);
  std::uniform_int_distribution<int32_t> prompt(kMinPrompt, kMaxPrompt);
  std::uniform_int_distribution<int32_t> pick(0, kSequences - 1);
  std::vector<int32_t> tokens(kSequences);
  std::vector<int32_t> blocks(kSequences);
  auto admit = [&](int32_t s) {
    tokens[s] = prompt(rng);
    blocks[s] = (tokens[s] + kBlockSize - 1) / kBlockSize;
    trace.calls.push_back({s * kMaxBlocksPerSeq, blocks[s], false});
  };
  for (int32_t s = 0; s < kSequences; ++s) admit(s);
  std::vector<int32_t> finished;
  for (int32_t step = 0; step < kSteps; ++step) {
    for (int32_t s = 0; s < kSequences; ++s) {
      if (tokens[s] % kBlockSize == 0) {  // every block is full: the token needs a new one
        if (blocks[s] == kMaxBlocksPerSeq) Die("decode_step: a block table overflows");
        trace.calls.push_back({s * kMaxBlocksPerSeq + blocks[s], 1, false});
        ++blocks[s];
      }
      ++tokens[s];
    }
    finished.clear();
    while (finished.size() < kFinishPerStep) {
      const int32_t s = pick(rng);
      if (std::find(finished.begin(), finished.end(), s) == finished.end()) finished.push_back(s);
    }
    for (const int32_t s : finished) trace.calls.push_back({s * kMaxBlocksPerSeq, blocks[s], true});
    for (const int32_t s : finished) admit(s);
  }
  return trace;
}

// blockkv's allocator through the span path, every Status checked.
class BlockkvPool {
 public:
  explicit BlockkvPool(int32_t num_blocks) : allocator_(Create(num_blocks)) {}

  void Allocate(int32_t n, std::span<BlockId> out) {
    Status status = allocator_.Allocate(n, out);
    if (!status.ok()) [[unlikely]] {
      Die("Allocate: " + status.ToString());
    }
  }
  void Free(std::span<const BlockId> blocks) {
    Status status = allocator_.Free(blocks);
    if (!status.ok()) [[unlikely]] {
      Die("Free: " + status.ToString());
    }
  }
  int32_t free_blocks() const { return allocator_.free_blocks(); }
  const BlockedAllocator& allocator() const { return allocator_; }

 private:
  static BlockedAllocator Create(int32_t num_blocks) {
    Result<BlockedAllocator> allocator = BlockedAllocator::Create(num_blocks);
    if (!allocator.ok()) Die("Create: " + allocator.status().ToString());
    return std::move(allocator).value();
  }

  BlockedAllocator allocator_;
};

// The baseline: push on free, pop on allocate, no validation. Stacked so that it hands out
// 0, 1, 2, ... first and reuses LIFO, exactly as BlockedAllocator does.
class StackPool {
 public:
  explicit StackPool(int32_t num_blocks) {
    free_.reserve(static_cast<size_t>(num_blocks));
    for (int32_t id = num_blocks - 1; id >= 0; --id) free_.push_back(id);
  }

  void Allocate(int32_t n, std::span<BlockId> out) {
    for (int32_t i = 0; i < n; ++i) {
      out[i] = free_.back();
      free_.pop_back();
    }
  }
  void Free(std::span<const BlockId> blocks) {
    for (const BlockId id : blocks) free_.push_back(id);
  }
  int32_t free_blocks() const { return static_cast<int32_t>(free_.size()); }

 private:
  std::vector<int32_t> free_;  // [free_blocks], the next id to hand out at the back
};

template <class Pool>
void Replay(const Trace& trace, Pool& pool, std::span<BlockId> ids) {
  for (const BlockCall& call : trace.calls) {
    const std::span<BlockId> blocks = ids.subspan(call.offset, call.count);
    if (call.free) {
      pool.Free(blocks);
    } else {
      pool.Allocate(call.count, blocks);
    }
  }
}

// Replays the trace on both pools in lockstep and dies unless every Allocate hands out the same
// ids and blockkv's invariants hold at the end: both sides do exactly the same operations.
void CheckSameOperations(const Trace& trace) {
  BlockkvPool blockkv(kPoolBlocks);
  StackPool stack(kPoolBlocks);
  std::vector<BlockId> blockkv_ids(static_cast<size_t>(trace.id_slots), kNoBlock);
  std::vector<BlockId> stack_ids(static_cast<size_t>(trace.id_slots), kNoBlock);
  for (const BlockCall& call : trace.calls) {
    const auto a = std::span<BlockId>(blockkv_ids).subspan(call.offset, call.count);
    const auto b = std::span<BlockId>(stack_ids).subspan(call.offset, call.count);
    if (call.free) {
      blockkv.Free(a);
      stack.Free(b);
    } else {
      blockkv.Allocate(call.count, a);
      stack.Allocate(call.count, b);
      if (!std::equal(a.begin(), a.end(), b.begin())) Die(trace.name + ": the pools disagree");
    }
  }
  if (blockkv.free_blocks() != stack.free_blocks()) Die(trace.name + ": free counts disagree");
  const Status invariants = blockkv.allocator().CheckInvariants();
  if (!invariants.ok()) Die(trace.name + ": " + invariants.ToString());
}

template <class Pool>
void ReplayBenchmark(benchmark::State& state, const Trace* trace) {
  std::vector<BlockId> ids(static_cast<size_t>(trace->id_slots), kNoBlock);
  benchmark::DoNotOptimize(ids.data());
  std::unique_ptr<Pool> pool;
  for (auto _ : state) {
    state.PauseTiming();
    pool.reset();
    pool = std::make_unique<Pool>(kPoolBlocks);
    state.ResumeTiming();
    Replay(*trace, *pool, std::span<BlockId>(ids));
    benchmark::DoNotOptimize(*pool);
    benchmark::ClobberMemory();
  }
  state.counters["ns_per_block_op"] = benchmark::Counter(
      static_cast<double>(trace->block_ops),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void PrintSummary(const std::vector<Trace>& traces,
                  const blockkv_bench::CounterReporter& reporter) {
  constexpr double kGoal = 2.0;
  std::printf("\nMedian ns per block op (CPU time; range over repetitions in brackets)\n");
  std::printf("%-12s | %-22s | %-22s | %-6s | goal <= %.1f\n", "workload", "blockkv ns/op",
              "stack ns/op", "ratio", kGoal);
  for (const Trace& trace : traces) {
    const std::optional<double> blockkv = reporter.Median(trace.name + "/blockkv");
    const std::optional<double> stack = reporter.Median(trace.name + "/stack");
    if (!blockkv || !stack) continue;  // filtered out
    const auto [blockkv_lo, blockkv_hi] = reporter.Range(trace.name + "/blockkv");
    const auto [stack_lo, stack_hi] = reporter.Range(trace.name + "/stack");
    const double ratio = *blockkv / *stack;
    std::printf("%-12s | %5.2f [%5.2f, %5.2f]   | %5.2f [%5.2f, %5.2f]   | %6.2f | %s\n",
                trace.name.c_str(), *blockkv, blockkv_lo, blockkv_hi, *stack, stack_lo, stack_hi,
                ratio, ratio <= kGoal ? "met" : "MISSED");
  }
}

}  // namespace
}  // namespace blockkv

int main(int argc, char** argv) {
  using blockkv::Trace;
  const bool color = blockkv::UseColor(argc, argv);
  if (!blockkv_bench::InitializeWithRepetitions(argc, argv)) return 1;

  std::vector<Trace> traces = {blockkv::ChurnTrace(), blockkv::DecodeStepTrace()};
  std::printf("pool %d blocks, seed %llu\n", blockkv::kPoolBlocks,
              static_cast<unsigned long long>(blockkv::kSeed));
  for (Trace& trace : traces) {
    blockkv::Validate(trace);
    blockkv::CheckSameOperations(trace);
    std::printf("%-12s %9zu calls (%lld Allocate), %9lld block ops, peak %d live blocks\n",
                trace.name.c_str(), trace.calls.size(), static_cast<long long>(trace.allocations),
                static_cast<long long>(trace.block_ops), trace.peak_live);
    benchmark::RegisterBenchmark((trace.name + "/blockkv").c_str(),
                                 blockkv::ReplayBenchmark<blockkv::BlockkvPool>, &trace)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((trace.name + "/stack").c_str(),
                                 blockkv::ReplayBenchmark<blockkv::StackPool>, &trace)
        ->Unit(benchmark::kMillisecond);
  }
  std::fflush(stdout);

  blockkv_bench::CounterReporter reporter(color, "ns_per_block_op", /*scale=*/1e9);  // ns
  benchmark::RunSpecifiedBenchmarks(&reporter);
  blockkv::PrintSummary(traces, reporter);
  benchmark::Shutdown();
  return 0;
}
