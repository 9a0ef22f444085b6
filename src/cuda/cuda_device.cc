// SPDX-License-Identifier: Apache-2.0
// CudaDevice: one CUDA GPU through the CUDA runtime API. Plain C++ (no kernels), compiled by the
// host compiler and linked against cudart. The contract is in include/blockkv/cuda_device.h.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "blockkv/cuda_device.h"
#include "blockkv/device.h"
#include "blockkv/log.h"
#include "cuda/cuda_util.h"
#include "internal/check.h"
#include "internal/strings.h"

namespace blockkv {

using internal::CudaError;
using internal::CudaErrorText;
using internal::ScopedCudaDevice;
using internal::StrCat;

namespace {

class CudaDeviceImpl final : public Device {
 public:
  // Queries the GPU and creates its copy stream. kUnavailable when there is no such GPU.
  static Result<std::shared_ptr<CudaDeviceImpl>> Create(int ordinal);

  ~CudaDeviceImpl() override {
    ScopedCudaDevice device(ordinal_);
    if (device.status().ok()) static_cast<void>(cudaStreamDestroy(stream_));
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  int ordinal() const override { return ordinal_; }
  std::string name() const override { return name_; }
  int64_t total_memory() const override { return total_; }

  // cudaMemGetInfo's free bytes; 0 (and a logged error) when CUDA fails, so that planning
  // against it fails with kResourceExhausted instead of over-committing.
  int64_t available_memory() const override {
    size_t free = 0;
    size_t total = 0;
    if (Status s = MemGetInfo(&free, &total); !s.ok()) {
      Log(LogLevel::kError, StrCat(name_, ": available_memory: ", s.message()));
      return 0;
    }
    return static_cast<int64_t>(free);
  }

  Result<DeviceBuffer> Allocate(int64_t bytes) override;
  void EmptyCache() override;

  Status CopyFromHost(void* dst, const void* host_src, int64_t bytes) override {
    return Copy(dst, host_src, bytes, cudaMemcpyHostToDevice, "CopyFromHost");
  }
  Status CopyToHost(void* host_dst, const void* src, int64_t bytes) override {
    return Copy(host_dst, src, bytes, cudaMemcpyDeviceToHost, "CopyToHost");
  }
  Status CopyWithin(void* dst, const void* src, int64_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToDevice, "CopyWithin");
  }

  CUstream_st* stream() const { return stream_; }

 protected:
  void Deallocate(void* data, int64_t bytes) override;

 private:
  CudaDeviceImpl(int ordinal, std::string name, int64_t total, cudaStream_t stream)
      : ordinal_(ordinal), name_(std::move(name)), total_(total), stream_(stream) {}

  // A copy on the legacy default stream, waited for: it starts after the work already queued on
  // that stream and on blocking streams (where engines usually run their kernels), and is done
  // when this returns. Work on non-blocking streams is the caller's to synchronize first.
  Status Copy(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind,
              const char* what) const;

  Status MemGetInfo(size_t* free, size_t* total) const {
    ScopedCudaDevice device(ordinal_);
    BLOCKKV_RETURN_IF_ERROR(device.status());
    if (const cudaError_t error = cudaMemGetInfo(free, total); error != cudaSuccess) {
      return CudaError("cudaMemGetInfo", error);
    }
    return Status::Ok();
  }

  const int ordinal_;
  const std::string name_;  // "cuda:0 (NVIDIA H200)"
  const int64_t total_;     // cudaMemGetInfo's total: constant for the device's life
  const cudaStream_t stream_;
};

Result<std::shared_ptr<CudaDeviceImpl>> CudaDeviceImpl::Create(int ordinal) {
  int count = 0;
  if (const cudaError_t error = cudaGetDeviceCount(&count); error != cudaSuccess) {
    static_cast<void>(cudaGetLastError());  // leave no error behind for the caller's own checks
    return UnavailableError(
        StrCat("CudaDevice(", ordinal, "): no CUDA device is available: ", CudaErrorText(error)));
  }
  if (count == 0) {
    return UnavailableError(StrCat("CudaDevice(", ordinal, "): no CUDA device is available"));
  }
  if (ordinal >= count) {
    return UnavailableError(StrCat("CudaDevice(", ordinal, "): no such GPU, this machine has ",
                                   count, " (ordinals 0..", count - 1, ")"));
  }
  ScopedCudaDevice device(ordinal);
  if (!device.status().ok()) {
    return UnavailableError(StrCat("CudaDevice(", ordinal, "): ", device.status().message()));
  }
  cudaDeviceProp properties{};
  if (const cudaError_t error = cudaGetDeviceProperties(&properties, ordinal);
      error != cudaSuccess) {
    return CudaError(StrCat("CudaDevice(", ordinal, "): cudaGetDeviceProperties"), error);
  }
  size_t free = 0;
  size_t total = 0;
  if (const cudaError_t error = cudaMemGetInfo(&free, &total); error != cudaSuccess) {
    return CudaError(StrCat("CudaDevice(", ordinal, "): cudaMemGetInfo"), error);
  }
  cudaStream_t stream = nullptr;
  if (const cudaError_t error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      error != cudaSuccess) {
    return CudaError(StrCat("CudaDevice(", ordinal, "): cudaStreamCreateWithFlags"), error);
  }
  std::string name = StrCat("cuda:", ordinal, " (", properties.name, ")");
  return std::shared_ptr<CudaDeviceImpl>(
      new CudaDeviceImpl(ordinal, std::move(name), static_cast<int64_t>(total), stream));
}

Result<DeviceBuffer> CudaDeviceImpl::Allocate(int64_t bytes) {
  if (bytes < 0) {
    return InvalidArgumentError(StrCat("cannot allocate a negative number of bytes: ", bytes));
  }
  if (bytes == 0) return DeviceBuffer();
  ScopedCudaDevice device(ordinal_);
  BLOCKKV_RETURN_IF_ERROR(device.status());
  void* data = nullptr;
  const cudaError_t error = cudaMalloc(&data, static_cast<size_t>(bytes));
  if (error == cudaErrorMemoryAllocation) {
    static_cast<void>(cudaGetLastError());  // out of memory is not sticky: clear it
    return ResourceExhaustedError(StrCat("cannot allocate ", bytes, " bytes on ", name_,
                                         ": out of memory, ", available_memory(), " of ", total_,
                                         " bytes free"));
  }
  if (error != cudaSuccess) {
    return CudaError(StrCat("cudaMalloc of ", bytes, " bytes on ", name_), error);
  }
  BLOCKKV_CHECK(reinterpret_cast<uintptr_t>(data) % kDeviceAlignment == 0,
                "cudaMalloc returned memory that is not 256-byte aligned");
  return MakeBuffer(data, bytes);
}

Status CudaDeviceImpl::Copy(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind,
                            const char* what) const {
  if (bytes < 0) {
    return InvalidArgumentError(StrCat(what, ": cannot copy a negative byte count: ", bytes));
  }
  if (bytes == 0) return Status::Ok();
  ScopedCudaDevice device(ordinal_);
  BLOCKKV_RETURN_IF_ERROR(device.status());
  cudaError_t error = cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, cudaStreamLegacy);
  if (error == cudaSuccess) error = cudaStreamSynchronize(cudaStreamLegacy);
  if (error != cudaSuccess) {
    static_cast<void>(cudaGetLastError());  // clears it unless it is sticky (then nothing can)
    return CudaError(StrCat(what, " of ", bytes, " bytes on ", name_), error);
  }
  return Status::Ok();
}

void CudaDeviceImpl::Deallocate(void* data, int64_t /*bytes*/) {
  ScopedCudaDevice device(ordinal_);
  cudaError_t error = device.status().ok() ? cudaFree(data) : cudaErrorInvalidDevice;
  // At process exit the runtime may already be gone; the driver frees everything then anyway.
  if (error == cudaSuccess || error == cudaErrorCudartUnloading) return;
  Log(LogLevel::kError, StrCat(name_, ": cudaFree failed: ", CudaErrorText(error)));
}

void CudaDeviceImpl::EmptyCache() {
  // blockkv's own memory comes from cudaMalloc, which caches nothing. What can be cached in the
  // process is the stream-ordered allocator's default pool (cudaMallocAsync / cudaFreeAsync, by
  // the engine or its libraries); trimming it hands that memory back to the driver so that
  // cudaMemGetInfo counts it as free. Memory whose cudaFreeAsync has not yet run on its stream
  // stays in the pool: this does not synchronize the device.
  int pools_supported = 0;
  cudaError_t error =
      cudaDeviceGetAttribute(&pools_supported, cudaDevAttrMemoryPoolsSupported, ordinal_);
  if (error == cudaSuccess && pools_supported == 0) return;
  cudaMemPool_t pool = nullptr;
  if (error == cudaSuccess) error = cudaDeviceGetDefaultMemPool(&pool, ordinal_);
  if (error == cudaSuccess) error = cudaMemPoolTrimTo(pool, 0);
  if (error != cudaSuccess) {
    Log(LogLevel::kWarning, StrCat(name_, ": EmptyCache could not trim the default memory pool: ",
                                   CudaErrorText(error)));
  }
}

}  // namespace

Result<std::shared_ptr<Device>> CudaDevice(int ordinal) {
  if (ordinal < 0) {
    return InvalidArgumentError(StrCat("CudaDevice(", ordinal, "): the ordinal must be >= 0"));
  }
  // One instance per ordinal for the life of the process. Never destroyed: buffers freed during
  // static destruction still find their device, and no CUDA call runs after the runtime unloads.
  static auto* mutex = new std::mutex();
  static auto* devices = new std::map<int, std::shared_ptr<Device>>();
  std::lock_guard<std::mutex> lock(*mutex);
  if (auto it = devices->find(ordinal); it != devices->end()) return it->second;
  BLOCKKV_ASSIGN_OR_RETURN(std::shared_ptr<CudaDeviceImpl> device, CudaDeviceImpl::Create(ordinal));
  Log(LogLevel::kDebug, StrCat(device->name(), ": ", device->total_memory(), " bytes"));
  return devices->emplace(ordinal, std::move(device)).first->second;
}

Result<CUstream_st*> CudaStream(const Device& device) {
  const auto* cuda = dynamic_cast<const CudaDeviceImpl*>(&device);
  if (cuda == nullptr) {
    return InvalidArgumentError(
        StrCat("CudaStream: ", device.name(), " is not a CUDA device made by CudaDevice()"));
  }
  return cuda->stream();
}

}  // namespace blockkv
