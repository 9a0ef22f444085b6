// SPDX-License-Identifier: Apache-2.0
// A tiny Llama-style decoder for `blockkv demo`: RMSNorm, rotary position embedding (RoPE),
// grouped-query attention, SwiGLU, greedy sampling; fp32 weights, either random from a seed or
// read from a llama2.c checkpoint (Karpathy's float32 `model.bin`).
//
//   Model model = *Model::Random(TinyConfig(), /*seed=*/7);
//   PagedAttentionBackend paged(manager, batch, model.config());   // the library's kernels
//   Status s = model.Forward(tokens, paged, rows, logits);         // one engine step
//   DenseAttentionBackend dense(model.config(), max_tokens);       // the reference
//
// Attention is the only part that differs between the paged run and the reference: the
// projections, norms and MLP are the same code on the same rows, so their results are equal bit
// for bit whatever the batch. Rotary uses the rotate-half form (Hugging Face Llama, and the
// library's AppendKV); a llama2.c checkpoint, trained with interleaved pairs (x[2i], x[2i+1]),
// has the rows of its wq and wk permuted per head on load so that rotate-half computes the same
// attention scores (the inverse of the permutation Hugging Face's conversion script applies).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "blockkv/status.h"

namespace blockkv::tool {

struct ModelConfig {
  int32_t dim = 128;
  int32_t hidden_dim = 384;  // SwiGLU inner size
  int32_t n_layers = 4;
  int32_t n_heads = 2;
  int32_t n_kv_heads = 1;  // < n_heads: grouped-query attention
  int32_t vocab_size = 256;
  int32_t seq_len = 1024;         // the longest sequence
  bool shared_classifier = true;  // the output layer is the token embedding
  double rope_theta = 10000.0;

  int32_t head_size() const { return dim / n_heads; }
  int32_t kv_dim() const { return n_kv_heads * head_size(); }
  // Every field > 0, n_heads divides dim, n_kv_heads divides n_heads, and a head size the
  // kernels support (64, 80, 96, 128, 256). kInvalidArgument names the field.
  Status Validate() const;
};

// Computes attention for one layer of a forward pass: rotates q and k by each row's position,
// stores k and v in its cache, and writes the output.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  //   q, out: [T, n_heads, head_size]; k, v: [T, n_kv_heads, head_size]; q and k are rotated in
  //   place (their contents afterwards are unspecified).
  virtual Status Attend(int layer, std::span<float> q, std::span<float> k, std::span<float> v,
                        std::span<float> out) = 0;
};

// The library's path: AppendKV (with RoPE) into the state manager's cache, then PagedAttention,
// for the rows of a finalized RaggedBatch. REQUIRES: the manager's cache is fp32 with the
// model's layers, KV heads and head size.
class PagedAttentionBackend : public AttentionBackend {
 public:
  PagedAttentionBackend(const StateManager& manager, const RaggedBatch& batch,
                        const ModelConfig& config);
  Status Attend(int layer, std::span<float> q, std::span<float> k, std::span<float> v,
                std::span<float> out) override;

 private:
  const StateManager& manager_;
  const RaggedBatch& batch_;
  const ModelConfig& config_;
};

// The reference: one sequence, a dense cache [layer, position, n_kv_heads, head_size], plain
// causal softmax attention in double precision. Rows of a Forward are positions position(),
// position() + 1, ...; Advance moves past them.
class DenseAttentionBackend : public AttentionBackend {
 public:
  DenseAttentionBackend(const ModelConfig& config, int64_t max_tokens);
  Status Attend(int layer, std::span<float> q, std::span<float> k, std::span<float> v,
                std::span<float> out) override;
  int64_t position() const { return position_; }
  void Advance(int64_t tokens) { position_ += tokens; }

 private:
  const ModelConfig& config_;
  int64_t max_tokens_;
  int64_t position_ = 0;
  std::vector<float> keys_;    // [n_layers, max_tokens, kv_dim]
  std::vector<float> values_;  // [n_layers, max_tokens, kv_dim]
};

// Rotates row x [heads, head_size] in place at `position`, rotate-half, angles in double as the
// library's AppendKV computes them.
void RotateHalf(std::span<float> x, int64_t heads, int64_t head_size, int64_t position,
                double theta);

class Model {
 public:
  // Weights ~ N(0, 1 / fan_in), norms 1, embedding ~ N(0, 1).
  static Result<Model> Random(const ModelConfig& config, uint64_t seed);
  // kNotFound (no file), kInvalidArgument naming the header field or the weight that does not
  // fit the file's length, or a shape the kernels cannot run.
  static Result<Model> LoadLlama2c(const std::string& path);
  // Writes the llama2.c format (wq, wk rows permuted back to interleaved pairs); for tests.
  Status SaveLlama2c(const std::string& path) const;

  // A cheaper copy for speculative decoding's drafts: the first `n_layers` layers, then the same
  // final norm and classifier (an early exit). kInvalidArgument unless 1 <= n_layers <= the
  // model's layers.
  Result<Model> FirstLayers(int32_t n_layers) const;

  const ModelConfig& config() const { return config_; }
  std::string Describe() const;  // "4 layers, dim 128, 2 heads / 1 KV head x 64, ..."

  // Runs `tokens` (one row each) through the model, attention by `backend`, and writes the
  // logits of rows logit_rows[i] to logits[i · vocab_size, ...). kInvalidArgument for a token
  // outside the vocabulary or a row outside [0, T).
  Status Forward(std::span<const int32_t> tokens, AttentionBackend& backend,
                 std::span<const int64_t> logit_rows, std::span<float> logits) const;

 private:
  struct Layer {
    std::vector<float> rms_att;         // [dim]
    std::vector<float> wq, wk, wv, wo;  // [dim, dim], [kv_dim, dim] x2, [dim, dim]
    std::vector<float> rms_ffn;         // [dim]
    std::vector<float> w1, w2, w3;      // [hidden, dim], [dim, hidden], [hidden, dim]
  };
  explicit Model(const ModelConfig& config);
  const std::vector<float>& classifier() const {
    return config_.shared_classifier ? embedding_ : classifier_;
  }

  ModelConfig config_;
  std::vector<float> embedding_;  // [vocab, dim]
  std::vector<Layer> layers_;
  std::vector<float> rms_final_;   // [dim]
  std::vector<float> classifier_;  // [vocab, dim] when not shared
};

// Greedy sampling: the index of the largest logit (the first of equals).
int32_t ArgMax(std::span<const float> logits);

}  // namespace blockkv::tool
