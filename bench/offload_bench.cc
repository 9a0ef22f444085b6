// SPDX-License-Identifier: Apache-2.0
// offload_bench: OffloadStore's host tier on the CPU against memcpy of the same bytes, and
// StateManager preemption of 4k-token sequences, in one run (docs/benchmarks.md).
//
//   ./build/default/bench/offload_bench      # ~30 s; Google Benchmark flags work as usual
//
// Defaults (a flag on the command line overrides them): --benchmark_repetitions=5 and
// --benchmark_enable_random_interleaving=true. After the runs it prints a summary of the median
// GB/s of each side and their ratio (goal: host tier >= 0.8x memcpy).
//
// Round trip (Llama-3-8B's cache: 32 layers, 8 KV heads of 128, fp16, 16-token blocks: 64 KiB
// per layer, 2 MiB per block), 32 blocks = 64 MiB each way, 128 MiB per iteration:
//   host/round_trip      Offload(32 blocks) + Wait, then Restore + Wait into fresh blocks
//   disk/round_trip      the same through the disk tier (a file in $TMPDIR or /tmp; the page
//                        cache, not the device, for files this small: for information)
//   memcpy/contiguous    memcpy of 64 MiB out of the cache and back: the bandwidth bound
//   memcpy/per_layer     32 · 32 memcpy of 64 KiB each way: the store's copy pattern (a block
//                        is one 64 KiB chunk per layer, the layers a group's size apart)
// Preemption (Llama-3.2-1B's cache: 16 layers, 8 KV heads of 64, fp16: 32 KiB per token, a
// 4,096-token sequence is 256 blocks, 128 MiB):
//   preempt/resume_4k    PreemptSequence + Wait, ResumeSequence + Wait, through a StateManager
//   preempt/memcpy_4k    memcpy of the sequence's 128 MiB out and back
//
// Decisions:
// - Real time, not CPU time: the store copies on its worker thread while the caller waits, so
//   the caller's CPU time would leave the copy out. Everything runs single-threaded otherwise;
//   under load the wall time of both sides suffers alike, and repetitions are interleaved.
// - Every buffer is written before timing (no page faults inside), and each side's data is
//   checked once before timing: the round trips restore every byte, so the store is not timed
//   doing less than the baseline.
// - Restore takes fresh blocks from the cache (whatever the allocator hands out), as an engine
//   would; the blocks Offload gives back are those.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench_util.h"
#include "blockkv/kv_cache.h"
#include "blockkv/log.h"
#include "blockkv/offload.h"
#include "blockkv/state_manager.h"

namespace blockkv {
namespace {

using blockkv_bench::Check;

constexpr int32_t kRoundTripBlocks = 32;                // 64 MiB of Llama-3-8B blocks
constexpr int32_t kCacheBlocks = kRoundTripBlocks + 8;  // a few more, so restores land elsewhere
constexpr int64_t kSequenceTokens = 4096;
constexpr int32_t kBlockSize = 16;
constexpr int32_t kSequenceBlocks = kSequenceTokens / kBlockSize;  // 256
constexpr SeqId kUid = 7;

KVCacheConfig Llama3_8B() {
  return {.block_size = kBlockSize, .cache_shape = {32, 8, 128}, .cache_dtype = DType::kFloat16};
}
KVCacheConfig Llama32_1B() {
  return {.block_size = kBlockSize,
          .cache_shape = {16, 8, 64},
          .cache_dtype = DType::kFloat16,
          .max_blocks_per_allocation_group = kSequenceBlocks};
}

// Fills `bytes` at `data` with random words.
void FillRandom(void* data, int64_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* p = static_cast<std::byte*>(data);
  for (int64_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t word = rng();
    std::memcpy(p + i, &word, 8);
  }
}

// Host memory for the baselines, written once so that no page faults land in the timing.
struct HostBuffer {
  explicit HostBuffer(int64_t bytes)
      : data(static_cast<std::byte*>(std::aligned_alloc(4096, static_cast<size_t>(bytes)))),
        size(bytes) {
    if (data == nullptr) Check(ResourceExhaustedError("aligned_alloc"), "baseline buffer");
    std::memset(data, 1, static_cast<size_t>(bytes));
  }
  ~HostBuffer() { std::free(data); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  std::byte* data;
  int64_t size;
};

// ---- host and disk round trips ----------------------------------------------------------------

struct RoundTrip {
  std::unique_ptr<BlockedKVCache> cache;
  std::unique_ptr<OffloadStore> host;  // host tier of kRoundTripBlocks
  std::unique_ptr<OffloadStore> disk;  // disk tier of kRoundTripBlocks (one host slot)
  std::vector<BlockId> blocks;         // the blocks the benchmark holds, kRoundTripBlocks
  std::unique_ptr<HostBuffer> baseline;
  int64_t block_bytes = 0;
  int64_t chunk_bytes = 0;   // one layer of one block
  int64_t layer_stride = 0;  // from a block's chunk in layer l to layer l + 1
  std::byte* storage = nullptr;

  int64_t bytes() const { return block_bytes * kRoundTripBlocks; }  // one way
};
RoundTrip* round_trip = nullptr;

// Offload + Wait, Restore + Wait: the blocks held afterwards are the restored ones.
void OffloadAndRestore(OffloadStore& store, Tier tier) {
  RoundTrip& r = *round_trip;
  std::vector<OffloadHandle> handles(r.blocks.size());
  Result<OffloadTicket> out = store.Offload(r.blocks, 0, handles, tier);
  Check(out.status(), "Offload");
  Check(out->Wait(), "Offload copy");
  Result<OffloadTicket> in = store.Restore(handles, 0, r.blocks);
  Check(in.status(), "Restore");
  Check(in->Wait(), "Restore copy");
}

// The block contents of r.blocks, every layer, for the correctness check before timing.
std::vector<std::byte> Contents() {
  const RoundTrip& r = *round_trip;
  std::vector<std::byte> out;
  out.reserve(static_cast<size_t>(r.bytes()));
  for (BlockId b : r.blocks) {
    for (int64_t l = 0; l < 32; ++l) {
      const std::byte* chunk = r.storage + l * r.layer_stride + b * r.chunk_bytes;
      out.insert(out.end(), chunk, chunk + r.chunk_bytes);
    }
  }
  return out;
}

void MakeRoundTrip(const std::string& disk_dir) {
  auto* r = new RoundTrip();  // lives until exit
  auto cache = BlockedKVCache::Create(
      {Llama3_8B()}, MemoryConfig{.mode = AllocationMode::kAllocate, .size = kCacheBlocks},
      CpuDevice());
  Check(cache.status(), "BlockedKVCache::Create");
  r->cache = std::move(*cache);
  auto host = OffloadStore::Create(r->cache.get(), {.host_blocks = kRoundTripBlocks});
  Check(host.status(), "OffloadStore::Create (host)");
  r->host = std::move(*host);
  auto disk = OffloadStore::Create(r->cache.get(), {.host_blocks = 1,
                                                    .disk_path = disk_dir + "/offload_bench.tier",
                                                    .disk_blocks = kRoundTripBlocks});
  Check(disk.status(), "OffloadStore::Create (disk)");
  r->disk = std::move(*disk);
  r->block_bytes = r->host->block_bytes(0);
  r->chunk_bytes = r->block_bytes / 32;
  r->layer_stride = r->chunk_bytes * kCacheBlocks;
  r->storage = static_cast<std::byte*>(r->cache->GetGroupStorage()->data);
  FillRandom(r->storage, r->layer_stride * 32, 1);
  Result<std::vector<BlockId>> blocks = r->cache->Reserve(kRoundTripBlocks);
  Check(blocks.status(), "Reserve");
  r->blocks = *blocks;
  r->baseline = std::make_unique<HostBuffer>(r->bytes());
  round_trip = r;
  // Every byte comes back, through both tiers; this also touches every page of both tiers.
  const std::vector<std::byte> before = Contents();
  OffloadAndRestore(*r->host, Tier::kHost);
  OffloadAndRestore(*r->disk, Tier::kDisk);
  if (Contents() != before) Check(InternalError("bytes changed in a round trip"), "check");
}

void BM_RoundTrip(benchmark::State& state, Tier tier) {
  RoundTrip& r = *round_trip;
  OffloadStore& store = tier == Tier::kHost ? *r.host : *r.disk;
  for (auto _ : state) OffloadAndRestore(store, tier);
  state.SetBytesProcessed(state.iterations() * 2 * r.bytes());
}

void MemcpyBothWays(std::byte* host, std::byte* device, int64_t bytes);

void BM_MemcpyContiguous(benchmark::State& state) {
  RoundTrip& r = *round_trip;
  for (auto _ : state) MemcpyBothWays(r.baseline->data, r.storage, r.bytes());
  state.SetBytesProcessed(state.iterations() * 2 * r.bytes());
}

void BM_MemcpyPerLayer(benchmark::State& state) {
  RoundTrip& r = *round_trip;
  const auto chunk = static_cast<size_t>(r.chunk_bytes);
  for (auto _ : state) {
    for (int out = 1; out >= 0; --out) {
      std::byte* host = r.baseline->data;
      for (BlockId b : r.blocks) {
        for (int64_t l = 0; l < 32; ++l, host += chunk) {
          std::byte* device = r.storage + l * r.layer_stride + b * r.chunk_bytes;
          if (out == 1) {
            std::memcpy(host, device, chunk);
          } else {
            std::memcpy(device, host, chunk);
          }
        }
      }
      benchmark::ClobberMemory();
    }
  }
  state.SetBytesProcessed(state.iterations() * 2 * r.bytes());
}

// ---- preemption -------------------------------------------------------------------------------

struct Preemption {
  std::unique_ptr<StateManager> manager;
  std::unique_ptr<HostBuffer> baseline;
  std::byte* storage = nullptr;  // the group's storage, for the baseline
  int64_t bytes = 0;             // the sequence's bytes, every layer
};
Preemption* preemption = nullptr;

void PreemptAndResume(StateManager& manager) {
  Result<OffloadTicket> out = manager.PreemptSequence(kUid);
  Check(out.status(), "PreemptSequence");
  Check(out->Wait(), "preempt copy");
  Result<OffloadTicket> in = manager.ResumeSequence(kUid);
  Check(in.status(), "ResumeSequence");
  Check(in->Wait(), "resume copy");
}

// Every byte of the sequence's blocks, in table order.
std::vector<std::byte> SequenceContents(const StateManager& manager) {
  std::vector<std::byte> out;
  const KVCacheConfig& kv = manager.kv_cache().config(0);
  for (BlockId b : manager.GetSequence(kUid)->block_table()) {
    for (int64_t l = 0; l < kv.num_caches(); ++l) {
      Result<TensorView> layer = manager.GetCache(l);
      const int64_t chunk = layer->stride(0) * 2;
      const auto* p = static_cast<const std::byte*>(layer->data) + b * chunk;
      out.insert(out.end(), p, p + chunk);
    }
  }
  return out;
}

void MakePreemption() {
  auto* p = new Preemption();  // lives until exit
  StateManagerConfig config;
  config.max_tracked_sequences = 4;
  config.max_ragged_sequence_count = 4;
  config.max_ragged_batch_size = kSequenceTokens;
  config.max_context = kSequenceTokens;
  config.memory_config = {.mode = AllocationMode::kAllocate, .size = kSequenceBlocks + 8};
  config.offload = true;
  config.offload_config = {.host_blocks = kSequenceBlocks};
  auto manager = StateManager::Create(config, {Llama32_1B()}, CpuDevice());
  Check(manager.status(), "StateManager::Create");
  p->manager = std::move(*manager);
  const SeqId uid[] = {kUid};
  const int64_t tokens[] = {kSequenceTokens};
  Check(p->manager->Schedule({.uids = uid, .lengths = tokens}), "Schedule 4k tokens");
  Check(p->manager->PostForward(uid), "PostForward");
  Result<TensorView> layer0 = p->manager->GetCache(0);
  Check(layer0.status(), "GetCache");
  p->storage = static_cast<std::byte*>(layer0->data);
  Result<TensorView> group = p->manager->kv_cache().GetGroupStorage();
  Check(group.status(), "GetGroupStorage");
  FillRandom(p->storage, group->numel() * 2, 2);
  p->bytes = *Llama32_1B().bytes_per_block() * kSequenceBlocks;
  p->baseline = std::make_unique<HostBuffer>(p->bytes);
  preemption = p;
  const std::vector<std::byte> before = SequenceContents(*p->manager);
  PreemptAndResume(*p->manager);
  PreemptAndResume(*p->manager);
  if (SequenceContents(*p->manager) != before) {
    Check(InternalError("bytes changed in a preempt-resume round trip"), "check");
  }
}

void BM_PreemptResume(benchmark::State& state) {
  for (auto _ : state) PreemptAndResume(*preemption->manager);
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * 2 * preemption->bytes);
}

void BM_PreemptMemcpy(benchmark::State& state) {
  Preemption& p = *preemption;
  for (auto _ : state) MemcpyBothWays(p.baseline->data, p.storage, p.bytes);
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * 2 * p.bytes);
}

// ---- paired ratios ----------------------------------------------------------------------------

// On a shared machine the bandwidth left to one process drifts by 2x within seconds, which the
// repetitions above see as wide ranges. Here the two sides alternate, one round trip each, and
// each pair gives a ratio of throughputs (baseline time / blockkv time) measured a few
// milliseconds apart, the side that goes first alternating: the median over the pairs, with its
// quartiles.
struct PairedRatio {
  double q1, median, q3;
};
template <class A, class B>
PairedRatio Paired(int pairs, A blockkv_side, B baseline_side) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> ratios;
  const auto seconds = [](auto&& side) {
    const Clock::time_point start = Clock::now();
    side();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  for (int i = 0; i < pairs; ++i) {
    // Which side goes first alternates, so that neither always runs on a core just woken up.
    double blockkv = 0;
    double baseline = 0;
    if (i % 2 == 0) {
      blockkv = seconds(blockkv_side);
      baseline = seconds(baseline_side);
    } else {
      baseline = seconds(baseline_side);
      blockkv = seconds(blockkv_side);
    }
    ratios.push_back(baseline / blockkv);
  }
  std::sort(ratios.begin(), ratios.end());
  const auto at = [&](double q) { return ratios[static_cast<size_t>(q * (pairs - 1))]; };
  return {at(0.25), at(0.5), at(0.75)};
}

void MemcpyBothWays(std::byte* host, std::byte* device, int64_t bytes) {
  std::memcpy(host, device, static_cast<size_t>(bytes));
  benchmark::ClobberMemory();
  std::memcpy(device, host, static_cast<size_t>(bytes));
  benchmark::ClobberMemory();
}

void PrintPairedRatios(int pairs) {
  RoundTrip& r = *round_trip;
  Preemption& p = *preemption;
  const PairedRatio host = Paired(
      pairs, [&] { OffloadAndRestore(*r.host, Tier::kHost); },
      [&] { MemcpyBothWays(r.baseline->data, r.storage, r.bytes()); });
  const PairedRatio preempt = Paired(
      pairs, [&] { PreemptAndResume(*p.manager); },
      [&] { MemcpyBothWays(p.baseline->data, p.storage, p.bytes); });
  std::printf(
      "\nPaired ratios, blockkv / memcpy throughput (median [quartiles] of %d adjacent pairs)\n",
      pairs);
  std::printf("host/round_trip   vs memcpy/contiguous: %5.2f [%5.2f, %5.2f] (goal >= 0.8: %s)\n",
              host.median, host.q1, host.q3, host.median >= 0.8 ? "met" : "MISSED");
  std::printf("preempt/resume_4k vs preempt/memcpy_4k: %5.2f [%5.2f, %5.2f]\n", preempt.median,
              preempt.q1, preempt.q3);
}

// ---- summary ----------------------------------------------------------------------------------

// The 1-minute load average, for the record: on a shared machine the ratios mean little without it.
double LoadAverage() {
  double load = -1;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) load = -1;
    std::fclose(f);
  }
  return load;
}

void PrintSummary(const blockkv_bench::CounterReporter& reporter) {
  constexpr double kGoal = 0.8;
  std::printf(
      "\nMedian GB/s (bytes moved both ways per second, real time; range over repetitions)\n");
  auto row = [&](const char* name, const char* baseline, const char* note) {
    const std::optional<double> a = reporter.Median(name);
    const std::optional<double> b = reporter.Median(baseline);
    if (!a || !b) return;
    const auto [a_lo, a_hi] = reporter.Range(name);
    const auto [b_lo, b_hi] = reporter.Range(baseline);
    std::printf("%-19s %6.2f [%5.2f, %5.2f] | %-18s %6.2f [%5.2f, %5.2f] | ratio %5.2f %s\n", name,
                *a, a_lo, a_hi, baseline, *b, b_lo, b_hi, *a / *b, note);
  };
  row("host/round_trip", "memcpy/contiguous",
      reporter.Median("host/round_trip").value_or(0) >=
              kGoal * reporter.Median("memcpy/contiguous").value_or(1e9)
          ? "(goal >= 0.8: met)"
          : "(goal >= 0.8: MISSED)");
  row("host/round_trip", "memcpy/per_layer", "(same copy pattern)");
  row("disk/round_trip", "memcpy/contiguous", "(page cache; for information)");
  row("preempt/resume_4k", "preempt/memcpy_4k", "");
  if (const std::optional<double> gbs = reporter.Median("preempt/resume_4k")) {
    const double seconds = 2.0 * static_cast<double>(preemption->bytes) / (*gbs * 1e9);
    std::printf(
        "preempt + resume of a 4,096-token sequence (%.0f MiB, Llama-3.2-1B): %.1f per "
        "second (%.1f ms)\n",
        static_cast<double>(preemption->bytes) / (1 << 20), 1.0 / seconds, seconds * 1e3);
  }
}

}  // namespace
}  // namespace blockkv

int main(int argc, char** argv) {
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  const bool color = blockkv_bench::UseColor(argc, argv);
  if (!blockkv_bench::InitializeWithRepetitions(argc, argv)) return 1;

  std::printf("load average at the start: %.2f\n", blockkv::LoadAverage());
  const char* tmp = std::getenv("TMPDIR");
  blockkv::MakeRoundTrip(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp");
  blockkv::MakePreemption();
  using blockkv::Tier;
  benchmark::RegisterBenchmark("host/round_trip", blockkv::BM_RoundTrip, Tier::kHost)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("disk/round_trip", blockkv::BM_RoundTrip, Tier::kDisk)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("memcpy/contiguous", blockkv::BM_MemcpyContiguous)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("memcpy/per_layer", blockkv::BM_MemcpyPerLayer)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("preempt/resume_4k", blockkv::BM_PreemptResume)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("preempt/memcpy_4k", blockkv::BM_PreemptMemcpy)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  blockkv_bench::CounterReporter reporter(color, "bytes_per_second", /*scale=*/1e-9);  // GB/s
  benchmark::RunSpecifiedBenchmarks(&reporter);
  blockkv::PrintSummary(reporter);
  blockkv::PrintPairedRatios(/*pairs=*/200);
  std::printf("load average at the end: %.2f\n", blockkv::LoadAverage());
  benchmark::Shutdown();
  return 0;
}
