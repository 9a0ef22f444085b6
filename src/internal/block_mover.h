// SPDX-License-Identifier: Apache-2.0
// What OffloadStore needs from a device, beyond the Device interface: host memory for its tiers
// (pinned on CUDA so copies are DMA), and copies of whole blocks between the device's strided
// cache layout and contiguous host memory, queued and then waited for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "blockkv/block_allocator.h"
#include "blockkv/device.h"
#include "blockkv/status.h"

namespace blockkv::internal {

// Where block b of a cache group lives: `layers` chunks of `chunk_bytes`, chunk l at
// base + l·layer_stride + b·chunk_bytes (the group's [layers, num_blocks, block_size, 2, H, D]).
// On the host a block is the same chunks back to back: layers·chunk_bytes bytes.
struct BlockLayout {
  std::byte* base = nullptr;
  int64_t layers = 0;
  int64_t chunk_bytes = 0;
  int64_t layer_stride = 0;
  int64_t block_bytes() const { return layers * chunk_bytes; }
};

// Host memory that frees itself. Move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(std::byte* data, int64_t bytes, void (*release)(std::byte*))
      : data_(data), bytes_(bytes), release_(release) {}
  HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = other.data_;
      bytes_ = other.bytes_;
      release_ = other.release_;
      other.data_ = nullptr;
      other.bytes_ = 0;
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { Reset(); }

  std::byte* data() const { return data_; }
  int64_t size() const { return bytes_; }

 private:
  void Reset() {
    if (data_ != nullptr) release_(data_);
    data_ = nullptr;
  }
  std::byte* data_ = nullptr;
  int64_t bytes_ = 0;
  void (*release_)(std::byte*) = nullptr;
};

// `bytes` of host memory, 4096-byte aligned: pinned (cudaHostAlloc) for a CUDA `device`, plain
// otherwise. kResourceExhausted when it cannot be had.
Result<HostBuffer> AllocateHostBuffer(const Device& device, int64_t bytes);
Result<HostBuffer> AllocatePinnedHostBuffer(const Device& device, int64_t bytes);  // CUDA only

// Queues block copies and waits for them. One per worker thread; not thread-safe.
class BlockMover {
 public:
  virtual ~BlockMover() = default;
  // Queues the copy of block `block` into / from contiguous host memory.
  virtual Status ToHost(const BlockLayout& layout, BlockId block, std::byte* host) = 0;
  virtual Status FromHost(const BlockLayout& layout, const std::byte* host, BlockId block) = 0;
  // Waits for every queued copy; the first error of any.
  virtual Status Finish() = 0;
};

// memcpy on the calling thread (a CPU device's memory is host memory).
std::unique_ptr<BlockMover> MakeHostBlockMover();
// cudaMemcpy2DAsync on the device's copy stream, an event recorded and waited for by Finish.
// kUnavailable without CUDA.
Result<std::unique_ptr<BlockMover>> MakeCudaBlockMover(const Device& device);

}  // namespace blockkv::internal
