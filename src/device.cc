// SPDX-License-Identifier: Apache-2.0
#include "blockkv/device.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

#include "internal/check.h"
#include "internal/host_memory.h"
#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

const char* DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "invalid";
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(std::move(other.device_)), data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::move(other.device_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

void DeviceBuffer::Reset() {
  if (device_ && data_ != nullptr) device_->Deallocate(data_, size_);
  device_.reset();
  data_ = nullptr;
  size_ = 0;
}

DeviceBuffer Device::MakeBuffer(void* data, int64_t bytes) {
  return {shared_from_this(), data, bytes};
}

Status Device::CopyFromHost(void* /*dst*/, const void* /*host_src*/, int64_t /*bytes*/) {
  return UnimplementedError(StrCat("CopyFromHost is not implemented for ", name()));
}
Status Device::CopyToHost(void* /*host_dst*/, const void* /*src*/, int64_t /*bytes*/) {
  return UnimplementedError(StrCat("CopyToHost is not implemented for ", name()));
}
Status Device::CopyWithin(void* /*dst*/, const void* /*src*/, int64_t /*bytes*/) {
  return UnimplementedError(StrCat("CopyWithin is not implemented for ", name()));
}

namespace {

// memcpy with the checks every host copy makes.
Status HostCopy(void* dst, const void* src, int64_t bytes) {
  if (bytes < 0) return InvalidArgumentError(StrCat("cannot copy a negative byte count: ", bytes));
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  return Status::Ok();
}

// Host memory, aligned to kDeviceAlignment. Large blocks come from mmap inside the allocator, so
// untouched pages cost nothing until first written.
class HostDevice final : public Device {
 public:
  // budget < 0: uncapped, memory figures come from the OS.
  explicit HostDevice(int64_t budget) : budget_(budget) {}

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int ordinal() const override { return 0; }
  std::string name() const override {
    if (budget_ < 0) return "cpu";
    return StrCat("cpu (budget ", internal::HumanBytes(static_cast<long double>(budget_)), ")");
  }
  int64_t total_memory() const override {
    return budget_ >= 0 ? budget_ : internal::ReadHostMemory().total;
  }
  int64_t available_memory() const override {
    if (budget_ >= 0) return budget_ - allocated_.load(std::memory_order_relaxed);
    return internal::ReadHostMemory().available;
  }

  Result<DeviceBuffer> Allocate(int64_t bytes) override {
    if (bytes < 0) {
      return InvalidArgumentError(StrCat("cannot allocate a negative number of bytes: ", bytes));
    }
    if (bytes == 0) return DeviceBuffer();
    if (bytes > INT64_MAX - kDeviceAlignment) {
      return ResourceExhaustedError(StrCat("cannot allocate ", bytes, " bytes on ", name()));
    }
    if (budget_ >= 0 && !Charge(bytes)) {
      return ResourceExhaustedError(StrCat("cannot allocate ", bytes, " bytes on ", name(), ": ",
                                           available_memory(), " of ", budget_, " available"));
    }
    const int64_t rounded = (bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment;
    void* data = std::aligned_alloc(kDeviceAlignment, static_cast<size_t>(rounded));
    if (data == nullptr) {
      if (budget_ >= 0) allocated_.fetch_sub(bytes, std::memory_order_relaxed);
      return ResourceExhaustedError(
          StrCat("host allocation of ", bytes, " bytes failed on ", name()));
    }
    return MakeBuffer(data, bytes);
  }

  void EmptyCache() override {}

  Status CopyFromHost(void* dst, const void* host_src, int64_t bytes) override {
    return HostCopy(dst, host_src, bytes);
  }
  Status CopyToHost(void* host_dst, const void* src, int64_t bytes) override {
    return HostCopy(host_dst, src, bytes);
  }
  Status CopyWithin(void* dst, const void* src, int64_t bytes) override {
    return HostCopy(dst, src, bytes);
  }

 protected:
  void Deallocate(void* data, int64_t bytes) override {
    std::free(data);
    if (budget_ >= 0) allocated_.fetch_sub(bytes, std::memory_order_relaxed);
  }

 private:
  // Takes `bytes` from the budget if they fit; thread-safe.
  bool Charge(int64_t bytes) {
    int64_t current = allocated_.load(std::memory_order_relaxed);
    do {
      if (bytes > budget_ - current) return false;
    } while (
        !allocated_.compare_exchange_weak(current, current + bytes, std::memory_order_relaxed));
    return true;
  }

  const int64_t budget_;
  std::atomic<int64_t> allocated_{0};
};

}  // namespace

std::shared_ptr<Device> CpuDevice() {
  static const std::shared_ptr<Device> device = std::make_shared<HostDevice>(-1);
  return device;
}

std::shared_ptr<Device> CpuDevice(int64_t memory_budget) {
  BLOCKKV_CHECK(memory_budget >= 0, "CpuDevice(memory_budget) requires memory_budget >= 0");
  return std::make_shared<HostDevice>(memory_budget);
}

}  // namespace blockkv
