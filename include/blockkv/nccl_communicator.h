// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator: a Communicator over an NCCL communicator and CUDA stream the caller already
// has (an engine's tensor-parallel group).
//
//   // engine_comm: the engine's ncclComm_t (e.g. from ncclCommInitRank), `stream` its stream
//   Result<std::unique_ptr<NcclCommunicator>> comm = NcclCommunicator::Create(engine_comm, stream);
//   auto cache = BlockedKVCache::Create(configs, memory, *CudaDevice(local_rank), comm->get());
//
// This header includes <nccl.h> and CUDA's runtime header, which is why it is separate from
// communicator.h. It exists only when blockkv was built with CUDA and NCCL; otherwise including
// it is a compile-time error.
//
// The ncclComm_t and the stream are borrowed: blockkv neither destroys nor aborts them. Each
// collective is enqueued on that stream (after whatever the caller already queued there), then
// the calling thread waits for the stream, polling ncclCommGetAsyncError so that a failed peer is
// reported instead of waited for forever (as far as NCCL detects it). Works with blocking and
// non-blocking (config.blocking = 0) communicators. Not thread-safe: one thread at a time per
// communicator, as NCCL requires.
#pragma once

#if !defined(BLOCKKV_HAVE_NCCL)
#error "blockkv was built without NCCL: reconfigure with BLOCKKV_CUDA=ON and NCCL installed"
#endif

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>

#include "blockkv/communicator.h"
#include "blockkv/status.h"

namespace blockkv {

class NcclCommunicator final : public Communicator {
 public:
  // Wraps `comm`; collectives run on `stream` (null: the legacy default stream), which must
  // belong to the communicator's device. Allocates one int64_t of device memory on that device.
  // kInvalidArgument for a null comm; kInternal with NCCL's or CUDA's error text when they fail.
  // REQUIRES: `comm` and `stream` outlive the NcclCommunicator.
  static Result<std::unique_ptr<NcclCommunicator>> Create(ncclComm_t comm, cudaStream_t stream);

  ~NcclCommunicator() override;

  int world_size() const override { return world_size_; }
  int rank() const override { return rank_; }
  // ncclAllReduce of one ncclInt64 with ncclMin, then waits for the stream. A peer or network
  // failure NCCL reports (ncclRemoteError, ncclSystemError) is kUnavailable; other NCCL and CUDA
  // errors are kInternal.
  Result<int64_t> AllReduceMin(int64_t value) override;
  // A one-element all-reduce: NCCL has no barrier. Errors as AllReduceMin.
  Status Barrier() override;

  // The CUDA device of the communicator (ncclCommCuDevice).
  int device() const { return device_; }

 private:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, int world_size, int rank, int device,
                   int64_t* scalar)
      : comm_(comm),
        stream_(stream),
        world_size_(world_size),
        rank_(rank),
        device_(device),
        scalar_(scalar) {}

  // Waits until the work queued on stream_ is done or NCCL reports a failure.
  Status Wait(const char* what);

  ncclComm_t comm_;
  cudaStream_t stream_;
  int world_size_;
  int rank_;
  int device_;
  int64_t* scalar_;   // device memory: the one value being reduced, in place
  int64_t host_ = 0;  // its host copy; a member so that asynchronous copies have a stable source
};

}  // namespace blockkv
