// AppendKV and PagedAttention: every argument is checked here, once, before any memory is
// touched; then the views of src/internal/paged_view.h go to the CPU backend (kernels_cpu.cc)
// or the CUDA backend (cuda/kernels.cu).
//
// What a check reads: the batch's host arrays (descriptors and the CSR page table), whichever
// side the tensors live on, so a CUDA call validates without a device round trip. The scan over
// each sequence's needed table entries (kNoBlock, ids past the cache) is O(blocks in the batch),
// small beside the attention itself.
#include "blockkv/kernels.h"

#include <cstddef>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <thread>
#include <utility>

#include "internal/kernels_backend.h"
#include "internal/paged_view.h"
#include "internal/strings.h"

namespace blockkv {

using internal::Activations;
using internal::PagedKV;
using internal::StrCat;

namespace {

bool IsActivationDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

bool IsSupportedHeadSize(int64_t d) {
  return std::find(std::begin(internal::kHeadSizes), std::end(internal::kHeadSizes), d) !=
         std::end(internal::kHeadSizes);
}

std::string Shape(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += StrCat(i == 0 ? "" : ", ", t.shape[i]);
  return s + "]";
}

Status CheckScale(const char* name, float value) {
  if (std::isfinite(value) && value > 0.0f) return Status::Ok();
  return InvalidArgumentError(StrCat(name, " must be finite and > 0, got ", value));
}

// More workers than this gain nothing on any machine blockkv runs on, and each costs a thread and
// a scratch buffer: larger requests are clamped (an absurd num_threads must not allocate).
constexpr int kMaxThreads = 256;

int ResolveThreads(int requested) {
  if (requested > 0) return std::min(requested, kMaxThreads);
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 256u));
}

// The layer cache: [num_blocks, block_size, 2, Hkv, D], a supported dtype and head size.
Status CheckCache(const TensorView& cache) {
  if (cache.ndim != 5 || cache.shape[2] != 2) {
    return InvalidArgumentError(
        StrCat("layer_cache must be [num_blocks, block_size, 2, "
               "num_kv_heads, head_size], got shape ",
               Shape(cache)));
  }
  if (!IsActivationDType(cache.dtype) && cache.dtype != DType::kFloat8E4M3) {
    return InvalidArgumentError(StrCat("layer_cache dtype ", DTypeName(cache.dtype),
                                       " is not supported (fp32, fp16, bf16, fp8_e4m3)"));
  }
  if (!IsSupportedHeadSize(cache.shape[4])) {
    return InvalidArgumentError(
        StrCat("head size ", cache.shape[4], " is not supported (64, 80, 96, 128, 256)"));
  }
  if (cache.stride(4) != 1) {
    return InvalidArgumentError(
        StrCat("layer_cache's head_size dimension must be contiguous, stride ", cache.stride(4)));
  }
  if (cache.shape[0] > std::numeric_limits<int32_t>::max() || cache.shape[1] < 1 ||
      cache.shape[3] < 1 || cache.shape[1] > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError(StrCat("layer_cache shape ", Shape(cache), " is out of range"));
  }
  if (cache.data == nullptr && cache.shape[0] > 0) {
    return InvalidArgumentError("layer_cache has no data");
  }
  return Status::Ok();
}

// An activation [rows, heads, D] on the cache's device, rows = T or P of the batch.
Status CheckActivations(const char* name, const TensorView& t, const TensorView& cache,
                        int64_t heads, const RaggedBatch& batch) {
  const int64_t d = cache.shape[4];
  const bool rows_ok =
      t.ndim == 3 && (t.shape[0] == batch.current_tokens() || t.shape[0] == batch.padded_tokens());
  if (!rows_ok || t.shape[1] != heads || t.shape[2] != d) {
    return InvalidArgumentError(StrCat(name, " must be [T, ", heads, ", ", d,
                                       "] with T = ", batch.current_tokens(), " (or padded ",
                                       batch.padded_tokens(), "), got shape ", Shape(t)));
  }
  if (!IsActivationDType(t.dtype)) {
    return InvalidArgumentError(
        StrCat(name, " dtype ", DTypeName(t.dtype), " is not supported (fp32, fp16, bf16)"));
  }
  // Rows and heads must not overlap: work items write different (row, head) ranges in
  // parallel, and a broadcast view (a stride of 0) would make them write the same memory.
  if (t.stride(2) != 1 || t.stride(1) < d || t.stride(0) < t.shape[1] * t.stride(1)) {
    return InvalidArgumentError(StrCat(name, " must have a contiguous last dimension and rows and ",
                                       "heads that do not overlap, got strides [", t.stride(0),
                                       ", ", t.stride(1), ", ", t.stride(2), "]"));
  }
  if (t.device != cache.device || t.device_ordinal != cache.device_ordinal) {
    return InvalidArgumentError(StrCat(name, " is on ", DeviceKindName(t.device), ":",
                                       t.device_ordinal, " but layer_cache on ",
                                       DeviceKindName(cache.device), ":", cache.device_ordinal));
  }
  if (t.data == nullptr && t.shape[0] > 0)
    return InvalidArgumentError(StrCat(name, " has no data"));
  const bool cache_ok = cache.dtype == t.dtype || cache.dtype == DType::kFloat8E4M3;
  if (!cache_ok) {
    return InvalidArgumentError(StrCat(name, " dtype ", DTypeName(t.dtype),
                                       " and layer_cache dtype ", DTypeName(cache.dtype),
                                       " differ (the cache holds the activations' dtype or fp8)"));
  }
  return Status::Ok();
}

// The bytes a [rows, heads, D] activation spans.
std::pair<const std::byte*, const std::byte*> Span(const TensorView& t) {
  const auto* begin = static_cast<const std::byte*>(t.data);
  if (t.shape[0] == 0) return {begin, begin};
  const int64_t last = (t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1) + t.shape[2];
  return {begin, begin + last * static_cast<int64_t>(ElementSize(t.dtype))};
}

// `a` is written while `b` is read (or written) by other work items: they must not share memory.
Status CheckDisjoint(const char* a_name, const TensorView& a, const char* b_name,
                     const TensorView& b) {
  const auto [a_begin, a_end] = Span(a);
  const auto [b_begin, b_end] = Span(b);
  if (a_begin < b_end && b_begin < a_end) {
    return InvalidArgumentError(StrCat(a_name, " and ", b_name, " overlap in memory"));
  }
  return Status::Ok();
}

Status CheckGqa(int64_t hq, int64_t hkv) {
  if (hq < 1 || hq % hkv != 0) {
    return InvalidArgumentError(StrCat("query heads ", hq, " must be a positive multiple of ", hkv,
                                       " KV heads (grouped-query attention)"));
  }
  return Status::Ok();
}

Activations ActivationsOf(const TensorView& t) {
  return Activations{.data = t.data,
                     .token_stride = t.stride(0),
                     .head_stride = t.stride(1),
                     .num_heads = static_cast<int32_t>(t.shape[1]),
                     .dtype = t.dtype};
}

// The paged view of `cache` over the batch's group `group`, host or device arrays.
Result<PagedKV> MakePagedKV(const TensorView& cache, const RaggedBatch& batch, int group,
                            float kv_scale) {
  const bool on_device = cache.device == DeviceKind::kCuda;
  BLOCKKV_ASSIGN_OR_RETURN(TensorView descriptors, batch.inflight_seq_descriptors(on_device));
  BLOCKKV_ASSIGN_OR_RETURN(TensorView tokens_to_seq, batch.tokens_to_seq(on_device));
  BLOCKKV_ASSIGN_OR_RETURN(TensorView indptr, batch.kv_indptr(group, on_device));
  BLOCKKV_ASSIGN_OR_RETURN(TensorView indices, batch.kv_indices(group, on_device));
  return PagedKV{.data = cache.data,
                 .block_stride = cache.stride(0),
                 .token_stride = cache.stride(1),
                 .plane_stride = cache.stride(2),
                 .head_stride = cache.stride(3),
                 .num_blocks = static_cast<int32_t>(cache.shape[0]),
                 .block_size = static_cast<int32_t>(cache.shape[1]),
                 .num_kv_heads = static_cast<int32_t>(cache.shape[3]),
                 .head_size = static_cast<int32_t>(cache.shape[4]),
                 .dtype = cache.dtype,
                 .kv_scale = cache.dtype == DType::kFloat8E4M3 ? kv_scale : 1.0f,
                 .descriptors = static_cast<const int32_t*>(descriptors.data),
                 .tokens_to_seq = static_cast<const int32_t*>(tokens_to_seq.data),
                 .kv_indptr = static_cast<const int32_t*>(indptr.data),
                 .kv_indices = static_cast<const int32_t*>(indices.data),
                 .num_seqs = batch.current_sequences(),
                 .num_tokens = batch.current_tokens()};
}

// The table entries for token positions [first, end) of sequence i (host view `host`) hold
// blocks of this cache: not released (kNoBlock), not past num_blocks. Also checks that the
// batch's table length matches this cache's block size.
Status CheckBlocks(const PagedKV& host, int32_t i, int64_t first, int64_t end, int group) {
  const int32_t* desc = host.descriptors + int64_t{i} * 4;
  const int64_t total = int64_t{desc[1]} + desc[2];
  const int64_t bs = host.block_size;
  const int32_t begin = host.kv_indptr[i];
  const int64_t listed = int64_t{host.kv_indptr[i + 1]} - begin;
  if (listed != (total + bs - 1) / bs) {
    return InvalidArgumentError(
        StrCat("layer_cache block size ", bs, " does not match cache group ", group,
               " of the batch: sequence ", i, " holds ", total, " tokens in ", listed, " blocks"));
  }
  for (int64_t b = first / bs; b < (end + bs - 1) / bs; ++b) {
    const int32_t block = host.kv_indices[begin + b];
    if (block == kNoBlock) {
      return FailedPreconditionError(StrCat("sequence ", i, " of the batch needs block ", b,
                                            " (tokens [", b * bs, ", ", (b + 1) * bs,
                                            ")), which was released (FreeLeadingBlocks)"));
    }
    if (block < 0 || block >= host.num_blocks) {
      return InvalidArgumentError(StrCat("sequence ", i, " of the batch uses block ", block,
                                         ", outside layer_cache's ", host.num_blocks,
                                         " blocks: is it this group's cache?"));
    }
  }
  return Status::Ok();
}

// `cache` is one layer of cache group `group` of the batch's own state manager: the block ids
// of the batch index that cache and no other (another manager's cache of the same shape would
// be written through ids it never handed out).
Status CheckOwnCache(const TensorView& cache, const RaggedBatch& batch, int group) {
  BLOCKKV_ASSIGN_OR_RETURN(TensorView storage, batch.manager().kv_cache().GetGroupStorage(group));
  const auto* begin = static_cast<const std::byte*>(storage.data);
  const std::byte* end = begin + storage.numel() * static_cast<int64_t>(ElementSize(storage.dtype));
  const auto* at = static_cast<const std::byte*>(cache.data);
  const int64_t layer_bytes = storage.strides[0] * static_cast<int64_t>(ElementSize(storage.dtype));
  bool same = at >= begin && at + layer_bytes <= end && (at - begin) % layer_bytes == 0 &&
              cache.dtype == storage.dtype && cache.device == storage.device &&
              cache.device_ordinal == storage.device_ordinal;
  for (int d = 0; d < 5 && same; ++d) {
    same = cache.shape[d] == storage.shape[d + 1] && cache.strides[d] == storage.strides[d + 1];
  }
  if (!same) {
    return InvalidArgumentError(StrCat("layer_cache is not a layer of cache group ", group,
                                       " of the batch's state manager (use its GetCache(layer, ",
                                       group, "))"));
  }
  return Status::Ok();
}

// Checks shared by both kernels; fills *host with the host view (for the block checks).
Status CheckCommon(const TensorView& cache, const RaggedBatch& batch, int group, float kv_scale,
                   int num_threads, PagedKV* host) {
  if (!batch.finalized()) {
    return FailedPreconditionError("the batch is not finalized: call Finalize before the kernels");
  }
  BLOCKKV_RETURN_IF_ERROR(CheckCache(cache));
  BLOCKKV_RETURN_IF_ERROR(CheckScale("kv_scale", kv_scale));
  if (num_threads < 0) {
    return InvalidArgumentError(StrCat("num_threads must be >= 0, got ", num_threads));
  }
#if !defined(BLOCKKV_HAVE_CUDA)
  if (cache.device == DeviceKind::kCuda) {
    return UnavailableError("the tensors are on a CUDA device but blockkv was built without CUDA");
  }
#endif
  TensorView host_cache = cache;
  host_cache.device = DeviceKind::kCpu;
  BLOCKKV_ASSIGN_OR_RETURN(*host, MakePagedKV(host_cache, batch, group, kv_scale));
  return CheckOwnCache(cache, batch, group);
}

Status CheckRotary(const RotaryOptions& rotary, int64_t head_size) {
  if (!rotary.enabled) return Status::Ok();
  const int64_t dim = rotary.rotary_dim == 0 ? head_size : rotary.rotary_dim;
  if (dim < 2 || dim % 2 != 0 || dim > head_size) {
    return InvalidArgumentError(StrCat("rotary_dim ", rotary.rotary_dim,
                                       " must be 0 or even and in [2, head_size ", head_size, "]"));
  }
  if (!std::isfinite(rotary.theta) || rotary.theta <= 0.0) {
    return InvalidArgumentError(StrCat("rotary theta must be finite and > 0, got ", rotary.theta));
  }
  return Status::Ok();
}

}  // namespace

Status AppendKV(const TensorView& layer_cache, const TensorView& k, const TensorView& v,
                const RaggedBatch& batch, const AppendKVOptions& options) {
  PagedKV host;
  BLOCKKV_RETURN_IF_ERROR(
      CheckCommon(layer_cache, batch, options.group, options.kv_scale, options.num_threads, &host));
  const int64_t hkv = layer_cache.shape[3];
  BLOCKKV_RETURN_IF_ERROR(CheckActivations("k", k, layer_cache, hkv, batch));
  BLOCKKV_RETURN_IF_ERROR(CheckActivations("v", v, layer_cache, hkv, batch));
  if (v.dtype != k.dtype) {
    return InvalidArgumentError(
        StrCat("k dtype ", DTypeName(k.dtype), " and v dtype ", DTypeName(v.dtype), " differ"));
  }
  BLOCKKV_RETURN_IF_ERROR(CheckRotary(options.rotary, layer_cache.shape[4]));
  const bool rotate_q = options.rotary.enabled && options.q != nullptr;
  if (rotate_q) {
    const TensorView& q = *options.q;
    BLOCKKV_RETURN_IF_ERROR(CheckGqa(q.ndim == 3 ? q.shape[1] : 0, hkv));
    BLOCKKV_RETURN_IF_ERROR(CheckActivations("q", q, layer_cache, q.shape[1], batch));
    if (q.dtype != k.dtype) {
      return InvalidArgumentError(
          StrCat("q dtype ", DTypeName(q.dtype), " and k dtype ", DTypeName(k.dtype), " differ"));
    }
    BLOCKKV_RETURN_IF_ERROR(CheckDisjoint("q", q, "k", k));
    BLOCKKV_RETURN_IF_ERROR(CheckDisjoint("q", q, "v", v));
  }
  for (int32_t i = 0; i < host.num_seqs; ++i) {
    const int32_t* desc = host.descriptors + int64_t{i} * 4;
    BLOCKKV_RETURN_IF_ERROR(
        CheckBlocks(host, i, desc[2], int64_t{desc[2]} + desc[1], options.group));
  }
  if (host.num_tokens == 0) return Status::Ok();
  const internal::RotaryParams rotary{
      .enabled = options.rotary.enabled,
      .rotary_dim = options.rotary.rotary_dim == 0 ? host.head_size : options.rotary.rotary_dim,
      .theta = options.rotary.theta};
  const Activations ka = ActivationsOf(k);
  const Activations va = ActivationsOf(v);
  Activations qa;
  if (rotate_q) qa = ActivationsOf(*options.q);
#if defined(BLOCKKV_HAVE_CUDA)
  if (layer_cache.device == DeviceKind::kCuda) {
    BLOCKKV_ASSIGN_OR_RETURN(PagedKV device,
                             MakePagedKV(layer_cache, batch, options.group, options.kv_scale));
    return internal::AppendKVCuda(device, ka, va, rotate_q ? &qa : nullptr, rotary,
                                  layer_cache.device_ordinal, options.stream);
  }
#endif
  internal::AppendKVCpu(host, ka, va, rotate_q ? &qa : nullptr, rotary,
                        ResolveThreads(options.num_threads));
  return Status::Ok();
}

Status PagedAttention(const TensorView& q, const TensorView& layer_cache, const RaggedBatch& batch,
                      const TensorView& out, const AttentionOptions& options) {
  PagedKV host;
  BLOCKKV_RETURN_IF_ERROR(
      CheckCommon(layer_cache, batch, options.group, options.kv_scale, options.num_threads, &host));
  const int64_t hkv = layer_cache.shape[3];
  const int64_t hq = q.ndim == 3 ? q.shape[1] : 0;
  BLOCKKV_RETURN_IF_ERROR(CheckGqa(hq, hkv));
  BLOCKKV_RETURN_IF_ERROR(CheckActivations("q", q, layer_cache, hq, batch));
  BLOCKKV_RETURN_IF_ERROR(CheckActivations("out", out, layer_cache, hq, batch));
  if (out.dtype != q.dtype) {
    return InvalidArgumentError(
        StrCat("q dtype ", DTypeName(q.dtype), " and out dtype ", DTypeName(out.dtype), " differ"));
  }
  BLOCKKV_RETURN_IF_ERROR(CheckDisjoint("out", out, "q", q));
  if (options.sliding_window < 0 || (options.sliding_window > 0 && !options.causal)) {
    return InvalidArgumentError(StrCat("sliding_window ", options.sliding_window,
                                       " must be 0 or > 0 with causal attention"));
  }
  if (options.scale != 0.0f) BLOCKKV_RETURN_IF_ERROR(CheckScale("scale", options.scale));
  int64_t max_context = 0;  // the most keys any sequence holds, for the CUDA split
  for (int32_t i = 0; i < host.num_seqs; ++i) {
    const int32_t* desc = host.descriptors + int64_t{i} * 4;
    const int64_t end = int64_t{desc[2]} + desc[1];
    max_context = std::max(max_context, end);
    // The first query (position seen) sees keys from seen − W + 1 with a window.
    const int64_t first =
        options.sliding_window > 0 ? std::max<int64_t>(0, desc[2] - options.sliding_window + 1) : 0;
    BLOCKKV_RETURN_IF_ERROR(CheckBlocks(host, i, first, end, options.group));
  }
  if (host.num_tokens == 0) return Status::Ok();
  const internal::AttentionParams params{
      .scale = options.scale != 0.0f
                   ? options.scale
                   : static_cast<float>(1.0 / std::sqrt(static_cast<double>(host.head_size))),
      .causal = options.causal,
      .sliding_window = options.sliding_window,
      .num_threads = ResolveThreads(options.num_threads)};
#if defined(BLOCKKV_HAVE_CUDA)
  if (layer_cache.device == DeviceKind::kCuda) {
    BLOCKKV_ASSIGN_OR_RETURN(PagedKV device,
                             MakePagedKV(layer_cache, batch, options.group, options.kv_scale));
    return internal::PagedAttentionCuda(device, ActivationsOf(q), ActivationsOf(out), params,
                                        max_context, layer_cache.device_ordinal, options.stream);
  }
#endif
  internal::PagedAttentionCpu(host, ActivationsOf(q), ActivationsOf(out), params);
  return Status::Ok();
}

}  // namespace blockkv
