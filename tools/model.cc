// SPDX-License-Identifier: Apache-2.0
#include "model.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "blockkv/kernels.h"
#include "blockkv/tensor.h"

namespace blockkv::tool {
namespace {

// Eight partial sums, so the compiler vectorizes it without reassociating anything: the same
// row gives the same result in every call.
float Dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y [rows, out] = x [rows, in] · wᵀ, w [out, in] (llama2.c's orientation).
void MatMul(const float* x, int64_t rows, int64_t in, const std::vector<float>& w, int64_t out,
            float* y) {
  for (int64_t o = 0; o < out; ++o) {
    const float* wo = w.data() + o * in;
    for (int64_t r = 0; r < rows; ++r) y[r * out + o] = Dot(x + r * in, wo, in);
  }
}

// out = x / sqrt(mean(x²) + 1e-5) · weight, per row of `dim` (llama2.c's rmsnorm).
void RmsNorm(const float* x, int64_t rows, int64_t dim, const std::vector<float>& weight,
             float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * dim;
    float ss = Dot(row, row, dim) / static_cast<float>(dim) + 1e-5f;
    ss = 1.0f / std::sqrt(ss);
    for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = weight[i] * (ss * row[i]);
  }
}

TensorView View(std::span<float> data, int64_t rows, int64_t heads, int64_t head_size) {
  return ContiguousView(data.data(), DType::kFloat32, DeviceKind::kCpu, 0,
                        {rows, heads, head_size});
}

}  // namespace

Status ModelConfig::Validate() const {
  const std::pair<const char*, int32_t> fields[] = {
      {"dim", dim},         {"hidden_dim", hidden_dim}, {"n_layers", n_layers},
      {"n_heads", n_heads}, {"n_kv_heads", n_kv_heads}, {"vocab_size", vocab_size},
      {"seq_len", seq_len}};
  for (const auto& [name, value] : fields) {
    if (value <= 0) {
      return InvalidArgumentError(std::string(name) + " = " + std::to_string(value) +
                                  " must be > 0");
    }
  }
  if (dim % n_heads != 0) {
    return InvalidArgumentError("n_heads = " + std::to_string(n_heads) +
                                " does not divide dim = " + std::to_string(dim));
  }
  if (n_heads % n_kv_heads != 0) {
    return InvalidArgumentError("n_kv_heads = " + std::to_string(n_kv_heads) +
                                " does not divide n_heads = " + std::to_string(n_heads));
  }
  const int32_t d = head_size();
  if (d != 64 && d != 80 && d != 96 && d != 128 && d != 256) {
    return InvalidArgumentError("head size " + std::to_string(d) + " (dim " + std::to_string(dim) +
                                " / n_heads " + std::to_string(n_heads) +
                                ") is not one PagedAttention runs: 64, 80, 96, 128 or 256");
  }
  if (!(rope_theta > 0)) return InvalidArgumentError("rope_theta must be > 0");
  return Status::Ok();
}

void RotateHalf(std::span<float> x, int64_t heads, int64_t head_size, int64_t position,
                double theta) {
  const int64_t half = head_size / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double angle =
        static_cast<double>(position) *
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_size));
    const auto c = static_cast<float>(std::cos(angle));
    const auto s = static_cast<float>(std::sin(angle));
    for (int64_t h = 0; h < heads; ++h) {
      float* row = x.data() + h * head_size;
      const float x1 = row[i], x2 = row[i + half];
      row[i] = x1 * c - x2 * s;
      row[i + half] = x2 * c + x1 * s;
    }
  }
}

// ---- paged ----

PagedAttentionBackend::PagedAttentionBackend(const StateManager& manager, const RaggedBatch& batch,
                                             const ModelConfig& config)
    : manager_(manager), batch_(batch), config_(config) {}

Status PagedAttentionBackend::Attend(int layer, std::span<float> q, std::span<float> k,
                                     std::span<float> v, std::span<float> out) {
  const int64_t rows = batch_.current_tokens();
  const int64_t d = config_.head_size();
  const TensorView qv = View(q, rows, config_.n_heads, d);
  const TensorView kv = View(k, rows, config_.n_kv_heads, d);
  const TensorView vv = View(v, rows, config_.n_kv_heads, d);
  const TensorView ov = View(out, rows, config_.n_heads, d);
  BLOCKKV_ASSIGN_OR_RETURN(const TensorView cache, manager_.GetCache(layer));
  AppendKVOptions append;
  append.rotary.enabled = true;
  append.rotary.theta = config_.rope_theta;
  append.q = &qv;
  BLOCKKV_RETURN_IF_ERROR(AppendKV(cache, kv, vv, batch_, append));
  return PagedAttention(qv, cache, batch_, ov);
}

// ---- dense ----

DenseAttentionBackend::DenseAttentionBackend(const ModelConfig& config, int64_t max_tokens)
    : config_(config),
      max_tokens_(max_tokens),
      keys_(static_cast<size_t>(config.n_layers * max_tokens * config.kv_dim())),
      values_(keys_.size()) {}

Status DenseAttentionBackend::Attend(int layer, std::span<float> q, std::span<float> k,
                                     std::span<float> v, std::span<float> out) {
  const int64_t d = config_.head_size(), hq = config_.n_heads, hkv = config_.n_kv_heads;
  const int64_t kv_dim = hkv * d, rows = std::ssize(q) / (hq * d);
  if (position_ + rows > max_tokens_) {
    return OutOfRangeError("dense cache holds " + std::to_string(max_tokens_) + " tokens, " +
                           std::to_string(position_ + rows) + " asked");
  }
  float* keys = keys_.data() + layer * max_tokens_ * kv_dim;
  float* values = values_.data() + layer * max_tokens_ * kv_dim;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t pos = position_ + t;
    RotateHalf(q.subspan(t * hq * d, hq * d), hq, d, pos, config_.rope_theta);
    RotateHalf(k.subspan(t * kv_dim, kv_dim), hkv, d, pos, config_.rope_theta);
    std::copy_n(k.data() + t * kv_dim, kv_dim, keys + pos * kv_dim);
    std::copy_n(v.data() + t * kv_dim, kv_dim, values + pos * kv_dim);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> scores(static_cast<size_t>(position_ + rows));
  std::vector<double> acc(static_cast<size_t>(d));
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t pos = position_ + t;
    for (int64_t h = 0; h < hq; ++h) {
      const float* qh = q.data() + (t * hq + h) * d;
      const int64_t kvh = h / (hq / hkv);
      double max_score = -INFINITY;
      for (int64_t j = 0; j <= pos; ++j) {
        const float* kj = keys + j * kv_dim + kvh * d;
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(qh[i]) * kj[i];
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j <= pos; ++j) {
        const double w = std::exp(scores[j] - max_score);
        sum += w;
        const float* vj = values + j * kv_dim + kvh * d;
        for (int64_t i = 0; i < d; ++i) acc[i] += w * vj[i];
      }
      float* oh = out.data() + (t * hq + h) * d;
      for (int64_t i = 0; i < d; ++i) oh[i] = static_cast<float>(acc[i] / sum);
    }
  }
  return Status::Ok();
}

// ---- model ----

Model::Model(const ModelConfig& config) : config_(config) {
  const auto dim = static_cast<size_t>(config.dim);
  const auto kv_dim = static_cast<size_t>(config.kv_dim());
  const auto hidden = static_cast<size_t>(config.hidden_dim);
  embedding_.resize(static_cast<size_t>(config.vocab_size) * dim);
  layers_.resize(static_cast<size_t>(config.n_layers));
  for (Layer& l : layers_) {
    l.rms_att.resize(dim);
    l.wq.resize(dim * dim);
    l.wk.resize(kv_dim * dim);
    l.wv.resize(kv_dim * dim);
    l.wo.resize(dim * dim);
    l.rms_ffn.resize(dim);
    l.w1.resize(hidden * dim);
    l.w2.resize(dim * hidden);
    l.w3.resize(hidden * dim);
  }
  rms_final_.resize(dim);
  if (!config.shared_classifier) classifier_.resize(embedding_.size());
}

Result<Model> Model::Random(const ModelConfig& config, uint64_t seed) {
  BLOCKKV_RETURN_IF_ERROR(config.Validate());
  Model model(config);
  std::mt19937_64 rng(seed);
  const auto fill = [&](std::vector<float>& w, double fan_in) {
    std::normal_distribution<float> normal(0.0f, static_cast<float>(1.0 / std::sqrt(fan_in)));
    for (float& x : w) x = normal(rng);
  };
  fill(model.embedding_, 1);
  for (Layer& l : model.layers_) {
    std::fill(l.rms_att.begin(), l.rms_att.end(), 1.0f);
    std::fill(l.rms_ffn.begin(), l.rms_ffn.end(), 1.0f);
    for (std::vector<float>* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w1, &l.w3}) {
      fill(*w, config.dim);
    }
    fill(l.w2, config.hidden_dim);
  }
  std::fill(model.rms_final_.begin(), model.rms_final_.end(), 1.0f);
  if (!config.shared_classifier) fill(model.classifier_, config.dim);
  return model;
}

Result<Model> Model::FirstLayers(int32_t n_layers) const {
  if (n_layers < 1 || n_layers > config_.n_layers) {
    return InvalidArgumentError("a draft of " + std::to_string(n_layers) +
                                " layers: the model has " + std::to_string(config_.n_layers) +
                                " (1 <= layers <= " + std::to_string(config_.n_layers) + ")");
  }
  Model draft = *this;
  draft.config_.n_layers = n_layers;
  draft.layers_.resize(static_cast<size_t>(n_layers));
  return draft;
}

std::string Model::Describe() const {
  const ModelConfig& c = config_;
  return std::to_string(c.n_layers) + " layers, dim " + std::to_string(c.dim) + ", " +
         std::to_string(c.n_heads) + " heads x " + std::to_string(c.head_size()) + " (" +
         std::to_string(c.n_kv_heads) + " KV head" + (c.n_kv_heads == 1 ? "" : "s") + "), SwiGLU " +
         std::to_string(c.hidden_dim) + ", vocab " + std::to_string(c.vocab_size);
}

Status Model::Forward(std::span<const int32_t> tokens, AttentionBackend& backend,
                      std::span<const int64_t> logit_rows, std::span<float> logits) const {
  const int64_t rows = std::ssize(tokens), dim = config_.dim, kv_dim = config_.kv_dim();
  const int64_t hidden = config_.hidden_dim, vocab = config_.vocab_size;
  for (const int32_t t : tokens) {
    if (t < 0 || t >= vocab) {
      return InvalidArgumentError("token " + std::to_string(t) + " outside the vocabulary of " +
                                  std::to_string(vocab));
    }
  }
  for (const int64_t r : logit_rows) {
    if (r < 0 || r >= rows) return InvalidArgumentError("logit row " + std::to_string(r));
  }
  if (std::ssize(logits) < std::ssize(logit_rows) * vocab) {
    return InvalidArgumentError("logits too small");
  }
  const auto n = [](int64_t count) { return static_cast<size_t>(count); };
  std::vector<float> x(n(rows * dim)), xb(x.size()), q(x.size()), att(x.size()), tmp(x.size());
  std::vector<float> k(n(rows * kv_dim)), v(k.size());
  std::vector<float> h1(n(rows * hidden)), h3(h1.size());
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(embedding_.data() + tokens[r] * dim, dim, x.data() + r * dim);
  }
  for (int layer = 0; layer < config_.n_layers; ++layer) {
    const Layer& l = layers_[layer];
    RmsNorm(x.data(), rows, dim, l.rms_att, xb.data());
    MatMul(xb.data(), rows, dim, l.wq, dim, q.data());
    MatMul(xb.data(), rows, dim, l.wk, kv_dim, k.data());
    MatMul(xb.data(), rows, dim, l.wv, kv_dim, v.data());
    BLOCKKV_RETURN_IF_ERROR(backend.Attend(layer, q, k, v, att));
    MatMul(att.data(), rows, dim, l.wo, dim, tmp.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];
    RmsNorm(x.data(), rows, dim, l.rms_ffn, xb.data());
    MatMul(xb.data(), rows, dim, l.w1, hidden, h1.data());
    MatMul(xb.data(), rows, dim, l.w3, hidden, h3.data());
    for (size_t i = 0; i < h1.size(); ++i) {
      h1[i] = h1[i] / (1.0f + std::exp(-h1[i])) * h3[i];  // SwiGLU: silu(w1 x) · (w3 x)
    }
    MatMul(h1.data(), rows, hidden, l.w2, dim, tmp.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];
  }
  for (size_t i = 0; i < logit_rows.size(); ++i) {
    RmsNorm(x.data() + logit_rows[i] * dim, 1, dim, rms_final_, xb.data());
    MatMul(xb.data(), 1, dim, classifier(), vocab, logits.data() + static_cast<int64_t>(i) * vocab);
  }
  return Status::Ok();
}

int32_t ArgMax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

}  // namespace blockkv::tool
