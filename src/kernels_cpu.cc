// SPDX-License-Identifier: Apache-2.0
// CPU backend of kernels.h's PagedAttention (AppendKV: kernels_cpu_append.cc): Highway SIMD,
// compiled for every x86 target Highway knows and chosen at run time with HWY_DYNAMIC_DISPATCH
// (Debian's Highway 1.0.3 compiles static dispatch to its scalar target without -march, dynamic
// dispatch picks AVX-512 or AVX2 on the machine it runs on).
//
// Implementation notes (attention). One work item is (sequence, KV heads, chunk of up to
// kMaxRows / G query tokens), G = Hq / Hkv: its rows are the chunk's tokens × the G query heads
// of each of its KV heads, so every key and value row read from the cache serves all of them.
// Keys are visited in tiles of kTile positions, gathered across block boundaries from the
// sequence's CSR table. Per tile, in three passes over the item's KV heads (each head's rows in
// blocks of up to kRowBlock): scores = q · kᵀ for every row (queries prescaled), then each row's
// online-softmax step of FlashAttention: m' = max(m, max(scores)); acc = acc · e^(m − m') +
// Σ e^(s − m') · v; l likewise; out = acc / l at the end; then the V sums. The K and V passes go
// stripe by stripe (kStripe, kValueStripe positions), every head within a stripe. Decode should be
// bound by how fast the K/V bytes stream in, so the per-key work is kept small: fp16/bf16 rows
// are converted in registers where they are read (no fp32 copy), each loaded K or V vector
// serves every row of the block (kRowBlock × 4 dot products in flight, one transposing reduction
// per 4 keys instead of a horizontal sum per key), and bf16 is split into its even and odd
// elements with two integer ops (queries and accumulators are kept in that order). Only fp8 (a
// table lookup per element) and prefill items (many row blocks per K row) first copy the tile's
// rows to fp32. Each pass asks for rows into L2 two stripes before their use, in the order they
// are read (TilePrefetch), and for rows into L1 a stripe before their loads. Memory per thread:
// (2 · rows · D + rows · kTile) floats, and 2 · heads · kTile · D more for an item that copies.
// Threads: a work-stealing loop over items (an atomic counter), the calling thread plus up to
// num_threads − 1 std::jthreads started per call when the work is large enough to pay for them.
#ifndef BLOCKKV_KERNELS_CPU_SHARED_
#define BLOCKKV_KERNELS_CPU_SHARED_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "internal/kernels_backend.h"
#include "internal/kernels_cpu_util.h"
#include "internal/paged_view.h"

namespace blockkv::internal::cpu {

inline constexpr int32_t kTile = 32;     // key positions per softmax step
inline constexpr int32_t kMaxRows = 64;  // query rows (tokens × query heads) per work item
inline constexpr int32_t kRowBlock = 4;  // rows computed together against each K/V vector
inline constexpr int32_t kMaxDirectRows = 2 * kRowBlock;  // rows per KV head up to which
                                                          // fp16/bf16 rows are read in place
inline constexpr int32_t kStripe = 8;  // key positions the scores pass takes for every head at once
inline constexpr int32_t kValueStripe = 2 * kStripe;  // the same for the V pass (fewer reloads of
                                                      // the accumulators)
inline constexpr int32_t kStripesAhead = 2;  // how far ahead of its use a stripe is asked for

// Query tokens [q_begin, q_end) of sequence `seq` for KV heads [kv_begin, kv_end) and their
// query heads. Row r of its scratch: KV head kv_begin + r / (tokens · G), token q_begin +
// (r / G) % tokens, query head (that KV head) · G + r % G — the rows of one KV head are
// contiguous, so they go through the tile kernels in blocks.
struct WorkItem {
  int32_t seq = 0;
  int32_t kv_begin = 0;
  int32_t kv_end = 0;
  int32_t q_begin = 0;
  int32_t q_end = 0;
};

// Whether an item's K/V rows are copied to fp32 (Scratch::k, v) before use rather than read in
// place: fp8 always (a table lookup per element); fp16/bf16 when many rows share them (prefill),
// where converting each row again for every block of kRowBlock rows would cost more than the copy.
inline bool CopiesRows(DType dtype, const WorkItem& item, int32_t g) {
  return dtype == DType::kFloat8E4M3 ||
         (dtype != DType::kFloat32 && (item.q_end - item.q_begin) * g > kMaxDirectRows);
}

// The keys each row of one block of up to kRowBlock rows (of any KV head: the blocks of every
// head see the same keys) sees in a tile: row r [j0[r], j1[r]), the block [lo, hi) (lo >= hi:
// none).
struct RowBlock {
  int32_t rows = 0;
  int32_t j0[kRowBlock];
  int32_t j1[kRowBlock];
  int32_t lo = 0;
  int32_t hi = 0;
};

// One thread's buffers, sized once per call for the largest item: an item has rows = tokens × G
// per KV head, and G = Hq / Hkv is the caller's (71 for Falcon-7B, up to kMaxHeads), so even a
// one-token item can pass kMaxRows; nothing here has a fixed size.
struct Scratch {
  std::vector<float> q;        // [rows, D] queries times the softmax scale, in load order
  std::vector<float> acc;      // [rows, D] unnormalized outputs, in load order
  std::vector<float> m;        // [rows] running maxima
  std::vector<float> l;        // [rows] running sums
  std::vector<float> scores;   // [rows, kTile] the tile's scores, then probabilities
  std::vector<float> k;        // [heads, kTile, D] the tile's K rows in fp32 (CopiesRows)
  std::vector<float> v;        // [heads, kTile, D] the same for V
  std::vector<int64_t> slots;  // [kTile] cache offsets of the tile's positions (plane 0, head 0)
  std::vector<int64_t> next_slots;  // [kTile] the same for the next tile
  std::vector<RowBlock> blocks;     // [ceil(rows / kRowBlock)] one KV head's row blocks of a tile

  void Resize(int32_t rows, int32_t heads, int32_t d) {
    const auto rd = static_cast<size_t>(rows) * static_cast<size_t>(d);
    const auto td = static_cast<size_t>(heads) * kTile * static_cast<size_t>(d);
    q.resize(rd);
    acc.resize(rd);
    m.resize(static_cast<size_t>(rows));
    l.resize(static_cast<size_t>(rows));
    scores.resize(static_cast<size_t>(rows) * kTile);
    k.resize(td);
    v.resize(td);
    slots.resize(kTile);
    next_slots.resize(kTile);
    blocks.resize(static_cast<size_t>((rows + kRowBlock - 1) / kRowBlock));
  }
};

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
using VF = hn::Vec<DF>;
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
  const int32_t* blocks = c.Blocks(seq);
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

// Asks for one plane's rows of KV head `head` at a tile's first `count` positions, into L2.
void PrefetchRows(const PagedKV& c, const int64_t* slots, int32_t count, int plane, int32_t head) {
  const auto elem = static_cast<int64_t>(ElementSize(c.dtype));
  const int64_t bytes = c.head_size * elem;
  for (int32_t j = 0; j < count; ++j) {
    const uint8_t* row = static_cast<const uint8_t*>(c.data) +
                         (slots[j] + plane * c.plane_stride + head * c.head_stride) * elem;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
  }
}

// Converts the K / V rows of KV heads [kv_begin, kv_end) at the tile's slots into s.k / s.v
// ([heads, kTile, D]).
void GatherTile(const PagedKV& c, int32_t kv_begin, int32_t kv_end, int32_t count, Scratch& s) {
  const int32_t d = c.head_size;
  for (int32_t j = 0; j < count; ++j) {
    for (int32_t h = 0; h < kv_end - kv_begin; ++h) {
      const int64_t at = s.slots[static_cast<size_t>(j)] + (kv_begin + h) * c.head_stride;
      const int64_t to = (int64_t{h} * kTile + j) * d;
      RowToFloat(c, ElementPtr(c.data, at, c.dtype), s.k.data() + to);
      RowToFloat(c, ElementPtr(c.data, at + c.plane_stride, c.dtype), s.v.data() + to);
    }
  }
}

// How the tile kernels read K/V rows of element type T in place: Load2 gives elements
// [i, i + 2N) as two float vectors, Load1 elements [i, i + N) (the last N of a head size that is
// an odd multiple of N; every supported head size is a multiple of N). Load2 may deliver the 2N
// elements in another order than the row's, the same for every row (kReordered); queries and
// accumulators are then kept in that "load order" too, which dot products and sums of rows
// cannot tell apart.
struct F32Rows {
  using T = float;
  static constexpr bool kReordered = false;
  static void Load2(const T* p, VF& a, VF& b) {
    const DF df;
    a = hn::LoadU(df, p);
    b = hn::LoadU(df, p + hn::Lanes(df));
  }
  static VF Load1(const T* p) { return hn::LoadU(DF(), p); }
};

struct F16Rows {
  using T = hwy::float16_t;
  static constexpr bool kReordered = false;
  static void Load2(const T* p, VF& a, VF& b) {
    const DF df;
    const hn::Rebind<T, DF> dh;
    a = hn::PromoteTo(df, hn::LoadU(dh, p));
    b = hn::PromoteTo(df, hn::LoadU(dh, p + hn::Lanes(df)));
  }
  static VF Load1(const T* p) { return hn::PromoteTo(DF(), hn::LoadU(hn::Rebind<T, DF>(), p)); }
};

// A bf16 value is the upper half of a float. Read as N 32-bit words, 2N elements give the even
// ones in the low halves (a float once shifted up) and the odd ones in the high halves (a float
// once the low half is masked off): one load and two integer ops per 2N elements, where
// promoting costs a widening load and a shift per N. The price is the order: evens, then odds.
struct Bf16Rows {
  using T = hwy::bfloat16_t;
  static constexpr bool kReordered = true;
  static void Load2(const T* p, VF& even, VF& odd) {
    const DF df;
    const hn::RebindToUnsigned<DF> du;
    const auto words = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));
    even = hn::BitCast(df, hn::ShiftLeft<16>(words));
    odd = hn::BitCast(df, hn::And(words, hn::Set(du, 0xFFFF0000u)));
  }
  static VF Load1(const T* p) { return hn::PromoteTo(DF(), hn::LoadU(hn::Rebind<T, DF>(), p)); }
};

// to[0, d) = the row `from` in Rows' load order (LoadOrder) or back (!LoadOrder).
template <class Rows, bool kToLoadOrder>
void Reorder(const float* from, int32_t d, float* to) {
  const auto n = static_cast<int32_t>(hn::Lanes(DF()));
  int32_t i = 0;
  if constexpr (Rows::kReordered) {
    for (; i + 2 * n <= d; i += 2 * n) {
      for (int32_t e = 0; e < n; ++e) {
        if constexpr (kToLoadOrder) {
          to[i + e] = from[i + 2 * e];
          to[i + n + e] = from[i + 2 * e + 1];
        } else {
          to[i + 2 * e] = from[i + e];
          to[i + 2 * e + 1] = from[i + n + e];
        }
      }
    }
  }
  std::copy(from + i, from + d, to + i);
}

// How many keys ahead of their loads the tile kernels ask for rows to move from L2 (where
// TilePrefetch put them) into L1: one stripe, so that rows 4 KiB apart, which share a few L1
// sets, are still there when used (with stripes, 8 measured better than 4 or 16).
inline constexpr int32_t kNearKeys = kStripe;

HWY_INLINE void PrefetchNear(const void* p, int32_t bytes) {
  for (int32_t b = 0; b < bytes; b += 64) hwy::Prefetch(static_cast<const uint8_t*>(p) + b);
}

// Where the K and V rows of the item's first KV head start for each position of a tile; the
// next head's are head_offset elements on. Positions past the tile's `count` repeat its last
// one, so that blocks of four keys never read out of range.
template <class Rows>
struct TileRows {
  const typename Rows::T* k[kTile];
  const typename Rows::T* v[kTile];
  int64_t head_offset;
};

// The rows of KV heads [kv_begin, kv_end) at the tile's slots: in the cache itself, or
// (`copied`, Rows = F32Rows) converted to fp32 into s.k / s.v first.
template <class Rows>
void FindRows(const PagedKV& c, int32_t kv_begin, int32_t kv_end, int32_t count, bool copied,
              Scratch& s, TileRows<Rows>& rows) {
  using T = typename Rows::T;
  const int32_t d = c.head_size;
  rows.head_offset = copied ? int64_t{kTile} * d : c.head_stride;
  for (int32_t j = 0; j < kTile; ++j) {
    const int32_t at = std::min(j, count - 1);
    if (copied) {
      rows.k[j] = reinterpret_cast<const T*>(s.k.data() + int64_t{at} * d);
      rows.v[j] = reinterpret_cast<const T*>(s.v.data() + int64_t{at} * d);
      continue;
    }
    // Not copied: T is the cache's element type.
    rows.k[j] =
        static_cast<const T*>(c.data) + s.slots[static_cast<size_t>(at)] + kv_begin * c.head_stride;
    rows.v[j] = rows.k[j] + c.plane_stride;
  }
  if (copied) GatherTile(c, kv_begin, kv_end, count, s);
}

#if HWY_TARGET != HWY_SCALAR
// out[0, 4) = the sums of the 4-lane blocks of v (folded in halves).
template <class D>
HWY_INLINE void StoreBlockSum(D d, hn::Vec<D> v, float* out) {
  if constexpr (hn::MaxLanes(D()) > 4) {
    const hn::Half<D> dh;
    StoreBlockSum(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)), out);
  } else {
    hn::StoreU(v, d, out);
  }
}
#endif

// out[0, 4) = the sums of the lanes of a, b, c and e: a transposing reduction (two rounds of
// interleaves within 128-bit blocks, then the blocks folded) costs about 3 ops per sum where a
// horizontal sum of one vector costs about 8.
HWY_INLINE void StoreSums4(VF a, VF b, VF c, VF e, float* out) {
#if HWY_TARGET == HWY_SCALAR
  out[0] = hn::GetLane(a);
  out[1] = hn::GetLane(b);
  out[2] = hn::GetLane(c);
  out[3] = hn::GetLane(e);
#else
  const DF df;
  const hn::Repartition<double, DF> dd;
  // In each block: [a0 + a2, b0 + b2, a1 + a3, b1 + b3], and the same for c and e.
  const auto ab =
      hn::BitCast(dd, hn::Add(hn::InterleaveLower(df, a, b), hn::InterleaveUpper(df, a, b)));
  const auto ce =
      hn::BitCast(dd, hn::Add(hn::InterleaveLower(df, c, e), hn::InterleaveUpper(df, c, e)));
  // In each block: [Σa, Σb, Σc, Σe] over that block.
  const VF sums = hn::Add(hn::BitCast(df, hn::InterleaveLower(dd, ab, ce)),
                          hn::BitCast(df, hn::InterleaveUpper(dd, ab, ce)));
  StoreBlockSum(df, sums, out);
#endif
}

// scores[r · kTile + j] = q_r · k_j for rows r < RB (q: [RB, d] in load order), the keys' rows
// `off` elements on from k[j], and the blocks of four keys that cover [j0, j1): RB × 4
// accumulators, each K vector loaded once for all RB rows.
template <class Rows, int RB>
HWY_INLINE void TileScores(const float* q, int32_t d, const typename Rows::T* const* k, int64_t off,
                           int32_t j0, int32_t j1, float* scores) {
  const DF df;
  const auto n = static_cast<int32_t>(hn::Lanes(df));
  for (int32_t j = j0 & ~3; j < j1; j += 4) {
    for (int32_t key = kNearKeys; key < kNearKeys + 4; ++key) {
      PrefetchNear(k[std::min(j + key, kTile - 1)] + off, d * static_cast<int32_t>(sizeof(*k[0])));
    }
    VF acc[RB][4];
    for (auto& row : acc) {
      for (VF& a : row) a = hn::Zero(df);
    }
    int32_t i = 0;
    for (; i + 2 * n <= d; i += 2 * n) {
      VF lo[4], hi[4];
      for (int32_t key = 0; key < 4; ++key) Rows::Load2(k[j + key] + off + i, lo[key], hi[key]);
      for (int64_t r = 0; r < RB; ++r) {
        const VF q_lo = hn::LoadU(df, q + r * d + i);
        const VF q_hi = hn::LoadU(df, q + r * d + i + n);
        for (int32_t key = 0; key < 4; ++key) {
          acc[r][key] = hn::MulAdd(q_lo, lo[key], acc[r][key]);
          acc[r][key] = hn::MulAdd(q_hi, hi[key], acc[r][key]);
        }
      }
    }
    if (i < d) {
      VF x[4];
      for (int32_t key = 0; key < 4; ++key) x[key] = Rows::Load1(k[j + key] + off + i);
      for (int64_t r = 0; r < RB; ++r) {
        const VF qv = hn::LoadU(df, q + r * d + i);
        for (int32_t key = 0; key < 4; ++key) acc[r][key] = hn::MulAdd(qv, x[key], acc[r][key]);
      }
    }
    for (int64_t r = 0; r < RB; ++r) {
      StoreSums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], scores + r * kTile + j);
    }
  }
}

// Online-softmax step of one row over its tile scores (-inf where it sees no key; at least one
// finite): turns them into probabilities in place, updates m and l, and returns e^(m − m'), the
// factor the row's accumulator must be scaled by.
float SoftmaxStep(float* scores, float& m, float& l) {
  const DF df;
  const auto n = static_cast<int32_t>(hn::Lanes(df));
  const auto neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
  auto tile_max = neg_inf;
  for (int32_t j = 0; j < kTile; j += n) tile_max = hn::Max(tile_max, hn::LoadU(df, scores + j));
  const float m_new = std::max(m, hn::GetLane(hn::MaxOfLanes(df, tile_max)));
  // 0 on the first tile (m = -inf); 1 without an exp while the maximum holds, as it mostly does.
  const float alpha = m_new == m ? 1.0f : std::exp(m - m_new);
  const auto vm = hn::Set(df, m_new);
  const auto floor = hn::Set(df, -87.0f);  // exp stays normal; masked lanes are zeroed below
  auto sum = hn::Zero(df);
  for (int32_t j = 0; j < kTile; j += n) {
    const auto x = hn::LoadU(df, scores + j);
    const auto p =
        hn::IfThenElseZero(hn::Gt(x, neg_inf), hn::Exp(df, hn::Max(hn::Sub(x, vm), floor)));
    hn::StoreU(p, df, scores + j);
    sum = hn::Add(sum, p);
  }
  l = l * alpha + hn::GetLane(hn::SumOfLanes(df, sum));
  m = m_new;
  return alpha;
}

// acc[r, i + c) += Σ_j p[r · kTile + j] · v_j[i + c) for rows r < RB, keys [j0, j1) (their rows
// `off` elements on from v[j]) and columns c < kSteps · 2N (kSteps = 0: the last N columns, Load1):
// those columns of every row stay in registers while the keys stream by, so each V vector is loaded
// once for all RB rows, and there are 2 · RB · kSteps independent sums to keep the FMAs busy.
template <class Rows, int RB, int kSteps>
HWY_INLINE void AccumulateColumns(const float* p, const typename Rows::T* const* v, int64_t off,
                                  int32_t j0, int32_t j1, int32_t d, int32_t i, float* acc) {
  const DF df;
  const auto n = static_cast<int32_t>(hn::Lanes(df));
  constexpr int kVectors = kSteps == 0 ? 1 : 2 * kSteps;
  VF a[RB][kVectors];
  for (int64_t r = 0; r < RB; ++r) {
    for (int64_t c = 0; c < kVectors; ++c) a[r][c] = hn::LoadU(df, acc + r * d + i + c * n);
  }
  for (int32_t j = j0; j < j1; ++j) {
    PrefetchNear(v[std::min(j + kNearKeys, kTile - 1)] + off + i,
                 kVectors * n * static_cast<int32_t>(sizeof(*v[0])));
    VF x[kVectors];
    if constexpr (kSteps == 0) {
      x[0] = Rows::Load1(v[j] + off + i);
    } else {
      for (int64_t c = 0; c < kSteps; ++c)
        Rows::Load2(v[j] + off + i + 2 * c * n, x[2 * c], x[2 * c + 1]);
    }
    for (int64_t r = 0; r < RB; ++r) {
      const VF pj = hn::Set(df, p[r * kTile + j]);
      for (int64_t c = 0; c < kVectors; ++c) a[r][c] = hn::MulAdd(pj, x[c], a[r][c]);
    }
  }
  for (int64_t r = 0; r < RB; ++r) {
    for (int64_t c = 0; c < kVectors; ++c) hn::StoreU(a[r][c], df, acc + r * d + i + c * n);
  }
}

// acc_r += Σ_j p[r · kTile + j] · v_j for rows r < RB (acc: [RB, d] in load order) and keys
// [j0, j1) (their rows `off` elements on from v[j]), in passes of up to 4N columns (16 sums for
// 4 rows).
template <class Rows, int RB>
void TileAccumulate(const float* p, const typename Rows::T* const* v, int64_t off, int32_t j0,
                    int32_t j1, int32_t d, float* acc) {
  const auto n = static_cast<int32_t>(hn::Lanes(DF()));
  int32_t i = 0;
  for (; i + 4 * n <= d; i += 4 * n) AccumulateColumns<Rows, RB, 2>(p, v, off, j0, j1, d, i, acc);
  if (i + 2 * n <= d) {
    AccumulateColumns<Rows, RB, 1>(p, v, off, j0, j1, d, i, acc);
    i += 2 * n;
  }
  if (i < d) AccumulateColumns<Rows, RB, 0>(p, v, off, j0, j1, d, i, acc);
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

// What the tile loop needs to know of one work item.
struct ItemShape {
  int64_t seen;         // the sequence's tokens before this step
  int64_t total;        // its keys: seen + its new tokens
  int32_t q_begin;      // the item's first query token among the new ones
  int32_t g;            // query heads per KV head
  int32_t d;            // head size
  int32_t rows_per_kv;  // the item's rows of each KV head: tokens × g
};

// Calls fn(std::integral_constant<int, rb>()) for rb in [1, kRowBlock].
template <class Fn>
HWY_INLINE void WithRowBlock(int32_t rb, const Fn& fn) {
  static_assert(kRowBlock == 4);
  switch (rb) {
    case 1:
      fn(std::integral_constant<int, 1>());
      break;
    case 2:
      fn(std::integral_constant<int, 2>());
      break;
    case 3:
      fn(std::integral_constant<int, 3>());
      break;
    default:
      fn(std::integral_constant<int, 4>());
  }
}

// The row blocks of one KV head's rows for the tile of keys [k0, k0 + count) (each row with its
// own range: the tokens of a prefill chunk see different keys); returns their number and sets
// [*lo, *hi) to the keys any of them sees.
int32_t TileRowBlocks(const AttentionParams& p, const ItemShape& x, int64_t k0, int32_t count,
                      RowBlock* blocks, int32_t* lo, int32_t* hi) {
  int32_t n = 0;
  *lo = count;
  *hi = 0;
  for (int32_t r0 = 0; r0 < x.rows_per_kv; r0 += kRowBlock, ++n) {
    RowBlock& b = blocks[n];
    b.rows = std::min(kRowBlock, x.rows_per_kv - r0);
    b.lo = count;
    b.hi = 0;
    for (int32_t r = 0; r < b.rows; ++r) {
      const KeyRange keys = VisibleKeys(p, x.seen + x.q_begin + (r0 + r) / x.g, x.total);
      b.j0[r] = static_cast<int32_t>(std::clamp<int64_t>(keys.lo - k0, 0, count));
      b.j1[r] = static_cast<int32_t>(std::clamp<int64_t>(keys.hi - k0, 0, count));
      if (b.j0[r] < b.j1[r]) {
        b.lo = std::min(b.lo, b.j0[r]);
        b.hi = std::max(b.hi, b.j1[r]);
      }
    }
    if (b.lo < b.hi) {
      *lo = std::min(*lo, b.lo);
      *hi = std::max(*hi, b.hi);
    }
  }
  return n;
}

// The rows a tile asks for into L2 ahead of their use. The passes read a tile stripe by stripe
// (kStripe positions for scores, kValueStripe for V sums, every KV head of the item within a
// stripe), so the tile's rows are read as one stream of 2 · kTile / kStripe units of kStripe
// positions: its K units, then its V units, then the next tile's K units. While the passes
// compute unit u for head h, they ask for head h's rows of unit u + kStripesAhead (the V pass
// for each of its stripe's units). Every position of a block is its own 4 KiB page for 8 KV heads
// of 128 bf16; a stripe reads each page's K (or V) half front to back, and the hardware
// prefetchers, which lose a head's stride at every block jump, do not have to find it again.
struct TilePrefetch {
  static constexpr int32_t kUnits = 2 * kTile / kStripe;

  const PagedKV* c;
  const int64_t* slots;  // this tile's
  int32_t count;
  const int64_t* next_slots;  // the next tile's
  int32_t next_count;         // 0: no next tile
  int32_t kv_begin;
  int32_t heads;

  // Head h's rows of unit `unit` of this tile's stream (kUnits and on: the next tile's).
  void Unit(int32_t unit, int32_t h) const {
    const bool next = unit >= kUnits;
    const int32_t u = unit % kUnits;
    const int32_t j0 = (u % (kUnits / 2)) * kStripe;
    const int32_t n = next ? next_count : count;
    if (j0 >= n) return;
    PrefetchRows(*c, (next ? next_slots : slots) + j0, std::min(kStripe, n - j0), u / (kUnits / 2),
                 kv_begin + h);
  }
  // The first tile's first kStripesAhead units, before anything else.
  void First() const {
    for (int32_t u = 0; u < kStripesAhead; ++u) {
      for (int32_t h = 0; h < heads; ++h) Unit(u, h);
    }
  }
  // While unit `unit` is computed for head h.
  void During(int32_t unit, int32_t h) const { Unit(unit + kStripesAhead, h); }
};

// The keys among [begin, end) that a row block sees: [*j0, *j1), empty when *j0 >= *j1.
HWY_INLINE void StripeKeys(const RowBlock& rb, int32_t begin, int32_t end, int32_t* j0,
                           int32_t* j1) {
  *j0 = std::max(rb.lo, begin);
  *j1 = std::min(rb.hi, end);
}

// scores = q · kᵀ for every row of the item over the tile's keys, stripe by stripe and head by
// head within a stripe; of each head's row blocks the last has RB rows, the others kRowBlock.
template <class Rows, int RB>
void ScoresPass(const TileRows<Rows>& t, const RowBlock* blocks, int32_t n_blocks,
                int32_t rows_per_kv, int32_t d, const TilePrefetch& ahead, Scratch& s) {
  for (int32_t stripe = 0; stripe < kTile / kStripe; ++stripe) {
    for (int32_t h = 0; h < ahead.heads; ++h) {
      ahead.During(stripe, h);
      const int64_t off = h * t.head_offset;
      for (int32_t b = 0; b < n_blocks; ++b) {
        int32_t j0 = 0;
        int32_t j1 = 0;
        StripeKeys(blocks[b], stripe * kStripe, (stripe + 1) * kStripe, &j0, &j1);
        if (j0 >= j1) continue;
        const int64_t row = int64_t{h} * rows_per_kv + int64_t{b} * kRowBlock;
        float* scores = s.scores.data() + row * kTile;
        const float* q = s.q.data() + row * d;
        if (b + 1 < n_blocks) {
          TileScores<Rows, kRowBlock>(q, d, t.k, off, j0, j1, scores);
        } else {
          TileScores<Rows, RB>(q, d, t.k, off, j0, j1, scores);
        }
      }
    }
  }
}

// One tile of keys [k0, k0 + count) for every row of the item, in three steps: scores = q · kᵀ
// for every row (ScoresPass), the online softmax of each row, acc += p · v head by head.
template <class Rows>
void AttendTile(const AttentionParams& p, const ItemShape& x, int64_t k0, int32_t count,
                const TileRows<Rows>& t, const TilePrefetch& ahead, Scratch& s) {
  const int32_t heads = ahead.heads;
  RowBlock* blocks = s.blocks.data();  // one KV head's rows: up to max(kMaxRows, G)
  int32_t lo = 0;
  int32_t hi = 0;
  const int32_t n_blocks = TileRowBlocks(p, x, k0, count, blocks, &lo, &hi);
  if (lo >= hi) return;  // not reached: the rows' key ranges leave no gap in an item's tiles
  const int32_t d = x.d;
  float* scores = s.scores.data();
  WithRowBlock(blocks[n_blocks - 1].rows, [&](auto n) {
    ScoresPass<Rows, decltype(n)::value>(t, blocks, n_blocks, x.rows_per_kv, d, ahead, s);
  });
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t b = 0; b < n_blocks; ++b) {
      const RowBlock& rb = blocks[b];
      for (int32_t r = 0; r < rb.rows; ++r) {
        const int64_t row = int64_t{h} * x.rows_per_kv + int64_t{b} * kRowBlock + r;
        float* sc = scores + row * kTile;
        if (rb.j0[r] >= rb.j1[r]) {  // weights 0, accumulator unchanged
          std::fill_n(sc, kTile, 0.0f);
          continue;
        }
        std::fill(sc, sc + rb.j0[r], -std::numeric_limits<float>::infinity());
        std::fill(sc + rb.j1[r], sc + kTile, -std::numeric_limits<float>::infinity());
        const auto at = static_cast<size_t>(row);
        const float alpha = SoftmaxStep(sc, s.m[at], s.l[at]);
        if (alpha != 1.0f) {
          float* acc = s.acc.data() + row * d;
          for (int32_t i = 0; i < d; ++i) acc[i] *= alpha;
        }
      }
    }
  }
  constexpr int32_t kPerValueStripe = kValueStripe / kStripe;
  for (int32_t stripe = 0; stripe < kTile / kStripe; stripe += kPerValueStripe) {
    for (int32_t h = 0; h < heads; ++h) {
      for (int32_t u = 0; u < kPerValueStripe; ++u)
        ahead.During(TilePrefetch::kUnits / 2 + stripe + u, h);
      for (int32_t b = 0; b < n_blocks; ++b) {
        int32_t j0 = 0;
        int32_t j1 = 0;
        StripeKeys(blocks[b], stripe * kStripe, (stripe + kPerValueStripe) * kStripe, &j0, &j1);
        if (j0 >= j1) continue;
        const int64_t row = int64_t{h} * x.rows_per_kv + int64_t{b} * kRowBlock;
        WithRowBlock(blocks[b].rows, [&](auto n) {
          TileAccumulate<Rows, decltype(n)::value>(scores + row * kTile, t.v, h * t.head_offset, j0,
                                                   j1, d, s.acc.data() + row * d);
        });
      }
    }
  }
}

// Calls fn(row, token, query head) for each scratch row of the item (the layout of WorkItem).
template <class Fn>
void ForEachRow(const WorkItem& item, int32_t g, Fn fn) {
  const int32_t tokens = item.q_end - item.q_begin;
  for (int32_t kv = item.kv_begin; kv < item.kv_end; ++kv) {
    for (int32_t t = 0; t < tokens; ++t) {
      for (int32_t h = 0; h < g; ++h) {
        fn((int64_t{kv - item.kv_begin} * tokens + t) * g + h, item.q_begin + t, kv * g + h);
      }
    }
  }
}

// Loads the item's queries, times the scale, into s.q in Rows' load order; clears m, l, acc.
template <class Rows>
void LoadQueries(const Activations& q, float scale, const WorkItem& item, int32_t start, int32_t g,
                 int32_t d, Scratch& s) {
  float row_q[kMaxHeadSize];
  ForEachRow(item, g, [&](int64_t row, int32_t token, int32_t head) {
    const int64_t at = int64_t{start + token} * q.token_stride + head * q.head_stride;
    ToFloat(ElementPtr(q.data, at, q.dtype), q.dtype, d, 1.0f, row_q);
    for (int32_t i = 0; i < d; ++i) row_q[i] *= scale;
    Reorder<Rows, true>(row_q, d, s.q.data() + row * d);
    s.m[static_cast<size_t>(row)] = -std::numeric_limits<float>::infinity();
    s.l[static_cast<size_t>(row)] = 0.0f;
  });
  const auto rows =
      static_cast<size_t>(item.q_end - item.q_begin) * g * (item.kv_end - item.kv_begin);
  std::fill_n(s.acc.begin(), rows * static_cast<size_t>(d), 0.0f);
}

// Writes acc / l of each of the item's rows to `out`, in the row's own order.
template <class Rows>
void StoreOutputs(const WorkItem& item, int32_t start, int32_t g, int32_t d, const Scratch& s,
                  const Activations& out) {
  float row[kMaxHeadSize];
  ForEachRow(item, g, [&](int64_t r, int32_t token, int32_t head) {
    const float inv = 1.0f / s.l[static_cast<size_t>(r)];
    Reorder<Rows, false>(s.acc.data() + r * d, d, row);
    for (int32_t i = 0; i < d; ++i) row[i] *= inv;
    const int64_t at = int64_t{start + token} * out.token_stride + head * out.head_stride;
    FromFloat(row, d, out.dtype, 1.0f, const_cast<uint8_t*>(ElementPtr(out.data, at, out.dtype)));
  });
}

template <class Rows>
void AttendItemWith(const PagedKV& c, const Activations& q, const Activations& out,
                    const AttentionParams& p, const WorkItem& item, bool copied, Scratch& s) {
  const int32_t start = c.Start(item.seq);
  const int32_t g = q.num_heads / c.num_kv_heads;
  const int32_t d = c.head_size;
  const ItemShape shape{.seen = c.Seen(item.seq),
                        .total = c.Length(item.seq),
                        .q_begin = item.q_begin,
                        .g = g,
                        .d = d,
                        .rows_per_kv = (item.q_end - item.q_begin) * g};
  LoadQueries<Rows>(q, p.scale, item, start, g, d, s);

  const KeyRange first = VisibleKeys(p, shape.seen + item.q_begin, shape.total);
  const KeyRange last = VisibleKeys(p, shape.seen + item.q_end - 1, shape.total);
  auto tile_count = [&](int64_t k0) {
    return static_cast<int32_t>(std::min<int64_t>(kTile, last.hi - k0));
  };
  TileRows<Rows> rows_of;
  for (int64_t k0 = first.lo; k0 < last.hi; k0 += kTile) {
    const int32_t count = tile_count(k0);
    const int32_t next_count = k0 + kTile < last.hi ? tile_count(k0 + kTile) : 0;
    if (k0 == first.lo) TileSlots(c, item.seq, k0, count, s.slots.data());
    if (next_count > 0) TileSlots(c, item.seq, k0 + kTile, next_count, s.next_slots.data());
    const TilePrefetch ahead{.c = &c,
                             .slots = s.slots.data(),
                             .count = count,
                             .next_slots = s.next_slots.data(),
                             .next_count = next_count,
                             .kv_begin = item.kv_begin,
                             .heads = item.kv_end - item.kv_begin};
    if (k0 == first.lo) ahead.First();
    FindRows(c, item.kv_begin, item.kv_end, count, copied, s, rows_of);
    AttendTile(p, shape, k0, count, rows_of, ahead, s);
    std::swap(s.slots, s.next_slots);
  }

  StoreOutputs<Rows>(item, start, g, d, s, out);
}

void AttendItem(const PagedKV& c, const Activations& q, const Activations& out,
                const AttentionParams& p, const WorkItem& item, Scratch& s) {
  const bool copied = CopiesRows(c.dtype, item, q.num_heads / c.num_kv_heads);
  if (copied || c.dtype == DType::kFloat32) {
    AttendItemWith<F32Rows>(c, q, out, p, item, copied, s);
  } else if (c.dtype == DType::kFloat16) {
    AttendItemWith<F16Rows>(c, q, out, p, item, false, s);
  } else {
    AttendItemWith<Bf16Rows>(c, q, out, p, item, false, s);
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
    const int32_t n = c.Tokens(i);
    *work += int64_t{n} * c.Length(i) * g * hkv * c.head_size;
    const auto hpi = static_cast<int32_t>(
        std::clamp<int64_t>(kMaxRows / std::max<int64_t>(1, int64_t{g} * n), 1, hkv));
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
    const int32_t n = c.Tokens(i);
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

}  // namespace cpu

void PagedAttentionCpu(const PagedKV& cache, const Activations& q, const Activations& out,
                       const AttentionParams& params) {
  const int32_t group_size = q.num_heads / cache.num_kv_heads;
  int64_t work = 0;
  int32_t rows = 0;
  const std::vector<cpu::WorkItem> items =
      cpu::MakeWorkItems(cache, group_size, params.num_threads, &rows, &work);
  int32_t copied_heads = 0;  // the most KV heads of an item whose rows are copied
  for (const cpu::WorkItem& item : items) {
    if (cpu::CopiesRows(cache.dtype, item, group_size))
      copied_heads = std::max(copied_heads, item.kv_end - item.kv_begin);
  }
  std::vector<cpu::Scratch> scratch(static_cast<size_t>(std::max(1, params.num_threads)));
  cpu::ParallelFor(std::ssize(items), params.num_threads, work, [&](int64_t index, int thread) {
    cpu::Scratch& s = scratch[static_cast<size_t>(thread)];
    if (s.q.empty()) s.Resize(rows, copied_heads, cache.head_size);
    HWY_DYNAMIC_DISPATCH(cpu::AttendItem)
    (cache, q, out, params, items[static_cast<size_t>(index)], s);
  });
}

}  // namespace blockkv::internal
#endif  // HWY_ONCE
