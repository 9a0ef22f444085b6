// SPDX-License-Identifier: Apache-2.0
#include "cuda/cuda_util.h"

#include "internal/strings.h"

namespace blockkv::internal {

std::string CudaErrorText(cudaError_t error) {
  return StrCat(cudaGetErrorString(error), " (", cudaGetErrorName(error), ")");
}

Status CudaError(std::string_view what, cudaError_t error) {
  return InternalError(StrCat(what, " failed: ", CudaErrorText(error)));
}

ScopedCudaDevice::ScopedCudaDevice(int ordinal) {
  int current = -1;
  if (const cudaError_t error = cudaGetDevice(&current); error != cudaSuccess) {
    status_ = CudaError("cudaGetDevice", error);
    return;
  }
  if (current == ordinal) return;
  if (const cudaError_t error = cudaSetDevice(ordinal); error != cudaSuccess) {
    status_ = CudaError(StrCat("cudaSetDevice(", ordinal, ")"), error);
    return;
  }
  previous_ = current;
}

ScopedCudaDevice::~ScopedCudaDevice() {
  // A failure here leaves `ordinal` current; there is nobody to report it to, and the next
  // blockkv call switches devices explicitly anyway.
  if (previous_ >= 0) static_cast<void>(cudaSetDevice(previous_));
}

}  // namespace blockkv::internal
