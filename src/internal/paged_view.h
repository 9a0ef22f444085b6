// SPDX-License-Identifier: Apache-2.0
// The kernels' view of one layer of the paged cache and of one ragged batch (FlashInfer's
// page.cuh style): small, trivially copyable structs passed by value to the CPU backend and, as a
// kernel argument, to the CUDA backend. src/kernels.cc builds them once, after every argument
// was checked, from the batch's host arrays (CPU) or its device mirror (CUDA); the backends trust
// them and check nothing.
#pragma once

#include <cstdint>
#include <type_traits>

#include "blockkv/dtype.h"
#include "internal/host_device.h"

namespace blockkv::internal {

// Supported head sizes, in the order the CUDA backend instantiates them.
inline constexpr int32_t kHeadSizes[] = {64, 80, 96, 128, 256};
inline constexpr int32_t kMaxHeadSize = 256;
// The most query (and so KV) heads a call takes: CUDA's limit on a grid's y and z extents, which
// the CUDA backend launches over heads. Larger counts are kInvalidArgument on every backend.
inline constexpr int32_t kMaxHeads = 65535;

// How PagedKV's page table is given: a RaggedBatch's arrays, FlashInfer's CSR form or vLLM's
// block tables (include/blockkv/page_table.h).
enum class TableForm : int32_t { kBatch, kCsr, kSlots };

struct PagedKV {
  // [num_blocks, block_size, 2, num_kv_heads, head_size] with the strides below (elements of
  // `dtype`; head_size is contiguous). K is plane 0, V plane 1.
  void* data = nullptr;
  int64_t block_stride = 0;
  int64_t token_stride = 0;
  int64_t plane_stride = 0;
  int64_t head_stride = 0;
  int32_t num_blocks = 0;
  int32_t block_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_size = 0;
  DType dtype = DType::kFloat16;
  float kv_scale = 1.0f;  // fp8: value = stored · kv_scale; 1 otherwise

  // The batch's page table, in one of three forms (see TableForm); the accessors below read any.
  TableForm form = TableForm::kBatch;
  const int32_t* descriptors = nullptr;       // kBatch: [num_seqs, 4]: start, n_tokens, seen, 0
  const int32_t* tokens_to_seq = nullptr;     // kBatch: [num_tokens]: each token's sequence
  const int32_t* qo_indptr = nullptr;         // kCsr, kSlots: [num_seqs + 1]: rows of sequence i
  const int32_t* kv_indptr = nullptr;         // kBatch, kCsr: [num_seqs + 1]: CSR offsets into
                                              // kv_indices
  const int32_t* kv_indices = nullptr;        // kBatch, kCsr: [kv_indptr[num_seqs]] block ids;
                                              // kSlots: [num_seqs, table_stride] block tables
  const int32_t* kv_last_page_len = nullptr;  // kCsr: [num_seqs]
  const int32_t* seq_lens = nullptr;          // kSlots: [num_seqs]
  int64_t table_stride = 0;                   // kSlots
  int32_t num_seqs = 0;
  int32_t num_tokens = 0;  // real tokens (T); rows past it are padding

  // Sequence i's first row, its new tokens, all its tokens (new ones last), and its block ids.
  BLOCKKV_HOST_DEVICE int32_t Start(int32_t i) const {
    return form == TableForm::kBatch ? descriptors[int64_t{i} * 4] : qo_indptr[i];
  }
  BLOCKKV_HOST_DEVICE int32_t Tokens(int32_t i) const {
    return form == TableForm::kBatch ? descriptors[int64_t{i} * 4 + 1]
                                     : qo_indptr[i + 1] - qo_indptr[i];
  }
  BLOCKKV_HOST_DEVICE int64_t Length(int32_t i) const {
    switch (form) {
      case TableForm::kBatch:
        return int64_t{descriptors[int64_t{i} * 4 + 1]} + descriptors[int64_t{i} * 4 + 2];
      case TableForm::kCsr: {
        const int64_t blocks = int64_t{kv_indptr[i + 1]} - kv_indptr[i];
        return blocks == 0 ? 0 : (blocks - 1) * block_size + kv_last_page_len[i];
      }
      default:
        return seq_lens[i];
    }
  }
  BLOCKKV_HOST_DEVICE int64_t Seen(int32_t i) const { return Length(i) - Tokens(i); }
  BLOCKKV_HOST_DEVICE const int32_t* Blocks(int32_t i) const {
    return form == TableForm::kSlots ? kv_indices + int64_t{i} * table_stride
                                     : kv_indices + kv_indptr[i];
  }
  // The sequence whose rows hold `token` (< num_tokens): a binary search over qo_indptr (the last
  // i with qo_indptr[i] <= token; empty sequences share their successor's start).
  BLOCKKV_HOST_DEVICE int32_t SeqOf(int32_t token) const {
    if (form == TableForm::kBatch) return tokens_to_seq[token];
    int32_t lo = 0;
    int32_t hi = num_seqs;  // qo_indptr[lo] <= token < qo_indptr[hi]
    while (hi - lo > 1) {
      const int32_t mid = lo + (hi - lo) / 2;
      if (qo_indptr[mid] <= token) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    return lo;
  }

  // Element offset of (block, offset, plane, head, 0).
  BLOCKKV_HOST_DEVICE int64_t Offset(int64_t block, int64_t offset, int plane, int64_t head) const {
    return block * block_stride + offset * token_stride + plane * plane_stride + head * head_stride;
  }
};
static_assert(std::is_trivially_copyable_v<PagedKV>);

// A [T, H, D] activation tensor (q, k, v or out): head_size contiguous.
struct Activations {
  void* data = nullptr;  // [T, num_heads, head_size]
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  int32_t num_heads = 0;
  DType dtype = DType::kFloat32;
};
static_assert(std::is_trivially_copyable_v<Activations>);

struct RotaryParams {
  bool enabled = false;
  int32_t rotary_dim = 0;  // even, 2 .. head_size
  double theta = 10000.0;
};

struct AttentionParams {
  float scale = 1.0f;  // already resolved (never 0)
  bool causal = true;
  int64_t sliding_window = 0;  // 0: none
  int num_threads = 1;         // CPU: resolved, >= 1
};

}  // namespace blockkv::internal
