// SPDX-License-Identifier: Apache-2.0
// The demo's model: llama2.c checkpoints (written, read back, checked against a transcription
// of llama2.c's own forward pass with interleaved RoPE) and their validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <vector>

#include "model.h"

namespace blockkv::tool {
namespace {

std::string TempPath(const std::string& name) { return testing::TempDir() + "/" + name; }

ModelConfig Small(bool shared) {
  ModelConfig c;
  c.dim = 128;
  c.hidden_dim = 160;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.vocab_size = 40;
  c.seq_len = 32;
  c.shared_classifier = shared;
  return c;
}

// Greedy tokens of the dense reference.
std::vector<int32_t> Generate(const Model& model, std::vector<int32_t> prompt, int n,
                              std::vector<float>* last_logits = nullptr) {
  DenseAttentionBackend dense(model.config(), std::ssize(prompt) + n);
  std::vector<float> logits(static_cast<size_t>(model.config().vocab_size));
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const std::array<int64_t, 1> row = {std::ssize(prompt) - 1};
    EXPECT_TRUE(model.Forward(prompt, dense, row, logits).ok());
    dense.Advance(std::ssize(prompt));
    out.push_back(ArgMax(logits));
    prompt.assign(1, out.back());
  }
  if (last_logits != nullptr) *last_logits = logits;
  return out;
}

// llama2.c's run.c forward for one token, transcribed: the weights read from the file as they
// are (interleaved RoPE pairs), float arithmetic, a dense cache per layer.
class Llama2cReference {
 public:
  explicit Llama2cReference(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    int32_t h[7];
    in.read(reinterpret_cast<char*>(h), sizeof(h));
    dim_ = h[0], hidden_ = h[1], layers_ = h[2], heads_ = h[3], kv_heads_ = h[4];
    vocab_ = std::abs(h[5]), seq_len_ = h[6];
    std::vector<float> rest;
    float x;
    while (in.read(reinterpret_cast<char*>(&x), 4)) rest.push_back(x);
    w_ = std::move(rest);
    const int64_t hs = dim_ / heads_, kv = kv_heads_ * hs;
    size_t at = 0;
    auto take = [&](int64_t n) {
      const size_t here = at;
      at += static_cast<size_t>(n);
      return here;
    };
    emb_ = take(int64_t{vocab_} * dim_);
    rms_att_ = take(int64_t{layers_} * dim_);
    wq_ = take(int64_t{layers_} * dim_ * dim_);
    wk_ = take(int64_t{layers_} * dim_ * kv);
    wv_ = take(int64_t{layers_} * dim_ * kv);
    wo_ = take(int64_t{layers_} * dim_ * dim_);
    rms_ffn_ = take(int64_t{layers_} * dim_);
    w1_ = take(int64_t{layers_} * dim_ * hidden_);
    w2_ = take(int64_t{layers_} * hidden_ * dim_);
    w3_ = take(int64_t{layers_} * dim_ * hidden_);
    rms_final_ = take(dim_);
    take(int64_t{seq_len_} * hs);  // freq_cis_real and _imag
    wcls_ = h[5] > 0 ? emb_ : take(int64_t{vocab_} * dim_);
    key_cache_.assign(static_cast<size_t>(layers_ * seq_len_ * kv), 0);
    value_cache_ = key_cache_;
  }

  std::vector<float> Forward(int token, int pos) {
    const int hs = dim_ / heads_, kv_dim = kv_heads_ * hs, kv_mul = heads_ / kv_heads_;
    std::vector<float> x(w_.begin() + emb_ + token * dim_, w_.begin() + emb_ + (token + 1) * dim_);
    std::vector<float> xb(dim_), xb2(dim_), q(dim_), hb(hidden_), hb2(hidden_);
    for (int l = 0; l < layers_; ++l) {
      RmsNorm(xb, x, rms_att_ + l * dim_);
      float* k = &key_cache_[(l * seq_len_ + pos) * kv_dim];
      float* v = &value_cache_[(l * seq_len_ + pos) * kv_dim];
      MatMul(q.data(), xb.data(), wq_ + size_t(l) * dim_ * dim_, dim_, dim_);
      MatMul(k, xb.data(), wk_ + size_t(l) * dim_ * kv_dim, dim_, kv_dim);
      MatMul(v, xb.data(), wv_ + size_t(l) * dim_ * kv_dim, dim_, kv_dim);
      for (int i = 0; i < dim_; i += 2) {  // run.c's RoPE: interleaved pairs
        const int head_dim = i % hs;
        const float freq =
            1.0f / powf(10000.0f, static_cast<float>(head_dim) / static_cast<float>(hs));
        const float val = static_cast<float>(pos) * freq, fcr = cosf(val), fci = sinf(val);
        for (int vi = 0; vi < (i < kv_dim ? 2 : 1); ++vi) {
          float* vec = vi == 0 ? q.data() : k;
          const float v0 = vec[i], v1 = vec[i + 1];
          vec[i] = v0 * fcr - v1 * fci;
          vec[i + 1] = v0 * fci + v1 * fcr;
        }
      }
      for (int h = 0; h < heads_; ++h) {
        std::vector<float> att(pos + 1);
        for (int t = 0; t <= pos; ++t) {
          const float* kt = &key_cache_[(l * seq_len_ + t) * kv_dim + (h / kv_mul) * hs];
          float score = 0;
          for (int i = 0; i < hs; ++i) score += q[h * hs + i] * kt[i];
          att[t] = score / sqrtf(static_cast<float>(hs));
        }
        float max = att[0], sum = 0;
        for (float a : att) max = std::max(max, a);
        for (float& a : att) sum += (a = expf(a - max));
        for (float& a : att) a /= sum;
        for (int i = 0; i < hs; ++i) {
          float acc = 0;
          for (int t = 0; t <= pos; ++t) {
            acc += att[t] * value_cache_[(l * seq_len_ + t) * kv_dim + (h / kv_mul) * hs + i];
          }
          xb[h * hs + i] = acc;
        }
      }
      MatMul(xb2.data(), xb.data(), wo_ + size_t(l) * dim_ * dim_, dim_, dim_);
      for (int i = 0; i < dim_; ++i) x[i] += xb2[i];
      RmsNorm(xb, x, rms_ffn_ + l * dim_);
      MatMul(hb.data(), xb.data(), w1_ + size_t(l) * dim_ * hidden_, dim_, hidden_);
      MatMul(hb2.data(), xb.data(), w3_ + size_t(l) * dim_ * hidden_, dim_, hidden_);
      for (int i = 0; i < hidden_; ++i) hb[i] = hb[i] * (1.0f / (1.0f + expf(-hb[i]))) * hb2[i];
      MatMul(xb.data(), hb.data(), w2_ + size_t(l) * dim_ * hidden_, hidden_, dim_);
      for (int i = 0; i < dim_; ++i) x[i] += xb[i];
    }
    RmsNorm(x, x, rms_final_);
    std::vector<float> logits(vocab_);
    MatMul(logits.data(), x.data(), wcls_, dim_, vocab_);
    return logits;
  }

 private:
  void RmsNorm(std::vector<float>& o, const std::vector<float>& x, size_t weight) const {
    float ss = 0;
    for (float a : x) ss += a * a;
    ss = 1.0f / sqrtf(ss / static_cast<float>(dim_) + 1e-5f);
    std::vector<float> out(x.size());
    for (int j = 0; j < dim_; ++j) out[j] = w_[weight + j] * (ss * x[j]);
    o = out;
  }
  void MatMul(float* xout, const float* x, size_t w, int n, int d) const {
    for (int i = 0; i < d; ++i) {
      float val = 0;
      for (int j = 0; j < n; ++j) val += w_[w + size_t(i) * n + j] * x[j];
      xout[i] = val;
    }
  }

  int dim_, hidden_, layers_, heads_, kv_heads_, vocab_, seq_len_;
  std::vector<float> w_;
  size_t emb_, rms_att_, wq_, wk_, wv_, wo_, rms_ffn_, w1_, w2_, w3_, rms_final_, wcls_;
  std::vector<float> key_cache_, value_cache_;
};

TEST(Llama2c, SavedModelLoadsBackIdentical) {
  for (const bool shared : {true, false}) {
    const Model model = *Model::Random(Small(shared), 3);
    const std::string path = TempPath(shared ? "shared.bin" : "unshared.bin");
    ASSERT_TRUE(model.SaveLlama2c(path).ok());
    Result<Model> loaded = Model::LoadLlama2c(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->config().shared_classifier, shared);
    const std::vector<int32_t> prompt = {1, 5, 9, 2, 7};
    EXPECT_EQ(Generate(*loaded, prompt, 12), Generate(model, prompt, 12));
  }
}

TEST(Llama2c, MatchesLlama2cForwardWithInterleavedRope) {
  // The file holds interleaved-pair wq / wk (as llama2.c trains them); the loader permutes them
  // for rotate-half. Logits must match run.c's forward, position after position.
  const Model model = *Model::Random(Small(false), 11);
  const std::string path = TempPath("reference.bin");
  ASSERT_TRUE(model.SaveLlama2c(path).ok());
  const Model loaded = *Model::LoadLlama2c(path);
  Llama2cReference reference(path);
  const std::vector<int32_t> tokens = {3, 17, 8, 30, 1, 22, 9, 14, 5, 39};
  DenseAttentionBackend dense(loaded.config(), std::ssize(tokens));
  std::vector<float> ours(static_cast<size_t>(loaded.config().vocab_size));
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    const std::array<int32_t, 1> one = {tokens[pos]};
    const std::array<int64_t, 1> row = {0};
    ASSERT_TRUE(loaded.Forward(one, dense, row, ours).ok());
    dense.Advance(1);
    const std::vector<float> theirs = reference.Forward(tokens[pos], static_cast<int>(pos));
    for (size_t v = 0; v < ours.size(); ++v) {
      ASSERT_NEAR(ours[v], theirs[v], 1e-3 * (1 + std::fabs(theirs[v])))
          << "position " << pos << ", logit " << v;
    }
    EXPECT_EQ(ArgMax(ours), ArgMax(theirs)) << "position " << pos;
  }
}

// Copies `path` with `edit` applied to its bytes.
std::string Edited(const std::string& path, const std::string& name,
                   const std::function<void(std::vector<char>&)>& edit) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  edit(bytes);
  const std::string out = TempPath(name);
  std::ofstream(out, std::ios::binary).write(bytes.data(), std::ssize(bytes));
  return out;
}

void SetHeader(std::vector<char>& bytes, int field, int32_t value) {
  std::memcpy(bytes.data() + 4 * field, &value, 4);
}

TEST(Llama2c, BadFilesNameTheFieldOrWeight) {
  const std::string good = TempPath("good.bin");
  ASSERT_TRUE(Model::Random(Small(true), 1)->SaveLlama2c(good).ok());
  struct Case {
    std::string path;
    const char* message;
  };
  const Case cases[] = {
      {Edited(good, "short.bin", [](std::vector<char>& b) { b.resize(20); }),
       "shorter than the 28-byte llama2.c header"},
      {Edited(good, "truncated.bin", [](std::vector<char>& b) { b.resize(b.size() / 2); }),
       "ends inside w1"},
      {Edited(good, "extra.bin", [](std::vector<char>& b) { b.resize(b.size() + 8); }),
       "8 bytes after the last weight"},
      {Edited(good, "heads.bin", [](std::vector<char>& b) { SetHeader(b, 3, 0); }),
       "n_heads = 0 must be > 0"},
      {Edited(good, "layers.bin", [](std::vector<char>& b) { SetHeader(b, 2, -1); }),
       "n_layers = -1 must be > 0"},
      {Edited(good, "headsize.bin", [](std::vector<char>& b) { SetHeader(b, 3, 4); }),
       "head size 32"},
      {Edited(good, "kvheads.bin", [](std::vector<char>& b) { SetHeader(b, 4, 3); }),
       "n_kv_heads = 3 does not divide n_heads = 2"},
      {Edited(good, "bigger.bin", [](std::vector<char>& b) { SetHeader(b, 2, 3); }), "ends inside"},
  };
  for (const Case& c : cases) {
    Result<Model> r = Model::LoadLlama2c(c.path);
    ASSERT_FALSE(r.ok()) << c.path;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.path;
    EXPECT_NE(r.status().message().find(c.message), std::string::npos)
        << c.path << ": " << r.status();
  }
  EXPECT_EQ(Model::LoadLlama2c(TempPath("missing.bin")).status().code(), StatusCode::kNotFound);
}

TEST(Llama2c, VocabSizeOfMinusTwoToTheThirtyOneIsNamed) {
  // |INT32_MIN| does not fit an int32; it was reported as vocab_size 0.
  const std::string good = TempPath("vocab_good.bin");
  ASSERT_TRUE(Model::Random(Small(true), 1)->SaveLlama2c(good).ok());
  const std::string bad = Edited(good, "vocab_min.bin", [](std::vector<char>& b) {
    SetHeader(b, 5, std::numeric_limits<int32_t>::min());
  });
  Result<Model> r = Model::LoadLlama2c(bad);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("vocab_size = -2147483648 is out of range"),
            std::string::npos)
      << r.status();
}

TEST(Llama2c, DirectoryIsNamedAsADirectory) {
  Result<Model> r = Model::LoadLlama2c(testing::TempDir());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("Is a directory"), std::string::npos) << r.status();
}

TEST(Llama2c, NonFiniteWeightsAreRefusedByName) {
  const std::string good = TempPath("finite.bin");
  ASSERT_TRUE(Model::Random(Small(true), 1)->SaveLlama2c(good).ok());
  // The first float of wq (after the 28-byte header, token_embedding and rms_att).
  const ModelConfig c = Small(true);
  const size_t wq = 28 + 4 * (size_t{40} * c.dim + size_t{2} * c.dim);
  for (const float bad : {NAN, INFINITY}) {
    const std::string path = Edited(
        good, "nonfinite.bin", [&](std::vector<char>& b) { std::memcpy(b.data() + wq, &bad, 4); });
    Result<Model> r = Model::LoadLlama2c(path);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("weight wq holds"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("at float 0: a checkpoint's weights must be finite"),
              std::string::npos)
        << r.status();
  }
}

TEST(Model, ConfigValidationNamesTheField) {
  ModelConfig c = Small(true);
  c.dim = 100;  // head size 50
  EXPECT_EQ(c.Validate().code(), StatusCode::kInvalidArgument);
  c = Small(true);
  c.vocab_size = 0;
  EXPECT_NE(c.Validate().message().find("vocab_size"), std::string::npos);
  const std::array<int32_t, 1> bad = {40};  // vocab 40
  const Model model = *Model::Random(Small(true), 1);
  DenseAttentionBackend dense(model.config(), 4);
  std::vector<float> logits(40);
  const std::array<int64_t, 1> row = {0};
  EXPECT_EQ(model.Forward(bad, dense, row, logits).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace blockkv::tool
