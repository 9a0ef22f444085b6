// SPDX-License-Identifier: Apache-2.0
// own_page_table: blockkv's kernels driven by an engine's own block tables, without a
// StateManager. The engine reserves blocks with BlockedKVCache::Reserve, keeps each sequence's
// block list itself, and hands the kernels a page table in FlashInfer's CSR form for a prefill
// step and in vLLM's slot-mapping form for the decode steps after it, the same table for every
// layer. At the end it checks the last decode step's attention against a plain dense attention
// over the keys it appended, and frees its blocks.
//
//   own_page_table
//
// Shape: 2 layers, 4 KV heads of 64 dims, 8 query heads, fp32, blocks of 16 tokens; two
// sequences (a prompt of 20 tokens and one of 7), then 12 decode steps. Exit status: 0 when the
// outputs match, 1 on a blockkv error or a mismatch (printed).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "blockkv/blockkv.h"

namespace {

constexpr int32_t kBlockSize = 16;
constexpr int64_t kLayers = 2;
constexpr int64_t kKVHeads = 4;
constexpr int64_t kQHeads = 8;
constexpr int64_t kHeadSize = 64;

int Fail(const blockkv::Status& status) {
  std::fprintf(stderr, "own_page_table: %s\n", status.ToString().c_str());
  return 1;
}

// The engine's own bookkeeping of one sequence: its blocks and its tokens so far.
struct Sequence {
  std::vector<blockkv::BlockId> blocks;
  int32_t length = 0;
  // Every key and value appended, [length, Hkv, D] per layer, to check attention against.
  std::vector<std::vector<float>> keys = std::vector<std::vector<float>>(kLayers);
  std::vector<std::vector<float>> values = std::vector<std::vector<float>>(kLayers);
};

// Activations [rows, heads, D] of random values.
std::vector<float> Random(std::mt19937& rng, int64_t rows, int64_t heads) {
  std::normal_distribution<float> n;
  std::vector<float> x(static_cast<size_t>(rows * heads * kHeadSize));
  for (float& v : x) v = n(rng);
  return x;
}

blockkv::TensorView View(std::vector<float>& x, int64_t heads) {
  return blockkv::ContiguousView(
      x.data(), blockkv::DType::kFloat32, blockkv::DeviceKind::kCpu, 0,
      {static_cast<int64_t>(x.size()) / (heads * kHeadSize), heads, kHeadSize});
}

// Dense causal attention of one query row (the sequence's last token) over its keys.
double MaxDifference(const Sequence& s, int64_t layer, const float* q, const float* out) {
  double worst = 0;
  for (int64_t h = 0; h < kQHeads; ++h) {
    const int64_t kv = h / (kQHeads / kKVHeads);
    std::vector<double> p(static_cast<size_t>(s.length));
    double max = -1e300;
    for (int32_t t = 0; t < s.length; ++t) {
      double dot = 0;
      for (int64_t x = 0; x < kHeadSize; ++x) {
        dot += double{q[h * kHeadSize + x]} *
               s.keys[layer][static_cast<size_t>((t * kKVHeads + kv) * kHeadSize + x)];
      }
      p[static_cast<size_t>(t)] = dot / std::sqrt(double{kHeadSize});
      max = std::max(max, p[static_cast<size_t>(t)]);
    }
    double sum = 0;
    for (double& v : p) sum += (v = std::exp(v - max));
    for (int64_t x = 0; x < kHeadSize; ++x) {
      double want = 0;
      for (int32_t t = 0; t < s.length; ++t) {
        want += p[static_cast<size_t>(t)] / sum *
                s.values[layer][static_cast<size_t>((t * kKVHeads + kv) * kHeadSize + x)];
      }
      worst = std::max(worst, std::abs(want - out[h * kHeadSize + x]));
    }
  }
  return worst;
}

}  // namespace

int main() {
  blockkv::KVCacheConfig config{.block_size = kBlockSize,
                                .cache_shape = {kLayers, kKVHeads, kHeadSize},
                                .cache_dtype = blockkv::DType::kFloat32};
  auto cache = blockkv::BlockedKVCache::Create(
      {config}, {.mode = blockkv::AllocationMode::kAllocate, .size = 32}, blockkv::CpuDevice());
  if (!cache.ok()) return Fail(cache.status());
  std::mt19937 rng(7);
  std::vector<Sequence> seqs(2);
  const std::vector<int32_t> prompts = {20, 7};

  // Grows each sequence by its new tokens (reserving blocks as needed), appends random K/V on
  // every layer, runs attention, and returns the last step's q and out of layer 1.
  auto step = [&](const std::vector<int32_t>& new_tokens, bool csr, std::vector<float>* q_last,
                  std::vector<float>* out_last) -> blockkv::Status {
    int32_t rows = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& s = seqs[i];
      const int32_t need = (s.length + new_tokens[i] + kBlockSize - 1) / kBlockSize;
      if (need > static_cast<int32_t>(s.blocks.size())) {
        auto more = (*cache)->Reserve(need - static_cast<int32_t>(s.blocks.size()));
        if (!more.ok()) return more.status();
        s.blocks.insert(s.blocks.end(), more->begin(), more->end());
      }
      s.length += new_tokens[i];
      rows += new_tokens[i];
    }
    // Both forms of the table, built from the engine's own lists.
    std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, kv_indices, last_page_len, seq_lens;
    std::vector<int64_t> slot_mapping;
    int32_t max_blocks = 0;
    for (const Sequence& s : seqs)
      max_blocks = std::max(max_blocks, static_cast<int32_t>(s.blocks.size()));
    std::vector<int32_t> block_tables(seqs.size() * static_cast<size_t>(max_blocks), 0);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const Sequence& s = seqs[i];
      qo_indptr.push_back(qo_indptr.back() + new_tokens[i]);
      kv_indptr.push_back(kv_indptr.back() + static_cast<int32_t>(s.blocks.size()));
      kv_indices.insert(kv_indices.end(), s.blocks.begin(), s.blocks.end());
      last_page_len.push_back((s.length - 1) % kBlockSize + 1);
      seq_lens.push_back(s.length);
      std::copy(s.blocks.begin(), s.blocks.end(), block_tables.begin() + i * max_blocks);
      for (int32_t p = s.length - new_tokens[i]; p < s.length; ++p) {
        slot_mapping.push_back(int64_t{s.blocks[p / kBlockSize]} * kBlockSize + p % kBlockSize);
      }
    }
    const blockkv::CsrPageTable csr_table{.qo_indptr = qo_indptr.data(),
                                          .kv_indptr = kv_indptr.data(),
                                          .kv_indices = kv_indices.data(),
                                          .kv_last_page_len = last_page_len.data(),
                                          .num_seqs = static_cast<int32_t>(seqs.size())};
    const blockkv::SlotMappingPageTable slot_table{.slot_mapping = slot_mapping.data(),
                                                   .block_tables = block_tables.data(),
                                                   .seq_lens = seq_lens.data(),
                                                   .query_start_loc = qo_indptr.data(),
                                                   .num_seqs = static_cast<int32_t>(seqs.size()),
                                                   .num_tokens = rows,
                                                   .max_blocks_per_seq = max_blocks};
    for (int64_t layer = 0; layer < kLayers; ++layer) {  // one table, every layer
      auto layer_cache = (*cache)->GetCache(layer);
      if (!layer_cache.ok()) return layer_cache.status();
      std::vector<float> q = Random(rng, rows, kQHeads);
      std::vector<float> k = Random(rng, rows, kKVHeads);
      std::vector<float> v = Random(rng, rows, kKVHeads);
      std::vector<float> out(q.size());
      for (size_t i = 0; i < seqs.size(); ++i) {  // remember the keys, for the check
        const auto from = static_cast<size_t>(qo_indptr[i] * kKVHeads * kHeadSize);
        const auto to = static_cast<size_t>(qo_indptr[i + 1] * kKVHeads * kHeadSize);
        seqs[i].keys[layer].insert(seqs[i].keys[layer].end(), k.begin() + from, k.begin() + to);
        seqs[i].values[layer].insert(seqs[i].values[layer].end(), v.begin() + from, v.begin() + to);
      }
      blockkv::Status s =
          csr ? blockkv::AppendKV(*layer_cache, View(k, kKVHeads), View(v, kKVHeads), csr_table)
              : blockkv::AppendKV(*layer_cache, View(k, kKVHeads), View(v, kKVHeads), slot_table);
      if (!s.ok()) return s;
      s = csr ? blockkv::PagedAttention(View(q, kQHeads), *layer_cache, csr_table,
                                        View(out, kQHeads))
              : blockkv::PagedAttention(View(q, kQHeads), *layer_cache, slot_table,
                                        View(out, kQHeads));
      if (!s.ok()) return s;
      *q_last = q;
      *out_last = out;
    }
    return blockkv::Status::Ok();
  };

  std::vector<float> q;
  std::vector<float> out;
  if (blockkv::Status s = step(prompts, /*csr=*/true, &q, &out); !s.ok()) return Fail(s);
  for (int i = 0; i < 12; ++i) {
    if (blockkv::Status s = step({1, 1}, /*csr=*/false, &q, &out); !s.ok()) return Fail(s);
  }
  double worst = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const auto at = i * static_cast<size_t>(kQHeads * kHeadSize);
    worst = std::max(worst, MaxDifference(seqs[i], kLayers - 1, q.data() + at, out.data() + at));
  }
  for (const Sequence& s : seqs) {
    std::printf("sequence of %d tokens in blocks", s.length);
    for (blockkv::BlockId b : s.blocks) std::printf(" %d", b);
    std::printf("\n");
    if (blockkv::Status st = (*cache)->Free(s.blocks); !st.ok()) return Fail(st);
  }
  std::printf("last decode step vs dense attention: max |difference| %.2e\n", worst);
  if (worst > 1e-4) {
    std::fprintf(stderr, "own_page_table: attention differs from the dense reference\n");
    return 1;
  }
  std::printf("free blocks after Free: %d of %d\n", (*cache)->free_blocks()[0],
              (*cache)->num_blocks());
  return 0;
}
