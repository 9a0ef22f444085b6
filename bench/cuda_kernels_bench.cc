// SPDX-License-Identifier: Apache-2.0
// Decode attention on a CUDA GPU against the device's copy bandwidth, in the same binary (issue
// 6; scripts/gpu-check.sh runs it):
//   BM_CudaDecodePaged  PagedAttention for B sequences of one new token each over a GPU cache
//                       whose blocks were handed out round-robin as the sequences grew together,
//                       with the default CUDA kernel (one warp per key).
//   BM_CudaDecodeHalfWarp  the same with the kernel meant to replace it (a key per half-warp).
//   BM_CudaMemcpyD2D    cudaMemcpyAsync device-to-device of the same number of bytes.
//   BM_CudaAppendDecode AppendKV of one token per sequence, with rotary.
// Shape: B = 64, Hq = 32, Hkv = 8, D = 128, bf16, block size 16; arg: context. bytes_per_second
// counts the K/V bytes the decode reads (B · context · Hkv · D · 2 planes · 2 bytes), and for the
// copy its memory traffic: the bytes copied, read once and written once (2 · the decode's bytes),
// which is how a device's copy bandwidth is quoted. Goal: decode ≥ 0.7× the copy's rate.
// Times are GPU times from CUDA events.
#include <cuda_runtime_api.h>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "bench_util.h"
#include "blockkv/blockkv.h"
#include "internal/kernels_backend.h"

namespace {

using blockkv_bench::Check;

using blockkv::DType;
using blockkv::SeqId;

constexpr int32_t kBatch = 64;
constexpr int32_t kQHeads = 32;
constexpr int32_t kKVHeads = 8;
constexpr int32_t kHeadSize = 128;
constexpr int32_t kBlockSize = 16;

void CheckCuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "cuda_kernels_bench: %s: %s\n", what, cudaGetErrorString(error));
    std::abort();
  }
}

int64_t KVBytes(int64_t context) {
  return int64_t{kBatch} * context * kKVHeads * kHeadSize * 2 * 2;
}

// Times `body` per iteration with CUDA events on the legacy default stream.
template <class Body>
void TimeGpu(benchmark::State& state, Body body) {
  cudaEvent_t start;
  cudaEvent_t stop;
  CheckCuda(cudaEventCreate(&start), "cudaEventCreate");
  CheckCuda(cudaEventCreate(&stop), "cudaEventCreate");
  body();  // warm-up
  CheckCuda(cudaDeviceSynchronize(), "warm-up");
  for (auto _ : state) {
    CheckCuda(cudaEventRecord(start), "cudaEventRecord");
    body();
    CheckCuda(cudaEventRecord(stop), "cudaEventRecord");
    CheckCuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

struct GpuDecode {
  std::shared_ptr<blockkv::Device> gpu;
  std::unique_ptr<blockkv::StateManager> manager;
  std::unique_ptr<blockkv::RaggedBatch> batch;
  blockkv::TensorView cache;
  blockkv::DeviceBuffer q;
  blockkv::DeviceBuffer out;

  explicit GpuDecode(int64_t context) {
    auto device = blockkv::CudaDevice(0);
    Check(device.status(), "CudaDevice(0)");
    gpu = *device;
    blockkv::StateManagerConfig config;
    config.max_context = context + 1;
    config.max_ragged_batch_size = 4096;
    config.max_ragged_sequence_count = kBatch;
    config.max_tracked_sequences = kBatch;
    const int64_t blocks_per_seq = context / kBlockSize + 1;
    config.memory_config = {.mode = blockkv::AllocationMode::kAllocate,
                            .size = kBatch * blocks_per_seq};
    blockkv::KVCacheConfig kv{
        .block_size = kBlockSize,
        .cache_shape = {1, kKVHeads, kHeadSize},
        .cache_dtype = DType::kBFloat16,
        .max_blocks_per_allocation_group = static_cast<int32_t>(blocks_per_seq)};
    auto created = blockkv::StateManager::Create(config, {kv}, gpu);
    Check(created.status(), "StateManager::Create");
    manager = std::move(*created);
    std::vector<SeqId> uids(kBatch);
    for (int32_t i = 0; i < kBatch; ++i) uids[static_cast<size_t>(i)] = i;
    for (int64_t done = 0; done < context - 1;) {
      const int64_t step = std::min<int64_t>(kBlockSize, context - 1 - done);
      Check(manager->Schedule({.uids = uids, .lengths = std::vector<int64_t>(kBatch, step)}),
            "Schedule");
      Check(manager->PostForward(uids), "PostForward");
      done += step;
    }
    Check(manager->Schedule({.uids = uids, .lengths = std::vector<int64_t>(kBatch, 1)}),
          "Schedule decode");
    auto b = blockkv::RaggedBatch::Create(*manager);
    Check(b.status(), "RaggedBatch::Create");
    batch = std::move(*b);
    const std::vector<blockkv::TokenId> token = {1};
    for (SeqId uid : uids) {
      Check(batch->InsertSequence(*manager->GetSequence(uid), token), "InsertSequence");
    }
    Check(batch->Finalize(), "Finalize");
    cache = *manager->GetCache(0);
    // Not zeros (METHOD.md: zeros can time faster than data): every bf16 is 0x3C3C, about 0.0115.
    CheckCuda(cudaMemset(cache.data, 0x3C, static_cast<size_t>(cache.numel()) * 2), "cudaMemset");
    const int64_t act_bytes = int64_t{kBatch} * kQHeads * kHeadSize * 2;
    q = *gpu->Allocate(act_bytes);
    out = *gpu->Allocate(act_bytes);
    CheckCuda(cudaMemset(q.data(), 0x3C, static_cast<size_t>(act_bytes)), "cudaMemset");
  }

  blockkv::TensorView View(const blockkv::DeviceBuffer& buffer, int64_t heads) const {
    return blockkv::ContiguousView(buffer.data(), DType::kBFloat16, blockkv::DeviceKind::kCuda, 0,
                                   {kBatch, heads, kHeadSize});
  }
};

bool HaveGpu(benchmark::State& state) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    state.SkipWithError("no CUDA GPU");
    return false;
  }
  return true;
}

template <blockkv::internal::CudaAttentionKernel kKernel>
void BM_CudaDecode(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int64_t context = state.range(0);
  GpuDecode setup(context);
  const blockkv::internal::CudaAttentionKernel before = blockkv::internal::GetCudaAttentionKernel();
  blockkv::internal::SetCudaAttentionKernel(kKernel);
  const blockkv::TensorView q = setup.View(setup.q, kQHeads);
  const blockkv::TensorView out = setup.View(setup.out, kQHeads);
  TimeGpu(state, [&] {
    Check(blockkv::PagedAttention(q, setup.cache, *setup.batch, out), "PagedAttention");
  });
  blockkv::internal::SetCudaAttentionKernel(before);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * KVBytes(context));
  state.counters["context"] = static_cast<double>(context);
}
// The default kernel (one warp per key) and the one meant to replace it (a key per half-warp).
void BM_CudaDecodePaged(benchmark::State& state) {
  BM_CudaDecode<blockkv::internal::CudaAttentionKernel::kWarpPerKey>(state);
}
void BM_CudaDecodeHalfWarp(benchmark::State& state) {
  BM_CudaDecode<blockkv::internal::CudaAttentionKernel::kHalfWarpPerKey>(state);
}

void BM_CudaMemcpyD2D(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const int64_t bytes = KVBytes(state.range(0));
  void* src = nullptr;
  void* dst = nullptr;
  CheckCuda(cudaMalloc(&src, static_cast<size_t>(bytes)), "cudaMalloc");
  CheckCuda(cudaMalloc(&dst, static_cast<size_t>(bytes)), "cudaMalloc");
  TimeGpu(state, [&] {
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice),
              "cudaMemcpyAsync");
  });
  // A copy's memory traffic: every byte is read once and written once.
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * bytes);
  state.counters["context"] = static_cast<double>(state.range(0));
  cudaFree(src);
  cudaFree(dst);
}

void BM_CudaAppendDecode(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  GpuDecode setup(state.range(0));
  const blockkv::TensorView q = setup.View(setup.q, kQHeads);
  const blockkv::TensorView kv = setup.View(setup.out, kKVHeads);
  blockkv::AppendKVOptions options;
  options.rotary.enabled = true;
  options.q = &q;
  TimeGpu(state, [&] {
    Check(blockkv::AppendKV(setup.cache, kv, kv, *setup.batch, options), "AppendKV");
  });
  // items_per_second: tokens appended per second. (A user counter here that the first case lacks
  // would abort Google Benchmark's CSV reporter.)
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kBatch);
}

BENCHMARK(BM_CudaDecodePaged)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaDecodeHalfWarp)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaMemcpyD2D)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaAppendDecode)->Arg(4096)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
