// SPDX-License-Identifier: Apache-2.0
// CudaDevice when blockkv is built without CUDA (BLOCKKV_CUDA=OFF, or no toolkit found).
#include "blockkv/cuda_device.h"
#include "blockkv/device.h"
#include "internal/block_mover.h"
#include "internal/strings.h"
#include "internal/upload_queue.h"

namespace blockkv {

Result<std::shared_ptr<Device>> CudaDevice(int ordinal) {
  return UnavailableError(internal::StrCat(
      "CudaDevice(", ordinal,
      ") is unavailable: blockkv was built without CUDA (configure with BLOCKKV_CUDA=ON and the "
      "CUDA toolkit installed)"));
}

Result<CUstream_st*> CudaStream(const Device& device) {
  return InvalidArgumentError(internal::StrCat(
      "CudaStream: ", device.name(), " is not a CUDA device (blockkv was built without CUDA)"));
}

}  // namespace blockkv

namespace blockkv::internal {

Result<HostBuffer> AllocatePinnedHostBuffer(const Device& device, int64_t) {
  return UnavailableError(
      StrCat("pinned host memory for ", device.name(), ": blockkv was built without CUDA"));
}

Result<std::unique_ptr<BlockMover>> MakeCudaBlockMover(const Device& device) {
  return UnavailableError(StrCat("copies for ", device.name(), ": blockkv was built without CUDA"));
}

Result<std::unique_ptr<UploadQueue>> MakeCudaUploadQueue(const Device& device) {
  return UnavailableError(StrCat("uploads to ", device.name(), ": blockkv was built without CUDA"));
}

Result<HostBuffer> AllocateUploadStaging(const Device& device, int64_t) {
  return UnavailableError(
      StrCat("pinned staging for ", device.name(), ": blockkv was built without CUDA"));
}

}  // namespace blockkv::internal
