// SPDX-License-Identifier: Apache-2.0
// The CUDA side of RaggedBatch's device mirror (src/internal/upload_queue.h): pinned staging and
// copies from it that the host does not wait for.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "blockkv/cuda_device.h"
#include "cuda/cuda_util.h"
#include "internal/strings.h"
#include "internal/upload_queue.h"

namespace blockkv::internal {
namespace {

class CudaUploadQueue final : public UploadQueue {
 public:
  CudaUploadQueue(int ordinal, std::string name, cudaEvent_t done)
      : ordinal_(ordinal), name_(std::move(name)), done_(done) {}
  ~CudaUploadQueue() override {
    ScopedCudaDevice device(ordinal_);
    if (!device.status().ok()) return;
    static_cast<void>(cudaEventSynchronize(done_));  // the staging is freed next
    static_cast<void>(cudaEventDestroy(done_));
  }
  CudaUploadQueue(const CudaUploadQueue&) = delete;
  CudaUploadQueue& operator=(const CudaUploadQueue&) = delete;

  Status Copy(void* dst, const std::byte* src, int64_t bytes) override {
    ScopedCudaDevice device(ordinal_);
    BLOCKKV_RETURN_IF_ERROR(device.status());
    const cudaError_t e = cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                          cudaMemcpyHostToDevice, cudaStreamLegacy);
    if (e != cudaSuccess) return Failed(StrCat("cudaMemcpyAsync of ", bytes, " bytes"), e);
    return Status::Ok();
  }

  Status Record() override {
    ScopedCudaDevice device(ordinal_);
    BLOCKKV_RETURN_IF_ERROR(device.status());
    const cudaError_t e = cudaEventRecord(done_, cudaStreamLegacy);
    if (e != cudaSuccess) return Failed("cudaEventRecord", e);
    return Status::Ok();
  }

  Status Wait() override {
    const cudaError_t e = cudaEventSynchronize(done_);
    if (e != cudaSuccess) return Failed("cudaEventSynchronize", e);
    return Status::Ok();
  }

 private:
  Status Failed(std::string_view what, cudaError_t e) const {
    static_cast<void>(cudaGetLastError());  // clears it unless it is sticky (then nothing can)
    return CudaError(StrCat("the batch's copy to its device mirror on ", name_, ": ", what), e);
  }

  int ordinal_;
  std::string name_;
  cudaEvent_t done_;
};

void FreePinned(std::byte* data) { static_cast<void>(cudaFreeHost(data)); }

}  // namespace

Result<std::unique_ptr<UploadQueue>> MakeCudaUploadQueue(const Device& device) {
  ScopedCudaDevice scoped(device.ordinal());
  BLOCKKV_RETURN_IF_ERROR(scoped.status());
  cudaEvent_t done = nullptr;
  if (cudaError_t e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming); e != cudaSuccess) {
    return CudaError(StrCat("the batch's device mirror on ", device.name(), ": cudaEventCreate"),
                     e);
  }
  return std::unique_ptr<UploadQueue>(
      std::make_unique<CudaUploadQueue>(device.ordinal(), device.name(), done));
}

Result<HostBuffer> AllocateUploadStaging(const Device& device, int64_t bytes) {
  ScopedCudaDevice scoped(device.ordinal());
  BLOCKKV_RETURN_IF_ERROR(scoped.status());
  void* data = nullptr;
  const cudaError_t e =
      cudaHostAlloc(&data, static_cast<size_t>(bytes > 0 ? bytes : 1), cudaHostAllocPortable);
  if (e == cudaErrorMemoryAllocation) {
    static_cast<void>(cudaGetLastError());
    return ResourceExhaustedError(StrCat("cannot pin ", HumanBytes(static_cast<long double>(bytes)),
                                         " of host memory for the ragged batch's staging on ",
                                         device.name(), ": ", CudaErrorText(e)));
  }
  if (e != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return CudaError("the ragged batch's staging: cudaHostAlloc", e);
  }
  return HostBuffer(static_cast<std::byte*>(data), bytes, FreePinned);
}

}  // namespace blockkv::internal
