// SPDX-License-Identifier: Apache-2.0
// Decode attention on the CPU over the paged cache, against its two baselines in the same
// binary (issue 6):
//   BM_DecodePaged       PagedAttention for B sequences of one new token each, over a cache
//                        whose blocks were handed out round-robin as the sequences grew
//                        together (block i of sequence s is nowhere near block i + 1).
//   BM_DecodeContiguous  the same kernel (internal::PagedAttentionCpu) over one contiguous
//                        [context, Hkv, D] K buffer and V buffer per sequence: one "block" per
//                        sequence. Goal: paged ≥ 0.9× contiguous.
//   BM_Memcpy            memcpy of the same K/V bytes the decode reads, on the same number of
//                        threads. Goal: decode's bytes/s ≥ 0.7× memcpy's at context ≥ 4k.
//   BM_DecodePageTable   BM_DecodePaged's call over a CsrPageTable of the same blocks (the
//                        caller's own table; the RaggedBatch's arrays, qo_indptr 0..B) instead
//                        of the RaggedBatch: the table path's checks against the batch path's.
//   BM_AppendDecode      AppendKV of one token per sequence (for scale; a few rows per token).
//   BM_MlaDecode         MlaPagedAttention (issue 21) for B sequences of one new token each over
//                        DeepSeek-V3's latent rows (512 + 64, bf16), as many cached bytes as
//                        BM_DecodePaged reads at the same context arg (so 4096 / 1152 times
//                        its tokens); args: dense context, heads (16: tp 8; 128: tp 1), threads.
// Shape: B = 16, Hq = 32, Hkv = 8, D = 128, bf16, block size 16; args: context, threads.
// bytes_per_second counts the K/V bytes read (B · context · Hkv · D · 2 planes · 2 bytes).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "blockkv/blockkv.h"
#include "internal/float_convert.h"
#include "internal/kernels_backend.h"
#include "internal/paged_view.h"

namespace {

using blockkv_bench::Check;

using blockkv::DType;
using blockkv::SeqId;
using blockkv::TokenId;

constexpr int32_t kBatch = 16;
constexpr int32_t kQHeads = 32;
constexpr int32_t kKVHeads = 8;
constexpr int32_t kHeadSize = 128;
constexpr int32_t kBlockSize = 16;

int64_t KVBytes(int64_t context) {
  return int64_t{kBatch} * context * kKVHeads * kHeadSize * 2 * 2;
}

void FillRandom(void* data, int64_t elements) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto* p = static_cast<uint16_t*>(data);
  for (int64_t i = 0; i < elements; ++i) p[i] = blockkv::internal::FloatToBf16(u(rng));
}

// MLA's latent and rotary dims (DeepSeek-V3).
constexpr int32_t kLatent = 512;
constexpr int32_t kRope = 64;

// B sequences with `context − 1` tokens of history grown together one block at a time, and a
// finalized batch of one new token each; a dense group of kKVHeads heads, or an MLA group.
struct DecodeSetup {
  std::unique_ptr<blockkv::StateManager> manager;
  std::unique_ptr<blockkv::RaggedBatch> batch;
  blockkv::TensorView cache;

  explicit DecodeSetup(int64_t context, bool mla = false) {
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
    if (mla) {
      kv.cache_shape = {1, 1, kLatent + kRope};
      kv.type = blockkv::KVCacheType::kMla;
      kv.latent_dim = kLatent;
      kv.rope_dim = kRope;
    }
    auto created = blockkv::StateManager::Create(config, {kv}, blockkv::CpuDevice(16LL << 30));
    Check(created.status(), "StateManager::Create");
    manager = std::move(*created);
    std::vector<SeqId> uids(kBatch);
    for (int32_t i = 0; i < kBatch; ++i) uids[static_cast<size_t>(i)] = i;
    for (int64_t done = 0; done < context - 1;) {  // round-robin growth, one block each
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
    const std::vector<TokenId> token = {1};
    for (SeqId uid : uids)
      Check(batch->InsertSequence(*manager->GetSequence(uid), token), "Insert");
    Check(batch->Finalize(), "Finalize");
    cache = *manager->GetCache(0);
    FillRandom(cache.data, cache.numel());
  }
};

struct Activations {
  std::vector<uint16_t> q = std::vector<uint16_t>(size_t{kBatch} * kQHeads * kHeadSize);
  std::vector<uint16_t> out = std::vector<uint16_t>(q.size());
  Activations() { FillRandom(q.data(), static_cast<int64_t>(q.size())); }
  blockkv::TensorView View(std::vector<uint16_t>& v) {
    return blockkv::ContiguousView(v.data(), DType::kBFloat16, blockkv::DeviceKind::kCpu, 0,
                                   {kBatch, kQHeads, kHeadSize});
  }
};

void SetCounters(benchmark::State& state, int64_t context) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * KVBytes(context));
  state.counters["context"] = static_cast<double>(context);
  state.counters["threads"] = static_cast<double>(state.range(1));
}

void BM_DecodePaged(benchmark::State& state) {
  const int64_t context = state.range(0);
  DecodeSetup setup(context);
  Activations act;
  blockkv::AttentionOptions options;
  options.num_threads = static_cast<int>(state.range(1));
  for (auto _ : state) {
    Check(blockkv::PagedAttention(act.View(act.q), setup.cache, *setup.batch, act.View(act.out),
                                  options),
          "PagedAttention");
    benchmark::ClobberMemory();
  }
  SetCounters(state, context);
}

void BM_DecodePageTable(benchmark::State& state) {
  const int64_t context = state.range(0);
  DecodeSetup setup(context);
  Activations act;
  std::vector<int32_t> qo_indptr(kBatch + 1);
  for (int32_t i = 0; i <= kBatch; ++i) qo_indptr[static_cast<size_t>(i)] = i;
  const blockkv::CsrPageTable table{
      .qo_indptr = qo_indptr.data(),
      .kv_indptr = static_cast<const int32_t*>(setup.batch->kv_indptr()->data),
      .kv_indices = static_cast<const int32_t*>(setup.batch->kv_indices()->data),
      .kv_last_page_len = static_cast<const int32_t*>(setup.batch->kv_last_page_len()->data),
      .num_seqs = kBatch};
  blockkv::AttentionOptions options;
  options.num_threads = static_cast<int>(state.range(1));
  for (auto _ : state) {
    Check(blockkv::PagedAttention(act.View(act.q), setup.cache, table, act.View(act.out), options),
          "PagedAttention (page table)");
    benchmark::ClobberMemory();
  }
  SetCounters(state, context);
}

void BM_DecodeContiguous(benchmark::State& state) {
  const int64_t context = state.range(0);
  // K: [B, context, Hkv, D], V likewise, right after it.
  const int64_t plane = int64_t{kBatch} * context * kKVHeads * kHeadSize;
  // Page-aligned like the paged cache (CpuDevice): a std::vector this large is an mmap 16 bytes
  // in, which splits every 256-byte head row across five cache lines and slows the kernel.
  const auto bytes = static_cast<size_t>(2 * plane) * sizeof(uint16_t);
  const std::unique_ptr<uint16_t, decltype(&std::free)> kv(
      static_cast<uint16_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)), &std::free);
  FillRandom(kv.get(), 2 * plane);
  std::vector<int32_t> descriptors(size_t{kBatch} * 4);
  std::vector<int32_t> indptr(kBatch + 1);
  std::vector<int32_t> indices(kBatch);
  for (int32_t i = 0; i < kBatch; ++i) {
    descriptors[static_cast<size_t>(i) * 4] = i;  // start
    descriptors[static_cast<size_t>(i) * 4 + 1] = 1;
    descriptors[static_cast<size_t>(i) * 4 + 2] = static_cast<int32_t>(context - 1);
    indptr[static_cast<size_t>(i) + 1] = i + 1;
    indices[static_cast<size_t>(i)] = i;
  }
  blockkv::internal::PagedKV view{.data = kv.get(),
                                  .block_stride = context * kKVHeads * kHeadSize,
                                  .token_stride = kKVHeads * kHeadSize,
                                  .plane_stride = plane,
                                  .head_stride = kHeadSize,
                                  .num_blocks = kBatch,
                                  .block_size = static_cast<int32_t>(context),
                                  .num_kv_heads = kKVHeads,
                                  .head_size = kHeadSize,
                                  .dtype = DType::kBFloat16,
                                  .kv_scale = 1.0f};
  view.form = blockkv::internal::TableForm::kBatch;
  view.descriptors = descriptors.data();
  view.kv_indptr = indptr.data();
  view.kv_indices = indices.data();
  view.num_seqs = kBatch;
  view.num_tokens = kBatch;
  Activations act;
  const blockkv::internal::Activations q{.data = act.q.data(),
                                         .token_stride = kQHeads * kHeadSize,
                                         .head_stride = kHeadSize,
                                         .num_heads = kQHeads,
                                         .dtype = DType::kBFloat16};
  blockkv::internal::Activations out = q;
  out.data = act.out.data();
  const blockkv::internal::AttentionParams params{.scale = 0.0883883f,
                                                  .causal = true,
                                                  .sliding_window = 0,
                                                  .num_threads = static_cast<int>(state.range(1))};
  for (auto _ : state) {
    blockkv::internal::PagedAttentionCpu(view, q, out, params);
    benchmark::ClobberMemory();
  }
  SetCounters(state, context);
}

void BM_Memcpy(benchmark::State& state) {
  const int64_t context = state.range(0);
  const int64_t bytes = KVBytes(context);
  std::vector<uint8_t> src(static_cast<size_t>(bytes), 1);
  std::vector<uint8_t> dst(static_cast<size_t>(bytes), 0);
  const auto threads = static_cast<int>(state.range(1));
  const int64_t part = bytes / threads;
  for (auto _ : state) {
    std::vector<std::jthread> workers;
    for (int t = 1; t < threads; ++t) {
      workers.emplace_back([&, t] {
        std::memcpy(dst.data() + t * part, src.data() + t * part, static_cast<size_t>(part));
      });
    }
    std::memcpy(dst.data(), src.data(), static_cast<size_t>(part));
    workers.clear();
    benchmark::ClobberMemory();
  }
  SetCounters(state, context);
}

void BM_AppendDecode(benchmark::State& state) {
  DecodeSetup setup(state.range(0));
  std::vector<uint16_t> k(size_t{kBatch} * kKVHeads * kHeadSize);
  FillRandom(k.data(), static_cast<int64_t>(k.size()));
  const auto view = blockkv::ContiguousView(k.data(), DType::kBFloat16, blockkv::DeviceKind::kCpu,
                                            0, {kBatch, kKVHeads, kHeadSize});
  blockkv::AppendKVOptions options;
  options.rotary.enabled = true;
  options.num_threads = static_cast<int>(state.range(1));
  for (auto _ : state) {
    Check(blockkv::AppendKV(setup.cache, view, view, *setup.batch, options), "AppendKV");
    benchmark::ClobberMemory();
  }
  state.counters["tokens_per_second"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * kBatch, benchmark::Counter::kIsRate);
}

void BM_MlaDecode(benchmark::State& state) {
  const int64_t dense_context = state.range(0);
  const auto heads = static_cast<int32_t>(state.range(1));
  // The same cached bytes as BM_DecodePaged at dense_context: Hkv · D · 2 planes per token there,
  // L + R here.
  const int64_t context = dense_context * kKVHeads * kHeadSize * 2 / (kLatent + kRope);
  DecodeSetup setup(context, /*mla=*/true);
  std::vector<uint16_t> q_nope(size_t{kBatch} * heads * kLatent);
  std::vector<uint16_t> q_pe(size_t{kBatch} * heads * kRope);
  std::vector<uint16_t> out(q_nope.size());
  FillRandom(q_nope.data(), static_cast<int64_t>(q_nope.size()));
  FillRandom(q_pe.data(), static_cast<int64_t>(q_pe.size()));
  auto view = [&](std::vector<uint16_t>& v, int64_t d) {
    return blockkv::ContiguousView(v.data(), DType::kBFloat16, blockkv::DeviceKind::kCpu, 0,
                                   {kBatch, heads, d});
  };
  const blockkv::MlaAttentionOptions options{.scale = 0.0722f,
                                             .num_threads = static_cast<int>(state.range(2))};
  for (auto _ : state) {
    Check(blockkv::MlaPagedAttention(view(q_nope, kLatent), view(q_pe, kRope), setup.cache,
                                     *setup.batch, view(out, kLatent), options),
          "MlaPagedAttention");
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kBatch * context *
                          (kLatent + kRope) * 2);
  state.counters["context"] = static_cast<double>(context);
  state.counters["heads"] = static_cast<double>(heads);
  state.counters["threads"] = static_cast<double>(state.range(2));
}

void MlaArgs(benchmark::internal::Benchmark* b) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int64_t heads : {16, 128}) {
    for (int threads : {1, hw}) {
      b->Args({4096, heads, threads});
      if (hw == 1) break;
    }
  }
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

void Args(benchmark::internal::Benchmark* b) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int64_t context : {1024, 4096, 8192}) {
    for (int threads : {1, hw}) {
      b->Args({context, threads});
      if (hw == 1) break;
    }
  }
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

BENCHMARK(BM_DecodePaged)->Apply(Args);
BENCHMARK(BM_DecodePageTable)->Apply(Args);
BENCHMARK(BM_DecodeContiguous)->Apply(Args);
BENCHMARK(BM_Memcpy)->Apply(Args);
BENCHMARK(BM_AppendDecode)->Args({4096, 1})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_MlaDecode)->Apply(MlaArgs);

}  // namespace

BENCHMARK_MAIN();
