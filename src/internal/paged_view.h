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

  // Batch, from RaggedBatch (all on the same side as `data`):
  const int32_t* descriptors = nullptr;    // [num_seqs, 4]: start_idx, n_tokens, seen_tokens, 0
  const int32_t* tokens_to_seq = nullptr;  // [num_tokens]: each token's sequence
  const int32_t* kv_indptr = nullptr;      // [num_seqs + 1]: CSR offsets into kv_indices
  const int32_t* kv_indices = nullptr;     // [kv_indptr[num_seqs]]: block of each sequence's
                                           // token-block t / block_size, in order
  int32_t num_seqs = 0;
  int32_t num_tokens = 0;  // real tokens (T); rows past it are padding

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
