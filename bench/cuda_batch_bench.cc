// SPDX-License-Identifier: Apache-2.0
// cuda_batch_bench: what mirroring the ragged batch to a GPU costs per engine step (issue 22).
// Needs a GPU; scripts/gpu-bundle.sh bundles it and scripts/gpu-check.sh runs it.
//
//   step/cpu/N     ScheduleBatch + PostForward for N decoding sequences over a host cache: the
//                  bookkeeping alone, no device mirror
//   step/cuda/N    the same over a GPU cache: Finalize also queues the copy of the batch from its
//                  pinned staging to the mirror (one cudaMemcpyAsync on the default stream), and
//                  the next step waits for it before writing the staging
//   step/synced/N  step/cuda, then the default stream synchronized: until the mirror is on the
//                  device, what a kernel launched after the step waits for at most
//   pinned/N       the baseline: one cudaMemcpyAsync from pinned memory of the bytes the mirror
//                  receives (the used parts of the arrays; kv_ptrs are copied once, in Create),
//                  waited for
//
// mirror_us = step/cuda − step/cpu, read from one run: what the mirror costs the scheduling
// thread; the goal is that it comes close to pinned/N (one asynchronous copy from pinned staging
// per step). The copy also carries the unused capacity between the arrays' used parts (a few KiB
// at these N, whose batches fill max_ragged_sequence_count). The cache is one layer of one KV
// head of 64, so that only the batch is measured. Every 64 steps the sequences are flushed and
// prefilled again with the timer paused.
#include <cuda_runtime_api.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <span>
#include <vector>

#include "bench_util.h"
#include "blockkv/blockkv.h"

namespace {

using blockkv_bench::Check;

using blockkv::SeqId;

constexpr int32_t kBlockSize = 16;
constexpr int kStepsPerRound = 64;
constexpr int64_t kPrompt = 512;

void CheckCuda(cudaError_t error, benchmark::State& state) {
  if (error != cudaSuccess) state.SkipWithError(cudaGetErrorString(error));
}

struct Engine {
  std::unique_ptr<blockkv::StateManager> manager;
  std::unique_ptr<blockkv::RaggedBatch> batch;
  std::vector<SeqId> uids;
  std::vector<int64_t> prompt, ones;
  std::vector<blockkv::TokenId> tokens;

  Engine(int n, std::shared_ptr<blockkv::Device> device) {
    blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
    blockkv::KVCacheConfig kv;
    kv.block_size = kBlockSize;
    kv.cache_shape = {1, 1, 64};
    kv.max_blocks_per_allocation_group = (kPrompt + kStepsPerRound) / kBlockSize + 2;
    blockkv::StateManagerConfig config;
    config.max_tracked_sequences = n;
    config.max_ragged_sequence_count = n;
    config.max_ragged_batch_size = std::max<int>(n, static_cast<int>(kPrompt));
    config.memory_config.mode = blockkv::AllocationMode::kAllocate;
    config.memory_config.size = int64_t{n} * kv.max_blocks_per_allocation_group;
    auto m = blockkv::StateManager::Create(config, {kv}, std::move(device));
    Check(m.status(), "StateManager::Create");
    manager = std::move(*m);
    auto b = blockkv::RaggedBatch::Create(*manager);
    Check(b.status(), "RaggedBatch::Create");
    batch = std::move(*b);
    uids.resize(static_cast<size_t>(n));
    std::iota(uids.begin(), uids.end(), SeqId{1});
    prompt.assign(1, kPrompt);
    ones.assign(static_cast<size_t>(n), 1);
    tokens.assign(static_cast<size_t>(n), 7);
    Prefill();
  }

  void Prefill() {
    for (const SeqId uid : uids) {
      const std::span<const SeqId> one(&uid, 1);
      Check(manager->Schedule({.uids = one, .lengths = prompt}), "prefill");
      Check(manager->PostForward(one), "prefill PostForward");
    }
  }

  void Flush() {
    for (const SeqId uid : uids) Check(manager->FlushSequence(uid), "FlushSequence");
  }

  void Step() {
    Check(manager->ScheduleBatch({.uids = uids, .lengths = ones}, tokens, *batch), "ScheduleBatch");
    Check(manager->PostForward(*batch), "PostForward");
  }

  // The bytes the device mirror receives each step: every array of the finalized batch but
  // kv_ptrs, which never changes.
  int64_t BatchBytes() const {
    int64_t bytes = 0;
    auto add = [&](const blockkv::Result<blockkv::TensorView>& t) {
      if (t.ok()) bytes += t->numel() * static_cast<int64_t>(blockkv::ElementSize(t->dtype));
    };
    add(batch->input_ids());
    add(batch->tokens_to_seq());
    add(batch->inflight_seq_descriptors());
    add(batch->batch_metadata());
    add(batch->block_tables());
    add(batch->kv_indptr());
    add(batch->kv_indices());
    add(batch->kv_last_page_len());
    add(batch->slot_mapping());
    return bytes;
  }
};

std::shared_ptr<blockkv::Device> DeviceFor(bool cuda) {
  if (!cuda) return blockkv::CpuDevice();
  auto gpu = blockkv::CudaDevice(0);
  Check(gpu.status(), "CudaDevice(0)");
  return *gpu;
}

void BM_Step(benchmark::State& state, bool cuda, bool synced) {
  const int n = static_cast<int>(state.range(0));
  Engine engine(n, DeviceFor(cuda));
  int step = 0;
  for (auto _ : state) {
    if (step++ == kStepsPerRound) {
      state.PauseTiming();
      engine.Flush();
      engine.Prefill();
      step = 1;
      state.ResumeTiming();
    }
    engine.Step();
    if (synced) CheckCuda(cudaStreamSynchronize(cudaStreamLegacy), state);
  }
  state.counters["batch_bytes"] = static_cast<double>(engine.BatchBytes());
  state.counters["ns_per_seq"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate |
                                                     benchmark::Counter::kInvert);
}

// One pinned → device copy of the batch's bytes (measured from a step of the same N).
void BM_Pinned(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  Engine engine(n, blockkv::CpuDevice());
  engine.Step();
  const auto bytes = static_cast<size_t>(engine.BatchBytes());
  void* host = nullptr;
  void* device = nullptr;
  cudaStream_t stream = nullptr;
  CheckCuda(cudaMallocHost(&host, bytes), state);
  CheckCuda(cudaMalloc(&device, bytes), state);
  CheckCuda(cudaStreamCreate(&stream), state);
  for (auto _ : state) {
    CheckCuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream), state);
    CheckCuda(cudaStreamSynchronize(stream), state);
  }
  state.counters["batch_bytes"] = static_cast<double>(bytes);
  cudaStreamDestroy(stream);
  cudaFree(device);
  cudaFreeHost(host);
}

BENCHMARK_CAPTURE(BM_Step, cpu, false, false)
    ->Name("step/cpu")
    ->Arg(256)
    ->Arg(1024)
    ->Arg(4096)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Step, cuda, true, false)
    ->Name("step/cuda")
    ->Arg(256)
    ->Arg(1024)
    ->Arg(4096)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Step, synced, true, true)
    ->Name("step/synced")
    ->Arg(256)
    ->Arg(1024)
    ->Arg(4096)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Pinned)->Name("pinned")->Arg(256)->Arg(1024)->Arg(4096)->UseRealTime()->Unit(
    benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
