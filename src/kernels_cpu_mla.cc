// SPDX-License-Identifier: Apache-2.0
// CPU backend of kernels.h's MLA kernels: MlaAppendKV (a copy of each new token's latent and
// rotary rows into its slot) and MlaPagedAttention in the absorbed form, Highway SIMD chosen at
// run time (HWY_DYNAMIC_DISPATCH, as kernels_cpu.cc).
//
// Implementation notes (attention). A cache row [c_kv | k_pe] serves as both key and value: the
// score of a query row [q_nope | q_pe] (times the scale) is one dot product over L + R elements,
// and the value is the row's first L elements. Every head of a token reads the same rows, so a
// work item is (sequence, chunk of tokens, chunk of heads) with up to kMaxRows rows (token ×
// head), and each tile of kTile key positions is converted to fp32 once per item (gathered across
// block boundaries through the sequence's table) into a buffer whose rows are padded with zeros to
// a multiple of kPad floats, as are the queries and accumulators: the SIMD loops need no tails.
// Per tile: scores of kRowBlock rows against two keys at a time (each key vector loaded once for
// the rows, each query vector once for the two keys), the online softmax of FlashAttention per
// row (m, l, acc · e^(m − m'), Highway's Exp over the tile), then acc += p · c_kv with kRowBlock
// rows' accumulators of two column vectors held in registers while the keys stream by. Measured
// in docs/benchmarks.md ("MLA decode"): together 379 -> 246 ms at 16 heads. With H heads, a
// key costs H · (2L + R) multiply-adds against 2(L + R) bytes (bf16) read: decode is compute-bound
// from a few heads on, unlike dense attention's K/V streaming.
#ifndef BLOCKKV_KERNELS_CPU_MLA_SHARED_
#define BLOCKKV_KERNELS_CPU_MLA_SHARED_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "internal/kernels_backend.h"
#include "internal/kernels_cpu_util.h"
#include "internal/paged_view.h"

namespace blockkv::internal::cpu::mla {

inline constexpr int32_t kTile = 32;     // key positions per softmax step
inline constexpr int32_t kMaxRows = 32;  // (token, head) rows per work item
inline constexpr int32_t kRowBlock = 4;  // rows computed together against each key vector
inline constexpr int32_t kPad = 16;      // floats: the widest vector (AVX-512) divides every row

inline int32_t Padded(int32_t n) { return (n + kPad - 1) / kPad * kPad; }

// Tokens [q_begin, q_end) of sequence `seq`, heads [h_begin, h_end). Row r of its scratch: token
// q_begin + r / heads, head h_begin + r % heads.
struct Item {
  int32_t seq = 0;
  int32_t q_begin = 0;
  int32_t q_end = 0;
  int32_t h_begin = 0;
  int32_t h_end = 0;
};

// One thread's buffers, sized once per call (dp = Padded(L + R), lp = Padded(L)).
struct Scratch {
  std::vector<float> q;        // [kMaxRows, dp] [q_nope | q_pe] · scale, zero-padded
  std::vector<float> acc;      // [kMaxRows, lp] unnormalized outputs
  std::vector<float> kv;       // [kTile, dp] the tile's cache rows in fp32, zero-padded
  std::vector<float> scores;   // [kMaxRows, kTile] scores, then probabilities
  std::vector<float> m;        // [kMaxRows] running maxima
  std::vector<float> l;        // [kMaxRows] running sums
  std::vector<int64_t> limit;  // [kMaxRows] a row sees key positions < limit

  void Resize(int32_t dp, int32_t lp) {
    q.assign(static_cast<size_t>(kMaxRows) * dp, 0.0f);
    acc.assign(static_cast<size_t>(kMaxRows) * lp, 0.0f);
    kv.assign(static_cast<size_t>(kTile) * dp, 0.0f);
    scores.assign(static_cast<size_t>(kMaxRows) * kTile, 0.0f);
    m.resize(kMaxRows);
    l.resize(kMaxRows);
    limit.resize(kMaxRows);
  }
};

}  // namespace blockkv::internal::cpu::mla

#endif  // BLOCKKV_KERNELS_CPU_MLA_SHARED_

// Highway: this file is compiled once per target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels_cpu_mla.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target.h must come first.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace blockkv::internal::cpu::mla::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// dst[0, n) = the n elements of `dtype` at src, as float.
void RowToFloat(const void* src, DType dtype, int32_t n, float* dst) {
  const DF df;
  const auto lanes = static_cast<int32_t>(hn::Lanes(df));
  int32_t i = 0;
  if (dtype == DType::kBFloat16) {
    const hn::Rebind<hwy::bfloat16_t, DF> dbf;
    const auto* p = static_cast<const hwy::bfloat16_t*>(src);
    for (; i + lanes <= n; i += lanes)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(dbf, p + i)), df, dst + i);
  } else if (dtype == DType::kFloat16) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto* p = static_cast<const hwy::float16_t*>(src);
    for (; i + lanes <= n; i += lanes)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, p + i)), df, dst + i);
  }
  if (i < n) ToFloat(ElementPtr(src, i, dtype), dtype, n - i, 1.0f, dst + i);
}

// Loads the item's query rows (times the scale), the keys each sees, and clears m, l, acc.
void LoadQueries(const PagedKV& c, const Activations& q_nope, const Activations& q_pe,
                 int32_t latent, const AttentionParams& p, const Item& item, int32_t dp, int32_t lp,
                 Scratch& s) {
  const int32_t rope = c.head_size - latent;
  const int32_t heads = item.h_end - item.h_begin;
  const int32_t rows = heads * (item.q_end - item.q_begin);
  const int64_t start = c.Start(item.seq);
  const int64_t seen = c.Seen(item.seq);
  for (int32_t r = 0; r < rows; ++r) {
    const int64_t token = start + item.q_begin + r / heads;
    const int64_t head = item.h_begin + r % heads;
    float* q = s.q.data() + int64_t{r} * dp;
    RowToFloat(ElementPtr(q_nope.data, token * q_nope.token_stride + head * q_nope.head_stride,
                          q_nope.dtype),
               q_nope.dtype, latent, q);
    if (rope > 0) {
      RowToFloat(
          ElementPtr(q_pe.data, token * q_pe.token_stride + head * q_pe.head_stride, q_pe.dtype),
          q_pe.dtype, rope, q + latent);
    }
    for (int32_t i = 0; i < c.head_size; ++i) q[i] *= p.scale;  // [d, dp) stays 0
    s.m[static_cast<size_t>(r)] = -std::numeric_limits<float>::infinity();
    s.l[static_cast<size_t>(r)] = 0.0f;
    s.limit[static_cast<size_t>(r)] =
        p.causal ? seen + item.q_begin + r / heads + 1 : c.Length(item.seq);
  }
  std::fill_n(s.acc.begin(), static_cast<size_t>(rows) * lp, 0.0f);
}

// The tile's cache rows [k0, k0 + count) of the item's sequence, in fp32, into s.kv.
void GatherTile(const PagedKV& c, int32_t seq, int64_t k0, int32_t count, int32_t dp, Scratch& s) {
  const int32_t* blocks = c.Blocks(seq);
  for (int32_t j = 0; j < count; ++j) {
    const int64_t pos = k0 + j;
    const int64_t at = c.Offset(blocks[pos / c.block_size], pos % c.block_size, 0, 0);
    RowToFloat(ElementPtr(c.data, at, c.dtype), c.dtype, c.head_size,
               s.kv.data() + int64_t{j} * dp);
  }
}

// scores[r, j] = q_r · kv_j for rows [r0, r0 + RB) and keys [0, count), two keys at a time: each
// query vector loaded serves two keys and each key vector RB rows (RB · 2 sums in flight).
template <int RB>
HWY_INLINE void BlockScores(const Scratch& s, int32_t r0, int32_t count, int32_t dp,
                            float* scores) {
  const DF df;
  const auto n = static_cast<int32_t>(hn::Lanes(df));
  const float* q = s.q.data() + int64_t{r0} * dp;
  int32_t j = 0;
  for (; j + 2 <= count; j += 2) {
    const float* k0 = s.kv.data() + int64_t{j} * dp;
    const float* k1 = k0 + dp;
    VF a[RB];
    VF b[RB];
    for (int32_t r = 0; r < RB; ++r) a[r] = b[r] = hn::Zero(df);
    for (int32_t i = 0; i < dp; i += n) {
      const VF x0 = hn::LoadU(df, k0 + i);
      const VF x1 = hn::LoadU(df, k1 + i);
      for (int32_t r = 0; r < RB; ++r) {
        const VF qv = hn::LoadU(df, q + int64_t{r} * dp + i);
        a[r] = hn::MulAdd(qv, x0, a[r]);
        b[r] = hn::MulAdd(qv, x1, b[r]);
      }
    }
    for (int32_t r = 0; r < RB; ++r) {
      scores[int64_t{r0 + r} * kTile + j] = hn::GetLane(hn::SumOfLanes(df, a[r]));
      scores[int64_t{r0 + r} * kTile + j + 1] = hn::GetLane(hn::SumOfLanes(df, b[r]));
    }
  }
  if (j < count) {
    const float* k = s.kv.data() + int64_t{j} * dp;
    VF a[RB];
    for (VF& x : a) x = hn::Zero(df);
    for (int32_t i = 0; i < dp; i += n) {
      const VF kv = hn::LoadU(df, k + i);
      for (int32_t r = 0; r < RB; ++r) {
        a[r] = hn::MulAdd(hn::LoadU(df, q + int64_t{r} * dp + i), kv, a[r]);
      }
    }
    for (int32_t r = 0; r < RB; ++r) {
      scores[int64_t{r0 + r} * kTile + j] = hn::GetLane(hn::SumOfLanes(df, a[r]));
    }
  }
}

// acc[r, 0:lp) += Σ_j p[r, j] · kv_j[0:lp) for rows [r0, r0 + RB): two column vectors of the RB
// rows stay in registers while the keys stream by (each probability broadcast serves both).
template <int RB>
HWY_INLINE void BlockValues(Scratch& s, int32_t r0, int32_t count, int32_t dp, int32_t lp) {
  const DF df;
  const auto n = static_cast<int32_t>(hn::Lanes(df));
  float* acc = s.acc.data() + int64_t{r0} * lp;
  const float* p = s.scores.data() + int64_t{r0} * kTile;
  int32_t i = 0;
  for (; i + 2 * n <= lp; i += 2 * n) {
    VF a[RB];
    VF b[RB];
    for (int32_t r = 0; r < RB; ++r) {
      a[r] = hn::LoadU(df, acc + int64_t{r} * lp + i);
      b[r] = hn::LoadU(df, acc + int64_t{r} * lp + i + n);
    }
    for (int32_t j = 0; j < count; ++j) {
      const float* v = s.kv.data() + int64_t{j} * dp + i;
      const VF v0 = hn::LoadU(df, v);
      const VF v1 = hn::LoadU(df, v + n);
      for (int32_t r = 0; r < RB; ++r) {
        const VF pr = hn::Set(df, p[int64_t{r} * kTile + j]);
        a[r] = hn::MulAdd(pr, v0, a[r]);
        b[r] = hn::MulAdd(pr, v1, b[r]);
      }
    }
    for (int32_t r = 0; r < RB; ++r) {
      hn::StoreU(a[r], df, acc + int64_t{r} * lp + i);
      hn::StoreU(b[r], df, acc + int64_t{r} * lp + i + n);
    }
  }
  for (; i < lp; i += n) {
    VF a[RB];
    for (int32_t r = 0; r < RB; ++r) a[r] = hn::LoadU(df, acc + int64_t{r} * lp + i);
    for (int32_t j = 0; j < count; ++j) {
      const VF v = hn::LoadU(df, s.kv.data() + int64_t{j} * dp + i);
      for (int32_t r = 0; r < RB; ++r) {
        a[r] = hn::MulAdd(hn::Set(df, p[int64_t{r} * kTile + j]), v, a[r]);
      }
    }
    for (int32_t r = 0; r < RB; ++r) hn::StoreU(a[r], df, acc + int64_t{r} * lp + i);
  }
}

template <class Fn>
HWY_INLINE void ForRowBlocks(int32_t rows, Fn fn) {
  int32_t r0 = 0;
  for (; r0 + kRowBlock <= rows; r0 += kRowBlock) fn(r0, std::integral_constant<int, kRowBlock>());
  switch (rows - r0) {
    case 3:
      fn(r0, std::integral_constant<int, 3>());
      break;
    case 2:
      fn(r0, std::integral_constant<int, 2>());
      break;
    case 1:
      fn(r0, std::integral_constant<int, 1>());
      break;
    default:
      break;
  }
}

// The online-softmax step of row r over keys [k0, k0 + count): probabilities in place (0 past
// what the row sees), m and l updated, acc rescaled. SIMD over the tile (Highway's Exp), as
// kernels_cpu.cc's SoftmaxStep: one exp per row and key is a sizeable part of a tile's work.
void SoftmaxRow(Scratch& s, int32_t r, int64_t k0, int32_t count, int32_t lp) {
  const DF df;
  const auto n = static_cast<int32_t>(hn::Lanes(df));
  float* sc = s.scores.data() + int64_t{r} * kTile;
  const auto at = static_cast<size_t>(r);
  const auto seen = static_cast<int32_t>(std::clamp<int64_t>(s.limit[at] - k0, 0, count));
  if (seen == 0) {  // no key of this tile: weights 0, nothing changes
    std::fill_n(sc, count, 0.0f);
    return;
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::fill(sc + seen, sc + kTile, kNegInf);  // unseen keys, and the tile's unused tail
  const VF neg_inf = hn::Set(df, kNegInf);
  VF tile_max = neg_inf;
  for (int32_t j = 0; j < kTile; j += n) tile_max = hn::Max(tile_max, hn::LoadU(df, sc + j));
  const float m_new = std::max(s.m[at], hn::GetLane(hn::MaxOfLanes(df, tile_max)));
  const float alpha = std::exp(s.m[at] - m_new);  // 0 on the first tile (m = -inf)
  const VF vm = hn::Set(df, m_new);
  const VF floor = hn::Set(df, -87.0f);  // exp stays normal; masked lanes are zeroed below
  VF sum = hn::Zero(df);
  for (int32_t j = 0; j < kTile; j += n) {
    const VF x = hn::LoadU(df, sc + j);
    const VF p =
        hn::IfThenElseZero(hn::Gt(x, neg_inf), hn::Exp(df, hn::Max(hn::Sub(x, vm), floor)));
    hn::StoreU(p, df, sc + j);
    sum = hn::Add(sum, p);
  }
  s.l[at] = s.l[at] * alpha + hn::GetLane(hn::SumOfLanes(df, sum));
  s.m[at] = m_new;
  if (alpha != 1.0f) {
    float* acc = s.acc.data() + int64_t{r} * lp;
    const VF va = hn::Set(df, alpha);
    for (int32_t i = 0; i < lp; i += n)
      hn::StoreU(hn::Mul(hn::LoadU(df, acc + i), va), df, acc + i);
  }
}

void AttendItem(const PagedKV& c, const Activations& q_nope, const Activations& q_pe,
                const Activations& out, int32_t latent, const AttentionParams& p, const Item& item,
                Scratch& s) {
  const int32_t dp = Padded(c.head_size);
  const int32_t lp = Padded(latent);
  const int32_t heads = item.h_end - item.h_begin;
  const int32_t rows = heads * (item.q_end - item.q_begin);
  LoadQueries(c, q_nope, q_pe, latent, p, item, dp, lp, s);
  const int64_t end = p.causal ? c.Seen(item.seq) + item.q_end : c.Length(item.seq);
  for (int64_t k0 = 0; k0 < end; k0 += kTile) {
    const auto count = static_cast<int32_t>(std::min<int64_t>(kTile, end - k0));
    GatherTile(c, item.seq, k0, count, dp, s);
    ForRowBlocks(rows, [&](int32_t r0, auto rb) {
      BlockScores<decltype(rb)::value>(s, r0, count, dp, s.scores.data());
    });
    for (int32_t r = 0; r < rows; ++r) SoftmaxRow(s, r, k0, count, lp);
    ForRowBlocks(
        rows, [&](int32_t r0, auto rb) { BlockValues<decltype(rb)::value>(s, r0, count, dp, lp); });
  }
  const int64_t start = c.Start(item.seq);
  for (int32_t r = 0; r < rows; ++r) {
    const int64_t token = start + item.q_begin + r / heads;
    const int64_t head = item.h_begin + r % heads;
    float* acc = s.acc.data() + int64_t{r} * lp;
    const float inv = 1.0f / s.l[static_cast<size_t>(r)];
    for (int32_t i = 0; i < latent; ++i) acc[i] *= inv;
    FromFloat(acc, latent, out.dtype, 1.0f,
              const_cast<uint8_t*>(ElementPtr(
                  out.data, token * out.token_stride + head * out.head_stride, out.dtype)));
  }
}

}  // namespace blockkv::internal::cpu::mla::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace blockkv::internal {
namespace cpu::mla {

HWY_EXPORT(AttendItem);

// Items of up to kMaxRows rows: all heads of a token together when they fit, several tokens of
// a sequence when few heads do; head ranges halved (down to kRowBlock heads) while there are
// fewer than two items per thread. *work: multiply-adds, roughly.
std::vector<Item> MakeItems(const PagedKV& c, int32_t num_heads, int32_t latent, int threads,
                            int64_t* work) {
  int32_t heads_per_item = std::min(num_heads, kMaxRows);
  auto build = [&](int32_t hpi) {
    const int32_t tokens_per_item = std::max(1, kMaxRows / hpi);
    std::vector<Item> items;
    for (int32_t i = 0; i < c.num_seqs; ++i) {
      for (int32_t t = 0; t < c.Tokens(i); t += tokens_per_item) {
        for (int32_t h = 0; h < num_heads; h += hpi) {
          items.push_back({.seq = i,
                           .q_begin = t,
                           .q_end = std::min(c.Tokens(i), t + tokens_per_item),
                           .h_begin = h,
                           .h_end = std::min(num_heads, h + hpi)});
        }
      }
    }
    return items;
  };
  std::vector<Item> items = build(heads_per_item);
  while (std::ssize(items) < 2 * int64_t{threads} && heads_per_item > kRowBlock) {
    heads_per_item = std::max(kRowBlock, (heads_per_item + 1) / 2);
    items = build(heads_per_item);
  }
  *work = 0;
  for (int32_t i = 0; i < c.num_seqs; ++i) {
    *work += int64_t{c.Tokens(i)} * c.Length(i) * num_heads * (c.head_size + latent);
  }
  return items;
}

}  // namespace cpu::mla

void MlaAppendCpu(const PagedKV& cache, const Activations& c_kv, const Activations& k_pe,
                  int32_t latent_dim, int num_threads) {
  const int32_t rope = cache.head_size - latent_dim;
  const auto elem = static_cast<int64_t>(ElementSize(cache.dtype));
  cpu::ParallelFor(
      cache.num_seqs, num_threads, int64_t{cache.num_tokens} * cache.head_size,
      [&](int64_t seq, int /*thread*/) {
        const auto i = static_cast<int32_t>(seq);
        for (int32_t j = 0; j < cache.Tokens(i); ++j) {
          const int64_t row = int64_t{cache.Start(i)} + j;
          const int64_t pos = cache.Seen(i) + j;
          const int64_t at =
              cache.Offset(cache.Blocks(i)[pos / cache.block_size], pos % cache.block_size, 0, 0);
          auto* dst = static_cast<uint8_t*>(cache.data) + at * elem;
          std::memcpy(dst, cpu::ElementPtr(c_kv.data, row * c_kv.token_stride, c_kv.dtype),
                      static_cast<size_t>(latent_dim * elem));
          if (rope > 0) {
            std::memcpy(dst + latent_dim * elem,
                        cpu::ElementPtr(k_pe.data, row * k_pe.token_stride, k_pe.dtype),
                        static_cast<size_t>(rope * elem));
          }
        }
      });
}

void MlaAttentionCpu(const PagedKV& cache, const Activations& q_nope, const Activations& q_pe,
                     const Activations& out, int32_t latent_dim, const AttentionParams& params) {
  int64_t work = 0;
  const std::vector<cpu::mla::Item> items =
      cpu::mla::MakeItems(cache, q_nope.num_heads, latent_dim, params.num_threads, &work);
  const int32_t dp = cpu::mla::Padded(cache.head_size);
  const int32_t lp = cpu::mla::Padded(latent_dim);
  std::vector<cpu::mla::Scratch> scratch(static_cast<size_t>(std::max(1, params.num_threads)));
  cpu::ParallelFor(std::ssize(items), params.num_threads, work, [&](int64_t index, int thread) {
    cpu::mla::Scratch& s = scratch[static_cast<size_t>(thread)];
    if (s.q.empty()) s.Resize(dp, lp);
    HWY_DYNAMIC_DISPATCH(cpu::mla::AttendItem)
    (cache, q_nope, q_pe, out, latent_dim, params, items[static_cast<size_t>(index)], s);
  });
}

}  // namespace blockkv::internal
#endif  // HWY_ONCE
