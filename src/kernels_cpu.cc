// CPU backend of kernels.h: AppendKV (scalar; it moves a few rows per token) and PagedAttention
// (Highway SIMD, compiled for every x86 target Highway knows and chosen at run time with
// HWY_DYNAMIC_DISPATCH: Debian's Highway 1.0.3 compiles static dispatch to its scalar target
// without -march, dynamic dispatch picks AVX-512 or AVX2 on the machine it runs on).
//
// Implementation notes (attention). One work item is (sequence, KV head, chunk of up to
// kMaxRows / G query tokens), G = Hq / Hkv: its rows are the chunk's tokens × the G query heads
// that share the KV head, so every key and value row read from the cache serves all of them.
// Keys are visited in tiles of kTile positions, gathered across block boundaries from the
// sequence's CSR table and converted to fp32 in a per-thread scratch (fp8 through the decode
// table, times kv_scale). For each tile: scores = q · kᵀ (queries prescaled), then the online
// softmax of FlashAttention: m' = max(m, max(scores)); acc = acc · e^(m − m') + Σ e^(s − m') · v;
// l likewise; out = acc / l at the end. Memory per thread: (kMaxRows + 2 · kTile) · D floats.
// Threads: a work-stealing loop over items (an atomic counter), the calling thread plus up to
// num_threads − 1 std::jthreads started per call when the work is large enough to pay for them.
#ifndef BLOCKKV_KERNELS_CPU_SHARED_
#define BLOCKKV_KERNELS_CPU_SHARED_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "internal/check.h"
#include "internal/float_convert.h"
#include "internal/kernels_backend.h"
#include "internal/paged_view.h"

namespace blockkv::internal::cpu {

inline constexpr int32_t kTile = 32;     // key positions per softmax step
inline constexpr int32_t kMaxRows = 64;  // query rows (tokens × query heads) per work item

// Query tokens [q_begin, q_end) of sequence `seq` for KV heads [kv_begin, kv_end) and their
// query heads. Row r of its scratch: token q_begin + r / (heads · G), KV head kv_begin +
// (r / G) % heads, query head (kv_begin + that) · G + r % G.
struct WorkItem {
  int32_t seq = 0;
  int32_t kv_begin = 0;
  int32_t kv_end = 0;
  int32_t q_begin = 0;
  int32_t q_end = 0;
};

// One thread's buffers, sized once per call.
struct Scratch {
  std::vector<float> q;        // [rows, D] queries times the softmax scale
  std::vector<float> acc;      // [rows, D] unnormalized outputs
  std::vector<float> m;        // [rows] running maxima
  std::vector<float> l;        // [rows] running sums
  std::vector<float> scores;   // [rows, kTile] scores, then probabilities
  std::vector<float> k;        // [kTile, D]
  std::vector<float> v;        // [kTile, D]
  std::vector<int64_t> slots;  // [kTile] cache offsets of the tile's positions (plane 0, head 0)
  std::vector<int64_t> next_slots;  // [kTile] the same for the next tile

  void Resize(int32_t rows, int32_t d) {
    const auto rd = static_cast<size_t>(rows) * static_cast<size_t>(d);
    const auto td = static_cast<size_t>(kTile) * static_cast<size_t>(d);
    q.resize(rd);
    acc.resize(rd);
    m.resize(static_cast<size_t>(rows));
    l.resize(static_cast<size_t>(rows));
    scores.resize(static_cast<size_t>(rows) * kTile);
    k.resize(td);
    v.resize(td);
    slots.resize(kTile);
    next_slots.resize(kTile);
  }
};

// Elements of `dtype` at `base + index` as bytes.
inline const uint8_t* ElementPtr(const void* base, int64_t index, DType dtype) {
  return static_cast<const uint8_t*>(base) + index * static_cast<int64_t>(ElementSize(dtype));
}

// Converts `n` elements of `dtype` to float (fp8 values times `scale`).
inline void ToFloat(const void* src, DType dtype, int32_t n, float scale, float* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kFloat16:
      for (int32_t i = 0; i < n; ++i) dst[i] = Fp16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::kBFloat16:
      for (int32_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::kFloat8E4M3:
      for (int32_t i = 0; i < n; ++i) {
        dst[i] = Fp8E4M3ToFloat(static_cast<const uint8_t*>(src)[i]) * scale;
      }
      return;
    default:
      BLOCKKV_CHECK(false, "unsupported dtype reached the CPU kernels");
  }
}

// Converts `n` floats to `dtype` (fp8: value / scale, saturating).
inline void FromFloat(const float* src, int32_t n, DType dtype, float scale, void* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kFloat16:
      for (int32_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToFp16(src[i]);
      return;
    case DType::kBFloat16:
      for (int32_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToBf16(src[i]);
      return;
    case DType::kFloat8E4M3:
      for (int32_t i = 0; i < n; ++i) {
        static_cast<uint8_t*>(dst)[i] = FloatToFp8E4M3(src[i] / scale);
      }
      return;
    default:
      BLOCKKV_CHECK(false, "unsupported dtype reached the CPU kernels");
  }
}

// Runs fn(item, thread) for item in [0, n_items) on up to `threads` threads (the caller's one
// included); one thread when `work` (a rough element count) is too small to pay for more.
inline void ParallelFor(int64_t n_items, int threads, int64_t work,
                        const std::function<void(int64_t, int)>& fn) {
  constexpr int64_t kWorkPerThread = int64_t{1} << 18;
  const int64_t useful = std::max<int64_t>(1, work / kWorkPerThread);
  const int n = static_cast<int>(std::min<int64_t>({threads, n_items, useful}));
  std::atomic<int64_t> next{0};
  auto run = [&](int thread) {
    for (int64_t item = next.fetch_add(1); item < n_items; item = next.fetch_add(1)) {
      fn(item, thread);
    }
  };
  if (n <= 1) {
    run(0);
    return;
  }
  std::vector<std::jthread> workers;
  workers.reserve(static_cast<size_t>(n - 1));
  for (int t = 1; t < n; ++t) workers.emplace_back(run, t);
  run(0);
}

}  // namespace blockkv::internal::cpu

#endif  // BLOCKKV_KERNELS_CPU_SHARED_

// Highway: this file is compiled once per target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels_cpu.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target.h must come first.
#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace blockkv::internal::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

// Converts one cache row of `d` elements to float at `dst`: SIMD for fp32/fp16/bf16.
void RowToFloat(const PagedKV& c, const void* src, float* dst) {
  const DF df;
  const int32_t d = c.head_size;
  const auto n = static_cast<int32_t>(hn::Lanes(df));
  if (c.dtype == DType::kBFloat16) {
    const hn::Rebind<hwy::bfloat16_t, DF> dbf;
    const auto* p = static_cast<const hwy::bfloat16_t*>(src);
    for (int32_t i = 0; i < d; i += n)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(dbf, p + i)), df, dst + i);
  } else if (c.dtype == DType::kFloat16) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto* p = static_cast<const hwy::float16_t*>(src);
    for (int32_t i = 0; i < d; i += n)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, p + i)), df, dst + i);
  } else {
    ToFloat(src, c.dtype, d, c.kv_scale, dst);
  }
}

// slots[j] = cache offset of key position k0 + j of sequence `seq` (plane 0, head 0).
void TileSlots(const PagedKV& c, int32_t seq, int64_t k0, int32_t count, int64_t* slots) {
  const int32_t* blocks = c.kv_indices + c.kv_indptr[seq];
  int64_t block = k0 / c.block_size;
  int64_t offset = k0 % c.block_size;
  for (int32_t j = 0; j < count; ++j) {
    slots[j] = c.Offset(blocks[block], offset, 0, 0);
    if (++offset == c.block_size) {
      offset = 0;
      ++block;
    }
  }
}

// Asks for the K and V rows of heads [h0, h1) where the tile's positions jump to another block
// (the first two positions there): within a block the rows are contiguous and the hardware
// prefetcher follows them, but it does not cross to the next block.
void PrefetchTile(const PagedKV& c, const int64_t* slots, int32_t count, int32_t h0, int32_t h1) {
  const auto elem = static_cast<int64_t>(ElementSize(c.dtype));
  const int64_t bytes = int64_t{h1 - h0} * c.head_stride * elem;
  for (int32_t j = 0; j < count; ++j) {
    const bool jump = j == 0 || slots[j] != slots[j - 1] + c.token_stride;
    const bool after_jump = j >= 1 && (j == 1 || slots[j - 1] != slots[j - 2] + c.token_stride);
    if (!jump && !after_jump) continue;
    const int64_t at = slots[j] + h0 * c.head_stride;
    const uint8_t* k = ElementPtr(c.data, at, c.dtype);
    const uint8_t* v = ElementPtr(c.data, at + c.plane_stride, c.dtype);
    for (int64_t b = 0; b < bytes; b += 64) {
      hwy::Prefetch(k + b);
      hwy::Prefetch(v + b);
    }
  }
}

// Converts the K / V rows of `head` at the tile's slots into s.k / s.v.
void GatherTile(const PagedKV& c, int32_t head, int32_t count, Scratch& s) {
  const int32_t d = c.head_size;
  for (int32_t j = 0; j < count; ++j) {
    const int64_t at = s.slots[static_cast<size_t>(j)] + head * c.head_stride;
    RowToFloat(c, ElementPtr(c.data, at, c.dtype), s.k.data() + int64_t{j} * d);
    RowToFloat(c, ElementPtr(c.data, at + c.plane_stride, c.dtype), s.v.data() + int64_t{j} * d);
  }
}

// scores[j] = q · k_j for j in [j0, j1), four keys at a time.
void Scores(const float* q, const float* k, int64_t d, int32_t j0, int32_t j1, float* scores) {
  const DF df;
  const auto n = static_cast<int64_t>(hn::Lanes(df));
  int32_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    const float* k0 = k + int64_t{j} * d;
    auto s0 = hn::Zero(df), s1 = hn::Zero(df), s2 = hn::Zero(df), s3 = hn::Zero(df);
    for (int64_t i = 0; i < d; i += n) {
      const auto qv = hn::LoadU(df, q + i);
      s0 = hn::MulAdd(qv, hn::LoadU(df, k0 + i), s0);
      s1 = hn::MulAdd(qv, hn::LoadU(df, k0 + d + i), s1);
      s2 = hn::MulAdd(qv, hn::LoadU(df, k0 + 2 * d + i), s2);
      s3 = hn::MulAdd(qv, hn::LoadU(df, k0 + 3 * d + i), s3);
    }
    scores[j] = hn::GetLane(hn::SumOfLanes(df, s0));
    scores[j + 1] = hn::GetLane(hn::SumOfLanes(df, s1));
    scores[j + 2] = hn::GetLane(hn::SumOfLanes(df, s2));
    scores[j + 3] = hn::GetLane(hn::SumOfLanes(df, s3));
  }
  for (; j < j1; ++j) {
    auto s0 = hn::Zero(df);
    for (int64_t i = 0; i < d; i += n) {
      s0 = hn::MulAdd(hn::LoadU(df, q + i), hn::LoadU(df, k + int64_t{j} * d + i), s0);
    }
    scores[j] = hn::GetLane(hn::SumOfLanes(df, s0));
  }
}

// Online-softmax step of one row over its tile scores [j0, j1) (others are -inf): turns them
// into probabilities in place, rescales acc, updates m and l.
void SoftmaxStep(int32_t d, int32_t j0, int32_t j1, float* scores, float* acc, float& m, float& l) {
  const DF df;
  const auto n = static_cast<int64_t>(hn::Lanes(df));
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int32_t j = j0; j < j1; ++j) tile_max = std::max(tile_max, scores[j]);
  const float m_new = std::max(m, tile_max);
  const float alpha = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
  const auto vm = hn::Set(df, m_new);
  const auto floor = hn::Set(df, -87.0f);  // exp stays normal; masked lanes are zeroed below
  auto sum = hn::Zero(df);
  for (int64_t j = 0; j < kTile; j += n) {
    const auto x = hn::LoadU(df, scores + j);
    const auto valid = hn::Gt(x, hn::Set(df, -std::numeric_limits<float>::infinity()));
    const auto p = hn::IfThenElseZero(valid, hn::Exp(df, hn::Max(hn::Sub(x, vm), floor)));
    hn::StoreU(p, df, scores + j);
    sum = hn::Add(sum, p);
  }
  l = l * alpha + hn::GetLane(hn::SumOfLanes(df, sum));
  if (alpha != 1.0f) {
    const auto va = hn::Set(df, alpha);
    for (int64_t i = 0; i < d; i += n) {
      hn::StoreU(hn::Mul(hn::LoadU(df, acc + i), va), df, acc + i);
    }
  }
  m = m_new;
}

// acc += Σ_j p[j] · v_j for j in [j0, j1), acc held in registers four vectors at a time.
void AccumulateV(const float* p, const float* v, int64_t d, int32_t j0, int32_t j1, float* acc) {
  const DF df;
  const auto n = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + 4 * n <= d; i += 4 * n) {
    auto a0 = hn::LoadU(df, acc + i), a1 = hn::LoadU(df, acc + i + n);
    auto a2 = hn::LoadU(df, acc + i + 2 * n), a3 = hn::LoadU(df, acc + i + 3 * n);
    for (int32_t j = j0; j < j1; ++j) {
      const auto pj = hn::Set(df, p[j]);
      const float* vj = v + int64_t{j} * d + i;
      a0 = hn::MulAdd(pj, hn::LoadU(df, vj), a0);
      a1 = hn::MulAdd(pj, hn::LoadU(df, vj + n), a1);
      a2 = hn::MulAdd(pj, hn::LoadU(df, vj + 2 * n), a2);
      a3 = hn::MulAdd(pj, hn::LoadU(df, vj + 3 * n), a3);
    }
    hn::StoreU(a0, df, acc + i);
    hn::StoreU(a1, df, acc + i + n);
    hn::StoreU(a2, df, acc + i + 2 * n);
    hn::StoreU(a3, df, acc + i + 3 * n);
  }
  for (; i < d; i += n) {
    auto a0 = hn::LoadU(df, acc + i);
    for (int32_t j = j0; j < j1; ++j) {
      a0 = hn::MulAdd(hn::Set(df, p[j]), hn::LoadU(df, v + int64_t{j} * d + i), a0);
    }
    hn::StoreU(a0, df, acc + i);
  }
}

// The keys query row at position `pos` sees: [lo, hi).
struct KeyRange {
  int64_t lo;
  int64_t hi;
};

KeyRange VisibleKeys(const AttentionParams& p, int64_t pos, int64_t total) {
  if (!p.causal) return {0, total};
  const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
  return {lo, pos + 1};
}

// Loads the item's queries (times the scale) and clears its accumulators. Rows per token are
// the item's query heads, q heads [kv_begin · g, kv_end · g).
void LoadQueries(const Activations& q, const AttentionParams& p, const WorkItem& item,
                 int32_t start, int32_t g, int32_t d, Scratch& s) {
  const int32_t heads = (item.kv_end - item.kv_begin) * g;
  for (int32_t t = item.q_begin; t < item.q_end; ++t) {
    for (int32_t h = 0; h < heads; ++h) {
      const int64_t row = int64_t{t - item.q_begin} * heads + h;
      const int64_t at =
          int64_t{start + t} * q.token_stride + (int64_t{item.kv_begin} * g + h) * q.head_stride;
      float* dst = s.q.data() + row * d;
      ToFloat(ElementPtr(q.data, at, q.dtype), q.dtype, d, 1.0f, dst);
      for (int32_t i = 0; i < d; ++i) dst[i] *= p.scale;
      s.m[static_cast<size_t>(row)] = -std::numeric_limits<float>::infinity();
      s.l[static_cast<size_t>(row)] = 0.0f;
    }
  }
  const auto rows = static_cast<size_t>(item.q_end - item.q_begin) * static_cast<size_t>(heads);
  std::fill_n(s.acc.begin(), rows * static_cast<size_t>(d), 0.0f);
}

// One tile for one KV head: every (token, query head of the group) row that sees keys in it.
void AttendTile(const AttentionParams& p, const WorkItem& item, int64_t seen, int64_t total,
                int64_t k0, int32_t count, int32_t kv, int32_t g, int32_t d, Scratch& s) {
  const int32_t heads = (item.kv_end - item.kv_begin) * g;
  for (int32_t t = item.q_begin; t < item.q_end; ++t) {
    const KeyRange keys = VisibleKeys(p, seen + t, total);
    const auto j0 = static_cast<int32_t>(std::clamp<int64_t>(keys.lo - k0, 0, count));
    const auto j1 = static_cast<int32_t>(std::clamp<int64_t>(keys.hi - k0, 0, count));
    if (j0 >= j1) continue;
    for (int32_t h = 0; h < g; ++h) {
      const int64_t row = int64_t{t - item.q_begin} * heads + int64_t{kv - item.kv_begin} * g + h;
      float* sc = s.scores.data() + row * kTile;
      std::fill_n(sc, kTile, -std::numeric_limits<float>::infinity());
      Scores(s.q.data() + row * d, s.k.data(), d, j0, j1, sc);
      float* acc = s.acc.data() + row * d;
      SoftmaxStep(d, j0, j1, sc, acc, s.m[static_cast<size_t>(row)], s.l[static_cast<size_t>(row)]);
      AccumulateV(sc, s.v.data(), d, j0, j1, acc);
    }
  }
}

void AttendItem(const PagedKV& c, const Activations& q, const Activations& out,
                const AttentionParams& p, const WorkItem& item, Scratch& s) {
  const int32_t* desc = c.descriptors + int64_t{item.seq} * 4;
  const int32_t start = desc[0];
  const int64_t seen = desc[2];
  const int64_t total = seen + desc[1];
  const int32_t g = q.num_heads / c.num_kv_heads;
  const int32_t d = c.head_size;
  LoadQueries(q, p, item, start, g, d, s);
  const KeyRange first = VisibleKeys(p, seen + item.q_begin, total);
  const KeyRange last = VisibleKeys(p, seen + item.q_end - 1, total);
  // Each tile's rows are prefetched while the tile before it is computed.
  auto tile_count = [&](int64_t k0) {
    return static_cast<int32_t>(std::min<int64_t>(kTile, last.hi - k0));
  };
  if (first.lo < last.hi) {
    TileSlots(c, item.seq, first.lo, tile_count(first.lo), s.slots.data());
    PrefetchTile(c, s.slots.data(), tile_count(first.lo), item.kv_begin, item.kv_end);
  }
  for (int64_t k0 = first.lo; k0 < last.hi; k0 += kTile) {
    const int32_t count = tile_count(k0);
    if (k0 + kTile < last.hi) {
      TileSlots(c, item.seq, k0 + kTile, tile_count(k0 + kTile), s.next_slots.data());
      PrefetchTile(c, s.next_slots.data(), tile_count(k0 + kTile), item.kv_begin, item.kv_end);
    }
    for (int32_t kv = item.kv_begin; kv < item.kv_end; ++kv) {
      GatherTile(c, kv, count, s);
      AttendTile(p, item, seen, total, k0, count, kv, g, d, s);
    }
    std::swap(s.slots, s.next_slots);
  }
  const int32_t heads = (item.kv_end - item.kv_begin) * g;
  for (int32_t t = item.q_begin; t < item.q_end; ++t) {
    for (int32_t h = 0; h < heads; ++h) {
      const int64_t row = int64_t{t - item.q_begin} * heads + h;
      float* acc = s.acc.data() + row * d;
      const float inv = 1.0f / s.l[static_cast<size_t>(row)];
      for (int32_t i = 0; i < d; ++i) acc[i] *= inv;
      const int64_t at = int64_t{start + t} * out.token_stride +
                         (int64_t{item.kv_begin} * g + h) * out.head_stride;
      FromFloat(acc, d, out.dtype, 1.0f, const_cast<uint8_t*>(ElementPtr(out.data, at, out.dtype)));
    }
  }
}

}  // namespace blockkv::internal::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace blockkv::internal {
namespace cpu {

HWY_EXPORT(AttendItem);

// The work items of a batch. A sequence with few new tokens (decode) takes all KV heads in one
// item, so each key position's rows of every head are read together, in order; one with many
// (prefill) takes one KV head per item and chunks of up to kMaxRows / G tokens. When that gives
// fewer than two items per thread, head ranges are split further. *max_rows: the most rows of
// any item; *work: a rough element count.
std::vector<WorkItem> MakeWorkItems(const PagedKV& c, int32_t g, int threads, int32_t* max_rows,
                                    int64_t* work) {
  const int32_t hkv = c.num_kv_heads;
  std::vector<int32_t> heads_per_item(static_cast<size_t>(c.num_seqs));
  int64_t count = 0;
  *work = 0;
  for (int32_t i = 0; i < c.num_seqs; ++i) {
    const int32_t n = c.descriptors[int64_t{i} * 4 + 1];
    *work += int64_t{n} * (c.descriptors[int64_t{i} * 4 + 2] + n) * g * hkv * c.head_size;
    const int32_t hpi = std::clamp(kMaxRows / std::max(1, g * n), 1, hkv);
    heads_per_item[static_cast<size_t>(i)] = hpi;
    count += int64_t{(hkv + hpi - 1) / hpi} *
             ((n + std::max(1, kMaxRows / g) - 1) / std::max(1, kMaxRows / g));
  }
  for (int32_t& hpi : heads_per_item) {  // more items for the threads, when there are few
    if (count < 2 * int64_t{threads} && hpi > 1)
      hpi = std::max(1, hpi * static_cast<int32_t>(count) / (2 * threads));
  }
  std::vector<WorkItem> items;
  *max_rows = 1;
  for (int32_t i = 0; i < c.num_seqs; ++i) {
    const int32_t n = c.descriptors[int64_t{i} * 4 + 1];
    const int32_t hpi = heads_per_item[static_cast<size_t>(i)];
    const int32_t chunk = std::max(1, kMaxRows / (g * hpi));
    for (int32_t begin = 0; begin < n; begin += chunk) {
      for (int32_t h = 0; h < hkv; h += hpi) {
        const WorkItem item{.seq = i,
                            .kv_begin = h,
                            .kv_end = std::min(hkv, h + hpi),
                            .q_begin = begin,
                            .q_end = std::min(n, begin + chunk)};
        *max_rows =
            std::max(*max_rows, (item.q_end - item.q_begin) * (item.kv_end - item.kv_begin) * g);
        items.push_back(item);
      }
    }
  }
  return items;
}

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
  const int32_t* desc = c.descriptors + int64_t{seq} * 4;
  const int64_t token = desc[0] + j;
  const int64_t pos = int64_t{desc[2]} + j;
  const int64_t block = c.kv_indices[c.kv_indptr[seq] + pos / c.block_size];
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
    const int32_t n = cache.descriptors[int64_t{i} * 4 + 1];
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

void PagedAttentionCpu(const PagedKV& cache, const Activations& q, const Activations& out,
                       const AttentionParams& params) {
  const int32_t group_size = q.num_heads / cache.num_kv_heads;
  int64_t work = 0;
  int32_t rows = 0;
  const std::vector<cpu::WorkItem> items =
      cpu::MakeWorkItems(cache, group_size, params.num_threads, &rows, &work);
  std::vector<cpu::Scratch> scratch(static_cast<size_t>(std::max(1, params.num_threads)));
  cpu::ParallelFor(std::ssize(items), params.num_threads, work, [&](int64_t index, int thread) {
    cpu::Scratch& s = scratch[static_cast<size_t>(thread)];
    if (s.k.empty()) s.Resize(rows, cache.head_size);
    HWY_DYNAMIC_DISPATCH(cpu::AttendItem)
    (cache, q, out, params, items[static_cast<size_t>(index)], s);
  });
}

}  // namespace blockkv::internal
#endif  // HWY_ONCE
