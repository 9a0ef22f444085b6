// SPDX-License-Identifier: Apache-2.0
// What only a CUDA device has, beyond the Device interface: its copy stream.
//
//   Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
//   Result<cudaStream_t> stream = CudaStream(**gpu);
//   cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, *stream);
//
// CudaDevice itself is declared in device.h. This header does not include the CUDA headers:
// CUstream_st* is the type that cudaStream_t names (`typedef struct CUstream_st* cudaStream_t`
// in CUDA's driver_types.h), so callers that do include them use cudaStream_t as usual, and
// callers built without CUDA can still compile against it.
//
// What a CudaDevice is (see docs/multi-gpu.md for the reasoning):
// - total_memory() / available_memory() are cudaMemGetInfo's total and free bytes on that GPU,
//   read with the device current. DeepSpeed plans from NVML's free memory instead; cudaMemGetInfo
//   is what this process's CUDA context can actually allocate.
// - Allocate is cudaMalloc (device memory, never managed memory), 256-byte aligned; out of memory
//   is kResourceExhausted, any other CUDA error kInternal with CUDA's error text. A buffer is
//   freed with cudaFree on its own device.
// - CopyFromHost / CopyToHost / CopyWithin are cudaMemcpyAsync on the legacy default stream
//   followed by a wait for it: ordered after the work already queued on the default stream and
//   on blocking streams, done when they return. Work on non-blocking streams (CudaStream's, or an
//   engine's own) must be synchronized by the caller first.
// - EmptyCache trims the device's default stream-ordered memory pool (cudaMallocAsync's) to zero,
//   so memory freed with cudaFreeAsync by anyone in the process goes back to the driver before
//   RESERVE planning. blockkv has no caching allocator of its own; a framework's cache (PyTorch's
//   torch.cuda.empty_cache()) is the framework's to empty.
// - CudaDevice(n) returns the same instance every time for one ordinal; it lives until the
//   process exits, as does its stream.
#pragma once

#include "blockkv/device.h"
#include "blockkv/status.h"

struct CUstream_st;  // CUDA's stream type: cudaStream_t is CUstream_st*

namespace blockkv {

// The stream blockkv uses for asynchronous copies on `device`: one per CUDA device, created with
// cudaStreamNonBlocking (it does not synchronize with the legacy default stream), never
// destroyed. kInvalidArgument when `device` is not a CudaDevice (always so without CUDA).
Result<CUstream_st*> CudaStream(const Device& device);

}  // namespace blockkv
