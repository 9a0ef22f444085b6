// SPDX-License-Identifier: Apache-2.0
// Device: where a KV cache's bytes live (host memory or one CUDA GPU), how much memory is there,
// and RAII buffers of it.
//
//   std::shared_ptr<Device> host = CpuDevice(/*memory_budget=*/8LL << 30);  // a fixed 8 GiB
//   Result<DeviceBuffer> buf = host->Allocate(1 << 20);   // 256-byte aligned, freed by RAII
//
// A Device is always owned by a shared_ptr; every DeviceBuffer keeps its device alive, so a
// buffer may outlive the caller's last handle to the device. Memory queries and Allocate are
// thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "blockkv/status.h"

namespace blockkv {

enum class DeviceKind { kCpu, kCuda };

// "cpu" / "cuda".
const char* DeviceKindName(DeviceKind kind);

inline constexpr int64_t kDeviceAlignment = 256;  // bytes; every DeviceBuffer's data is aligned

class Device;

// Owns `size()` bytes of one device's memory; frees them when destroyed. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return data_; }
  int64_t size() const { return size_; }  // bytes requested
  // The device this buffer belongs to; null for a default-constructed buffer.
  const std::shared_ptr<Device>& device() const { return device_; }

 private:
  friend class Device;
  DeviceBuffer(std::shared_ptr<Device> device, void* data, int64_t size)
      : device_(std::move(device)), data_(data), size_(size) {}
  void Reset();

  std::shared_ptr<Device> device_;
  void* data_ = nullptr;
  int64_t size_ = 0;
};

class Device : public std::enable_shared_from_this<Device> {
 public:
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  virtual int ordinal() const = 0;
  // "cpu", "cpu (budget 8.00 GiB)", "cuda:0 (NVIDIA H200)": for messages and logs.
  virtual std::string name() const = 0;
  // Bytes of memory this device has in all, and bytes that can be allocated now.
  virtual int64_t total_memory() const = 0;
  virtual int64_t available_memory() const = 0;

  // `bytes` of device memory, 256-byte aligned, contents unspecified. bytes == 0 gives an empty
  // buffer; bytes < 0 is kInvalidArgument; too little memory is kResourceExhausted.
  virtual Result<DeviceBuffer> Allocate(int64_t bytes) = 0;

  // Returns cached, unused memory to the system so available_memory() sees it. On the CPU there
  // is no such cache and it does nothing.
  virtual void EmptyCache() = 0;

  // Synchronous copies of `bytes` between host memory and this device's memory, or within this
  // device; done when they return. Pointers must not overlap. bytes < 0 is kInvalidArgument; a
  // device error is kInternal. The base class returns kUnimplemented.
  virtual Status CopyFromHost(void* dst, const void* host_src, int64_t bytes);
  virtual Status CopyToHost(void* host_dst, const void* src, int64_t bytes);
  virtual Status CopyWithin(void* dst, const void* src, int64_t bytes);

 protected:
  // Wraps memory this device allocated in a buffer that will call Deallocate(data, bytes).
  DeviceBuffer MakeBuffer(void* data, int64_t bytes);
  virtual void Deallocate(void* data, int64_t bytes) = 0;

  friend class DeviceBuffer;
};

// Host memory. total = min(MemTotal, cgroup limit); available = min(MemAvailable, cgroup limit
// − cgroup usage), read at each call from /proc/meminfo and the cgroup (v2 memory.max /
// memory.current, v1 memory.limit_in_bytes / memory.usage_in_bytes). One shared instance.
std::shared_ptr<Device> CpuDevice();

// Host memory capped at `memory_budget` bytes: total = budget, available = budget − bytes this
// device has handed out and not yet had back. Allocate fails with kResourceExhausted past the
// budget. For tests, and for anyone who wants a fixed host budget. REQUIRES: memory_budget >= 0.
std::shared_ptr<Device> CpuDevice(int64_t memory_budget);

// One CUDA GPU. kUnavailable when blockkv was built without CUDA or there is no such GPU.
Result<std::shared_ptr<Device>> CudaDevice(int ordinal);

}  // namespace blockkv
