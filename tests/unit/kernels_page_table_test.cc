// SPDX-License-Identifier: Apache-2.0
// AppendKV and PagedAttention over page tables of the caller's (page_table.h): the same numerics
// as the RaggedBatch path (bit for bit: the same backend), hand-made tables over a cache from
// BlockedKVCache::Reserve (scattered blocks, a block shared between sequences, one table reused
// across layers) against a double-precision reference, the shapes of issue 17, and every check
// of a table with nothing written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "blockkv/kernels.h"
#include "blockkv/kv_cache.h"
#include "blockkv/page_table.h"
#include "unit/kernels_reference.h"
#include "unit/test_util.h"

#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace blockkv {
namespace {

using ::blockkv_test::BatchSetup;
using ::blockkv_test::HostTensor;
using ::blockkv_test::KernelBatch;
using ::blockkv_test::SeqSpec;
using ::testing::HasSubstr;

std::vector<uint8_t> Bytes(const TensorView& t) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  return {p, p + t.numel() * static_cast<int64_t>(ElementSize(t.dtype))};
}

// One sequence of a hand-made table: its blocks, its tokens in all (the new ones last), and its
// new tokens.
struct TableSeq {
  std::vector<int32_t> blocks;
  int32_t length = 0;
  int32_t n = 0;
};

// Both forms of one batch's page table, owning their arrays.
struct Tables {
  std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, kv_indices, last_page_len, positions;
  std::vector<int64_t> slot_mapping;
  std::vector<int32_t> block_tables, seq_lens;
  int32_t max_blocks = 0;

  Tables(const std::vector<TableSeq>& seqs, int32_t block_size, int32_t padding_rows = 0) {
    for (const TableSeq& s : seqs)
      max_blocks = std::max(max_blocks, static_cast<int32_t>(s.blocks.size()));
    for (const TableSeq& s : seqs) {
      const auto used = static_cast<int32_t>((s.length + block_size - 1) / block_size);
      qo_indptr.push_back(qo_indptr.back() + s.n);
      kv_indptr.push_back(kv_indptr.back() + used);
      kv_indices.insert(kv_indices.end(), s.blocks.begin(), s.blocks.begin() + used);
      last_page_len.push_back(used == 0 ? 0 : (s.length - 1) % block_size + 1);
      for (int32_t j = 0; j < s.n; ++j) {
        const int32_t pos = s.length - s.n + j;
        positions.push_back(pos);
        slot_mapping.push_back(int64_t{s.blocks[static_cast<size_t>(pos / block_size)]} *
                                   block_size +
                               pos % block_size);
      }
      std::vector<int32_t> row(static_cast<size_t>(max_blocks), 0);
      std::copy(s.blocks.begin(), s.blocks.end(), row.begin());
      block_tables.insert(block_tables.end(), row.begin(), row.end());
      seq_lens.push_back(s.length);
    }
    slot_mapping.resize(slot_mapping.size() + static_cast<size_t>(padding_rows), kPaddingSlot);
  }
  int32_t num_seqs() const { return static_cast<int32_t>(seq_lens.size()); }
  CsrPageTable Csr(bool with_positions = true) const {
    return {.qo_indptr = qo_indptr.data(),
            .kv_indptr = kv_indptr.data(),
            .kv_indices = kv_indices.data(),
            .kv_last_page_len = last_page_len.data(),
            .positions = with_positions ? positions.data() : nullptr,
            .num_seqs = num_seqs()};
  }
  SlotMappingPageTable Slots() const {
    return {.slot_mapping = slot_mapping.data(),
            .block_tables = block_tables.data(),
            .seq_lens = seq_lens.data(),
            .query_start_loc = qo_indptr.data(),
            .num_seqs = num_seqs(),
            .num_tokens = static_cast<int32_t>(slot_mapping.size()),
            .max_blocks_per_seq = max_blocks};
  }
};

// The tables of a KernelBatch's sequences (their own block tables).
Tables TablesOf(const KernelBatch& kb) {
  std::vector<TableSeq> seqs;
  for (size_t i = 0; i < kb.seqs().size(); ++i) {
    const auto table = kb.Seq(i)->block_table();
    seqs.push_back({.blocks = {table.begin(), table.end()},
                    .length = static_cast<int32_t>(kb.seqs()[i].history + kb.seqs()[i].n),
                    .n = static_cast<int32_t>(kb.seqs()[i].n)});
  }
  return Tables(seqs, kb.setup().block_size);
}

// A copy of `cache`'s bytes and a view of the copy.
struct CacheCopy {
  std::vector<uint8_t> bytes;
  TensorView view;
  explicit CacheCopy(const TensorView& cache) : bytes(Bytes(cache)), view(cache) {
    view.data = bytes.data();
  }
};

// The RaggedBatch path on the batch's cache, and each table form on a copy of the cache as it
// was: the caches and outputs agree byte for byte.
void ExpectSameAsRaggedBatch(const BatchSetup& setup, const std::vector<SeqSpec>& seqs,
                             int64_t q_heads, DType act) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed << " Hq " << q_heads);
  BatchSetup s = setup;
  s.cache_dtype = act;
  KernelBatch kb(s, seqs, seed);
  const Tables tables = TablesOf(kb);
  CacheCopy csr_cache(kb.cache());
  CacheCopy slot_cache(kb.cache());
  HostTensor q(act, kb.rows(), q_heads, s.head_size);
  HostTensor k(act, kb.rows(), s.num_kv_heads, s.head_size);
  HostTensor v(act, kb.rows(), s.num_kv_heads, s.head_size);
  q.Fill(kb.rng());
  k.Fill(kb.rng());
  v.Fill(kb.rng());
  HostTensor out(act, kb.rows(), q_heads, s.head_size);
  HostTensor csr_out = out;
  HostTensor slot_out = out;
  csr_out.view.data = csr_out.bytes.data();
  slot_out.view.data = slot_out.bytes.data();
  ASSERT_OK(AppendKV(kb.cache(), k.view, v.view, kb.batch()));
  ASSERT_OK(PagedAttention(q.view, kb.cache(), kb.batch(), out.view));
  ASSERT_OK(AppendKV(csr_cache.view, k.view, v.view, tables.Csr()));
  ASSERT_OK(PagedAttention(q.view, csr_cache.view, tables.Csr(), csr_out.view));
  ASSERT_OK(AppendKV(slot_cache.view, k.view, v.view, tables.Slots()));
  ASSERT_OK(PagedAttention(q.view, slot_cache.view, tables.Slots(), slot_out.view));
  EXPECT_TRUE(csr_cache.bytes == Bytes(kb.cache()));
  EXPECT_TRUE(slot_cache.bytes == Bytes(kb.cache()));
  EXPECT_TRUE(csr_out.bytes == out.bytes);
  EXPECT_TRUE(slot_out.bytes == out.bytes);
}

TEST(PageTable, SameNumericsAsTheRaggedBatchPath) {
  ExpectSameAsRaggedBatch({.block_size = 16, .num_kv_heads = 2, .head_size = 64},
                          {{128, 0}, {17, 40}, {1, 293}, {1, 0}}, 4, DType::kFloat16);
  ExpectSameAsRaggedBatch({.block_size = 8, .num_kv_heads = 1, .head_size = 128}, {{1, 70}, {9, 3}},
                          71, DType::kBFloat16);
  ExpectSameAsRaggedBatch({.block_size = 1, .num_kv_heads = 1, .head_size = 64}, {{1, 5}}, 1,
                          DType::kFloat32);
}

// Dense attention in double over a hand-made table: ref[row, h, :].
std::vector<double> TableReference(const TensorView& cache, const std::vector<TableSeq>& seqs,
                                   const HostTensor& q) {
  const int64_t hq = q.view.shape[1];
  const int64_t d = q.view.shape[2];
  const int64_t group = hq / cache.shape[3];
  const int64_t bs = cache.shape[1];
  std::vector<double> ref(static_cast<size_t>(q.numel()), 0.0);
  auto at = [&](const TableSeq& s, int64_t pos, int plane, int64_t head, int64_t x) {
    const int64_t block = s.blocks[static_cast<size_t>(pos / bs)];
    return blockkv_test::Decode(cache.data,
                                block * cache.stride(0) + (pos % bs) * cache.stride(1) +
                                    plane * cache.stride(2) + head * cache.stride(3) + x,
                                cache.dtype);
  };
  int64_t row = 0;
  for (const TableSeq& s : seqs) {
    for (int32_t j = 0; j < s.n; ++j, ++row) {
      const int64_t pos = s.length - s.n + j;
      for (int64_t h = 0; h < hq; ++h) {
        std::vector<double> scores;
        double max = -1e300;
        for (int64_t key = 0; key <= pos; ++key) {
          double dot = 0;
          for (int64_t x = 0; x < d; ++x)
            dot += q.at((row * hq + h) * d + x) * at(s, key, 0, h / group, x);
          scores.push_back(dot / std::sqrt(static_cast<double>(d)));
          max = std::max(max, scores.back());
        }
        double sum = 0;
        for (double& sc : scores) sum += (sc = std::exp(sc - max));
        for (int64_t key = 0; key <= pos; ++key) {
          for (int64_t x = 0; x < d; ++x) {
            ref[static_cast<size_t>((row * hq + h) * d + x)] +=
                scores[static_cast<size_t>(key)] / sum * at(s, key, 1, h / group, x);
          }
        }
      }
    }
  }
  return ref;
}

// A 2-layer fp32 cache of the engine's own (BlockedKVCache::Reserve, no state manager).
struct OwnCache {
  std::unique_ptr<BlockedKVCache> cache;
  explicit OwnCache(int32_t block_size, int64_t hkv = 2, int32_t blocks = 12) {
    KVCacheConfig config{
        .block_size = block_size, .cache_shape = {2, hkv, 64}, .cache_dtype = DType::kFloat32};
    auto created = BlockedKVCache::Create(
        {config}, {.mode = AllocationMode::kAllocate, .size = blocks}, CpuDevice(1LL << 30));
    EXPECT_OK(created.status());
    cache = std::move(*created);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int64_t layer = 0; layer < 2; ++layer) {
      const TensorView t = Layer(layer);
      auto* p = static_cast<float*>(t.data);
      for (int64_t i = 0; i < t.numel(); ++i) p[i] = u(rng);
    }
  }
  TensorView Layer(int64_t layer) const { return *cache->GetCache(layer); }
};

// Sequence A in scattered blocks; B shares A's first (full) block as a common prefix and goes on
// in its own; C is one token. One table drives both layers; every form gives the reference.
TEST(PageTable, ScatteredAndSharedBlocksOneTableForEveryLayer) {
  for (bool csr : {true, false}) {
    OwnCache own(4);
    std::vector<BlockId> blocks = *own.cache->Reserve(6);  // the engine's own allocation
    const std::vector<TableSeq> seqs = {
        {.blocks = {blocks[4], blocks[1], blocks[5]}, .length = 11, .n = 3},
        {.blocks = {blocks[4], blocks[2]}, .length = 7, .n = 2},  // block 0 shared with A
        {.blocks = {blocks[0]}, .length = 1, .n = 1}};
    const Tables tables(seqs, 4);
    for (int64_t layer = 0; layer < 2; ++layer) {
      SCOPED_TRACE(testing::Message() << "csr " << csr << " layer " << layer);
      std::mt19937 rng(static_cast<uint32_t>(layer));
      HostTensor q(DType::kFloat32, 6, 4, 64), k(DType::kFloat32, 6, 2, 64),
          v(DType::kFloat32, 6, 2, 64), out(DType::kFloat32, 6, 4, 64);
      q.Fill(rng);
      k.Fill(rng);
      v.Fill(rng);
      out.Poison();
      const TensorView cache = own.Layer(layer);
      if (csr) {
        ASSERT_OK(AppendKV(cache, k.view, v.view, tables.Csr(/*with_positions=*/layer == 0)));
        ASSERT_OK(PagedAttention(q.view, cache, tables.Csr(), out.view, {.num_threads = 2}));
      } else {
        ASSERT_OK(AppendKV(cache, k.view, v.view, tables.Slots()));
        ASSERT_OK(PagedAttention(q.view, cache, tables.Slots(), out.view, {.num_threads = 2}));
      }
      // The new keys are where the table says.
      EXPECT_EQ(
          static_cast<const float*>(
              cache.data)[blocks[5] * cache.stride(0) + 2 * cache.stride(1) + cache.stride(3) + 7],
          static_cast<const float*>(k.view.data)[(2 * 2 + 1) * 64 + 7]);
      EXPECT_LE(blockkv_test::RelativeError(out, TableReference(cache, seqs, q), 6), 1e-5);
    }
  }
}

// Issue 17's shapes through a table: one token, one sequence, one KV head, blocks of one token,
// torch's strides (1 for every extent-1 dimension).
TEST(PageTable, OneTokenOneKVHeadBlockSizeOneWithTorchStrides) {
  OwnCache own(1, /*hkv=*/1, /*blocks=*/8);
  const std::vector<TableSeq> seqs = {{.blocks = {6, 2, 5}, .length = 3, .n = 1}};
  const Tables tables(seqs, 1);
  auto torch = [](TensorView t) {
    for (int i = 0; i < t.ndim; ++i) {
      if (t.shape[i] == 1) t.strides[i] = 1;
    }
    return t;
  };
  std::mt19937 rng(5);
  HostTensor q(DType::kFloat32, 1, 1, 64), k(DType::kFloat32, 1, 1, 64),
      v(DType::kFloat32, 1, 1, 64), out(DType::kFloat32, 1, 1, 64);
  q.Fill(rng);
  k.Fill(rng);
  v.Fill(rng);
  const TensorView cache = torch(own.Layer(0));
  ASSERT_OK(AppendKV(cache, torch(k.view), torch(v.view), tables.Csr()));
  ASSERT_OK(PagedAttention(torch(q.view), cache, tables.Slots(), torch(out.view)));
  EXPECT_LE(blockkv_test::RelativeError(out, TableReference(own.Layer(0), seqs, q), 1), 1e-5);
}

// Every check of a table: the code, a message naming the values, nothing written.
class PageTableErrors : public ::testing::Test {
 protected:
  PageTableErrors()
      : own_(4),
        seqs_({{.blocks = {3, 7}, .length = 6, .n = 2}, {.blocks = {9}, .length = 3, .n = 1}}),
        tables_(seqs_, 4, /*padding_rows=*/1),
        q_(DType::kFloat32, 4, 2, 64),
        k_(DType::kFloat32, 4, 2, 64),
        v_(DType::kFloat32, 4, 2, 64),
        out_(DType::kFloat32, 4, 2, 64) {
    std::mt19937 rng(1);
    q_.Fill(rng);
    k_.Fill(rng);
    v_.Fill(rng);
  }

  void ExpectRejected(const std::function<Status()>& call, const std::string& text) {
    const std::vector<uint8_t> cache = Bytes(own_.Layer(0));
    const std::vector<uint8_t> out = out_.bytes;
    const Status status = call();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr(text));
    EXPECT_TRUE(Bytes(own_.Layer(0)) == cache) << "the cache changed: " << status;
    EXPECT_TRUE(out_.bytes == out) << "out changed: " << status;
  }
  // Both kernels with `csr`, and both with `slots`, rejected with `text`.
  void ExpectCsrRejected(const CsrPageTable& csr, const std::string& text) {
    ExpectRejected([&] { return AppendKV(own_.Layer(0), k_.view, v_.view, csr); }, text);
    ExpectRejected([&] { return PagedAttention(q_.view, own_.Layer(0), csr, out_.view); }, text);
  }
  void ExpectSlotsRejected(const SlotMappingPageTable& slots, const std::string& text) {
    ExpectRejected([&] { return AppendKV(own_.Layer(0), k_.view, v_.view, slots); }, text);
    ExpectRejected([&] { return PagedAttention(q_.view, own_.Layer(0), slots, out_.view); }, text);
  }

  OwnCache own_;
  std::vector<TableSeq> seqs_;
  Tables tables_;
  HostTensor q_, k_, v_, out_;
};

TEST_F(PageTableErrors, ValidTablesSucceed) {
  EXPECT_OK(AppendKV(own_.Layer(0), k_.view, v_.view, tables_.Csr()));
  EXPECT_OK(PagedAttention(q_.view, own_.Layer(0), tables_.Csr(), out_.view));
  EXPECT_OK(AppendKV(own_.Layer(1), k_.view, v_.view, tables_.Slots()));
  EXPECT_OK(PagedAttention(q_.view, own_.Layer(1), tables_.Slots(), out_.view));
}

TEST_F(PageTableErrors, BlockIdsOutsideTheCache) {
  Tables t = tables_;
  t.kv_indices[1] = 12;  // the cache has 12 blocks
  ExpectCsrRejected(t.Csr(false), "uses block 12 (its block 1), outside layer_cache's 12 blocks");
  t.kv_indices[1] = -3;
  ExpectCsrRejected(t.Csr(false), "uses block -3");
  Tables s = tables_;
  s.block_tables[2] = 40;  // sequence 1's block 0
  ExpectSlotsRejected(s.Slots(), "sequence 1 uses block 40");
}

TEST_F(PageTableErrors, OffsetsThatDoNotStartAtZeroOrDecrease) {
  Tables t = tables_;
  t.qo_indptr[0] = 1;
  ExpectCsrRejected(t.Csr(false), "qo_indptr[0] must be 0, got 1");
  t = tables_;
  t.kv_indptr = {0, 2, 1};
  ExpectCsrRejected(t.Csr(false), "kv_indptr[2] = 1 is less than kv_indptr[1] = 2");
  t = tables_;
  t.qo_indptr = {0, 3, 2};
  ExpectSlotsRejected(t.Slots(), "query_start_loc[2] = 2 is less than query_start_loc[1] = 3");
}

TEST_F(PageTableErrors, LengthsThatDisagree) {
  Tables t = tables_;
  t.last_page_len[0] = 5;  // blocks of 4
  ExpectCsrRejected(t.Csr(false), "kv_last_page_len[0] = 5 must be in [1, block_size 4]");
  t = tables_;
  t.qo_indptr = {0, 2, 6};  // sequence 1: 4 new tokens, 3 in all
  ExpectCsrRejected(t.Csr(false), "sequence 1 has 4 new tokens but holds 3 tokens in all");
  t = tables_;
  t.seq_lens[0] = 9;  // 3 blocks of 4, the table has 2
  ExpectSlotsRejected(t.Slots(), "more than max_blocks_per_seq 2");
  SlotMappingPageTable short_mapping = tables_.Slots();
  short_mapping.num_tokens = 2;  // query_start_loc says 3
  ExpectSlotsRejected(short_mapping, "query_start_loc[2] = 3 tokens, but slot_mapping has 2");
  ExpectRejected(
      [&] {
        HostTensor k(DType::kFloat32, 2, 2, 64);
        return AppendKV(own_.Layer(0), k.view, k.view, tables_.Csr());
      },
      "with T >= 3 (the table's tokens)");
}

TEST_F(PageTableErrors, PositionsAndSlotsThatAreNotTheTables) {
  Tables t = tables_;
  t.positions[1] = 4;
  ExpectRejected([&] { return AppendKV(own_.Layer(0), k_.view, v_.view, t.Csr()); },
                 "positions[1] = 4 but the table puts token 1 of sequence 0 at position 5");
  t = tables_;
  t.slot_mapping[2] = 5;
  ExpectSlotsRejected(t.Slots(), "slot_mapping[2] = 5 but block_tables puts token 0 of sequence 1");
  t = tables_;
  t.slot_mapping[3] = 0;  // the padding row
  ExpectSlotsRejected(t.Slots(), "slot_mapping[3] = 0 is past the 3 tokens");
  CsrPageTable null_indices = tables_.Csr();
  null_indices.kv_indices = nullptr;
  ExpectCsrRejected(null_indices, "kv_indices is null but must hold 3 entries");
}

TEST_F(PageTableErrors, TwoTokensWrittenToOneSlot) {
  // Sequence 1 given sequence 0's last block: both would write position 5's slot (block 7, 1).
  const std::vector<TableSeq> seqs = {{.blocks = {3, 7}, .length = 6, .n = 2},
                                      {.blocks = {3, 7}, .length = 6, .n = 1}};
  const Tables t(seqs, 4);
  ExpectRejected([&] { return AppendKV(own_.Layer(0), k_.view, v_.view, t.Csr()); },
                 "tokens 1 and 2 would both be written to slot 29 (block 7, offset 1)");
  ExpectRejected([&] { return AppendKV(own_.Layer(0), k_.view, v_.view, t.Slots()); },
                 "would both be written to slot 29");
  // Reading shared blocks is fine: attention over the same table succeeds.
  EXPECT_OK(PagedAttention(q_.view, own_.Layer(0), t.Csr(), out_.view));
}

TEST_F(PageTableErrors, EmptyTableIsOk) {
  const Tables t({}, 4);
  HostTensor none(DType::kFloat32, 0, 2, 64);
  EXPECT_OK(AppendKV(own_.Layer(0), none.view, none.view, t.Csr()));
  EXPECT_OK(PagedAttention(none.view, own_.Layer(0), t.Slots(), none.view));
}

}  // namespace
}  // namespace blockkv
