// SPDX-License-Identifier: Apache-2.0
// The checksum of every block copy kept or sent out of the cache (src/internal/checksum.h):
//   Checksum64Rate  Checksum64, AVX2 where the CPU has it.
//   Xxh3Sse2Rate    baseline: XXH3-64 compiled here for plain x86-64 (SSE2), what blockkv used
//                   before it chose AVX2 at run time.
// Args: the block's bytes (64 KiB: one layer of Llama-3-8B at block size 16; 2 MiB: all 32
// layers) and hot (one block hashed again and again, in cache) or cold (blocks of a 256 MiB
// region in turn, read from memory as a block copied out of the cache a while ago is).
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "internal/checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace {

constexpr size_t kRegion = size_t{256} << 20;

template <uint64_t (*Hash)(const void*, size_t)>
void Run(benchmark::State& state) {
  const auto block = static_cast<size_t>(state.range(0));
  const bool cold = state.range(1) != 0;
  std::vector<unsigned char> region(cold ? kRegion : block, 1);
  size_t at = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(Hash(region.data() + at, block));
    if (cold) at = (at + block) % (region.size() - block + 1);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * block));
}

uint64_t Xxh3Sse2(const void* data, size_t size) { return XXH3_64bits(data, size); }

void Args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bytes", "cold"});
  for (const int64_t bytes : {int64_t{64} << 10, int64_t{2} << 20}) {
    for (const int64_t cold : {0, 1}) b->Args({bytes, cold});
  }
}

void Checksum64Rate(benchmark::State& state) { Run<blockkv::internal::Checksum64>(state); }
void Xxh3Sse2Rate(benchmark::State& state) { Run<Xxh3Sse2>(state); }
BENCHMARK(Checksum64Rate)->Apply(Args);
BENCHMARK(Xxh3Sse2Rate)->Apply(Args);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (blockkv::internal::Checksum64UsesAvx2()) {
    benchmark::AddCustomContext("checksum64", "AVX2");
  } else {
    benchmark::AddCustomContext("checksum64", "SSE2 (this CPU has no AVX2)");
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
