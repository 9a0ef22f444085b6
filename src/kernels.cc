// SPDX-License-Identifier: Apache-2.0
// AppendKV and PagedAttention: every argument is checked here, once, before any memory is
// touched; then the views of src/internal/paged_view.h go to the CPU backend (kernels_cpu.cc)
// or the CUDA backend (cuda/kernels.cu).
//
// Three ways in, one path: a RaggedBatch (its host arrays validate, its device mirror serves the
// GPU; the cache must be a layer of the batch's own manager), or a page table of the caller's
// (page_table.h), CSR or slot mapping, whose arrays live with the cache: read in place on the
// host, copied to the host first (synchronously, on the call's stream) for a CUDA cache. Each
// becomes a PagedKV; the checks below read it through its accessors, the same ones the backends
// use. The scans are O(sequences + blocks read + tokens), small beside the attention itself; the
// slot-uniqueness check of a table's AppendKV sorts the step's slots (O(T log T)).
#include "blockkv/kernels.h"

#include <cstddef>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
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
  if (cache.ndim == 3) {
    return InvalidArgumentError(
        StrCat("layer_cache of shape ", Shape(cache),
               " is an MLA layer [num_blocks, block_size, latent_dim + rope_dim]: use "
               "MlaAppendKV / MlaPagedAttention"));
  }
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
  if (cache.shape[0] < 0 || cache.shape[0] > std::numeric_limits<int32_t>::max() ||
      cache.shape[1] < 1 || cache.shape[3] < 1 ||
      cache.shape[1] > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError(StrCat("layer_cache shape ", Shape(cache), " is out of range"));
  }
  if (cache.shape[3] > internal::kMaxHeads) {
    return InvalidArgumentError(StrCat("layer_cache's ", cache.shape[3],
                                       " KV heads exceed the limit of ", internal::kMaxHeads));
  }
  if (cache.data == nullptr && cache.shape[0] > 0) {
    return InvalidArgumentError("layer_cache has no data");
  }
  return Status::Ok();
}

// Which row counts an activation may have: a RaggedBatch's T or P, or a table's T or more.
struct Rows {
  int64_t tokens = 0;  // real tokens
  int64_t padded = 0;  // RaggedBatch: P; a table: -1 (any count >= tokens)
};

// An activation [rows, heads, D] on the cache's device.
Status CheckActivations(const char* name, const TensorView& t, const TensorView& cache,
                        int64_t heads, const Rows& rows) {
  const int64_t d = cache.shape[4];
  const bool rows_ok =
      t.ndim == 3 && (rows.padded < 0 ? t.shape[0] >= rows.tokens
                                      : t.shape[0] == rows.tokens || t.shape[0] == rows.padded);
  if (!rows_ok || t.shape[1] != heads || t.shape[2] != d) {
    const std::string want = rows.padded < 0
                                 ? StrCat(">= ", rows.tokens, " (the table's tokens)")
                                 : StrCat("= ", rows.tokens, " (or padded ", rows.padded, ")");
    return InvalidArgumentError(
        StrCat(name, " must be [T, ", heads, ", ", d, "] with T ", want, ", got shape ", Shape(t)));
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
  if (hq > internal::kMaxHeads) {
    return InvalidArgumentError(
        StrCat("query heads ", hq, " exceed the limit of ", internal::kMaxHeads));
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

// The cache part of a paged view (the page table is filled in by the caller).
PagedKV CacheView(const TensorView& cache, float kv_scale) {
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
                 .kv_scale = cache.dtype == DType::kFloat8E4M3 ? kv_scale : 1.0f};
}

// An MLA layer [num_blocks, block_size, L + R] seen as one KV head of head_size L + R.
PagedKV MlaCacheView(const TensorView& cache) {
  return PagedKV{.data = cache.data,
                 .block_stride = cache.stride(0),
                 .token_stride = cache.stride(1),
                 .plane_stride = 0,
                 .head_stride = 0,
                 .num_blocks = static_cast<int32_t>(cache.shape[0]),
                 .block_size = static_cast<int32_t>(cache.shape[1]),
                 .num_kv_heads = 1,
                 .head_size = static_cast<int32_t>(cache.shape[2]),
                 .dtype = cache.dtype,
                 .kv_scale = 1.0f};
}

// The paged view of `cache` over the batch's group `group`, host or device arrays.
Result<PagedKV> BatchView(const TensorView& cache, const RaggedBatch& batch, int group,
                          float kv_scale, bool on_device) {
  BLOCKKV_ASSIGN_OR_RETURN(TensorView descriptors, batch.inflight_seq_descriptors(on_device));
  BLOCKKV_ASSIGN_OR_RETURN(TensorView tokens_to_seq, batch.tokens_to_seq(on_device));
  BLOCKKV_ASSIGN_OR_RETURN(TensorView indptr, batch.kv_indptr(group, on_device));
  BLOCKKV_ASSIGN_OR_RETURN(TensorView indices, batch.kv_indices(group, on_device));
  PagedKV view = cache.ndim == 3 ? MlaCacheView(cache) : CacheView(cache, kv_scale);
  view.form = internal::TableForm::kBatch;
  view.descriptors = static_cast<const int32_t*>(descriptors.data);
  view.tokens_to_seq = static_cast<const int32_t*>(tokens_to_seq.data);
  view.kv_indptr = static_cast<const int32_t*>(indptr.data);
  view.kv_indices = static_cast<const int32_t*>(indices.data);
  view.num_seqs = batch.current_sequences();
  view.num_tokens = batch.current_tokens();
  return view;
}

// Sequence i's table entries for token positions [first, end) hold blocks of this cache (host
// view). A RaggedBatch's entries may be kNoBlock (released by FreeLeadingBlocks), and its table
// length must match this cache's block size.
Status CheckBlocks(const PagedKV& host, int32_t i, int64_t first, int64_t end) {
  const int64_t bs = host.block_size;
  if (host.form == internal::TableForm::kBatch) {
    const int64_t listed = int64_t{host.kv_indptr[i + 1]} - host.kv_indptr[i];
    if (listed != (host.Length(i) + bs - 1) / bs) {
      return InvalidArgumentError(StrCat(
          "layer_cache block size ", bs, " does not match the batch's cache group: sequence ", i,
          " holds ", host.Length(i), " tokens in ", listed, " blocks"));
    }
  }
  const int32_t* blocks = host.Blocks(i);
  for (int64_t b = first / bs; b < (end + bs - 1) / bs; ++b) {
    const int32_t block = blocks[b];
    if (block == kNoBlock && host.form == internal::TableForm::kBatch) {
      return FailedPreconditionError(StrCat("sequence ", i, " of the batch needs block ", b,
                                            " (tokens [", b * bs, ", ", (b + 1) * bs,
                                            ")), which was released (FreeLeadingBlocks)"));
    }
    if (block < 0 || block >= host.num_blocks) {
      return InvalidArgumentError(StrCat("sequence ", i, " uses block ", block, " (its block ", b,
                                         "), outside layer_cache's ", host.num_blocks,
                                         " blocks: is it this cache's table?"));
    }
  }
  return Status::Ok();
}

// `cache` is one layer of cache group `group` of the batch's own state manager: the block ids
// of the batch index that cache and no other (another manager's cache of the same shape would
// be written through ids it never handed out).
Status CheckOwnCache(const TensorView& cache, const RaggedBatch& batch, int group) {
  BLOCKKV_ASSIGN_OR_RETURN(TensorView storage, batch.manager().kv_cache().GetGroupStorage(group));
  storage = CanonicalStrides(storage);
  const auto* begin = static_cast<const std::byte*>(storage.data);
  const std::byte* end = begin + storage.numel() * static_cast<int64_t>(ElementSize(storage.dtype));
  const auto* at = static_cast<const std::byte*>(cache.data);
  const int64_t layer_bytes = storage.strides[0] * static_cast<int64_t>(ElementSize(storage.dtype));
  bool same = at >= begin && at + layer_bytes <= end && (at - begin) % layer_bytes == 0 &&
              cache.dtype == storage.dtype && cache.device == storage.device &&
              cache.device_ordinal == storage.device_ordinal && storage.ndim == cache.ndim + 1;
  for (int d = 0; d < cache.ndim && same; ++d) {
    same = cache.shape[d] == storage.shape[d + 1] && cache.strides[d] == storage.strides[d + 1];
  }
  if (!same) {
    return InvalidArgumentError(StrCat("layer_cache is not a layer of cache group ", group,
                                       " of the batch's state manager (use its GetCache(layer, ",
                                       group, "))"));
  }
  return Status::Ok();
}

// Checks shared by both kernels and every form of page table.
Status CheckCommon(const TensorView& cache, float kv_scale, int num_threads) {
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
  return Status::Ok();
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

// ---- page tables of the caller's -------------------------------------------------------------

// A page table's arrays as the checks read them: in place for a host cache; for a CUDA cache,
// host copies made here (they live as long as this object).
class HostArrays {
 public:
  HostArrays(const TensorView& cache, CUstream_st* stream)
      : on_device_(cache.device == DeviceKind::kCuda),
        ordinal_(cache.device_ordinal),
        stream_(stream) {}

  // `n` elements at `p`, readable here. kInvalidArgument for a null array of n > 0 elements.
  template <class T>
  Result<const T*> Get(const char* name, const T* p, int64_t n) {
    if (n <= 0) return p;
    if (p == nullptr)
      return InvalidArgumentError(StrCat(name, " is null but must hold ", n, " entries"));
    if (!on_device_) return p;
#if defined(BLOCKKV_HAVE_CUDA)
    copies_.emplace_back(static_cast<size_t>(n) * sizeof(T));
    BLOCKKV_RETURN_IF_ERROR(internal::CopyToHostCuda(copies_.back().data(), p,
                                                     copies_.back().size(), ordinal_, stream_));
    return reinterpret_cast<const T*>(copies_.back().data());
#else
    return UnavailableError("the tensors are on a CUDA device but blockkv was built without CUDA");
#endif
  }

 private:
  bool on_device_;
  [[maybe_unused]] int ordinal_;                // read only with CUDA
  [[maybe_unused]] CUstream_st* stream_;        // read only with CUDA
  std::vector<std::vector<std::byte>> copies_;  // 8-byte aligned (operator new)
};

// The 0-based, non-decreasing offsets indptr[0..n] (n + 1 entries).
Status CheckIndptr(const char* name, const int32_t* indptr, int32_t n) {
  if (indptr[0] != 0) return InvalidArgumentError(StrCat(name, "[0] must be 0, got ", indptr[0]));
  for (int32_t i = 0; i < n; ++i) {
    if (indptr[i + 1] < indptr[i]) {
      return InvalidArgumentError(StrCat(name, "[", i + 1, "] = ", indptr[i + 1], " is less than ",
                                         name, "[", i, "] = ", indptr[i]));
    }
  }
  return Status::Ok();
}

Status CheckNumSeqs(int32_t num_seqs) {
  if (num_seqs < 0) return InvalidArgumentError(StrCat("num_seqs must be >= 0, got ", num_seqs));
  return Status::Ok();
}

// Each sequence holds at least its new tokens, and at most what an int32 position counts.
Status CheckLengths(const PagedKV& host) {
  for (int32_t i = 0; i < host.num_seqs; ++i) {
    const int64_t length = host.Length(i);
    if (length < host.Tokens(i) || length > std::numeric_limits<int32_t>::max()) {
      return InvalidArgumentError(StrCat("sequence ", i, " has ", host.Tokens(i),
                                         " new tokens but holds ", length,
                                         " tokens in all (must be >= them, < 2^31)"));
    }
  }
  return Status::Ok();
}

// Host and device views of a CSR table (arrays copied to `arrays` for a CUDA cache) and its
// structure checked; *positions: the host positions, or null.
Status CsrViews(const CsrPageTable& t, const TensorView& cache, float kv_scale, HostArrays& arrays,
                PagedKV* host, PagedKV* device, const int32_t** positions) {
  BLOCKKV_RETURN_IF_ERROR(CheckNumSeqs(t.num_seqs));
  const int64_t s = t.num_seqs;
  *device = cache.ndim == 3 ? MlaCacheView(cache) : CacheView(cache, kv_scale);
  device->form = internal::TableForm::kCsr;
  device->qo_indptr = t.qo_indptr;
  device->kv_indptr = t.kv_indptr;
  device->kv_indices = t.kv_indices;
  device->kv_last_page_len = t.kv_last_page_len;
  device->num_seqs = t.num_seqs;
  *host = *device;
  if (s == 0) return Status::Ok();
  BLOCKKV_ASSIGN_OR_RETURN(host->qo_indptr, arrays.Get("qo_indptr", t.qo_indptr, s + 1));
  BLOCKKV_RETURN_IF_ERROR(CheckIndptr("qo_indptr", host->qo_indptr, t.num_seqs));
  BLOCKKV_ASSIGN_OR_RETURN(host->kv_indptr, arrays.Get("kv_indptr", t.kv_indptr, s + 1));
  BLOCKKV_RETURN_IF_ERROR(CheckIndptr("kv_indptr", host->kv_indptr, t.num_seqs));
  BLOCKKV_ASSIGN_OR_RETURN(host->kv_indices,
                           arrays.Get("kv_indices", t.kv_indices, host->kv_indptr[s]));
  BLOCKKV_ASSIGN_OR_RETURN(host->kv_last_page_len,
                           arrays.Get("kv_last_page_len", t.kv_last_page_len, s));
  host->num_tokens = device->num_tokens = host->qo_indptr[s];
  if (t.positions != nullptr) {
    BLOCKKV_ASSIGN_OR_RETURN(*positions, arrays.Get("positions", t.positions, host->num_tokens));
  }
  for (int32_t i = 0; i < t.num_seqs; ++i) {
    const int32_t blocks = host->kv_indptr[i + 1] - host->kv_indptr[i];
    const int32_t last = host->kv_last_page_len[i];
    if (blocks > 0 ? last < 1 || last > host->block_size : last != 0) {
      return InvalidArgumentError(StrCat(
          "kv_last_page_len[", i, "] = ", last, " must be in [1, block_size ", host->block_size,
          "] (0 for a sequence of no blocks); it has ", blocks, " blocks"));
    }
  }
  return CheckLengths(*host);
}

// The same for vLLM's form; *slot_mapping: the host slot mapping (num_tokens entries).
Status SlotViews(const SlotMappingPageTable& t, const TensorView& cache, float kv_scale,
                 HostArrays& arrays, PagedKV* host, PagedKV* device, const int64_t** slot_mapping) {
  BLOCKKV_RETURN_IF_ERROR(CheckNumSeqs(t.num_seqs));
  if (t.num_tokens < 0 || t.max_blocks_per_seq < 0) {
    return InvalidArgumentError(StrCat("num_tokens ", t.num_tokens, " and max_blocks_per_seq ",
                                       t.max_blocks_per_seq, " must be >= 0"));
  }
  const int64_t s = t.num_seqs;
  *device = cache.ndim == 3 ? MlaCacheView(cache) : CacheView(cache, kv_scale);
  device->form = internal::TableForm::kSlots;
  device->qo_indptr = t.query_start_loc;
  device->kv_indices = t.block_tables;
  device->seq_lens = t.seq_lens;
  device->table_stride = t.max_blocks_per_seq;
  device->num_seqs = t.num_seqs;
  *host = *device;
  BLOCKKV_ASSIGN_OR_RETURN(*slot_mapping, arrays.Get("slot_mapping", t.slot_mapping, t.num_tokens));
  if (s == 0) return Status::Ok();
  BLOCKKV_ASSIGN_OR_RETURN(host->qo_indptr,
                           arrays.Get("query_start_loc", t.query_start_loc, s + 1));
  BLOCKKV_RETURN_IF_ERROR(CheckIndptr("query_start_loc", host->qo_indptr, t.num_seqs));
  host->num_tokens = device->num_tokens = host->qo_indptr[s];
  if (host->num_tokens > t.num_tokens) {
    return InvalidArgumentError(StrCat("query_start_loc[", s, "] = ", host->num_tokens,
                                       " tokens, but slot_mapping has ", t.num_tokens));
  }
  BLOCKKV_ASSIGN_OR_RETURN(host->seq_lens, arrays.Get("seq_lens", t.seq_lens, s));
  BLOCKKV_ASSIGN_OR_RETURN(host->kv_indices,
                           arrays.Get("block_tables", t.block_tables, s * t.max_blocks_per_seq));
  BLOCKKV_RETURN_IF_ERROR(CheckLengths(*host));
  for (int32_t i = 0; i < t.num_seqs; ++i) {
    const int64_t need = (int64_t{host->seq_lens[i]} + host->block_size - 1) / host->block_size;
    if (need > t.max_blocks_per_seq) {
      return InvalidArgumentError(StrCat("sequence ", i, " holds ", host->seq_lens[i],
                                         " tokens: ", need, " blocks of ", host->block_size,
                                         ", more than max_blocks_per_seq ", t.max_blocks_per_seq));
    }
  }
  return Status::Ok();
}

// The slot (block · block_size + offset) of new token j of sequence i. REQUIRES: its block was
// checked.
int64_t SlotOf(const PagedKV& host, int32_t i, int64_t j) {
  const int64_t pos = host.Seen(i) + j;
  return int64_t{host.Blocks(i)[pos / host.block_size]} * host.block_size + pos % host.block_size;
}

// Positions (CSR) and slot_mapping (vLLM) say what the table says; padding slots are
// kPaddingSlot. REQUIRES: the new tokens' blocks were checked.
Status CheckTokenIndices(const PagedKV& host, const int32_t* positions, const int64_t* slots,
                         int32_t slot_rows) {
  for (int32_t i = 0; i < host.num_seqs; ++i) {
    for (int32_t j = 0; j < host.Tokens(i); ++j) {
      const int32_t row = host.Start(i) + j;
      const int64_t pos = host.Seen(i) + j;
      if (positions != nullptr && positions[row] != pos) {
        return InvalidArgumentError(StrCat("positions[", row, "] = ", positions[row],
                                           " but the table puts token ", j, " of sequence ", i,
                                           " at position ", pos));
      }
      if (slots != nullptr && slots[row] != SlotOf(host, i, j)) {
        return InvalidArgumentError(StrCat("slot_mapping[", row, "] = ", slots[row],
                                           " but block_tables puts token ", j, " of sequence ", i,
                                           " (position ", pos, ") in slot ", SlotOf(host, i, j)));
      }
    }
  }
  for (int32_t row = host.num_tokens; slots != nullptr && row < slot_rows; ++row) {
    if (slots[row] != kPaddingSlot) {
      return InvalidArgumentError(
          StrCat("slot_mapping[", row, "] = ", slots[row], " is past the ", host.num_tokens,
                 " tokens of query_start_loc: it must be kPaddingSlot (", kPaddingSlot, ")"));
    }
  }
  return Status::Ok();
}

// No two of the step's tokens are written to one slot (blocks shared between sequences).
Status CheckDistinctSlots(const PagedKV& host) {
  std::vector<std::pair<int64_t, int32_t>> slots;  // (slot, row)
  slots.reserve(static_cast<size_t>(host.num_tokens));
  for (int32_t i = 0; i < host.num_seqs; ++i) {
    for (int32_t j = 0; j < host.Tokens(i); ++j) {
      slots.emplace_back(SlotOf(host, i, j), host.Start(i) + j);
    }
  }
  std::sort(slots.begin(), slots.end());
  for (size_t x = 1; x < slots.size(); ++x) {
    if (slots[x].first == slots[x - 1].first) {
      const int64_t slot = slots[x].first;
      return InvalidArgumentError(StrCat("tokens ", slots[x - 1].second, " and ", slots[x].second,
                                         " would both be written to slot ", slot, " (block ",
                                         slot / host.block_size, ", offset ",
                                         slot % host.block_size, ")"));
    }
  }
  return Status::Ok();
}

// ---- the two kernels over any view -----------------------------------------------------------

// Canonical strides of every tensor argument (q: the options' q, when given).
struct Canonical {
  TensorView cache, a, b, c;
};

// AppendKV over checked views of the table: the rest of the checks, then the backend.
Status RunAppend(const TensorView& layer_cache, const TensorView& k, const TensorView& v,
                 const AppendKVOptions& options, const PagedKV& host, const PagedKV& device,
                 const Rows& rows) {
  const int64_t hkv = layer_cache.shape[3];
  BLOCKKV_RETURN_IF_ERROR(CheckActivations("k", k, layer_cache, hkv, rows));
  BLOCKKV_RETURN_IF_ERROR(CheckActivations("v", v, layer_cache, hkv, rows));
  if (v.dtype != k.dtype) {
    return InvalidArgumentError(
        StrCat("k dtype ", DTypeName(k.dtype), " and v dtype ", DTypeName(v.dtype), " differ"));
  }
  BLOCKKV_RETURN_IF_ERROR(CheckRotary(options.rotary, layer_cache.shape[4]));
  const bool rotate_q = options.rotary.enabled && options.q != nullptr;
  if (rotate_q) {
    const TensorView& q = *options.q;
    BLOCKKV_RETURN_IF_ERROR(CheckGqa(q.ndim == 3 ? q.shape[1] : 0, hkv));
    BLOCKKV_RETURN_IF_ERROR(CheckActivations("q", q, layer_cache, q.shape[1], rows));
    if (q.dtype != k.dtype) {
      return InvalidArgumentError(
          StrCat("q dtype ", DTypeName(q.dtype), " and k dtype ", DTypeName(k.dtype), " differ"));
    }
    BLOCKKV_RETURN_IF_ERROR(CheckDisjoint("q", q, "k", k));
    BLOCKKV_RETURN_IF_ERROR(CheckDisjoint("q", q, "v", v));
  }
  for (int32_t i = 0; i < host.num_seqs; ++i) {
    BLOCKKV_RETURN_IF_ERROR(CheckBlocks(host, i, host.Seen(i), host.Length(i)));
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
    return internal::AppendKVCuda(device, ka, va, rotate_q ? &qa : nullptr, rotary,
                                  layer_cache.device_ordinal, options.stream);
  }
#else
  static_cast<void>(device);
#endif
  internal::AppendKVCpu(host, ka, va, rotate_q ? &qa : nullptr, rotary,
                        ResolveThreads(options.num_threads));
  return Status::Ok();
}

Status RunAttention(const TensorView& q, const TensorView& layer_cache, const TensorView& out,
                    const AttentionOptions& options, const PagedKV& host, const PagedKV& device,
                    const Rows& rows) {
  const int64_t hkv = layer_cache.shape[3];
  const int64_t hq = q.ndim == 3 ? q.shape[1] : 0;
  BLOCKKV_RETURN_IF_ERROR(CheckGqa(hq, hkv));
  BLOCKKV_RETURN_IF_ERROR(CheckActivations("q", q, layer_cache, hq, rows));
  BLOCKKV_RETURN_IF_ERROR(CheckActivations("out", out, layer_cache, hq, rows));
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
    const int64_t seen = host.Seen(i);
    const int64_t end = host.Length(i);
    max_context = std::max(max_context, end);
    // The first query (position seen) sees keys from seen − W + 1 with a window.
    const int64_t first =
        options.sliding_window > 0 ? std::max<int64_t>(0, seen - options.sliding_window + 1) : 0;
    BLOCKKV_RETURN_IF_ERROR(CheckBlocks(host, i, first, end));
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
    return internal::PagedAttentionCuda(device, ActivationsOf(q), ActivationsOf(out), params,
                                        max_context, layer_cache.device_ordinal, options.stream);
  }
#else
  static_cast<void>(device);
  static_cast<void>(max_context);
#endif
  internal::PagedAttentionCpu(host, ActivationsOf(q), ActivationsOf(out), params);
  return Status::Ok();
}

// The batch's host and device views, after the batch checks.
Status BatchViews(const TensorView& cache, const RaggedBatch& batch, int group, float kv_scale,
                  PagedKV* host, PagedKV* device) {
  if (!batch.finalized()) {
    return FailedPreconditionError("the batch is not finalized: call Finalize before the kernels");
  }
  BLOCKKV_ASSIGN_OR_RETURN(*host, BatchView(cache, batch, group, kv_scale, /*on_device=*/false));
  BLOCKKV_RETURN_IF_ERROR(CheckOwnCache(cache, batch, group));
  *device = *host;
  if (cache.device == DeviceKind::kCuda) {
    BLOCKKV_ASSIGN_OR_RETURN(*device, BatchView(cache, batch, group, kv_scale, /*on_device=*/true));
  }
  return Status::Ok();
}

Rows BatchRows(const RaggedBatch& batch) {
  return Rows{.tokens = batch.current_tokens(), .padded = batch.padded_tokens()};
}

Rows TableRows(const PagedKV& host) { return Rows{.tokens = host.num_tokens, .padded = -1}; }

// AppendKV's options with q's canonical strides (q_view holds them).
AppendKVOptions CanonicalQ(const AppendKVOptions& options, TensorView* q_view) {
  AppendKVOptions out = options;
  if (options.q != nullptr) {
    *q_view = CanonicalStrides(*options.q);
    out.q = q_view;
  }
  return out;
}

// A table's views, checked as both kernels need before they touch the cache: every block each
// sequence reads or writes (the new tokens' too: attention reads the keys just appended), then
// the positions and slots that name them.
template <class Table>
Status CheckedTableViews(const Table& table, const TensorView& layer_cache, float kv_scale,
                         HostArrays& arrays, PagedKV* host, PagedKV* device) {
  const int32_t* positions = nullptr;
  const int64_t* slots = nullptr;
  int32_t slot_rows = 0;
  if constexpr (std::is_same_v<Table, CsrPageTable>) {
    BLOCKKV_RETURN_IF_ERROR(
        CsrViews(table, layer_cache, kv_scale, arrays, host, device, &positions));
  } else {
    BLOCKKV_RETURN_IF_ERROR(SlotViews(table, layer_cache, kv_scale, arrays, host, device, &slots));
    slot_rows = table.num_tokens;
  }
  for (int32_t i = 0; i < host->num_seqs; ++i) {
    BLOCKKV_RETURN_IF_ERROR(CheckBlocks(*host, i, host->Seen(i), host->Length(i)));
  }
  return CheckTokenIndices(*host, positions, slots, slot_rows);
}

// A table AppendKV: views, the table's own checks, then RunAppend.
template <class Table>
Status AppendOverTable(const TensorView& layer_cache_in, const TensorView& k, const TensorView& v,
                       const Table& table, const AppendKVOptions& options_in) {
  const TensorView layer_cache = CanonicalStrides(layer_cache_in);
  TensorView q_view;
  const AppendKVOptions options = CanonicalQ(options_in, &q_view);
  BLOCKKV_RETURN_IF_ERROR(CheckCommon(layer_cache, options.kv_scale, options.num_threads));
  HostArrays arrays(layer_cache, options.stream);
  PagedKV host;
  PagedKV device;
  BLOCKKV_RETURN_IF_ERROR(
      CheckedTableViews(table, layer_cache, options.kv_scale, arrays, &host, &device));
  BLOCKKV_RETURN_IF_ERROR(CheckDistinctSlots(host));
  return RunAppend(layer_cache, CanonicalStrides(k), CanonicalStrides(v), options, host, device,
                   TableRows(host));
}

template <class Table>
Status AttendOverTable(const TensorView& q, const TensorView& layer_cache_in, const Table& table,
                       const TensorView& out, const AttentionOptions& options) {
  const TensorView layer_cache = CanonicalStrides(layer_cache_in);
  BLOCKKV_RETURN_IF_ERROR(CheckCommon(layer_cache, options.kv_scale, options.num_threads));
  HostArrays arrays(layer_cache, options.stream);
  PagedKV host;
  PagedKV device;
  BLOCKKV_RETURN_IF_ERROR(
      CheckedTableViews(table, layer_cache, options.kv_scale, arrays, &host, &device));
  return RunAttention(CanonicalStrides(q), layer_cache, CanonicalStrides(out), options, host,
                      device, TableRows(host));
}

// ---- MLA --------------------------------------------------------------------------------------

// An MLA layer [num_blocks, block_size, L + R] of a supported dtype on the host, and the options
// every MLA call shares.
Status CheckMlaCommon(const TensorView& cache, int num_threads) {
  if (cache.ndim != 3) {
    return InvalidArgumentError(
        StrCat("layer_cache must be an MLA layer [num_blocks, block_size, latent_dim + rope_dim], "
               "got shape ",
               Shape(cache)));
  }
  if (!IsActivationDType(cache.dtype)) {
    return InvalidArgumentError(StrCat("layer_cache dtype ", DTypeName(cache.dtype),
                                       " is not supported by the MLA kernels (fp32, fp16, bf16)"));
  }
  if (cache.shape[2] < 1 || cache.shape[2] > kMlaMaxRowDim) {
    return InvalidArgumentError(StrCat("layer_cache's row of ", cache.shape[2],
                                       " elements (latent_dim + rope_dim) must be in [1, ",
                                       kMlaMaxRowDim, "]"));
  }
  if (cache.stride(2) != 1) {
    return InvalidArgumentError(
        StrCat("layer_cache's last dimension must be contiguous, stride ", cache.stride(2)));
  }
  if (cache.shape[0] < 0 || cache.shape[0] > std::numeric_limits<int32_t>::max() ||
      cache.shape[1] < 1 || cache.shape[1] > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError(StrCat("layer_cache shape ", Shape(cache), " is out of range"));
  }
  if (cache.data == nullptr && cache.shape[0] > 0) {
    return InvalidArgumentError("layer_cache has no data");
  }
  if (num_threads < 0) {
    return InvalidArgumentError(StrCat("num_threads must be >= 0, got ", num_threads));
  }
  if (cache.device != DeviceKind::kCpu) {
    return UnimplementedError(StrCat("the MLA kernels run on the CPU only so far (the CUDA kernel ",
                                     "is a later issue); layer_cache is on ",
                                     DeviceKindName(cache.device), ":", cache.device_ordinal));
  }
  return Status::Ok();
}

// A [rows, dims...] activation of an MLA kernel on the cache's device, in the cache's dtype.
Status CheckMlaTensor(const char* name, const TensorView& t, std::initializer_list<int64_t> dims,
                      const TensorView& cache, const Rows& rows) {
  const auto want_ndim = static_cast<int>(dims.size()) + 1;
  bool ok = t.ndim == want_ndim &&
            (rows.padded < 0 ? t.shape[0] >= rows.tokens
                             : t.shape[0] == rows.tokens || t.shape[0] == rows.padded);
  int i = 1;
  for (const int64_t d : dims) ok = ok && t.shape[i++] == d;
  if (!ok) {
    std::string want = "[T";
    for (const int64_t d : dims) want += StrCat(", ", d);
    want += rows.padded < 0 ? StrCat("] with T >= ", rows.tokens, " (the table's tokens)")
                            : StrCat("] with T = ", rows.tokens, " (or padded ", rows.padded, ")");
    return InvalidArgumentError(StrCat(name, " must be ", want, ", got shape ", Shape(t)));
  }
  if (t.dtype != cache.dtype) {
    return InvalidArgumentError(StrCat(name, " dtype ", DTypeName(t.dtype),
                                       " and layer_cache dtype ", DTypeName(cache.dtype),
                                       " differ (the MLA kernels take one dtype throughout)"));
  }
  if (t.device != cache.device || t.device_ordinal != cache.device_ordinal) {
    return InvalidArgumentError(StrCat(name, " is on ", DeviceKindName(t.device), ":",
                                       t.device_ordinal, " but layer_cache on ",
                                       DeviceKindName(cache.device), ":", cache.device_ordinal));
  }
  const int64_t last = t.shape[t.ndim - 1];
  if (t.numel() == 0) return Status::Ok();
  // Rows (and heads) must not overlap: work items write different rows in parallel.
  bool strides_ok = t.stride(t.ndim - 1) == 1;
  int64_t inner = last;
  for (int d = t.ndim - 2; d >= 0 && strides_ok; --d) {
    strides_ok = t.stride(d) >= inner;
    inner = t.shape[d] * t.stride(d);
  }
  if (!strides_ok) {
    std::string strides;
    for (int d = 0; d < t.ndim; ++d) strides += StrCat(d == 0 ? "" : ", ", t.stride(d));
    return InvalidArgumentError(StrCat(name, " must have a contiguous last dimension and rows ",
                                       "and heads that do not overlap, got strides [", strides,
                                       "]"));
  }
  if (t.data == nullptr) return InvalidArgumentError(StrCat(name, " has no data"));
  return Status::Ok();
}

// The bytes any view spans ([begin, begin) when it has no element).
std::pair<const std::byte*, const std::byte*> SpanOf(const TensorView& t) {
  const auto* begin = static_cast<const std::byte*>(t.data);
  if (t.numel() == 0) return {begin, begin};
  int64_t last = 1;
  for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.stride(d);
  return {begin, begin + last * static_cast<int64_t>(ElementSize(t.dtype))};
}

Status CheckMlaDisjoint(const char* a_name, const TensorView& a, const char* b_name,
                        const TensorView& b) {
  const auto [a_begin, a_end] = SpanOf(a);
  const auto [b_begin, b_end] = SpanOf(b);
  if (a_begin < b_end && b_begin < a_end) {
    return InvalidArgumentError(StrCat(a_name, " and ", b_name, " overlap in memory"));
  }
  return Status::Ok();
}

// The batch's cache group is an MLA group of latent_dim `latent` (its rope_dim then follows).
Status CheckMlaGroup(const RaggedBatch& batch, int group, int64_t latent) {
  const KVCacheConfig& config = batch.manager().kv_cache().config(group);
  if (config.type != KVCacheType::kMla) {
    return InvalidArgumentError(StrCat("cache group ", group, " of the batch is of type ",
                                       KVCacheTypeName(config.type), ", not mla"));
  }
  if (config.latent_dim != latent) {
    return InvalidArgumentError(StrCat("the tensors' latent width ", latent, " is not cache group ",
                                       group, "'s latent_dim ", config.latent_dim, " (rope_dim ",
                                       config.rope_dim, ")"));
  }
  return Status::Ok();
}

// MlaAppendKV over checked views of the table: the tensors, the blocks written, the backend.
// *latent: c_kv's width, for the batch's group check.
Status CheckMlaAppend(const TensorView& cache, const TensorView& c_kv, const TensorView& k_pe,
                      const PagedKV& host, const Rows& rows) {
  const int64_t row = cache.shape[2];
  const int64_t latent = c_kv.ndim == 2 ? c_kv.shape[1] : 0;
  if (latent < 1 || latent > row) {
    return InvalidArgumentError(StrCat("c_kv must be [T, latent_dim] with latent_dim in [1, ", row,
                                       "] (layer_cache's row), got shape ", Shape(c_kv)));
  }
  BLOCKKV_RETURN_IF_ERROR(CheckMlaTensor("c_kv", c_kv, {latent}, cache, rows));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaTensor("k_pe", k_pe, {row - latent}, cache, rows));
  for (int32_t i = 0; i < host.num_seqs; ++i) {
    BLOCKKV_RETURN_IF_ERROR(CheckBlocks(host, i, host.Seen(i), host.Length(i)));
  }
  return Status::Ok();
}

void RunMlaAppend(const TensorView& c_kv, const TensorView& k_pe, const PagedKV& host,
                  int num_threads) {
  if (host.num_tokens == 0) return;
  const Activations ca{.data = c_kv.data,
                       .token_stride = c_kv.stride(0),
                       .head_stride = 0,
                       .num_heads = 1,
                       .dtype = c_kv.dtype};
  const Activations pa{.data = k_pe.data,
                       .token_stride = k_pe.stride(0),
                       .head_stride = 0,
                       .num_heads = 1,
                       .dtype = k_pe.dtype};
  internal::MlaAppendCpu(host, ca, pa, static_cast<int32_t>(c_kv.shape[1]),
                         ResolveThreads(num_threads));
}

Status CheckMlaAttention(const TensorView& q_nope, const TensorView& q_pe, const TensorView& cache,
                         const TensorView& out, const MlaAttentionOptions& options,
                         const PagedKV& host, const Rows& rows) {
  const int64_t row = cache.shape[2];
  const int64_t heads = q_nope.ndim == 3 ? q_nope.shape[1] : 0;
  const int64_t latent = q_nope.ndim == 3 ? q_nope.shape[2] : 0;
  if (heads < 1 || heads > internal::kMaxHeads || latent < 1 || latent > row) {
    return InvalidArgumentError(StrCat("q_nope must be [T, heads, latent_dim] with heads in [1, ",
                                       internal::kMaxHeads, "] and latent_dim in [1, ", row,
                                       "] (layer_cache's row), got shape ", Shape(q_nope)));
  }
  BLOCKKV_RETURN_IF_ERROR(CheckMlaTensor("q_nope", q_nope, {heads, latent}, cache, rows));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaTensor("q_pe", q_pe, {heads, row - latent}, cache, rows));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaTensor("out", out, {heads, latent}, cache, rows));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaDisjoint("out", out, "q_nope", q_nope));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaDisjoint("out", out, "q_pe", q_pe));
  if (!std::isfinite(options.scale) || options.scale <= 0.0f) {
    return InvalidArgumentError(
        StrCat("MlaAttentionOptions.scale must be the model's softmax scale, finite and > 0, got ",
               options.scale));
  }
  for (int32_t i = 0; i < host.num_seqs; ++i) {
    BLOCKKV_RETURN_IF_ERROR(CheckBlocks(host, i, 0, host.Length(i)));
  }
  return Status::Ok();
}

void RunMlaAttention(const TensorView& q_nope, const TensorView& q_pe, const TensorView& out,
                     const MlaAttentionOptions& options, const PagedKV& host) {
  if (host.num_tokens == 0) return;
  const Activations qa = ActivationsOf(q_nope);
  const Activations pa{.data = q_pe.data,
                       .token_stride = q_pe.stride(0),
                       .head_stride = q_pe.stride(1),
                       .num_heads = static_cast<int32_t>(q_pe.shape[1]),
                       .dtype = q_pe.dtype};
  const internal::AttentionParams params{.scale = options.scale,
                                         .causal = options.causal,
                                         .sliding_window = 0,
                                         .num_threads = ResolveThreads(options.num_threads)};
  internal::MlaAttentionCpu(host, qa, pa, ActivationsOf(out), static_cast<int32_t>(q_nope.shape[2]),
                            params);
}

// The batch's host view of an MLA layer, after the batch checks.
Status MlaBatchView(const TensorView& cache, const RaggedBatch& batch, int group, PagedKV* host) {
  PagedKV device;
  return BatchViews(cache, batch, group, /*kv_scale=*/1.0f, host, &device);
}

template <class Table>
Status MlaTableView(const Table& table, const TensorView& cache, PagedKV* host) {
  HostArrays arrays(cache, nullptr);  // a host cache: the arrays are read in place
  PagedKV device;
  return CheckedTableViews(table, cache, /*kv_scale=*/1.0f, arrays, host, &device);
}

template <class Table>
Status MlaAppendOverTable(const TensorView& cache_in, const TensorView& c_kv_in,
                          const TensorView& k_pe_in, const Table& table,
                          const MlaAppendOptions& options) {
  const TensorView cache = CanonicalStrides(cache_in);
  const TensorView c_kv = CanonicalStrides(c_kv_in);
  const TensorView k_pe = CanonicalStrides(k_pe_in);
  BLOCKKV_RETURN_IF_ERROR(CheckMlaCommon(cache, options.num_threads));
  PagedKV host;
  BLOCKKV_RETURN_IF_ERROR(MlaTableView(table, cache, &host));
  BLOCKKV_RETURN_IF_ERROR(CheckDistinctSlots(host));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaAppend(cache, c_kv, k_pe, host, TableRows(host)));
  RunMlaAppend(c_kv, k_pe, host, options.num_threads);
  return Status::Ok();
}

template <class Table>
Status MlaAttendOverTable(const TensorView& q_nope_in, const TensorView& q_pe_in,
                          const TensorView& cache_in, const Table& table, const TensorView& out_in,
                          const MlaAttentionOptions& options) {
  const TensorView cache = CanonicalStrides(cache_in);
  const TensorView q_nope = CanonicalStrides(q_nope_in);
  const TensorView q_pe = CanonicalStrides(q_pe_in);
  const TensorView out = CanonicalStrides(out_in);
  BLOCKKV_RETURN_IF_ERROR(CheckMlaCommon(cache, options.num_threads));
  PagedKV host;
  BLOCKKV_RETURN_IF_ERROR(MlaTableView(table, cache, &host));
  BLOCKKV_RETURN_IF_ERROR(
      CheckMlaAttention(q_nope, q_pe, cache, out, options, host, TableRows(host)));
  RunMlaAttention(q_nope, q_pe, out, options, host);
  return Status::Ok();
}

}  // namespace

Status AppendKV(const TensorView& layer_cache_in, const TensorView& k, const TensorView& v,
                const RaggedBatch& batch, const AppendKVOptions& options_in) {
  const TensorView layer_cache = CanonicalStrides(layer_cache_in);
  TensorView q_view;
  const AppendKVOptions options = CanonicalQ(options_in, &q_view);
  BLOCKKV_RETURN_IF_ERROR(CheckCommon(layer_cache, options.kv_scale, options.num_threads));
  PagedKV host;
  PagedKV device;
  BLOCKKV_RETURN_IF_ERROR(
      BatchViews(layer_cache, batch, options.group, options.kv_scale, &host, &device));
  return RunAppend(layer_cache, CanonicalStrides(k), CanonicalStrides(v), options, host, device,
                   BatchRows(batch));
}

Status AppendKV(const TensorView& layer_cache, const TensorView& k, const TensorView& v,
                const CsrPageTable& table, const AppendKVOptions& options) {
  return AppendOverTable(layer_cache, k, v, table, options);
}

Status AppendKV(const TensorView& layer_cache, const TensorView& k, const TensorView& v,
                const SlotMappingPageTable& table, const AppendKVOptions& options) {
  return AppendOverTable(layer_cache, k, v, table, options);
}

Status PagedAttention(const TensorView& q, const TensorView& layer_cache_in,
                      const RaggedBatch& batch, const TensorView& out,
                      const AttentionOptions& options) {
  const TensorView layer_cache = CanonicalStrides(layer_cache_in);
  BLOCKKV_RETURN_IF_ERROR(CheckCommon(layer_cache, options.kv_scale, options.num_threads));
  PagedKV host;
  PagedKV device;
  BLOCKKV_RETURN_IF_ERROR(
      BatchViews(layer_cache, batch, options.group, options.kv_scale, &host, &device));
  return RunAttention(CanonicalStrides(q), layer_cache, CanonicalStrides(out), options, host,
                      device, BatchRows(batch));
}

Status PagedAttention(const TensorView& q, const TensorView& layer_cache, const CsrPageTable& table,
                      const TensorView& out, const AttentionOptions& options) {
  return AttendOverTable(q, layer_cache, table, out, options);
}

Status PagedAttention(const TensorView& q, const TensorView& layer_cache,
                      const SlotMappingPageTable& table, const TensorView& out,
                      const AttentionOptions& options) {
  return AttendOverTable(q, layer_cache, table, out, options);
}

Status MlaAppendKV(const TensorView& layer_cache_in, const TensorView& c_kv_in,
                   const TensorView& k_pe_in, const RaggedBatch& batch,
                   const MlaAppendOptions& options) {
  const TensorView cache = CanonicalStrides(layer_cache_in);
  const TensorView c_kv = CanonicalStrides(c_kv_in);
  const TensorView k_pe = CanonicalStrides(k_pe_in);
  BLOCKKV_RETURN_IF_ERROR(CheckMlaCommon(cache, options.num_threads));
  PagedKV host;
  BLOCKKV_RETURN_IF_ERROR(MlaBatchView(cache, batch, options.group, &host));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaAppend(cache, c_kv, k_pe, host, BatchRows(batch)));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaGroup(batch, options.group, c_kv.shape[1]));
  RunMlaAppend(c_kv, k_pe, host, options.num_threads);
  return Status::Ok();
}

Status MlaAppendKV(const TensorView& layer_cache, const TensorView& c_kv, const TensorView& k_pe,
                   const CsrPageTable& table, const MlaAppendOptions& options) {
  return MlaAppendOverTable(layer_cache, c_kv, k_pe, table, options);
}

Status MlaAppendKV(const TensorView& layer_cache, const TensorView& c_kv, const TensorView& k_pe,
                   const SlotMappingPageTable& table, const MlaAppendOptions& options) {
  return MlaAppendOverTable(layer_cache, c_kv, k_pe, table, options);
}

Status MlaPagedAttention(const TensorView& q_nope_in, const TensorView& q_pe_in,
                         const TensorView& layer_cache_in, const RaggedBatch& batch,
                         const TensorView& out_in, const MlaAttentionOptions& options) {
  const TensorView cache = CanonicalStrides(layer_cache_in);
  const TensorView q_nope = CanonicalStrides(q_nope_in);
  const TensorView q_pe = CanonicalStrides(q_pe_in);
  const TensorView out = CanonicalStrides(out_in);
  BLOCKKV_RETURN_IF_ERROR(CheckMlaCommon(cache, options.num_threads));
  PagedKV host;
  BLOCKKV_RETURN_IF_ERROR(MlaBatchView(cache, batch, options.group, &host));
  BLOCKKV_RETURN_IF_ERROR(
      CheckMlaAttention(q_nope, q_pe, cache, out, options, host, BatchRows(batch)));
  BLOCKKV_RETURN_IF_ERROR(CheckMlaGroup(batch, options.group, q_nope.shape[2]));
  RunMlaAttention(q_nope, q_pe, out, options, host);
  return Status::Ok();
}

Status MlaPagedAttention(const TensorView& q_nope, const TensorView& q_pe,
                         const TensorView& layer_cache, const CsrPageTable& table,
                         const TensorView& out, const MlaAttentionOptions& options) {
  return MlaAttendOverTable(q_nope, q_pe, layer_cache, table, out, options);
}

Status MlaPagedAttention(const TensorView& q_nope, const TensorView& q_pe,
                         const TensorView& layer_cache, const SlotMappingPageTable& table,
                         const TensorView& out, const MlaAttentionOptions& options) {
  return MlaAttendOverTable(q_nope, q_pe, layer_cache, table, out, options);
}

}  // namespace blockkv
