// SPDX-License-Identifier: Apache-2.0
// The CUDA side of OffloadStore: pinned host memory for its tiers, and block copies on the
// device's copy stream (src/internal/block_mover.h).
#include <cuda_runtime_api.h>

#include <memory>

#include "blockkv/cuda_device.h"
#include "cuda/cuda_util.h"
#include "internal/block_mover.h"
#include "internal/strings.h"

namespace blockkv::internal {
namespace {

class CudaBlockMover final : public BlockMover {
 public:
  CudaBlockMover(int ordinal, cudaStream_t stream, cudaEvent_t done)
      : ordinal_(ordinal), stream_(stream), done_(done) {}
  ~CudaBlockMover() override {
    ScopedCudaDevice device(ordinal_);
    if (device.status().ok()) static_cast<void>(cudaEventDestroy(done_));
  }

  // One 2-D copy per block: `layers` rows of chunk_bytes, strided on the device, packed on the
  // host.
  Status ToHost(const BlockLayout& layout, BlockId block, std::byte* host) override {
    return Copy2D(host, static_cast<size_t>(layout.chunk_bytes),
                  layout.base + block * layout.chunk_bytes,
                  static_cast<size_t>(layout.layer_stride), layout, cudaMemcpyDeviceToHost);
  }
  Status FromHost(const BlockLayout& layout, const std::byte* host, BlockId block) override {
    return Copy2D(layout.base + block * layout.chunk_bytes,
                  static_cast<size_t>(layout.layer_stride), host,
                  static_cast<size_t>(layout.chunk_bytes), layout, cudaMemcpyHostToDevice);
  }
  Status Finish() override {
    ScopedCudaDevice device(ordinal_);
    if (!device.status().ok()) return device.status();
    if (cudaError_t e = cudaEventRecord(done_, stream_); e != cudaSuccess) {
      return CudaError("offload: cudaEventRecord", e);
    }
    if (cudaError_t e = cudaEventSynchronize(done_); e != cudaSuccess) {
      return CudaError("offload: cudaEventSynchronize", e);
    }
    return Status::Ok();
  }

 private:
  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, const BlockLayout& layout,
                cudaMemcpyKind kind) {
    ScopedCudaDevice device(ordinal_);
    if (!device.status().ok()) return device.status();
    const cudaError_t e =
        cudaMemcpy2DAsync(dst, dpitch, src, spitch, static_cast<size_t>(layout.chunk_bytes),
                          static_cast<size_t>(layout.layers), kind, stream_);
    if (e != cudaSuccess) return CudaError("offload: cudaMemcpy2DAsync", e);
    return Status::Ok();
  }

  int ordinal_;
  cudaStream_t stream_;
  cudaEvent_t done_;
};

void FreePinned(std::byte* data) { static_cast<void>(cudaFreeHost(data)); }

}  // namespace

Result<HostBuffer> AllocatePinnedHostBuffer(const Device& device, int64_t bytes) {
  ScopedCudaDevice scoped(device.ordinal());
  if (!scoped.status().ok()) return scoped.status();
  void* data = nullptr;
  const cudaError_t e =
      cudaHostAlloc(&data, static_cast<size_t>(bytes > 0 ? bytes : 1), cudaHostAllocPortable);
  if (e == cudaErrorMemoryAllocation) {
    return ResourceExhaustedError(
        StrCat("cannot pin ", HumanBytes(static_cast<long double>(bytes)),
               " of host memory for the offload tier: ", CudaErrorText(e)));
  }
  if (e != cudaSuccess) return CudaError("offload: cudaHostAlloc", e);
  return HostBuffer(static_cast<std::byte*>(data), bytes, FreePinned);
}

Result<std::unique_ptr<BlockMover>> MakeCudaBlockMover(const Device& device) {
  Result<CUstream_st*> stream = CudaStream(device);
  if (!stream.ok()) return stream.status();
  ScopedCudaDevice scoped(device.ordinal());
  if (!scoped.status().ok()) return scoped.status();
  cudaEvent_t done = nullptr;
  if (cudaError_t e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming); e != cudaSuccess) {
    return CudaError("offload: cudaEventCreate", e);
  }
  return std::unique_ptr<BlockMover>(
      std::make_unique<CudaBlockMover>(device.ordinal(), *stream, done));
}

}  // namespace blockkv::internal
