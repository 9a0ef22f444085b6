// SPDX-License-Identifier: Apache-2.0
// Helpers shared by blockkv's CUDA runtime code (CudaDevice, NcclCommunicator): Status from a
// cudaError_t, and a scoped switch of the calling thread's current device.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "blockkv/status.h"

namespace blockkv::internal {

// "out of memory (cudaErrorMemoryAllocation)": cudaGetErrorString and cudaGetErrorName.
std::string CudaErrorText(cudaError_t error);

// kInternal "<what> failed: <CudaErrorText(error)>". REQUIRES: error != cudaSuccess.
Status CudaError(std::string_view what, cudaError_t error);

// Makes `ordinal` the calling thread's current CUDA device while the guard lives, then makes the
// previous device current again. Does nothing when `ordinal` is already current, which is the
// usual case: an engine calls cudaSetDevice(local_rank) once per thread. Restoring a device that
// has no CUDA context yet creates one (cudaSetDevice's behaviour since CUDA 12), which is why
// engines should set their device first; docs/multi-gpu.md says so.
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int ordinal);
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  ~ScopedCudaDevice();

  // OK, or the kInternal error of cudaGetDevice / cudaSetDevice; the caller must not go on when
  // it is not OK.
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;  // the device to restore; -1 when nothing was switched
  Status status_;
};

}  // namespace blockkv::internal
