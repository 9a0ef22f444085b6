// SPDX-License-Identifier: Apache-2.0
// CUDA backend of kernels.h (sm_80, sm_90). src/kernels.cc has checked every argument and built
// the views over the batch's device mirror; this file launches and returns without waiting.
//
// Implementation notes.
// AppendKV: one thread block per real token; the rotary cos/sin of its position are computed
//   once (fp64 angle) into shared memory; threads stride over (head, element) for K and V and over
//   (head, rotation pair) for Q, which is rotated in place (each pair read and written by one
//   thread, so no thread reads what another writes).
// PagedAttention (flash-decoding), two kernels; internal::SetCudaAttentionKernel picks one:
//   kWarpPerKey (the default; passed the CUDA suite on an H200): one thread block of 4 warps per
//     (query token, KV head, group of up to 8 query heads sharing it, split of the key range);
//     each warp takes every 4th key and reduces each score over all 32 lanes. It read K/V at 0.2 of
//     the copy bandwidth on the H200: a 32-lane reduction and two exponentials per key and query
//     head, with two keys' loads in flight per warp.
//   kHalfWarpPerKey (not yet run on a GPU; to replace the first once it has passed there): the
//     same grid with R query heads per block (the group size rounded up to a power of two, at most
//     8). Each half-warp takes its own keys: a lane holds 4-element chunks j, j + 16, ... of the
//     head, so a score is reduced over 16 lanes and one warp instruction serves two keys. A
//     half-warp issues the loads of 4 keys' K and V rows (2 when R · chunks is large) before it
//     uses any, then rescales its online softmax (base 2) once for those keys. Half-warps merge
//     through shuffles, warps through shared memory.
//   With one split a block writes `out`; with several (long contexts, few blocks for the GPU) each
//   writes an unnormalized partial to a stream-ordered workspace that a second kernel merges. No
//   [T, context] matrix, no limit on blocks per sequence.
// Instantiations: 3 activation dtypes × (same dtype | fp8 cache) × (2 chunk counts for the first
//   kernel + 3 chunk counts × 3-4 row counts for the second), 3 × 2 for AppendKV, 3 for the merge.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/cuda_util.h"
#include "internal/kernels_backend.h"
#include "internal/strings.h"

namespace blockkv::internal {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSplits = 64;
constexpr int64_t kMinKeysPerSplit = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kMaxGridYZ = 65535;  // CUDA's limit on a grid's y and z extents
static_assert(kMaxHeads <= kMaxGridYZ, "grid.y spans the KV heads, the merge's grid.y the heads");

using Fp8 = __nv_fp8_e4m3;

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToF(Fp8 x) { return static_cast<float>(x); }

template <class T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromF<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ Fp8 FromF<Fp8>(float x) {
  return Fp8(x);  // round to nearest even, saturating to ±448 (__NV_SATFINITE)
}

template <class T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

// Four consecutive elements at p (4-element aligned) as floats times `scale`.
template <class T>
__device__ __forceinline__ void Load4(const T* p, float scale, float out[4]) {
  const Vec4<T> x = *reinterpret_cast<const Vec4<T>*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = ToF(x.v[i]) * scale;
}

// ---- AppendKV ---------------------------------------------------------------------------------

template <class T>
__device__ __forceinline__ const T* Row(const Activations& a, int64_t token, int64_t head) {
  return static_cast<const T*>(a.data) + token * a.token_stride + head * a.head_stride;
}

template <class T, class C>
__global__ void __launch_bounds__(kThreads)
    AppendKernel(PagedKV c, Activations k, Activations v, Activations q, bool rotate_q,
                 RotaryParams rotary) {
  __shared__ float cos_s[kMaxHeadSize / 2];
  __shared__ float sin_s[kMaxHeadSize / 2];
  const int token = blockIdx.x;
  const int seq = c.SeqOf(token);
  const int64_t pos = c.Seen(seq) + (token - c.Start(seq));
  const int64_t block = c.Blocks(seq)[pos / c.block_size];
  const int64_t slot = c.Offset(block, pos % c.block_size, 0, 0);
  const int half = rotary.enabled ? rotary.rotary_dim / 2 : 0;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double s, co;
    sincos(static_cast<double>(pos) * pow(rotary.theta, -2.0 * i / rotary.rotary_dim), &s, &co);
    cos_s[i] = static_cast<float>(co);
    sin_s[i] = static_cast<float>(s);
  }
  __syncthreads();
  const int d = c.head_size;
  C* cache = static_cast<C*>(c.data);
  for (int idx = threadIdx.x; idx < c.num_kv_heads * d; idx += blockDim.x) {
    const int h = idx / d;
    const int e = idx % d;
    const T* kr = Row<T>(k, token, h);
    float y = ToF(kr[e]);
    if (e < half) {
      y = y * cos_s[e] - ToF(kr[e + half]) * sin_s[e];
    } else if (e < 2 * half) {
      y = y * cos_s[e - half] + ToF(kr[e - half]) * sin_s[e - half];
    }
    const int64_t at = slot + h * c.head_stride + e;
    cache[at] = FromF<C>(y / c.kv_scale);
    cache[at + c.plane_stride] = FromF<C>(ToF(Row<T>(v, token, h)[e]) / c.kv_scale);
  }
  if (!rotate_q || half == 0) return;
  for (int idx = threadIdx.x; idx < q.num_heads * half; idx += blockDim.x) {
    const int h = idx / half;
    const int i = idx % half;
    T* qr = static_cast<T*>(q.data) + int64_t{token} * q.token_stride + h * q.head_stride;
    const float x1 = ToF(qr[i]);
    const float x2 = ToF(qr[i + half]);
    qr[i] = FromF<T>(x1 * cos_s[i] - x2 * sin_s[i]);
    qr[i + half] = FromF<T>(x2 * cos_s[i] + x1 * sin_s[i]);
  }
}

// ---- PagedAttention, a key per half-warp (kHalfWarpPerKey) ------------------------------------

// Output of one (token, head) row of a split: out directly (one split) or the workspace.
struct Partials {
  float* acc = nullptr;  // [splits, T, Hq, D] unnormalized, relative to m
  float* ml = nullptr;   // [splits, T, Hq, 2]: m (base-2 exponent), l
  int splits = 1;
};

// Sum over the 16 lanes of a half-warp (every lane gets it). `mask` names the half's lanes only:
// the two halves of a warp may run different numbers of loop trips.
__device__ __forceinline__ float HalfWarpSum(float x, unsigned mask) {
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) x += __shfl_xor_sync(mask, x, offset);
  return x;
}

// exp2 of a base-2 exponent relative to a running maximum that may still be -inf (no key yet):
// then every term is 0, not NaN.
__device__ __forceinline__ float SafeMax(float m) { return m == -INFINITY ? 0.0f : m; }

// Block of the sequence's `key`-th position: block_size is a power of two in practice (shift >= 0).
__device__ __forceinline__ int64_t KeyRow(const PagedKV& c, const int32_t* blocks, int64_t key,
                                          int shift) {
  const int64_t b = shift >= 0 ? key >> shift : key / c.block_size;
  const int64_t o = shift >= 0 ? key & (c.block_size - 1) : key % c.block_size;
  return c.Offset(blocks[b], o, 0, 0);
}

template <int NC, int R>
struct AttentionShape {
  // Keys a half-warp loads before it computes on any: enough bytes in flight to cover the
  // latency of HBM, within 255 registers (q and the accumulator take 2 · R · NC · 4).
  static constexpr int kUnroll = R * NC >= 16 ? 2 : 4;
};

// One thread block of 4 warps per (query token, KV head, group of R query heads sharing it,
// split of the key range). Each half-warp takes one key at a time: lane j of the half holds the
// 4-element chunks j, j + 16, ... of the head (NC of them), so a key's dot product is reduced over
// 16 lanes (4 shuffles) and each warp instruction serves two keys. A half-warp loads kUnroll keys'
// K and V rows before it uses any, then per query head computes their scores, one rescale of its
// online softmax (m, l, acc) for the kUnroll keys together, and the weighted V sums. The half-warps
// merge through shuffles and shared memory. Scores are kept in base 2 (q is pre-scaled by log2 e).
template <class T, class C, int NC, int R>
__global__ void __launch_bounds__(kThreads)
    HalfWarpKernel(PagedKV c, Activations q, Activations out, AttentionParams p, Partials part,
                   int block_shift) {
  constexpr int kUnroll = AttentionShape<NC, R>::kUnroll;
  constexpr int kHalves = 2 * kWarps;
  __shared__ float merge_acc[kWarps][R][NC * 64];
  __shared__ float merge_ml[kWarps][R][2];
  const int token = blockIdx.x;
  const int kv = blockIdx.y;
  const int g = q.num_heads / c.num_kv_heads;
  const int head0 = kv * g + (blockIdx.z / part.splits) * R;  // first query head
  const int rows = min(R, kv * g + g - head0);
  const int split = blockIdx.z % part.splits;
  const int seq = c.SeqOf(token);
  const int64_t pos = c.Seen(seq) + (token - c.Start(seq));
  int64_t lo = 0;
  int64_t hi = c.Length(seq);
  if (p.causal) {
    hi = pos + 1;
    if (p.sliding_window > 0) lo = max(int64_t{0}, pos - p.sliding_window + 1);
  }
  const int64_t per = (hi - lo + part.splits - 1) / part.splits;
  const int64_t k_begin = lo + split * per;
  const int64_t k_end = min(hi, k_begin + per);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int j = lane % 16;
  const int half = warp * 2 + lane / 16;
  const unsigned half_mask = lane < 16 ? 0x0000FFFFu : 0xFFFF0000u;
  const int d = c.head_size;
  const float q_scale = p.scale * kLog2e;  // exp(x) = exp2(x · log2 e)

  float qf[R][NC][4];
  float acc[R][NC][4];
  float m[R];
  float l[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < NC; ++i) {
      const int e = (j + 16 * i) * 4;
#pragma unroll
      for (int x = 0; x < 4; ++x) {  // element by element: q carries no alignment promise
        qf[r][i][x] =
            r < rows && e + x < d ? ToF(Row<T>(q, token, head0 + r)[e + x]) * q_scale : 0.0f;
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) acc[r][i][x] = 0.0f;
    }
  }

  const int32_t* blocks = c.Blocks(seq);
  const C* cache = static_cast<const C*>(c.data) + int64_t{kv} * c.head_stride;
  for (int64_t base = k_begin + int64_t{half} * kUnroll; base < k_end;
       base += int64_t{kHalves} * kUnroll) {
    float kf[kUnroll][NC][4];
    float vf[kUnroll][NC][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool valid = base + u < k_end;
      const C* kp = cache + (valid ? KeyRow(c, blocks, base + u, block_shift) : 0);
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        const int e = (j + 16 * i) * 4;
        if (valid && e < d) {
          Load4(kp + e, c.kv_scale, kf[u][i]);
          Load4(kp + c.plane_stride + e, c.kv_scale, vf[u][i]);
        } else {
#pragma unroll
          for (int x = 0; x < 4; ++x) kf[u][i][x] = vf[u][i][x] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;  // uniform across the block
      float s[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < NC; ++i) {
#pragma unroll
          for (int x = 0; x < 4; ++x) dot += qf[r][i][x] * kf[u][i][x];
        }
        s[u] = HalfWarpSum(dot, half_mask);
      }
      float m_new = m[r];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u >= k_end) s[u] = -INFINITY;
        m_new = fmaxf(m_new, s[u]);
      }
      const float ref = SafeMax(m_new);
      const float alpha = exp2f(m[r] - ref);
      m[r] = m_new;
      float sum = l[r] * alpha;
#pragma unroll
      for (int i = 0; i < NC; ++i) {
#pragma unroll
        for (int x = 0; x < 4; ++x) acc[r][i][x] *= alpha;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float w = exp2f(s[u] - ref);
        sum += w;
#pragma unroll
        for (int i = 0; i < NC; ++i) {
#pragma unroll
          for (int x = 0; x < 4; ++x) acc[r][i][x] += w * vf[u][i][x];
        }
      }
      l[r] = sum;
    }
  }

  // The two halves of each warp merge through shuffles; then the warps through shared memory.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float m_other = __shfl_xor_sync(0xFFFFFFFFu, m[r], 16);
    const float l_other = __shfl_xor_sync(0xFFFFFFFFu, l[r], 16);
    const float m_new = fmaxf(m[r], m_other);
    const float a = exp2f(m[r] - SafeMax(m_new));
    const float b = exp2f(m_other - SafeMax(m_new));
#pragma unroll
    for (int i = 0; i < NC; ++i) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float other = __shfl_xor_sync(0xFFFFFFFFu, acc[r][i][x], 16);
        acc[r][i][x] = acc[r][i][x] * a + other * b;
      }
    }
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < NC; ++i) {
#pragma unroll
        for (int x = 0; x < 4; ++x) merge_acc[warp][r][(j + 16 * i) * 4 + x] = acc[r][i][x];
      }
      if (lane == 0) {
        merge_ml[warp][r][0] = m_new;
        merge_ml[warp][r][1] = l[r] * a + l_other * b;
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rows * d; idx += blockDim.x) {
    const int r = idx / d;
    const int e = idx % d;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, merge_ml[w][r][0]);
    float l_sum = 0.0f;
    float a = 0.0f;
    if (mx != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float scale = exp2f(merge_ml[w][r][0] - mx);
        l_sum += merge_ml[w][r][1] * scale;
        a += merge_acc[w][r][e] * scale;
      }
    }
    const int head = head0 + r;
    if (part.splits == 1) {
      T* o = static_cast<T*>(out.data) + int64_t{token} * out.token_stride + head * out.head_stride;
      o[e] = FromF<T>(a / l_sum);
      continue;
    }
    const int64_t row = (int64_t{split} * gridDim.x + token) * q.num_heads + head;
    part.acc[row * d + e] = a;
    if (e == 0) {
      part.ml[row * 2] = mx;
      part.ml[row * 2 + 1] = l_sum;
    }
  }
}

// ---- PagedAttention, one warp per key (kWarpPerKey) ---------------------------------------------
// One thread block of 4 warps per (query token, KV head, group of up to 8 query heads sharing it,
// split of the key range). Each warp takes every 4th key of the split; a lane holds 4-element
// chunks of the head (1 chunk for D <= 128, 2 for 256), loads the key and value rows with vector
// loads, reduces q·k across the warp with shuffles and keeps an online softmax (m, l, acc) per
// query head in registers. The warps merge through shared memory.

constexpr int kWarpRows = 8;  // query heads of one KV head's group per thread block

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, offset);
  return x;
}

template <class T, int NC>
struct RowState {
  float q[NC][4];
  float acc[NC][4];
  float m;
  float l;
};

// The lane's chunks of the K and V rows of `key` (zeros past the head size).
template <class C, int NC>
__device__ __forceinline__ void LoadKV(const PagedKV& c, const C* cache, const int32_t* blocks,
                                       int64_t key, int kv, int lane, float kf[NC][4],
                                       float vf[NC][4]) {
  const C* kp = cache + c.Offset(blocks[key / c.block_size], key % c.block_size, 0, kv);
#pragma unroll
  for (int i = 0; i < NC; ++i) {
    const int e = (lane + 32 * i) * 4;
    if (e < c.head_size) {
      Load4(kp + e, c.kv_scale, kf[i]);
      Load4(kp + c.plane_stride + e, c.kv_scale, vf[i]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) kf[i][j] = vf[i][j] = 0.0f;
    }
  }
}

// One key for every row: score (a warp-wide dot product), then the online-softmax update.
template <class T, int NC>
__device__ __forceinline__ void Update(RowState<T, NC> (&st)[kWarpRows], int rows,
                                       const float kf[NC][4], const float vf[NC][4]) {
#pragma unroll
  for (int r = 0; r < kWarpRows; ++r) {
    if (r >= rows) break;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NC; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) s += st[r].q[i][j] * kf[i][j];
    }
    s = WarpSum(s);
    const float m_new = fmaxf(st[r].m, s);
    const float alpha = expf(st[r].m - m_new);
    const float w = expf(s - m_new);
    st[r].m = m_new;
    st[r].l = st[r].l * alpha + w;
#pragma unroll
    for (int i = 0; i < NC; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) st[r].acc[i][j] = st[r].acc[i][j] * alpha + w * vf[i][j];
    }
  }
}

template <class T, class C, int NC>
__global__ void __launch_bounds__(kThreads)
    WarpPerKeyKernel(PagedKV c, Activations q, Activations out, AttentionParams p, Partials part) {
  __shared__ float merge_acc[kWarps][kWarpRows][NC * 128];
  __shared__ float merge_ml[kWarps][kWarpRows][2];
  const int token = blockIdx.x;
  const int kv = blockIdx.y;
  const int g = q.num_heads / c.num_kv_heads;
  const int head0 = kv * g + (blockIdx.z / part.splits) * kWarpRows;  // first query head
  const int rows = min(kWarpRows, kv * g + g - head0);
  const int split = blockIdx.z % part.splits;
  const int seq = c.SeqOf(token);
  const int64_t pos = c.Seen(seq) + (token - c.Start(seq));
  int64_t lo = 0;
  int64_t hi = c.Length(seq);
  if (p.causal) {
    hi = pos + 1;
    if (p.sliding_window > 0) lo = max(int64_t{0}, pos - p.sliding_window + 1);
  }
  const int64_t per = (hi - lo + part.splits - 1) / part.splits;
  const int64_t k_begin = lo + split * per;
  const int64_t k_end = min(hi, k_begin + per);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int d = c.head_size;
  RowState<T, NC> st[kWarpRows];
#pragma unroll
  for (int r = 0; r < kWarpRows; ++r) {
    st[r].m = -INFINITY;
    st[r].l = 0.0f;
#pragma unroll
    for (int i = 0; i < NC; ++i) {
      const int e = (lane + 32 * i) * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        st[r].acc[i][j] = 0.0f;
        st[r].q[i][j] =
            r < rows && e < d ? ToF(Row<T>(q, token, head0 + r)[e + j]) * p.scale : 0.0f;
      }
    }
  }
  const int32_t* blocks = c.Blocks(seq);
  const C* cache = static_cast<const C*>(c.data);
  // Two keys per warp per step: both rows' loads are issued before either is used.
  for (int64_t key = k_begin + warp; key < k_end; key += 2 * kWarps) {
    const bool second = key + kWarps < k_end;
    float kf[2][NC][4];
    float vf[2][NC][4];
    LoadKV<C, NC>(c, cache, blocks, key, kv, lane, kf[0], vf[0]);
    if (second) LoadKV<C, NC>(c, cache, blocks, key + kWarps, kv, lane, kf[1], vf[1]);
    Update<T, NC>(st, rows, kf[0], vf[0]);
    if (second) Update<T, NC>(st, rows, kf[1], vf[1]);
  }
  // Merge the warps.
#pragma unroll
  for (int r = 0; r < kWarpRows; ++r) {
#pragma unroll
    for (int i = 0; i < NC; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) merge_acc[warp][r][(lane + 32 * i) * 4 + j] = st[r].acc[i][j];
    }
    if (lane == 0) {
      merge_ml[warp][r][0] = st[r].m;
      merge_ml[warp][r][1] = st[r].l;
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rows * d; idx += blockDim.x) {
    const int r = idx / d;
    const int e = idx % d;
    float m = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge_ml[w][r][0]);
    float l = 0.0f;
    float a = 0.0f;
    if (m != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float scale = expf(merge_ml[w][r][0] - m);
        l += merge_ml[w][r][1] * scale;
        a += merge_acc[w][r][e] * scale;
      }
    }
    const int head = head0 + r;
    if (part.splits == 1) {
      T* o = static_cast<T*>(out.data) + int64_t{token} * out.token_stride + head * out.head_stride;
      o[e] = FromF<T>(a / l);
      continue;
    }
    const int64_t row = (int64_t{split} * gridDim.x + token) * q.num_heads + head;
    part.acc[row * d + e] = a;
    if (e == 0) {
      part.ml[row * 2] = m * kLog2e;  // MergeKernel reads base-2 exponents
      part.ml[row * 2 + 1] = l;
    }
  }
}

// Merges the splits of each (token, head) row into out.
template <class T>
__global__ void MergeKernel(Partials part, Activations out, int num_tokens, int d) {
  const int token = blockIdx.x;
  const int head = blockIdx.y;
  const int hq = gridDim.y;
  float m = -INFINITY;
  for (int s = 0; s < part.splits; ++s) {
    m = fmaxf(m, part.ml[((int64_t{s} * num_tokens + token) * hq + head) * 2]);
  }
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    float l = 0.0f;
    float a = 0.0f;
    for (int s = 0; s < part.splits; ++s) {
      const int64_t row = (int64_t{s} * num_tokens + token) * hq + head;
      const float ms = part.ml[row * 2];
      if (ms == -INFINITY) continue;
      const float scale = exp2f(ms - m);
      l += part.ml[row * 2 + 1] * scale;
      a += part.acc[row * d + e] * scale;
    }
    T* o = static_cast<T*>(out.data) + int64_t{token} * out.token_stride + head * out.head_stride;
    o[e] = FromF<T>(a / l);
  }
}

// ---- host side --------------------------------------------------------------------------------

int MultiprocessorCount(int device) {
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return 100;
  }
  return count;
}

Status LaunchStatus(const char* what) {
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return CudaError(what, e);
  return Status::Ok();
}

// Clears an error an earlier CUDA call (the engine's, or ours) left in the runtime's last-error
// slot, so that this call's launch checks report this call's launches only.
void ClearStaleError() { static_cast<void>(cudaGetLastError()); }

// The cache rows are read 4 elements at a time.
Status CheckAligned(const PagedKV& c) {
  const auto address = reinterpret_cast<uintptr_t>(c.data);
  const uintptr_t bytes = 4 * ElementSize(c.dtype);
  const bool ok = address % bytes == 0 && c.block_stride % 4 == 0 && c.token_stride % 4 == 0 &&
                  c.plane_stride % 4 == 0 && c.head_stride % 4 == 0;
  if (ok) return Status::Ok();
  return InvalidArgumentError(
      StrCat("layer_cache on CUDA must be aligned to 4 elements (address and strides) for vector "
             "loads; address ",
             c.data, ", strides ", c.block_stride, ", ", c.token_stride, ", ", c.plane_stride, ", ",
             c.head_stride));
}

template <class T, class C>
void LaunchAppend(const PagedKV& c, const Activations& k, const Activations& v,
                  const Activations* q, const RotaryParams& rotary, cudaStream_t stream) {
  AppendKernel<T, C>
      <<<c.num_tokens, kThreads, 0, stream>>>(c, k, v, q != nullptr ? *q : k, q != nullptr, rotary);
}

// Launches `kernel(grid, part)` for `rows_per_block` query heads per thread block, with the key
// range split when there are too few thread blocks to fill the GPU and the contexts are long; the
// splits' partials go to a stream-ordered workspace that MergeKernel reduces into `out`.
template <class T, class Launch>
Status LaunchSplit(const PagedKV& c, const Activations& q, const Activations& out,
                   int64_t max_context, int rows_per_block, int blocks_per_sm, int device,
                   cudaStream_t stream, Launch kernel) {
  const int g = q.num_heads / c.num_kv_heads;
  const int head_groups = (g + rows_per_block - 1) / rows_per_block;
  const int64_t blocks = int64_t{c.num_tokens} * c.num_kv_heads * head_groups;
  const int64_t wanted =
      (int64_t{blocks_per_sm} * MultiprocessorCount(device) + blocks - 1) / blocks;
  const int64_t by_length = std::max<int64_t>(1, max_context / kMinKeysPerSplit);
  Partials part;
  // The grid's z extent (head groups × splits) stays within CUDA's 65,535: head_groups is at most
  // kMaxHeads (kernels.cc bounds the heads), so one split always fits.
  const int64_t by_grid = std::max<int64_t>(1, kMaxGridYZ / head_groups);
  part.splits =
      static_cast<int>(std::clamp<int64_t>(std::min({wanted, by_length, by_grid}), 1, kMaxSplits));
  const dim3 grid(static_cast<unsigned>(c.num_tokens), static_cast<unsigned>(c.num_kv_heads),
                  static_cast<unsigned>(head_groups * part.splits));
  if (part.splits == 1) {
    kernel(grid, part);
    return LaunchStatus("PagedAttention kernel launch");
  }
  const int64_t rows = int64_t{part.splits} * c.num_tokens * q.num_heads;
  void* workspace = nullptr;
  const size_t bytes = static_cast<size_t>(rows) * (c.head_size + 2) * sizeof(float);
  if (cudaError_t e = cudaMallocAsync(&workspace, bytes, stream); e != cudaSuccess) {
    static_cast<void>(cudaGetLastError());  // not sticky: leave no error for the next call
    return CudaError(StrCat("cudaMallocAsync of a ", bytes, "-byte attention workspace"), e);
  }
  part.acc = static_cast<float*>(workspace);
  part.ml = part.acc + rows * c.head_size;
  kernel(grid, part);
  // The merge writes `out` from the workspace: only after the partials' launch succeeded.
  const Status launched = [&] {
    BLOCKKV_RETURN_IF_ERROR(LaunchStatus("PagedAttention kernel launch"));
    MergeKernel<T><<<dim3(static_cast<unsigned>(c.num_tokens), static_cast<unsigned>(q.num_heads)),
                     128, 0, stream>>>(part, out, c.num_tokens, c.head_size);
    return LaunchStatus("PagedAttention merge kernel launch");
  }();
  if (cudaError_t e = cudaFreeAsync(workspace, stream); e != cudaSuccess && launched.ok()) {
    static_cast<void>(cudaGetLastError());
    return CudaError("cudaFreeAsync of the attention workspace", e);
  }
  return launched;
}

template <class T, class C, int NC>
Status LaunchWarpPerKey(const PagedKV& c, const Activations& q, const Activations& out,
                        const AttentionParams& p, int64_t max_context, int device,
                        cudaStream_t stream) {
  return LaunchSplit<T>(
      c, q, out, max_context, kWarpRows, 4, device, stream, [&](dim3 grid, const Partials& part) {
        WarpPerKeyKernel<T, C, NC><<<grid, kThreads, 0, stream>>>(c, q, out, p, part);
      });
}

template <class T, class C, int NC, int R>
Status LaunchHalfWarp(const PagedKV& c, const Activations& q, const Activations& out,
                      const AttentionParams& p, int64_t max_context, int device,
                      cudaStream_t stream) {
  const int bs = c.block_size;
  const int block_shift = (bs & (bs - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(bs)) : -1;
  return LaunchSplit<T>(
      c, q, out, max_context, R, 8, device, stream, [&](dim3 grid, const Partials& part) {
        HalfWarpKernel<T, C, NC, R><<<grid, kThreads, 0, stream>>>(c, q, out, p, part, block_shift);
      });
}

// Query heads per thread block: the group size rounded up to a power of two, at most 8 (4 for
// head sizes over 128, whose q and accumulator take twice the registers).
template <class T, class C, int NC>
Status HalfWarpRows(const PagedKV& c, const Activations& q, const Activations& out,
                    const AttentionParams& p, int64_t max_context, int device,
                    cudaStream_t stream) {
  const int g = q.num_heads / c.num_kv_heads;
  if (g == 1) return LaunchHalfWarp<T, C, NC, 1>(c, q, out, p, max_context, device, stream);
  if (g == 2) return LaunchHalfWarp<T, C, NC, 2>(c, q, out, p, max_context, device, stream);
  if constexpr (NC <= 2) {
    if (g > 4) return LaunchHalfWarp<T, C, NC, 8>(c, q, out, p, max_context, device, stream);
  }
  return LaunchHalfWarp<T, C, NC, 4>(c, q, out, p, max_context, device, stream);
}

std::atomic<CudaAttentionKernel> g_attention_kernel{CudaAttentionKernel::kWarpPerKey};

// kWarpPerKey: chunks of 4 elements over 32 lanes (1 for D <= 128, else 2). kHalfWarpPerKey:
// over 16 lanes, so NC chunks cover 64 · NC elements.
template <class T, class C>
Status DispatchKernel(const PagedKV& c, const Activations& q, const Activations& out,
                      const AttentionParams& p, int64_t max_context, int device,
                      cudaStream_t stream) {
  const int d = c.head_size;
  if (g_attention_kernel.load(std::memory_order_relaxed) == CudaAttentionKernel::kWarpPerKey) {
    return d > 128 ? LaunchWarpPerKey<T, C, 2>(c, q, out, p, max_context, device, stream)
                   : LaunchWarpPerKey<T, C, 1>(c, q, out, p, max_context, device, stream);
  }
  if (d <= 64) return HalfWarpRows<T, C, 1>(c, q, out, p, max_context, device, stream);
  if (d <= 128) return HalfWarpRows<T, C, 2>(c, q, out, p, max_context, device, stream);
  return HalfWarpRows<T, C, 4>(c, q, out, p, max_context, device, stream);
}

template <class T>
Status DispatchAttention(const PagedKV& c, const Activations& q, const Activations& out,
                         const AttentionParams& p, int64_t max_context, int device,
                         cudaStream_t stream) {
  if (c.dtype == DType::kFloat8E4M3) {
    return DispatchKernel<T, Fp8>(c, q, out, p, max_context, device, stream);
  }
  return DispatchKernel<T, T>(c, q, out, p, max_context, device, stream);
}

Status DispatchByDType(const PagedKV& c, const Activations& q, const Activations& out,
                       const AttentionParams& p, int64_t max_context, int device,
                       cudaStream_t stream) {
  switch (q.dtype) {
    case DType::kFloat32:
      return DispatchAttention<float>(c, q, out, p, max_context, device, stream);
    case DType::kFloat16:
      return DispatchAttention<__half>(c, q, out, p, max_context, device, stream);
    case DType::kBFloat16:
      return DispatchAttention<__nv_bfloat16>(c, q, out, p, max_context, device, stream);
    default:
      return InternalError(StrCat("PagedAttentionCuda: unchecked dtype ", DTypeName(q.dtype)));
  }
}

}  // namespace

void SetCudaAttentionKernel(CudaAttentionKernel kernel) {
  g_attention_kernel.store(kernel, std::memory_order_relaxed);
}

CudaAttentionKernel GetCudaAttentionKernel() {
  return g_attention_kernel.load(std::memory_order_relaxed);
}

Status AppendKVCuda(const PagedKV& cache, const Activations& k, const Activations& v,
                    const Activations* q, const RotaryParams& rotary, int device,
                    CUstream_st* stream) {
  ScopedCudaDevice guard(device);
  BLOCKKV_RETURN_IF_ERROR(guard.status());
  ClearStaleError();
  const bool fp8 = cache.dtype == DType::kFloat8E4M3;
  switch (k.dtype) {
    case DType::kFloat32:
      fp8 ? LaunchAppend<float, Fp8>(cache, k, v, q, rotary, stream)
          : LaunchAppend<float, float>(cache, k, v, q, rotary, stream);
      break;
    case DType::kFloat16:
      fp8 ? LaunchAppend<__half, Fp8>(cache, k, v, q, rotary, stream)
          : LaunchAppend<__half, __half>(cache, k, v, q, rotary, stream);
      break;
    case DType::kBFloat16:
      fp8 ? LaunchAppend<__nv_bfloat16, Fp8>(cache, k, v, q, rotary, stream)
          : LaunchAppend<__nv_bfloat16, __nv_bfloat16>(cache, k, v, q, rotary, stream);
      break;
    default:
      return InternalError(StrCat("AppendKVCuda: unchecked dtype ", DTypeName(k.dtype)));
  }
  return LaunchStatus("AppendKV kernel launch");
}

Status CopyToHostCuda(void* dst, const void* src, size_t bytes, int device, CUstream_st* stream) {
  ScopedCudaDevice guard(device);
  BLOCKKV_RETURN_IF_ERROR(guard.status());
  if (cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream);
      e != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return CudaError(StrCat("copying a ", bytes, "-byte page-table array to the host"), e);
  }
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return CudaError("waiting for a page-table array's copy to the host", e);
  }
  return Status::Ok();
}

Status PagedAttentionCuda(const PagedKV& cache, const Activations& q, const Activations& out,
                          const AttentionParams& params, int64_t max_context, int device,
                          CUstream_st* stream) {
  ScopedCudaDevice guard(device);
  BLOCKKV_RETURN_IF_ERROR(guard.status());
  BLOCKKV_RETURN_IF_ERROR(CheckAligned(cache));
  ClearStaleError();
  return DispatchByDType(cache, q, out, params, max_context, device, stream);
}

}  // namespace blockkv::internal
