// SPDX-License-Identifier: Apache-2.0
// Host → device copies that the host does not wait for, for RaggedBatch's device mirror: the
// batch stages its arrays in pinned host memory, queues their copy once per step, and waits for
// that copy only before it writes the staging again (the next step).
//
//   UploadQueue& q = ...;
//   q.Copy(device_dst, pinned_src, bytes);  // queued, not waited for
//   q.Record();                             // marks what Wait waits for
//   ... the host may read pinned_src, not write it ...
//   q.Wait();                               // done: pinned_src may be written again
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "blockkv/device.h"
#include "blockkv/status.h"
#include "internal/block_mover.h"

namespace blockkv::internal {

class UploadQueue {
 public:
  virtual ~UploadQueue() = default;
  // Queues the copy of host [src, src + bytes) to device [dst, dst + bytes). The host bytes must
  // not change until a Wait after the next Record returns. bytes > 0.
  virtual Status Copy(void* dst, const std::byte* src, int64_t bytes) = 0;
  // Marks every copy queued so far as what the next Wait waits for.
  virtual Status Record() = 0;
  // Returns once the copies queued before the last Record are done; the error of a copy that
  // failed on the device.
  virtual Status Wait() = 0;
};

// The CUDA queue: cudaMemcpyAsync on the legacy default stream (so after the work already queued
// there and on blocking streams, and before the kernels queued there next), an event recorded
// there and synchronized by Wait. REQUIRES: `device` is blockkv's CudaDevice (CudaStream(device)
// is OK). kUnavailable without CUDA.
Result<std::unique_ptr<UploadQueue>> MakeCudaUploadQueue(const Device& device);

// `bytes` of page-locked host memory (cudaHostAlloc) for `device`'s uploads, so that a copy from
// it is asynchronous DMA. kResourceExhausted when it cannot be pinned; kUnavailable without CUDA.
Result<HostBuffer> AllocateUploadStaging(const Device& device, int64_t bytes);

}  // namespace blockkv::internal
