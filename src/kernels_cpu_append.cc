// SPDX-License-Identifier: Apache-2.0
// CPU backend of kernels.h's AppendKV: scalar, since it moves a few rows per token (K and V of
// each KV head, and Q's heads when rotary rotates them in place); the rotary cos/sin of a token
// are computed once, in double, for all of its heads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "internal/kernels_backend.h"
#include "internal/kernels_cpu_util.h"
#include "internal/paged_view.h"

namespace blockkv::internal {
namespace cpu {
namespace {

// Rotates row x[0, d) in place by the rotate-half rule, with cos/sin of each pair given.
void Rotate(float* x, int32_t half, const float* cos, const float* sin) {
  for (int32_t i = 0; i < half; ++i) {
    const float x1 = x[i];
    const float x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// One token of AppendKV: K (rotated) and V to their slot, Q rotated in place.
void AppendToken(const PagedKV& c, const Activations& k, const Activations& v, const Activations* q,
                 const RotaryParams& rotary, int32_t seq, int32_t j, std::vector<float>& row) {
  const int64_t token = int64_t{c.Start(seq)} + j;
  const int64_t pos = c.Seen(seq) + j;
  const int64_t block = c.Blocks(seq)[pos / c.block_size];
  const int32_t d = c.head_size;
  const int32_t half = rotary.rotary_dim / 2;
  float* x = row.data();
  float* cos = row.data() + d;
  float* sin = cos + half;
  if (rotary.enabled) {
    for (int32_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(pos) * std::pow(rotary.theta, -2.0 * i / rotary.rotary_dim);
      cos[i] = static_cast<float>(std::cos(angle));
      sin[i] = static_cast<float>(std::sin(angle));
    }
  }
  for (int32_t h = 0; h < c.num_kv_heads; ++h) {
    const int64_t slot = c.Offset(block, pos % c.block_size, 0, h);
    ToFloat(ElementPtr(k.data, token * k.token_stride + h * k.head_stride, k.dtype), k.dtype, d,
            1.0f, x);
    if (rotary.enabled) Rotate(x, half, cos, sin);
    FromFloat(x, d, c.dtype, c.kv_scale, const_cast<uint8_t*>(ElementPtr(c.data, slot, c.dtype)));
    ToFloat(ElementPtr(v.data, token * v.token_stride + h * v.head_stride, v.dtype), v.dtype, d,
            1.0f, x);
    FromFloat(x, d, c.dtype, c.kv_scale,
              const_cast<uint8_t*>(ElementPtr(c.data, slot + c.plane_stride, c.dtype)));
  }
  if (q == nullptr) return;
  for (int32_t h = 0; h < q->num_heads; ++h) {
    auto* at = const_cast<uint8_t*>(
        ElementPtr(q->data, token * q->token_stride + h * q->head_stride, q->dtype));
    ToFloat(at, q->dtype, d, 1.0f, x);
    Rotate(x, half, cos, sin);
    FromFloat(x, d, q->dtype, 1.0f, at);
  }
}

}  // namespace
}  // namespace cpu

void AppendKVCpu(const PagedKV& cache, const Activations& k, const Activations& v,
                 const Activations* q, const RotaryParams& rotary, int num_threads) {
  // One item per sequence and chunk of its tokens.
  constexpr int32_t kChunk = 64;
  struct Chunk {
    int32_t seq, begin, end;
  };
  std::vector<Chunk> chunks;
  for (int32_t i = 0; i < cache.num_seqs; ++i) {
    const int32_t n = cache.Tokens(i);
    for (int32_t b = 0; b < n; b += kChunk) chunks.push_back({i, b, std::min(n, b + kChunk)});
  }
  const int64_t heads = cache.num_kv_heads * 2 + (q != nullptr ? q->num_heads : 0);
  const int64_t work =
      int64_t{cache.num_tokens} * heads * cache.head_size * (rotary.enabled ? 4 : 1);
  std::vector<std::vector<float>> rows(static_cast<size_t>(std::max(1, num_threads)));
  cpu::ParallelFor(std::ssize(chunks), num_threads, work, [&](int64_t index, int thread) {
    std::vector<float>& row = rows[static_cast<size_t>(thread)];
    row.resize(static_cast<size_t>(cache.head_size) * 2);
    const Chunk& chunk = chunks[static_cast<size_t>(index)];
    for (int32_t j = chunk.begin; j < chunk.end; ++j) {
      cpu::AppendToken(cache, k, v, q, rotary, chunk.seq, j, row);
    }
  });
}
}  // namespace blockkv::internal
