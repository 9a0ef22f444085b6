// SPDX-License-Identifier: Apache-2.0
// llama2.c checkpoints (github.com/karpathy/llama2.c, run.c's float32 "version 0" model.bin):
// seven int32 header fields, then every weight as float32 in run.c's memory_map_weights order:
//   token_embedding [vocab, dim], rms_att [L, dim], wq [L, dim, dim], wk [L, kv_dim, dim],
//   wv [L, kv_dim, dim], wo [L, dim, dim], rms_ffn [L, dim], w1 [L, hidden, dim],
//   w2 [L, dim, hidden], w3 [L, hidden, dim], rms_final [dim],
//   freq_cis_real and freq_cis_imag [seq_len, head_size / 2] (unused: RoPE is recomputed),
//   wcls [vocab, dim] only when the header's vocab_size is negative (an unshared classifier).
// The file's length must be exactly what the header implies.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include "json.h"
#include "model.h"

namespace blockkv::tool {
namespace {

// Row permutation of one projection: per head, interleaved pairs (2i, 2i + 1) become rotate-half
// positions (i, i + D/2). `to_half` = false is the inverse.
void PermuteRotary(std::vector<float>& w, int64_t heads, int64_t head_size, int64_t in,
                   bool to_half) {
  std::vector<float> out(w.size());
  const int64_t half = head_size / 2;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      for (const int64_t part : {int64_t{0}, int64_t{1}}) {
        const int64_t interleaved = h * head_size + 2 * i + part;
        const int64_t halves = h * head_size + i + part * half;
        const int64_t from = to_half ? interleaved : halves;
        const int64_t to = to_half ? halves : interleaved;
        std::copy_n(w.data() + from * in, in, out.data() + to * in);
      }
    }
  }
  w = std::move(out);
}

// The weights in file order, for reading and writing alike.
template <class Visit>
void ForEachWeight(std::vector<float>& embedding, auto& layers, std::vector<float>& rms_final,
                   Visit&& visit) {
  visit("token_embedding", embedding);
  for (auto& l : layers) visit("rms_att", l.rms_att);
  for (auto& l : layers) visit("wq", l.wq);
  for (auto& l : layers) visit("wk", l.wk);
  for (auto& l : layers) visit("wv", l.wv);
  for (auto& l : layers) visit("wo", l.wo);
  for (auto& l : layers) visit("rms_ffn", l.rms_ffn);
  for (auto& l : layers) visit("w1", l.w1);
  for (auto& l : layers) visit("w2", l.w2);
  for (auto& l : layers) visit("w3", l.w3);
  visit("rms_final", rms_final);
}

}  // namespace

Result<Model> Model::LoadLlama2c(const std::string& path) {
  {
    // A directory, a missing file or one without read permission, each named for what it is.
    BLOCKKV_ASSIGN_OR_RETURN(std::FILE * file, OpenInputFile(path));
    std::fclose(file);
  }
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return FileError("cannot open", path, errno);
  const std::streamoff size = in.tellg();
  in.seekg(0);
  constexpr int64_t kHeaderBytes = int64_t{7} * 4;
  if (size < kHeaderBytes) {
    return InvalidArgumentError(path + ": " + std::to_string(size) +
                                " bytes, shorter than the 28-byte llama2.c header");
  }
  int32_t header[7];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  ModelConfig config;
  config.dim = header[0];
  config.hidden_dim = header[1];
  config.n_layers = header[2];
  config.n_heads = header[3];
  config.n_kv_heads = header[4];
  config.shared_classifier = header[5] > 0;
  if (header[5] == std::numeric_limits<int32_t>::min()) {
    // Its absolute value does not fit an int32: not a size any checkpoint has.
    return InvalidArgumentError(path + ": header field vocab_size = -2147483648 is out of range");
  }
  config.vocab_size = std::abs(header[5]);
  config.seq_len = header[6];
  if (Status s = config.Validate(); !s.ok()) {
    return InvalidArgumentError(path + ": header field " + s.message());
  }
  // Sizes in floats, checked against the file before anything is allocated.
  const int64_t dim = config.dim, kv_dim = config.kv_dim(), hidden = config.hidden_dim;
  const int64_t layers = config.n_layers, vocab = config.vocab_size;
  const int64_t freq = int64_t{config.seq_len} * (config.head_size() / 2);
  struct Part {
    const char* name;
    long double floats;
  };
  const Part parts[] = {
      {"token_embedding", static_cast<long double>(vocab) * dim},
      {"rms_att", static_cast<long double>(layers) * dim},
      {"wq", static_cast<long double>(layers) * dim * dim},
      {"wk", static_cast<long double>(layers) * kv_dim * dim},
      {"wv", static_cast<long double>(layers) * kv_dim * dim},
      {"wo", static_cast<long double>(layers) * dim * dim},
      {"rms_ffn", static_cast<long double>(layers) * dim},
      {"w1", static_cast<long double>(layers) * hidden * dim},
      {"w2", static_cast<long double>(layers) * dim * hidden},
      {"w3", static_cast<long double>(layers) * hidden * dim},
      {"rms_final", static_cast<long double>(dim)},
      {"freq_cis_real", static_cast<long double>(freq)},
      {"freq_cis_imag", static_cast<long double>(freq)},
      {"wcls", config.shared_classifier ? 0.0L : static_cast<long double>(vocab) * dim},
  };
  long double end = kHeaderBytes;
  for (const Part& part : parts) {
    end += 4 * part.floats;
    if (end > static_cast<long double>(size)) {
      return InvalidArgumentError(
          path + ": the file (" + std::to_string(size) + " bytes) ends inside " + part.name +
          ", which the header (dim " + std::to_string(dim) + ", hidden_dim " +
          std::to_string(hidden) + ", n_layers " + std::to_string(layers) + ", n_heads " +
          std::to_string(config.n_heads) + ", n_kv_heads " + std::to_string(config.n_kv_heads) +
          ", vocab_size " + std::to_string(header[5]) + ", seq_len " +
          std::to_string(config.seq_len) + ") puts past it");
    }
  }
  if (end != static_cast<long double>(size)) {
    return InvalidArgumentError(path + ": " + std::to_string(size - static_cast<int64_t>(end)) +
                                " bytes after the last weight (" +
                                (config.shared_classifier ? "freq_cis_imag" : "wcls") +
                                "): the header does not describe this file");
  }

  Model model(config);
  Status status;
  const auto read = [&](const char* name, std::vector<float>& w) {
    if (!status.ok()) return;
    in.read(reinterpret_cast<char*>(w.data()), static_cast<std::streamsize>(w.size() * 4));
    if (!in) {
      status = DataLossError(path + ": read error in " + name);
      return;
    }
    // A NaN or infinite weight makes every logit after it meaningless: refuse it here, by name.
    const auto bad = std::find_if(w.begin(), w.end(), [](float x) { return !std::isfinite(x); });
    if (bad != w.end()) {
      status = InvalidArgumentError(path + ": weight " + name + " holds " + std::to_string(*bad) +
                                    " at float " + std::to_string(bad - w.begin()) +
                                    ": a checkpoint's weights must be finite");
    }
  };
  ForEachWeight(model.embedding_, model.layers_, model.rms_final_, read);
  in.seekg(2 * freq * 4, std::ios::cur);
  if (!config.shared_classifier) read("wcls", model.classifier_);
  BLOCKKV_RETURN_IF_ERROR(status);
  for (Layer& l : model.layers_) {
    PermuteRotary(l.wq, config.n_heads, config.head_size(), dim, /*to_half=*/true);
    PermuteRotary(l.wk, config.n_kv_heads, config.head_size(), dim, /*to_half=*/true);
  }
  return model;
}

Status Model::SaveLlama2c(const std::string& path) const {
  Model copy = *this;
  for (Layer& l : copy.layers_) {
    PermuteRotary(l.wq, config_.n_heads, config_.head_size(), config_.dim, /*to_half=*/false);
    PermuteRotary(l.wk, config_.n_kv_heads, config_.head_size(), config_.dim, /*to_half=*/false);
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return InternalError("cannot write " + path + ": " + std::strerror(errno));
  const int32_t header[7] = {
      config_.dim,        config_.hidden_dim,
      config_.n_layers,   config_.n_heads,
      config_.n_kv_heads, config_.shared_classifier ? config_.vocab_size : -config_.vocab_size,
      config_.seq_len};
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  const auto write = [&](const char*, std::vector<float>& w) {
    out.write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(w.size() * 4));
  };
  ForEachWeight(copy.embedding_, copy.layers_, copy.rms_final_, write);
  // freq_cis_real, freq_cis_imag: cos and sin of position · 10000^(−2i / head_size), as
  // llama2.c's export wrote them.
  const int32_t half = config_.head_size() / 2;
  for (const bool imag : {false, true}) {
    std::vector<float> table(static_cast<size_t>(config_.seq_len) * half);
    for (int32_t p = 0; p < config_.seq_len; ++p) {
      for (int32_t i = 0; i < half; ++i) {
        const double angle = p * std::pow(10000.0, -2.0 * i / config_.head_size());
        table[static_cast<size_t>(p) * half + i] =
            static_cast<float>(imag ? std::sin(angle) : std::cos(angle));
      }
    }
    write("freq_cis", table);
  }
  if (!config_.shared_classifier) write("wcls", copy.classifier_);
  out.close();
  if (!out) return InternalError("cannot write " + path + ": " + std::strerror(errno));
  return Status::Ok();
}

}  // namespace blockkv::tool
