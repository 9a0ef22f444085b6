// SPDX-License-Identifier: Apache-2.0
// MlaAppendKV and MlaPagedAttention on the CPU against a reference in double written from the
// equations of kernels.h (score = (q_nope · c_kv + q_pe · k_pe) · scale over the keys a token
// sees, out = softmax · c_kv), in fp32, fp16 and bf16, with DeepSeek-V3's dimensions (latent 512,
// rope 64, 16 and 128 heads) and small odd ones (T = 1, block size 1, no rotary part, several
// sequences of different lengths mixing prefill and decode); the page tables of the caller's; and
// the argument checks, each a clear error that writes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "blockkv/kernels.h"
#include "blockkv/page_table.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "unit/kernels_reference.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using blockkv_test::Decode;
using blockkv_test::Encode;
using blockkv_test::HostTensor;
using blockkv_test::SeqSpec;

struct MlaSetup {
  int32_t block_size = 64;
  int64_t latent = 512;
  int64_t rope = 64;
  DType dtype = DType::kBFloat16;
  bool padding = false;
};

// A manager with one MLA group of one layer holding exactly the sequences' blocks (plus two),
// each sequence given its history (cache contents random), the new tokens in a finalized batch.
class MlaBatch {
 public:
  MlaBatch(const MlaSetup& setup, std::vector<SeqSpec> seqs, uint32_t seed)
      : setup_(setup), seqs_(std::move(seqs)), rng_(seed) {
    int64_t blocks = 2;
    int64_t tokens = 0;
    int64_t max_blocks = 1;
    int64_t max_history = 0;
    for (const SeqSpec& s : seqs_) {
      const int64_t need = (s.n + s.history + setup.block_size - 1) / setup.block_size;
      blocks += need;
      tokens += s.n;
      max_blocks = std::max(max_blocks, need);
      max_history = std::max(max_history, s.history);
    }
    StateManagerConfig config;
    config.max_tracked_sequences = 64;
    config.max_ragged_sequence_count = 64;
    config.max_ragged_batch_size =
        static_cast<int32_t>(std::max<int64_t>({64, tokens, max_history}));
    config.max_context = 1 << 20;
    config.memory_config = {.mode = AllocationMode::kAllocate, .size = blocks};
    const KVCacheConfig kv{.block_size = setup.block_size,
                           .cache_shape = {1, 1, setup.latent + setup.rope},
                           .cache_dtype = setup.dtype,
                           .max_blocks_per_allocation_group = static_cast<int32_t>(max_blocks),
                           .type = KVCacheType::kMla,
                           .latent_dim = setup.latent,
                           .rope_dim = setup.rope};
    auto manager = StateManager::Create(config, {kv}, CpuDevice(int64_t{1} << 30));
    if (!manager.ok()) {
      ADD_FAILURE() << manager.status();
      return;
    }
    manager_ = std::move(*manager);
    cache_ = *manager_->GetCache(0);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int64_t i = 0; i < cache_.numel(); ++i) Encode(cache_.data, i, cache_.dtype, u(rng_));
    for (size_t i = 0; i < seqs_.size(); ++i) {
      const std::vector<SeqId> uid = {static_cast<SeqId>(i)};
      if (seqs_[i].history == 0) continue;
      EXPECT_OK(
          manager_->Schedule({.uids = uid, .lengths = std::vector<int64_t>{seqs_[i].history}}));
      EXPECT_OK(manager_->PostForward(uid));
    }
    std::vector<SeqId> uids;
    std::vector<int64_t> lengths;
    for (size_t i = 0; i < seqs_.size(); ++i) {
      uids.push_back(static_cast<SeqId>(i));
      lengths.push_back(seqs_[i].n);
    }
    EXPECT_OK(manager_->Schedule({.uids = uids, .lengths = lengths}));
    batch_ = std::move(*RaggedBatch::Create(*manager_));
    for (size_t i = 0; i < seqs_.size(); ++i) {
      const std::vector<TokenId> ids(static_cast<size_t>(seqs_[i].n), 7);
      EXPECT_OK(batch_->InsertSequence(*manager_->GetSequence(static_cast<SeqId>(i)), ids));
    }
    EXPECT_OK(batch_->Finalize(setup.padding));
  }

  int64_t rows() const { return batch_->padded_tokens(); }
  int64_t width() const { return setup_.latent + setup_.rope; }
  // Element index of the cache row of sequence i at position pos.
  int64_t RowIndex(size_t i, int64_t pos) const {
    const BlockId block = manager_->GetSequence(static_cast<SeqId>(i))
                              ->block_table()[static_cast<size_t>(pos / setup_.block_size)];
    return block * cache_.stride(0) + (pos % setup_.block_size) * cache_.stride(1);
  }
  int64_t FirstRow(size_t i) const {
    int64_t row = 0;
    for (size_t s = 0; s < i; ++s) row += seqs_[s].n;
    return row;
  }

  const MlaSetup& setup() const { return setup_; }
  const std::vector<SeqSpec>& seqs() const { return seqs_; }
  std::mt19937& rng() { return rng_; }
  const TensorView& cache() const { return cache_; }
  const RaggedBatch& batch() const { return *batch_; }
  StateManager& manager() { return *manager_; }

 private:
  MlaSetup setup_;
  std::vector<SeqSpec> seqs_;
  std::mt19937 rng_;
  std::unique_ptr<StateManager> manager_;
  std::unique_ptr<RaggedBatch> batch_;
  TensorView cache_;
};

// A host [rows, dim] tensor (c_kv, k_pe).
HostTensor Rows2(DType dtype, int64_t rows, int64_t dim) {
  HostTensor t(dtype, rows, 1, dim);
  t.view = ContiguousView(t.bytes.data(), dtype, DeviceKind::kCpu, 0, {rows, dim});
  return t;
}

std::vector<uint8_t> CacheBytes(const TensorView& cache) {
  const auto* p = static_cast<const uint8_t*>(cache.data);
  return {p, p + cache.numel() * static_cast<int64_t>(ElementSize(cache.dtype))};
}

// The reference in double, from the equations: ref[row, h, 0:L) for every real token.
std::vector<double> Reference(const MlaBatch& mb, const HostTensor& q_nope, const HostTensor& q_pe,
                              double scale, bool causal) {
  const int64_t heads = q_nope.view.shape[1];
  const int64_t latent = mb.setup().latent;
  const int64_t rope = mb.setup().rope;
  std::vector<double> out(static_cast<size_t>(q_nope.numel()), 0.0);
  for (size_t i = 0; i < mb.seqs().size(); ++i) {
    const SeqSpec& s = mb.seqs()[i];
    const int64_t total = s.history + s.n;
    for (int64_t j = 0; j < s.n; ++j) {
      const int64_t row = mb.FirstRow(i) + j;
      const int64_t keys = causal ? s.history + j + 1 : total;
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<double> score(static_cast<size_t>(keys));
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t k = 0; k < keys; ++k) {
          const int64_t at = mb.RowIndex(i, k);
          double dot = 0;
          for (int64_t d = 0; d < latent; ++d) {
            dot += q_nope.at((row * heads + h) * latent + d) *
                   Decode(mb.cache().data, at + d, mb.cache().dtype);
          }
          for (int64_t d = 0; d < rope; ++d) {
            dot += q_pe.at((row * heads + h) * rope + d) *
                   Decode(mb.cache().data, at + latent + d, mb.cache().dtype);
          }
          score[static_cast<size_t>(k)] = dot * scale;
          max_score = std::max(max_score, dot * scale);
        }
        double sum = 0;
        for (double& x : score) {
          x = std::exp(x - max_score);
          sum += x;
        }
        for (int64_t k = 0; k < keys; ++k) {
          const int64_t at = mb.RowIndex(i, k);
          const double w = score[static_cast<size_t>(k)] / sum;
          for (int64_t d = 0; d < latent; ++d) {
            out[static_cast<size_t>((row * heads + h) * latent + d)] +=
                w * Decode(mb.cache().data, at + d, mb.cache().dtype);
          }
        }
      }
    }
  }
  return out;
}

struct MlaCase {
  MlaSetup setup;
  std::vector<SeqSpec> seqs;
  int64_t heads = 16;
  bool causal = true;
  int num_threads = 0;
};

// Appends random latents, checks they landed in their slots bit for bit, attends, and compares
// with the reference. Returns the output for further comparisons.
HostTensor RunCase(const MlaCase& c, uint32_t seed) {
  MlaBatch mb(c.setup, c.seqs, seed);
  const DType dt = c.setup.dtype;
  const int64_t rows = mb.rows();
  HostTensor c_kv = Rows2(dt, rows, c.setup.latent);
  HostTensor k_pe = Rows2(dt, rows, c.setup.rope);
  c_kv.Fill(mb.rng());
  k_pe.Fill(mb.rng());
  EXPECT_OK(
      MlaAppendKV(mb.cache(), c_kv.view, k_pe.view, mb.batch(), {.num_threads = c.num_threads}));
  const size_t elem = ElementSize(dt);
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    for (int64_t j = 0; j < c.seqs[i].n; ++j) {
      const int64_t row = mb.FirstRow(i) + j;
      const auto* slot = static_cast<const uint8_t*>(mb.cache().data) +
                         mb.RowIndex(i, c.seqs[i].history + j) * static_cast<int64_t>(elem);
      EXPECT_EQ(
          std::memcmp(slot, c_kv.bytes.data() + row * c.setup.latent * elem, c.setup.latent * elem),
          0)
          << "c_kv of sequence " << i << " token " << j;
      if (c.setup.rope == 0) continue;  // k_pe has no bytes (and memcmp no null pointers)
      EXPECT_EQ(std::memcmp(slot + c.setup.latent * elem,
                            k_pe.bytes.data() + row * c.setup.rope * elem, c.setup.rope * elem),
                0)
          << "k_pe of sequence " << i << " token " << j;
    }
  }
  HostTensor q_nope(dt, rows, c.heads, c.setup.latent);
  HostTensor q_pe(dt, rows, c.heads, c.setup.rope);
  q_nope.Fill(mb.rng());
  q_pe.Fill(mb.rng());
  HostTensor out(dt, rows, c.heads, c.setup.latent);
  out.Poison();
  const float scale = 1.0f / std::sqrt(192.0f);
  EXPECT_OK(MlaPagedAttention(q_nope.view, q_pe.view, mb.cache(), mb.batch(), out.view,
                              {.scale = scale, .causal = c.causal, .num_threads = c.num_threads}));
  const std::vector<double> want = Reference(mb, q_nope, q_pe, scale, c.causal);
  const double err = blockkv_test::RelativeError(out, want, mb.batch().current_tokens());
  EXPECT_LT(err, blockkv_test::Tolerance(dt, dt)) << DTypeName(dt);
  return out;
}

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

TEST(MlaKernelsTest, DeepSeekV3DimsMixedPrefillAndDecodeMatchTheReference) {
  for (const DType dt : kDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    RunCase({.setup = {.block_size = 64, .dtype = dt},
             .seqs = {{.n = 1, .history = 300},
                      {.n = 5, .history = 0},
                      {.n = 1, .history = 64},
                      {.n = 3, .history = 17}},
             .heads = 16},
            1);
  }
}

TEST(MlaKernelsTest, DeepSeekV3OneDecodeTokenOver128HeadsMatchesTheReference) {
  for (const DType dt : kDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    RunCase({.setup = {.block_size = 64, .dtype = dt},
             .seqs = {{.n = 1, .history = 200}},
             .heads = 128},
            2);
  }
}

TEST(MlaKernelsTest, SmallOddShapesMatchTheReference) {
  for (const DType dt : kDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    // Block size 1, latent 7 + rope 3, 3 heads: rows shorter than any vector, one token a block.
    RunCase({.setup = {.block_size = 1, .latent = 7, .rope = 3, .dtype = dt},
             .seqs = {{.n = 1, .history = 0}, {.n = 4, .history = 2}, {.n = 1, .history = 9}},
             .heads = 3},
            3);
    // T = 1, the first token of its sequence, one head.
    RunCase({.setup = {.block_size = 16, .latent = 33, .rope = 5, .dtype = dt},
             .seqs = {{.n = 1, .history = 0}},
             .heads = 1},
            4);
    // No rotary part (R = 0: k_pe and q_pe are [T, 0] and [T, H, 0]).
    RunCase({.setup = {.block_size = 4, .latent = 16, .rope = 0, .dtype = dt},
             .seqs = {{.n = 2, .history = 5}, {.n = 1, .history = 40}},
             .heads = 5},
            5);
  }
}

TEST(MlaKernelsTest, NonCausalAndPaddedRowsMatchTheReference) {
  RunCase({.setup = {.block_size = 8, .latent = 64, .rope = 16, .dtype = DType::kFloat32},
           .seqs = {{.n = 6, .history = 3}, {.n = 1, .history = 20}},
           .heads = 6,
           .causal = false},
          6);
  // Padding: the padded rows of out stay NaN (RelativeError checks both kinds of row).
  RunCase(
      {.setup =
           {.block_size = 8, .latent = 64, .rope = 16, .dtype = DType::kFloat16, .padding = true},
       .seqs = {{.n = 3, .history = 3}, {.n = 1, .history = 20}},
       .heads = 4},
      7);
}

TEST(MlaKernelsTest, OutputDoesNotDependOnTheNumberOfThreads) {
  MlaCase c{.setup = {.block_size = 16, .dtype = DType::kBFloat16},
            .seqs = {{.n = 1, .history = 100}, {.n = 2, .history = 40}},
            .heads = 64,
            .num_threads = 1};
  const HostTensor one = RunCase(c, 8);
  c.num_threads = 8;
  const HostTensor eight = RunCase(c, 8);
  EXPECT_TRUE(one.bytes == eight.bytes);
}

// The batch's CSR arrays as a page table of the caller's give the batch's results bit for bit.
TEST(MlaKernelsTest, CsrAndSlotMappingTablesGiveTheBatchResult) {
  const MlaSetup setup{.block_size = 4, .latent = 32, .rope = 8, .dtype = DType::kFloat32};
  const std::vector<SeqSpec> seqs = {{.n = 1, .history = 9}, {.n = 3, .history = 2}};
  MlaBatch mb(setup, seqs, 9);
  const int64_t rows = mb.rows();
  HostTensor c_kv = Rows2(setup.dtype, rows, setup.latent);
  HostTensor k_pe = Rows2(setup.dtype, rows, setup.rope);
  c_kv.Fill(mb.rng());
  k_pe.Fill(mb.rng());
  ASSERT_OK(MlaAppendKV(mb.cache(), c_kv.view, k_pe.view, mb.batch()));
  HostTensor q_nope(setup.dtype, rows, 4, setup.latent);
  HostTensor q_pe(setup.dtype, rows, 4, setup.rope);
  q_nope.Fill(mb.rng());
  q_pe.Fill(mb.rng());
  HostTensor want(setup.dtype, rows, 4, setup.latent);
  ASSERT_OK(MlaPagedAttention(q_nope.view, q_pe.view, mb.cache(), mb.batch(), want.view,
                              {.scale = 0.125f}));

  std::vector<int32_t> qo = {0}, kv_ptr = {0}, indices, last, lens, tables;
  std::vector<int64_t> slots;
  const int32_t max_blocks = 3;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t total = seqs[i].history + seqs[i].n;
    const int64_t blocks = (total + setup.block_size - 1) / setup.block_size;
    const auto table = mb.manager().GetSequence(static_cast<SeqId>(i))->block_table();
    for (int64_t b = 0; b < max_blocks; ++b) {
      if (b < blocks) indices.push_back(table[static_cast<size_t>(b)]);
      tables.push_back(b < blocks ? table[static_cast<size_t>(b)] : 0);
    }
    for (int64_t j = 0; j < seqs[i].n; ++j) {
      const int64_t pos = seqs[i].history + j;
      slots.push_back(int64_t{table[static_cast<size_t>(pos / setup.block_size)]} *
                          setup.block_size +
                      pos % setup.block_size);
    }
    qo.push_back(qo.back() + static_cast<int32_t>(seqs[i].n));
    kv_ptr.push_back(kv_ptr.back() + static_cast<int32_t>(blocks));
    last.push_back(static_cast<int32_t>(total - (blocks - 1) * setup.block_size));
    lens.push_back(static_cast<int32_t>(total));
  }
  const CsrPageTable csr{.qo_indptr = qo.data(),
                         .kv_indptr = kv_ptr.data(),
                         .kv_indices = indices.data(),
                         .kv_last_page_len = last.data(),
                         .num_seqs = 2};
  const SlotMappingPageTable vllm{.slot_mapping = slots.data(),
                                  .block_tables = tables.data(),
                                  .seq_lens = lens.data(),
                                  .query_start_loc = qo.data(),
                                  .num_seqs = 2,
                                  .num_tokens = 4,
                                  .max_blocks_per_seq = max_blocks};
  const std::vector<uint8_t> appended = CacheBytes(mb.cache());
  ASSERT_OK(MlaAppendKV(mb.cache(), c_kv.view, k_pe.view, csr));
  ASSERT_OK(MlaAppendKV(mb.cache(), c_kv.view, k_pe.view, vllm));
  EXPECT_TRUE(CacheBytes(mb.cache()) == appended);
  HostTensor got(setup.dtype, rows, 4, setup.latent);
  ASSERT_OK(
      MlaPagedAttention(q_nope.view, q_pe.view, mb.cache(), csr, got.view, {.scale = 0.125f}));
  EXPECT_TRUE(got.bytes == want.bytes);
  got.Poison();
  ASSERT_OK(
      MlaPagedAttention(q_nope.view, q_pe.view, mb.cache(), vllm, got.view, {.scale = 0.125f}));
  EXPECT_TRUE(got.bytes == want.bytes);
  // A table naming a block outside the cache writes nothing.
  indices[2] = 1000;  // the block sequence 0's new token goes to
  EXPECT_CODE(MlaAppendKV(mb.cache(), c_kv.view, k_pe.view, csr), StatusCode::kInvalidArgument);
  EXPECT_TRUE(CacheBytes(mb.cache()) == appended);
}

// ---- errors: each names the value, and nothing is written ------------------------------------

class MlaErrorsTest : public testing::Test {
 protected:
  MlaErrorsTest()
      : mb_({.block_size = 4, .latent = 16, .rope = 8, .dtype = DType::kFloat16},
            {{.n = 2, .history = 3}}, 10),
        c_kv_(Rows2(DType::kFloat16, 2, 16)),
        k_pe_(Rows2(DType::kFloat16, 2, 8)),
        q_nope_(DType::kFloat16, 2, 4, 16),
        q_pe_(DType::kFloat16, 2, 4, 8),
        out_(DType::kFloat16, 2, 4, 16) {
    c_kv_.Fill(mb_.rng());
    k_pe_.Fill(mb_.rng());
    q_nope_.Fill(mb_.rng());
    q_pe_.Fill(mb_.rng());
    out_.Poison();
    before_ = CacheBytes(mb_.cache());
  }
  // The call failed with `code` and a message containing `text`, and wrote nothing.
  void ExpectFails(const Status& s, StatusCode code, const std::string& text) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(text), std::string::npos) << s;
    EXPECT_TRUE(CacheBytes(mb_.cache()) == before_) << "the cache changed";
    for (int64_t i = 0; i < out_.numel(); ++i) ASSERT_TRUE(std::isnan(out_.at(i))) << i;
  }
  Status Attend(const MlaAttentionOptions& options = {.scale = 0.25f}) {
    return MlaPagedAttention(q_nope_.view, q_pe_.view, mb_.cache(), mb_.batch(), out_.view,
                             options);
  }

  MlaBatch mb_;
  HostTensor c_kv_, k_pe_, q_nope_, q_pe_, out_;
  std::vector<uint8_t> before_;
};

TEST_F(MlaErrorsTest, AppendChecksWidthsDtypesAndRows) {
  HostTensor wide = Rows2(DType::kFloat16, 2, 9);
  ExpectFails(MlaAppendKV(mb_.cache(), c_kv_.view, wide.view, mb_.batch()),
              StatusCode::kInvalidArgument, "k_pe must be [T, 8] with T = 2");
  HostTensor fp32 = Rows2(DType::kFloat32, 2, 16);
  ExpectFails(MlaAppendKV(mb_.cache(), fp32.view, k_pe_.view, mb_.batch()),
              StatusCode::kInvalidArgument, "c_kv dtype fp32 and layer_cache dtype fp16 differ");
  HostTensor short_rows = Rows2(DType::kFloat16, 1, 16);
  ExpectFails(MlaAppendKV(mb_.cache(), short_rows.view, k_pe_.view, mb_.batch()),
              StatusCode::kInvalidArgument, "c_kv must be [T, 16] with T = 2");
  // Widths that sum to the row but are not the group's latent_dim / rope_dim.
  HostTensor c20 = Rows2(DType::kFloat16, 2, 20);
  HostTensor k4 = Rows2(DType::kFloat16, 2, 4);
  ExpectFails(MlaAppendKV(mb_.cache(), c20.view, k4.view, mb_.batch()),
              StatusCode::kInvalidArgument, "latent width 20 is not cache group 0's latent_dim 16");
  ExpectFails(MlaAppendKV(mb_.cache(), c_kv_.view, k_pe_.view, mb_.batch(), {.num_threads = -1}),
              StatusCode::kInvalidArgument, "num_threads must be >= 0, got -1");
  ExpectFails(MlaAppendKV(mb_.cache(), c_kv_.view, k_pe_.view, mb_.batch(), {.group = 1}),
              StatusCode::kOutOfRange, "");
}

TEST_F(MlaErrorsTest, AttentionChecksScaleShapesOverlapAndTheLayer) {
  ExpectFails(Attend({}), StatusCode::kInvalidArgument,
              "MlaAttentionOptions.scale must be the model's softmax scale, finite and > 0, got 0");
  ExpectFails(Attend({.scale = std::numeric_limits<float>::infinity()}),
              StatusCode::kInvalidArgument, "finite and > 0");
  HostTensor q_pe3(DType::kFloat16, 2, 3, 8);
  ExpectFails(MlaPagedAttention(q_nope_.view, q_pe3.view, mb_.cache(), mb_.batch(), out_.view,
                                {.scale = 0.25f}),
              StatusCode::kInvalidArgument, "q_pe must be [T, 4, 8]");
  // out aliasing q_nope.
  ExpectFails(MlaPagedAttention(q_nope_.view, q_pe_.view, mb_.cache(), mb_.batch(), q_nope_.view,
                                {.scale = 0.25f}),
              StatusCode::kInvalidArgument, "out and q_nope overlap in memory");
  // A transposed q_nope (heads overlapping rows).
  TensorView bad = q_nope_.view;
  bad.strides[1] = 1;
  bad.strides[2] = 4;
  ExpectFails(
      MlaPagedAttention(bad, q_pe_.view, mb_.cache(), mb_.batch(), out_.view, {.scale = 0.25f}),
      StatusCode::kInvalidArgument, "contiguous last dimension");
  // The dense kernels refuse an MLA layer, naming the MLA ones.
  HostTensor q(DType::kFloat16, 2, 4, 64);
  ExpectFails(PagedAttention(q.view, mb_.cache(), mb_.batch(), out_.view),
              StatusCode::kInvalidArgument, "is an MLA layer");
  // A layer that is not the batch's.
  std::vector<uint16_t> other(static_cast<size_t>(mb_.cache().numel()));
  TensorView foreign = mb_.cache();
  foreign.data = other.data();
  ExpectFails(MlaPagedAttention(q_nope_.view, q_pe_.view, foreign, mb_.batch(), out_.view,
                                {.scale = 0.25f}),
              StatusCode::kInvalidArgument, "is not a layer of cache group 0");
  // A CUDA tensor: not implemented yet, said so.
  TensorView cuda = mb_.cache();
  cuda.device = DeviceKind::kCuda;
  ExpectFails(
      MlaPagedAttention(q_nope_.view, q_pe_.view, cuda, mb_.batch(), out_.view, {.scale = 0.25f}),
      StatusCode::kUnimplemented, "CPU only so far");
  // fp8 caches are not supported by the MLA kernels.
  TensorView fp8 = mb_.cache();
  fp8.dtype = DType::kFloat8E4M3;
  ExpectFails(
      MlaPagedAttention(q_nope_.view, q_pe_.view, fp8, mb_.batch(), out_.view, {.scale = 0.25f}),
      StatusCode::kInvalidArgument, "not supported by the MLA kernels");
}

TEST(MlaKernelsDenseGroupTest, MlaCallOnADenseGroupNamesItsType) {
  blockkv_test::KernelBatch kb(
      {.block_size = 4, .num_kv_heads = 1, .head_size = 64, .cache_dtype = DType::kFloat32},
      {{.n = 1, .history = 2}}, 11);
  // A 3-D view of the dense layer's memory is not a layer of that group.
  TensorView flat = kb.cache();
  flat.ndim = 3;
  flat.shape = {kb.cache().shape[0], 4, 128};
  flat.strides = {512, 128, 1};
  HostTensor c_kv = Rows2(DType::kFloat32, 1, 96);
  HostTensor k_pe = Rows2(DType::kFloat32, 1, 32);
  const Status s = MlaAppendKV(flat, c_kv.view, k_pe.view, kb.batch());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("is not a layer of cache group 0"), std::string::npos) << s;
}

TEST(MlaKernelsTest, UnfinalizedBatchIsFailedPrecondition) {
  MlaBatch mb({.block_size = 4, .latent = 16, .rope = 8, .dtype = DType::kFloat32},
              {{.n = 1, .history = 0}}, 12);
  auto fresh = RaggedBatch::Create(mb.manager());
  ASSERT_OK(fresh);
  HostTensor c_kv = Rows2(DType::kFloat32, 1, 16);
  HostTensor k_pe = Rows2(DType::kFloat32, 1, 8);
  EXPECT_CODE(MlaAppendKV(mb.cache(), c_kv.view, k_pe.view, **fresh),
              StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace blockkv
