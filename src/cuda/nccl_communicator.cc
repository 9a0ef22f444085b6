// SPDX-License-Identifier: Apache-2.0
#include "blockkv/nccl_communicator.h"

#include <string>
#include <string_view>
#include <thread>

#include "blockkv/log.h"
#include "cuda/cuda_util.h"
#include "internal/strings.h"

namespace blockkv {

using internal::CudaError;
using internal::CudaErrorText;
using internal::ScopedCudaDevice;
using internal::StrCat;

namespace {

// "<what> failed: <NCCL's error string>: <NCCL's last error message>". A peer or network failure
// is kUnavailable (the group is broken; retrying on it will not help, re-forming it may), any
// other NCCL error kInternal.
Status NcclError(std::string_view what, ncclResult_t result, ncclComm_t comm) {
  std::string message = StrCat(what, " failed: ", ncclGetErrorString(result));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') message = StrCat(message, ": ", last);
  if (result == ncclRemoteError || result == ncclSystemError) {
    return UnavailableError(std::move(message));
  }
  return InternalError(std::move(message));
}

// ncclInProgress is how a non-blocking communicator says "enqueued, still working".
bool NcclFailed(ncclResult_t result) { return result != ncclSuccess && result != ncclInProgress; }

}  // namespace

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(ncclComm_t comm,
                                                                   cudaStream_t stream) {
  if (comm == nullptr) {
    return InvalidArgumentError("NcclCommunicator::Create: the ncclComm_t is null");
  }
  int size = 0;
  int rank = 0;
  int device = 0;
  if (ncclResult_t r = ncclCommCount(comm, &size); r != ncclSuccess) {
    return NcclError("NcclCommunicator::Create: ncclCommCount", r, comm);
  }
  if (ncclResult_t r = ncclCommUserRank(comm, &rank); r != ncclSuccess) {
    return NcclError("NcclCommunicator::Create: ncclCommUserRank", r, comm);
  }
  if (ncclResult_t r = ncclCommCuDevice(comm, &device); r != ncclSuccess) {
    return NcclError("NcclCommunicator::Create: ncclCommCuDevice", r, comm);
  }
  ScopedCudaDevice current(device);
  BLOCKKV_RETURN_IF_ERROR(current.status());
  void* scalar = nullptr;
  if (cudaError_t error = cudaMalloc(&scalar, sizeof(int64_t)); error != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return CudaError("NcclCommunicator::Create: cudaMalloc", error);
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, stream, size, rank, device, static_cast<int64_t*>(scalar)));
}

NcclCommunicator::~NcclCommunicator() {
  ScopedCudaDevice current(device_);
  const cudaError_t error = current.status().ok() ? cudaFree(scalar_) : cudaErrorInvalidDevice;
  if (error != cudaSuccess && error != cudaErrorCudartUnloading) {
    Log(LogLevel::kError, StrCat("NcclCommunicator: cudaFree failed: ", CudaErrorText(error)));
  }
}

Result<int64_t> NcclCommunicator::AllReduceMin(int64_t value) {
  ScopedCudaDevice current(device_);
  BLOCKKV_RETURN_IF_ERROR(current.status());
  host_ = value;
  if (cudaError_t error =
          cudaMemcpyAsync(scalar_, &host_, sizeof(int64_t), cudaMemcpyHostToDevice, stream_);
      error != cudaSuccess) {
    return CudaError("NcclCommunicator::AllReduceMin: cudaMemcpyAsync to the device", error);
  }
  if (ncclResult_t r = ncclAllReduce(scalar_, scalar_, 1, ncclInt64, ncclMin, comm_, stream_);
      NcclFailed(r)) {
    return NcclError(StrCat("ncclAllReduce(MIN) on rank ", rank_, " of ", world_size_), r, comm_);
  }
  // Wait before copying back: a copy into pageable memory blocks inside CUDA until the stream
  // reaches it, where a failed peer could not be noticed.
  BLOCKKV_RETURN_IF_ERROR(Wait("NcclCommunicator::AllReduceMin"));
  cudaError_t error =
      cudaMemcpyAsync(&host_, scalar_, sizeof(int64_t), cudaMemcpyDeviceToHost, stream_);
  if (error == cudaSuccess) error = cudaStreamSynchronize(stream_);
  if (error != cudaSuccess) {
    return CudaError("NcclCommunicator::AllReduceMin: copying the result to the host", error);
  }
  return host_;
}

Status NcclCommunicator::Barrier() { return AllReduceMin(0).status(); }

Status NcclCommunicator::Wait(const char* what) {
  while (true) {
    // NCCL's state first: on a non-blocking communicator the collective may still be on its way
    // into the stream (ncclInProgress), and an idle stream proves nothing until it is there.
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(comm_, &async); r != ncclSuccess) {
      return NcclError(StrCat(what, ": ncclCommGetAsyncError"), r, comm_);
    }
    if (NcclFailed(async)) return NcclError(StrCat(what, " on rank ", rank_), async, comm_);
    if (async == ncclSuccess) {
      const cudaError_t error = cudaStreamQuery(stream_);
      if (error == cudaSuccess) return Status::Ok();
      if (error != cudaErrorNotReady) return CudaError(StrCat(what, ": cudaStreamQuery"), error);
    }
    std::this_thread::yield();  // a one-off wait for a few microseconds of work
  }
}

}  // namespace blockkv
