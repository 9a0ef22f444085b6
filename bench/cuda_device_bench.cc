// SPDX-License-Identifier: Apache-2.0
// cuda_device_bench: moving one KV-cache block between pinned host memory and a GPU-resident
// BlockedKVCache, against a raw cudaMemcpy of the same bytes. Needs a GPU; scripts/gpu-check.sh
// runs it.
//
//   ./build/gpu-check/bench/cuda_device_bench      # a few seconds; Google Benchmark flags work
//
// Model: Llama-3-8B's cache shape (32 layers, 8 KV heads of 128, fp16) with blocks of 16 tokens:
// one block is 64 KiB per layer, 2 MiB over all layers. In blockkv's layout a block is
// contiguous within a layer but the 32 layers are separate allocations' worth apart
// ([num_caches, num_blocks, block_size, 2, H, D]), so offloading or restoring one block is 32
// copies of 64 KiB, or one strided cudaMemcpy2D; the baseline is one contiguous copy of 2 MiB.
//
//   raw/h2d, raw/d2h        one cudaMemcpyAsync of the block's bytes, contiguous on both sides
//   per_layer/h2d, .../d2h  one cudaMemcpyAsync per layer (32) into / out of the cache
//   strided/h2d, .../d2h    one cudaMemcpy2DAsync covering all layers
//   create                  BlockedKVCache::Create of 1,024 blocks (2 GiB, ALLOCATE) and destroy
//
// Every copy runs on CudaStream(device) and is waited for inside the timed iteration (real time).
// Host memory is pinned (cudaMallocHost), as an offload tier's would be.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include <benchmark/benchmark.h>

#include "blockkv/cuda_device.h"
#include "blockkv/kv_cache.h"
#include "blockkv/log.h"

namespace blockkv {
namespace {

constexpr int64_t kLayers = 32;
constexpr int32_t kCacheBlocks = 256;  // 512 MiB of cache
constexpr BlockId kBlock = 77;         // the block that is copied, away from the start

KVCacheConfig Llama8B() {
  return KVCacheConfig{.block_size = 16, .cache_shape = {kLayers, 8, 128}};
}

// Created once in main; the benchmarks only copy.
struct Setup {
  std::shared_ptr<Device> gpu;
  cudaStream_t stream = nullptr;
  std::unique_ptr<BlockedKVCache> cache;
  void* pinned = nullptr;      // one block, all layers: [kLayers, layer_block_bytes]
  void* contiguous = nullptr;  // the same bytes in device memory, for the baseline
  int64_t layer_block_bytes = 0;
  int64_t layer_bytes = 0;  // distance between one layer's block and the next layer's
};

Setup* setup = nullptr;

char* CacheBlock() {
  return static_cast<char*>(setup->cache->GetGroupStorage()->data) +
         kBlock * setup->layer_block_bytes;
}

int64_t BlockBytes() { return kLayers * setup->layer_block_bytes; }

void Check(cudaError_t error, benchmark::State& state) {
  if (error != cudaSuccess) state.SkipWithError(cudaGetErrorString(error));
}

void BM_Raw(benchmark::State& state, cudaMemcpyKind kind) {
  const bool h2d = kind == cudaMemcpyHostToDevice;
  for (auto _ : state) {
    Check(cudaMemcpyAsync(h2d ? setup->contiguous : setup->pinned,
                          h2d ? setup->pinned : setup->contiguous,
                          static_cast<size_t>(BlockBytes()), kind, setup->stream),
          state);
    Check(cudaStreamSynchronize(setup->stream), state);
  }
  state.SetBytesProcessed(state.iterations() * BlockBytes());
}

void BM_PerLayer(benchmark::State& state, cudaMemcpyKind kind) {
  const bool h2d = kind == cudaMemcpyHostToDevice;
  const auto bytes = static_cast<size_t>(setup->layer_block_bytes);
  for (auto _ : state) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      char* device = CacheBlock() + layer * setup->layer_bytes;
      char* host = static_cast<char*>(setup->pinned) + layer * setup->layer_block_bytes;
      Check(cudaMemcpyAsync(h2d ? device : host, h2d ? host : device, bytes, kind, setup->stream),
            state);
    }
    Check(cudaStreamSynchronize(setup->stream), state);
  }
  state.SetBytesProcessed(state.iterations() * BlockBytes());
}

void BM_Strided(benchmark::State& state, cudaMemcpyKind kind) {
  const bool h2d = kind == cudaMemcpyHostToDevice;
  const auto width = static_cast<size_t>(setup->layer_block_bytes);
  const auto device_pitch = static_cast<size_t>(setup->layer_bytes);
  for (auto _ : state) {
    if (h2d) {
      Check(cudaMemcpy2DAsync(CacheBlock(), device_pitch, setup->pinned, width, width, kLayers,
                              kind, setup->stream),
            state);
    } else {
      Check(cudaMemcpy2DAsync(setup->pinned, width, CacheBlock(), device_pitch, width, kLayers,
                              kind, setup->stream),
            state);
    }
    Check(cudaStreamSynchronize(setup->stream), state);
  }
  state.SetBytesProcessed(state.iterations() * BlockBytes());
}

void BM_Create(benchmark::State& state) {
  const MemoryConfig memory{.mode = AllocationMode::kAllocate, .size = 1024};
  for (auto _ : state) {
    auto cache = BlockedKVCache::Create({Llama8B()}, memory, setup->gpu);
    if (!cache.ok()) state.SkipWithError(cache.status().ToString().c_str());
    benchmark::DoNotOptimize(cache);
  }
}

BENCHMARK_CAPTURE(BM_Raw, h2d, cudaMemcpyHostToDevice)->Name("raw/h2d")->UseRealTime();
BENCHMARK_CAPTURE(BM_PerLayer, h2d, cudaMemcpyHostToDevice)->Name("per_layer/h2d")->UseRealTime();
BENCHMARK_CAPTURE(BM_Strided, h2d, cudaMemcpyHostToDevice)->Name("strided/h2d")->UseRealTime();
BENCHMARK_CAPTURE(BM_Raw, d2h, cudaMemcpyDeviceToHost)->Name("raw/d2h")->UseRealTime();
BENCHMARK_CAPTURE(BM_PerLayer, d2h, cudaMemcpyDeviceToHost)->Name("per_layer/d2h")->UseRealTime();
BENCHMARK_CAPTURE(BM_Strided, d2h, cudaMemcpyDeviceToHost)->Name("strided/d2h")->UseRealTime();
BENCHMARK(BM_Create)->Name("create")->UseRealTime()->Unit(benchmark::kMillisecond);

// Everything the benchmarks share; a message and false when there is no GPU.
bool MakeSetup() {
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  if (!gpu.ok()) {
    std::fprintf(stderr, "cuda_device_bench: %s\n", gpu.status().ToString().c_str());
    return false;
  }
  auto* s = new Setup();  // lives until exit, like the device
  s->gpu = *gpu;
  s->stream = *CudaStream(**gpu);
  auto cache = BlockedKVCache::Create(
      {Llama8B()}, MemoryConfig{.mode = AllocationMode::kAllocate, .size = kCacheBlocks}, *gpu);
  if (!cache.ok()) {
    std::fprintf(stderr, "cuda_device_bench: %s\n", cache.status().ToString().c_str());
    return false;
  }
  s->cache = std::move(*cache);
  s->layer_block_bytes = Llama8B().elements_per_layer_block() * 2;
  s->layer_bytes = s->layer_block_bytes * kCacheBlocks;
  const auto bytes = static_cast<size_t>(kLayers * s->layer_block_bytes);
  if (cudaMallocHost(&s->pinned, bytes) != cudaSuccess ||
      cudaMalloc(&s->contiguous, bytes) != cudaSuccess) {
    std::fprintf(stderr, "cuda_device_bench: cannot allocate the copy buffers\n");
    return false;
  }
  setup = s;
  return true;
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
