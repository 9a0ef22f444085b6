// SPDX-License-Identifier: Apache-2.0
// What the kernel tests (CPU, and tests/cuda) share: batches built the real way (StateManager on a
// budgeted host device, Schedule, RaggedBatch), host tensors of any dtype, and a dense reference
// in double precision over K/V gathered from the cache through each sequence's own block table.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "blockkv/kernels.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "internal/float_convert.h"

namespace blockkv_test {

using blockkv::DType;

// One sequence of a batch: `n` new tokens after `history` tokens already in the cache.
struct SeqSpec {
  int64_t n = 1;
  int64_t history = 0;
};

inline double Decode(const void* base, int64_t index, DType dtype, double kv_scale = 1.0) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[index];
    case DType::kFloat16:
      return blockkv::internal::Fp16ToFloat(static_cast<const uint16_t*>(base)[index]);
    case DType::kBFloat16:
      return blockkv::internal::Bf16ToFloat(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat8E4M3:
      return blockkv::internal::Fp8E4M3ToFloat(static_cast<const uint8_t*>(base)[index]) * kv_scale;
    default:
      ADD_FAILURE() << "no decoder for dtype " << blockkv::DTypeName(dtype);
      return 0;
  }
}

inline void Encode(void* base, int64_t index, DType dtype, float value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(base)[index] = value;
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(base)[index] = blockkv::internal::FloatToFp16(value);
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[index] = blockkv::internal::FloatToBf16(value);
      return;
    case DType::kFloat8E4M3:
      static_cast<uint8_t*>(base)[index] = blockkv::internal::FloatToFp8E4M3(value);
      return;
    default:
      ADD_FAILURE() << "no encoder for dtype " << blockkv::DTypeName(dtype);
  }
}

// Relative error bound of each activation dtype (the issue's).
inline double Tolerance(DType activations, DType cache) {
  if (cache == DType::kFloat8E4M3) return 5e-2;
  return activations == DType::kFloat32 ? 1e-5 : 1e-2;
}

// A host tensor [rows, heads, dim] owning its bytes.
struct HostTensor {
  std::vector<uint8_t> bytes;
  blockkv::TensorView view;

  HostTensor(DType dtype, int64_t rows, int64_t heads, int64_t dim)
      : bytes(static_cast<size_t>(rows * heads * dim) * blockkv::ElementSize(dtype)) {
    view = blockkv::ContiguousView(bytes.data(), dtype, blockkv::DeviceKind::kCpu, 0,
                                   {rows, heads, dim});
  }
  int64_t numel() const { return view.numel(); }
  double at(int64_t i) const { return Decode(bytes.data(), i, view.dtype); }
  void Fill(std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> u(lo, hi);
    for (int64_t i = 0; i < numel(); ++i) Encode(bytes.data(), i, view.dtype, u(rng));
  }
  void Poison() {
    for (int64_t i = 0; i < numel(); ++i) {
      Encode(bytes.data(), i, view.dtype, std::numeric_limits<float>::quiet_NaN());
    }
  }
};

struct BatchSetup {
  int32_t block_size = 64;
  int64_t num_kv_heads = 16;
  int64_t head_size = 64;
  DType cache_dtype = DType::kFloat16;
  int64_t extra_blocks = 4;  // beyond what the sequences need
  bool padding = false;
};

// One attention test: the batch (with the activations' dtype as the cache's unless it is fp8),
// query heads, activation dtype, options, and the rotary AppendKV applies first.
struct AttentionCase {
  BatchSetup setup;
  std::vector<SeqSpec> seqs;
  int64_t q_heads = 16;
  DType act = DType::kFloat16;
  blockkv::AttentionOptions options;
  blockkv::RotaryOptions rotary;
};

// A manager whose cache holds exactly the sequences' blocks (plus extra), each sequence given its
// history (Schedule + PostForward, cache contents random), then the new tokens scheduled and
// inserted into a finalized batch. On a CUDA `device` the cache lives there and host_cache() is a
// host copy (SyncToHost refreshes it); on the host both are the cache itself.
class KernelBatch {
 public:
  KernelBatch(const BatchSetup& setup, const std::vector<SeqSpec>& seqs, uint32_t seed,
              std::shared_ptr<blockkv::Device> device = nullptr)
      : setup_(setup), seqs_(seqs), rng_(seed) {
    if (device == nullptr) device = blockkv::CpuDevice(1LL << 30);
    device_ = device;
    int64_t blocks = setup.extra_blocks;
    int64_t tokens = 0;
    int64_t max_blocks = 1;
    int64_t max_history = 0;
    for (const SeqSpec& s : seqs) {
      max_history = std::max(max_history, s.history);
      const int64_t need = (s.n + s.history + setup.block_size - 1) / setup.block_size;
      blocks += need;
      tokens += s.n;
      max_blocks = std::max(max_blocks, need);
    }
    blockkv::StateManagerConfig config;
    config.max_tracked_sequences = 64;
    config.max_ragged_sequence_count = 64;
    config.max_ragged_batch_size =
        static_cast<int32_t>(std::max<int64_t>({64, tokens, max_history}));
    config.max_context = 1 << 20;
    config.memory_config = {.mode = blockkv::AllocationMode::kAllocate, .size = blocks};
    blockkv::KVCacheConfig kv{.block_size = setup.block_size,
                              .cache_shape = {1, setup.num_kv_heads, setup.head_size},
                              .cache_dtype = setup.cache_dtype,
                              .max_blocks_per_allocation_group = static_cast<int32_t>(max_blocks)};
    auto manager = blockkv::StateManager::Create(config, {kv}, device);
    if (!manager.ok()) {
      ADD_FAILURE() << manager.status();
      return;
    }
    manager_ = std::move(*manager);
    cache_ = *manager_->GetCache(0);
    host_cache_ = cache_;
    if (cache_.device != blockkv::DeviceKind::kCpu) {
      host_bytes_.resize(static_cast<size_t>(bytes()));
      host_cache_.data = host_bytes_.data();
      host_cache_.device = blockkv::DeviceKind::kCpu;
    }
    FillCache();
    for (size_t i = 0; i < seqs.size(); ++i) {
      const std::vector<blockkv::SeqId> uid = {static_cast<blockkv::SeqId>(i)};
      if (seqs[i].history > 0) {
        EXPECT_TRUE(
            manager_->Schedule({.uids = uid, .lengths = std::vector<int64_t>{seqs[i].history}})
                .ok());
        EXPECT_TRUE(manager_->PostForward(uid).ok());
      }
    }
    std::vector<blockkv::SeqId> uids;
    std::vector<int64_t> lengths;
    for (size_t i = 0; i < seqs.size(); ++i) {
      uids.push_back(static_cast<blockkv::SeqId>(i));
      lengths.push_back(seqs[i].n);
    }
    EXPECT_TRUE(manager_->Schedule({.uids = uids, .lengths = lengths}).ok());
    batch_ = std::move(*blockkv::RaggedBatch::Create(*manager_));
    Rebuild();
  }

  // Clears and re-inserts every sequence (after FreeLeadingBlocks, say).
  void Rebuild() {
    batch_->Clear();
    for (size_t i = 0; i < seqs_.size(); ++i) {
      const std::vector<blockkv::TokenId> tokens(static_cast<size_t>(seqs_[i].n), 7);
      EXPECT_TRUE(batch_->InsertSequence(*Seq(i), tokens).ok());
    }
    EXPECT_TRUE(batch_->Finalize(setup_.padding).ok());
  }

  // Every cache element random in [-1, 1] (in the cache dtype).
  void FillCache() {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int64_t n = cache_.numel();
    for (int64_t i = 0; i < n; ++i) Encode(host_cache_.data, i, cache_.dtype, u(rng_));
    if (host_cache_.data != cache_.data) {
      EXPECT_TRUE(device_->CopyFromHost(cache_.data, host_cache_.data, bytes()).ok());
    }
  }

  // Copies a device cache back into host_cache().
  void SyncToHost() {
    if (host_cache_.data == cache_.data) return;
    EXPECT_TRUE(device_->CopyToHost(host_cache_.data, cache_.data, bytes()).ok());
  }

  int64_t bytes() const {
    return cache_.numel() * static_cast<int64_t>(blockkv::ElementSize(cache_.dtype));
  }

  const blockkv::Sequence* Seq(size_t i) const {
    return manager_->GetSequence(static_cast<blockkv::SeqId>(i));
  }
  // Rows of activation tensors: T, or P when padding.
  int64_t rows() const { return batch_->padded_tokens(); }
  int64_t tokens() const { return batch_->current_tokens(); }
  // Batch row of token j of sequence i.
  int64_t Row(size_t i, int64_t j) const {
    int64_t start = 0;
    for (size_t s = 0; s < i; ++s) start += seqs_[s].n;
    return start + j;
  }
  // Element index in the cache of (position, plane, head, 0) of sequence i.
  int64_t CacheIndex(size_t i, int64_t pos, int plane, int64_t head) const {
    const blockkv::BlockId block =
        Seq(i)->block_table()[static_cast<size_t>(pos / setup_.block_size)];
    return block * cache_.stride(0) + (pos % setup_.block_size) * cache_.stride(1) +
           plane * cache_.stride(2) + head * cache_.stride(3);
  }

  std::mt19937& rng() { return rng_; }
  blockkv::StateManager& manager() { return *manager_; }
  const blockkv::RaggedBatch& batch() const { return *batch_; }
  blockkv::RaggedBatch& mutable_batch() { return *batch_; }
  const blockkv::TensorView& cache() const { return cache_; }
  const blockkv::TensorView& host_cache() const { return host_cache_; }
  const std::shared_ptr<blockkv::Device>& device() const { return device_; }
  const std::vector<SeqSpec>& seqs() const { return seqs_; }
  const BatchSetup& setup() const { return setup_; }

 private:
  BatchSetup setup_;
  std::vector<SeqSpec> seqs_;
  std::mt19937 rng_;
  std::shared_ptr<blockkv::Device> device_;
  std::unique_ptr<blockkv::StateManager> manager_;
  std::unique_ptr<blockkv::RaggedBatch> batch_;
  blockkv::TensorView cache_;
  blockkv::TensorView host_cache_;
  std::vector<uint8_t> host_bytes_;
};

// Dense attention in double for every real token of `kb` over K/V read from the (host copy of
// the) cache through each sequence's block table: ref[row, h, :]. Rows of padding stay 0.
inline std::vector<double> ReferenceAttention(const KernelBatch& kb, const HostTensor& q,
                                              const blockkv::AttentionOptions& options) {
  const blockkv::TensorView& c = kb.host_cache();
  const int64_t hq = q.view.shape[1];
  const int64_t d = q.view.shape[2];
  const int64_t group = hq / c.shape[3];
  const double scale =
      options.scale != 0.0f ? options.scale : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> ref(static_cast<size_t>(q.numel()), 0.0);
  std::vector<double> qd(static_cast<size_t>(q.numel()));
  for (int64_t x = 0; x < q.numel(); ++x) qd[static_cast<size_t>(x)] = q.at(x);
  std::vector<double> cd(static_cast<size_t>(c.numel()));
  for (int64_t x = 0; x < c.numel(); ++x) {
    cd[static_cast<size_t>(x)] = Decode(c.data, x, c.dtype, options.kv_scale);
  }
  std::vector<double> scores;
  for (size_t i = 0; i < kb.seqs().size(); ++i) {
    const SeqSpec& s = kb.seqs()[i];
    const int64_t total = s.history + s.n;
    for (int64_t j = 0; j < s.n; ++j) {
      const int64_t pos = s.history + j;
      int64_t lo = 0;
      int64_t hi = total;
      if (options.causal) {
        hi = pos + 1;
        if (options.sliding_window > 0) lo = std::max<int64_t>(0, pos - options.sliding_window + 1);
      }
      const int64_t row = kb.Row(i, j);
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t qbase = (row * hq + h) * d;
        scores.assign(static_cast<size_t>(hi - lo), 0.0);
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t key = lo; key < hi; ++key) {
          const int64_t kbase = kb.CacheIndex(i, key, 0, h / group);
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) {
            dot += qd[static_cast<size_t>(qbase + x)] * cd[static_cast<size_t>(kbase + x)];
          }
          scores[static_cast<size_t>(key - lo)] = dot * scale;
          max = std::max(max, dot * scale);
        }
        double sum = 0;
        for (double& sc : scores) sum += (sc = std::exp(sc - max));
        for (int64_t key = lo; key < hi; ++key) {
          const int64_t vbase = kb.CacheIndex(i, key, 1, h / group);
          const double p = scores[static_cast<size_t>(key - lo)] / sum;
          for (int64_t x = 0; x < d; ++x) {
            ref[static_cast<size_t>(qbase + x)] += p * cd[static_cast<size_t>(vbase + x)];
          }
        }
      }
    }
  }
  return ref;
}

// Rotate-half in double of x[0, d) at `pos`.
inline void ReferenceRotate(std::vector<double>& x, int64_t pos, int64_t rotary_dim, double theta) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double angle =
        static_cast<double>(pos) *
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
    const double x1 = x[static_cast<size_t>(i)];
    const double x2 = x[static_cast<size_t>(i + half)];
    x[static_cast<size_t>(i)] = x1 * std::cos(angle) - x2 * std::sin(angle);
    x[static_cast<size_t>(i + half)] = x2 * std::cos(angle) + x1 * std::sin(angle);
  }
}

// The worst, over the real rows' (token, head) vectors, of max |got − want| / max |want| within
// that vector — floored at a tenth of the largest |want| anywhere, so that a head whose outputs
// are all near zero is not judged by rounding alone. A small-output head that is badly wrong
// fails, where a batch-wide denominator would let it pass. ADD_FAILUREs a NaN in a real row (not
// every output written) or a non-NaN in a padded row (written past the real tokens).
inline double RelativeError(const HostTensor& got, const std::vector<double>& want,
                            int64_t real_rows) {
  const int64_t d = got.view.shape[2];
  const int64_t per_row = got.view.shape[1] * d;
  double max_ref = 1e-30;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.at(i);
    if (i / per_row >= real_rows) {
      if (!std::isnan(g)) {
        ADD_FAILURE() << "padded row " << i / per_row << " was written";
        return 1e30;
      }
      continue;
    }
    if (std::isnan(g)) {
      ADD_FAILURE() << "output " << i << " (row " << i / per_row << ") was not written";
      return 1e30;
    }
    max_ref = std::max(max_ref, std::abs(want[static_cast<size_t>(i)]));
  }
  double worst = 0;
  for (int64_t v = 0; v < real_rows * got.view.shape[1]; ++v) {
    double diff = 0;
    double ref = 0.1 * max_ref;
    for (int64_t j = v * d; j < (v + 1) * d; ++j) {
      diff = std::max(diff, std::abs(got.at(j) - want[static_cast<size_t>(j)]));
      ref = std::max(ref, std::abs(want[static_cast<size_t>(j)]));
    }
    worst = std::max(worst, diff / ref);
  }
  return worst;
}

}  // namespace blockkv_test
