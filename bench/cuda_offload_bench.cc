// SPDX-License-Identifier: Apache-2.0
// cuda_offload_bench: OffloadStore's host tier on a GPU cache against the pinned-memory copy rate
// (cudaMemcpyAsync of the same bytes between pinned host memory and device memory). Needs a GPU;
// scripts/gpu-check.sh runs it.
//
//   ./build/gpu-check/bench/cuda_offload_bench      # a few seconds; Google Benchmark flags work
//
// Model: Llama-3-8B's cache (32 layers, 8 KV heads of 128, fp16, 16-token blocks: 2 MiB per
// block, one 64 KiB chunk per layer). Each iteration moves 32 blocks (64 MiB) each way:
//
//   offload/round_trip   Offload(32) + Wait, then Restore + Wait into fresh blocks: one
//                        cudaMemcpy2DAsync per block on the copy stream, an event per job
//   offload/d2h          Offload(32) + Wait alone (the restore runs with the timer paused)
//   pinned/round_trip    one cudaMemcpyAsync of 64 MiB device → pinned host, one back, on the
//                        same stream, synchronized: the rate the store is measured against
//   pinned/d2h           the device → host half alone
//
// Each store benchmark also times the matching pinned copy in every iteration, right after its
// own, and reports counter vs_pinned = pinned time / store time (paired, so the two see the
// same machine): 1.0 means the store moves blocks as fast as one contiguous pinned copy.
// Real time throughout (the copies run on the store's worker thread and the GPU).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include <benchmark/benchmark.h>

#include "blockkv/cuda_device.h"
#include "blockkv/kv_cache.h"
#include "blockkv/log.h"
#include "blockkv/offload.h"

namespace blockkv {
namespace {

constexpr int32_t kMoved = 32;                // blocks per iteration, 64 MiB
constexpr int32_t kCacheBlocks = kMoved + 8;  // 80 MiB of GPU memory

KVCacheConfig Llama8B() { return KVCacheConfig{.block_size = 16, .cache_shape = {32, 8, 128}}; }

struct Setup {
  std::shared_ptr<Device> gpu;
  cudaStream_t stream = nullptr;
  std::unique_ptr<BlockedKVCache> cache;
  std::unique_ptr<OffloadStore> store;
  std::vector<BlockId> blocks;  // the blocks the benchmark holds
  void* pinned = nullptr;       // kMoved blocks of pinned host memory, for the baseline
  int64_t bytes = 0;            // kMoved blocks
};
Setup* setup = nullptr;

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One pinned copy of `bytes` each way asked for, synchronized; false on a CUDA error.
bool PinnedCopy(bool d2h, bool h2d) {
  void* device = setup->cache->GetGroupStorage()->data;
  const auto bytes = static_cast<size_t>(setup->bytes);
  if (d2h && cudaMemcpyAsync(setup->pinned, device, bytes, cudaMemcpyDeviceToHost, setup->stream) !=
                 cudaSuccess) {
    return false;
  }
  if (h2d && cudaMemcpyAsync(device, setup->pinned, bytes, cudaMemcpyHostToDevice, setup->stream) !=
                 cudaSuccess) {
    return false;
  }
  return cudaStreamSynchronize(setup->stream) == cudaSuccess;
}

Status Offload(std::vector<OffloadHandle>& handles) {
  Result<OffloadTicket> out = setup->store->Offload(setup->blocks, 0, handles);
  if (!out.ok()) return out.status();
  return out->Wait();
}
Status Restore(const std::vector<OffloadHandle>& handles) {
  Result<OffloadTicket> in = setup->store->Restore(handles, 0, setup->blocks);
  if (!in.ok()) return in.status();
  return in->Wait();
}

void BM_Store(benchmark::State& state, bool round_trip) {
  std::vector<OffloadHandle> handles(kMoved);
  double store_seconds = 0;
  double pinned_seconds = 0;
  for (auto _ : state) {
    const Clock::time_point start = Clock::now();
    Status s = Offload(handles);
    if (s.ok() && round_trip) s = Restore(handles);
    const double seconds = Since(start);
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    state.SetIterationTime(seconds);
    store_seconds += seconds;
    const Clock::time_point pinned_start = Clock::now();
    if (!PinnedCopy(/*d2h=*/true, /*h2d=*/round_trip)) {
      state.SkipWithError("pinned copy failed");
      break;
    }
    pinned_seconds += Since(pinned_start);
    if (!round_trip) {
      const Status back = Restore(handles);  // untimed: the next iteration offloads again
      if (!back.ok()) {
        state.SkipWithError(back.ToString().c_str());
        break;
      }
    }
  }
  state.SetBytesProcessed(state.iterations() * setup->bytes * (round_trip ? 2 : 1));
  if (store_seconds > 0) state.counters["vs_pinned"] = pinned_seconds / store_seconds;
}

void BM_Pinned(benchmark::State& state, bool round_trip) {
  for (auto _ : state) {
    if (!PinnedCopy(/*d2h=*/true, /*h2d=*/round_trip)) {
      state.SkipWithError("pinned copy failed");
      break;
    }
  }
  state.SetBytesProcessed(state.iterations() * setup->bytes * (round_trip ? 2 : 1));
}

BENCHMARK_CAPTURE(BM_Store, round_trip, true)->Name("offload/round_trip")->UseManualTime();
BENCHMARK_CAPTURE(BM_Store, d2h, false)->Name("offload/d2h")->UseManualTime();
BENCHMARK_CAPTURE(BM_Pinned, round_trip, true)->Name("pinned/round_trip")->UseRealTime();
BENCHMARK_CAPTURE(BM_Pinned, d2h, false)->Name("pinned/d2h")->UseRealTime();

// Everything the benchmarks share; a message and false when there is no GPU.
bool MakeSetup() {
  const auto fail = [](const Status& s) {
    std::fprintf(stderr, "cuda_offload_bench: %s\n", s.ToString().c_str());
    return false;
  };
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  if (!gpu.ok()) return fail(gpu.status());
  auto* s = new Setup();  // lives until exit, like the device
  s->gpu = *gpu;
  s->stream = *CudaStream(**gpu);
  auto cache = BlockedKVCache::Create(
      {Llama8B()}, MemoryConfig{.mode = AllocationMode::kAllocate, .size = kCacheBlocks}, *gpu);
  if (!cache.ok()) return fail(cache.status());
  s->cache = std::move(*cache);
  auto store = OffloadStore::Create(s->cache.get(), {.host_blocks = kMoved});
  if (!store.ok()) return fail(store.status());
  s->store = std::move(*store);
  Result<std::vector<BlockId>> blocks = s->cache->Reserve(kMoved);
  if (!blocks.ok()) return fail(blocks.status());
  s->blocks = *blocks;
  s->bytes = s->store->block_bytes(0) * kMoved;
  if (cudaMallocHost(&s->pinned, static_cast<size_t>(s->bytes)) != cudaSuccess) {
    return fail(InternalError("cudaMallocHost of the baseline buffer failed"));
  }
  setup = s;
  // One untimed round trip: the pinned tier and the stream are warm, and the store works.
  std::vector<OffloadHandle> handles(kMoved);
  Status warm = Offload(handles);
  if (warm.ok()) warm = Restore(handles);
  if (!warm.ok()) return fail(warm);
  return PinnedCopy(true, true) || fail(InternalError("pinned copy failed"));
}

}  // namespace
}  // namespace blockkv

int main(int argc, char** argv) {
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (!blockkv::MakeSetup()) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
