// SPDX-License-Identifier: Apache-2.0
// The backends behind kernels.h. src/kernels.cc checks every argument and builds the views; the
// backends trust them.
#pragma once

#include <cstddef>

#include "blockkv/status.h"
#include "internal/paged_view.h"

struct CUstream_st;

namespace blockkv::internal {

// Host memory. q is null unless rotary.enabled and a q was given.
void AppendKVCpu(const PagedKV& cache, const Activations& k, const Activations& v,
                 const Activations* q, const RotaryParams& rotary, int num_threads);
void PagedAttentionCpu(const PagedKV& cache, const Activations& q, const Activations& out,
                       const AttentionParams& params);

// MLA (kernels_cpu_mla.cc). `cache` is an MLA layer viewed as one KV head of head_size L + R
// (plane_stride and head_stride 0); c_kv / k_pe are [T, 1, L] / [T, 1, R] Activations (R may be
// 0), q_nope / out [T, H, L], q_pe [T, H, R]. Every dtype is the cache's.
void MlaAppendCpu(const PagedKV& cache, const Activations& c_kv, const Activations& k_pe,
                  int32_t latent_dim, int num_threads);
void MlaAttentionCpu(const PagedKV& cache, const Activations& q_nope, const Activations& q_pe,
                     const Activations& out, int32_t latent_dim, const AttentionParams& params);

// Device memory of CUDA device `device` (defined only when BLOCKKV_HAVE_CUDA), launched on
// `stream` (null: the legacy default stream) and not waited for. kInvalidArgument when a tensor
// is not aligned for the vector loads (4 elements); kInternal carries CUDA's error text.
Status AppendKVCuda(const PagedKV& cache, const Activations& k, const Activations& v,
                    const Activations* q, const RotaryParams& rotary, int device,
                    CUstream_st* stream);
// Which CUDA attention kernel PagedAttentionCuda launches, process-wide (src/cuda/kernels.cu
// describes both). kWarpPerKey, the default, passed the CUDA suite on an H200 (2026-12-04).
// kHalfWarpPerKey is meant to read K/V near the copy bandwidth but has not run on a GPU yet: the
// CUDA tests run both and cuda_kernels_bench times both in the same run; once it has passed there
// it becomes the default and kWarpPerKey goes. Not for engines; tests and benchmarks only.
enum class CudaAttentionKernel { kWarpPerKey, kHalfWarpPerKey };
void SetCudaAttentionKernel(CudaAttentionKernel kernel);
CudaAttentionKernel GetCudaAttentionKernel();

// Copies `bytes` of CUDA device `device`'s memory at `src` to host memory at `dst`, ordered after
// the work on `stream` and waited for (the page-table checks read a caller's device table).
Status CopyToHostCuda(void* dst, const void* src, size_t bytes, int device, CUstream_st* stream);
// max_context: the most keys (seen + new tokens) of any sequence in the batch.
Status PagedAttentionCuda(const PagedKV& cache, const Activations& q, const Activations& out,
                          const AttentionParams& params, int64_t max_context, int device,
                          CUstream_st* stream);

}  // namespace blockkv::internal
