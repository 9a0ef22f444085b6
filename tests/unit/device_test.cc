// SPDX-License-Identifier: Apache-2.0
// Devices: the budgeted host device, the OS-backed host device, CudaDevice without a GPU build,
// DeviceBuffer's RAII, and the /proc/meminfo and cgroup parsers behind CpuDevice().
#include "blockkv/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "internal/host_memory.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::testing::HasSubstr;

DeviceBuffer AllocateOrDie(Device& device, int64_t bytes) {
  Result<DeviceBuffer> buffer = device.Allocate(bytes);
  EXPECT_OK(buffer);
  return std::move(buffer).value();
}

TEST(CpuDeviceBudgetTest, TotalIsTheBudgetAndAvailableCountsOutstandingBytes) {
  std::shared_ptr<Device> device = CpuDevice(1000);
  EXPECT_EQ(device->kind(), DeviceKind::kCpu);
  EXPECT_EQ(device->ordinal(), 0);
  EXPECT_THAT(device->name(), HasSubstr("cpu"));
  EXPECT_EQ(device->total_memory(), 1000);
  EXPECT_EQ(device->available_memory(), 1000);
  DeviceBuffer a = AllocateOrDie(*device, 600);
  EXPECT_EQ(a.size(), 600);
  EXPECT_EQ(device->available_memory(), 400);
  DeviceBuffer b = AllocateOrDie(*device, 400);
  EXPECT_EQ(device->available_memory(), 0);
  EXPECT_EQ(device->total_memory(), 1000);
}

TEST(CpuDeviceBudgetTest, AllocateBeyondBudgetFailsAndChargesNothing) {
  std::shared_ptr<Device> device = CpuDevice(1000);
  DeviceBuffer a = AllocateOrDie(*device, 600);
  Result<DeviceBuffer> b = device->Allocate(401);
  ASSERT_CODE(b, StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(), HasSubstr("401"));
  EXPECT_EQ(device->available_memory(), 400);
  EXPECT_CODE(device->Allocate(INT64_MAX), StatusCode::kResourceExhausted);
  EXPECT_EQ(device->available_memory(), 400);
  // Exactly what is left still fits.
  DeviceBuffer c = AllocateOrDie(*device, 400);
  EXPECT_EQ(device->available_memory(), 0);
}

TEST(CpuDeviceBudgetTest, NegativeSizeIsInvalidArgument) {
  std::shared_ptr<Device> device = CpuDevice(1000);
  Result<DeviceBuffer> b = device->Allocate(-1);
  ASSERT_CODE(b, StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("-1"));
  EXPECT_EQ(device->available_memory(), 1000);
}

TEST(CpuDeviceBudgetTest, ZeroBytesGivesAnEmptyBuffer) {
  std::shared_ptr<Device> device = CpuDevice(0);
  Result<DeviceBuffer> b = device->Allocate(0);
  ASSERT_OK(b);
  EXPECT_EQ(b->size(), 0);
  EXPECT_EQ(b->data(), nullptr);
  EXPECT_EQ(device->available_memory(), 0);
  EXPECT_CODE(device->Allocate(1), StatusCode::kResourceExhausted);
}

TEST(CpuDeviceBudgetTest, BuffersAre256ByteAlignedAndWritable) {
  std::shared_ptr<Device> device = CpuDevice(1 << 20);
  std::vector<DeviceBuffer> buffers;
  for (int64_t bytes : {1, 3, 255, 256, 257, 1000, 4096, 65537}) {
    buffers.push_back(AllocateOrDie(*device, bytes));
    const DeviceBuffer& b = buffers.back();
    ASSERT_NE(b.data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % kDeviceAlignment, 0u) << bytes;
    std::memset(b.data(), 0xab, static_cast<size_t>(bytes));  // ASan checks the extent
  }
}

TEST(CpuDeviceBudgetTest, DestroyingABufferReturnsItsBytes) {
  std::shared_ptr<Device> device = CpuDevice(1000);
  {
    DeviceBuffer a = AllocateOrDie(*device, 700);
    EXPECT_EQ(device->available_memory(), 300);
  }
  EXPECT_EQ(device->available_memory(), 1000);
}

TEST(CpuDeviceBudgetTest, MoveAssignReturnsTheOverwrittenBuffersBytes) {
  std::shared_ptr<Device> device = CpuDevice(1000);
  DeviceBuffer a = AllocateOrDie(*device, 100);
  DeviceBuffer b = AllocateOrDie(*device, 200);
  void* b_data = b.data();
  EXPECT_EQ(device->available_memory(), 700);
  a = std::move(b);
  EXPECT_EQ(device->available_memory(), 800);
  EXPECT_EQ(a.data(), b_data);
  EXPECT_EQ(a.size(), 200);
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(b.size(), 0);
  EXPECT_EQ(b.device(), nullptr);

  DeviceBuffer c(std::move(a));  // move construction transfers without charging again
  EXPECT_EQ(c.data(), b_data);
  EXPECT_EQ(device->available_memory(), 800);
  c = DeviceBuffer();
  EXPECT_EQ(device->available_memory(), 1000);
}

TEST(CpuDeviceBudgetTest, BufferKeepsItsDeviceAlive) {
  std::shared_ptr<Device> device = CpuDevice(1000);
  std::weak_ptr<Device> weak = device;
  DeviceBuffer b = AllocateOrDie(*device, 100);
  device.reset();
  ASSERT_FALSE(weak.expired());
  EXPECT_EQ(b.device(), weak.lock());
  EXPECT_EQ(b.device()->available_memory(), 900);
  b = DeviceBuffer();
  EXPECT_TRUE(weak.expired());
}

TEST(CpuDeviceBudgetTest, ConcurrentAllocationNeverExceedsTheBudget) {
  constexpr int64_t kBudget = 1 << 20;
  std::shared_ptr<Device> device = CpuDevice(kBudget);
  std::atomic<int64_t> live{0};  // bytes held by the threads; added after Allocate, removed
                                 // before the buffer is destroyed, so live <= charged always
  std::atomic<bool> exceeded{false};
  std::atomic<int64_t> failures{0};
  auto worker = [&](uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<DeviceBuffer> held;
    for (int i = 0; i < 20'000; ++i) {
      if (held.size() < 8 && rng() % 3 != 0) {
        const int64_t bytes = 1 + rng() % (kBudget / 4);
        Result<DeviceBuffer> b = device->Allocate(bytes);
        if (b.ok()) {
          if (live.fetch_add(bytes) + bytes > kBudget) exceeded = true;
          held.push_back(*std::move(b));
        } else {
          if (b.status().code() != StatusCode::kResourceExhausted) exceeded = true;
          ++failures;
        }
      } else if (!held.empty()) {
        const size_t victim = rng() % held.size();
        live.fetch_sub(held[victim].size());
        held[victim] = std::move(held.back());
        held.pop_back();
      }
      const int64_t available = device->available_memory();
      if (available < 0 || available > kBudget) exceeded = true;
    }
    for (DeviceBuffer& b : held) live.fetch_sub(b.size());
  };
  std::thread t1(worker, 1u);
  std::thread t2(worker, 2u);
  t1.join();
  t2.join();
  EXPECT_FALSE(exceeded.load());
  EXPECT_GT(failures.load(), 0);  // the budget was actually contended
  EXPECT_EQ(live.load(), 0);
  EXPECT_EQ(device->available_memory(), kBudget);
}

TEST(CpuDeviceTest, HostDeviceReportsPlausibleMemory) {
  std::shared_ptr<Device> device = CpuDevice();
  ASSERT_NE(device, nullptr);
  EXPECT_EQ(device->kind(), DeviceKind::kCpu);
  EXPECT_EQ(device->name(), "cpu");
  const int64_t total = device->total_memory();
  const int64_t available = device->available_memory();
  EXPECT_GT(total, 0);
  EXPECT_GT(available, 0);
  EXPECT_LE(available, total);
  EXPECT_EQ(CpuDevice(), device);  // one shared instance
  DeviceBuffer b = AllocateOrDie(*device, 4096);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % kDeviceAlignment, 0u);
  device->EmptyCache();
}

TEST(CudaDeviceTest, UnavailableWithoutCudaOrGpu) {
  Result<std::shared_ptr<Device>> cuda = CudaDevice(0);
  if (cuda.ok()) {
    // Built with CUDA and a GPU is present: it must be a real CUDA device.
    EXPECT_EQ((*cuda)->kind(), DeviceKind::kCuda);
    EXPECT_EQ((*cuda)->ordinal(), 0);
    EXPECT_GT((*cuda)->total_memory(), 0);
  } else {
    EXPECT_EQ(cuda.status().code(), StatusCode::kUnavailable) << cuda.status();
  }
}

TEST(DeviceKindTest, Names) {
  EXPECT_STREQ(DeviceKindName(DeviceKind::kCpu), "cpu");
  EXPECT_STREQ(DeviceKindName(DeviceKind::kCuda), "cuda");
}

TEST(DeviceDeathTest, NegativeBudgetAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH((void)CpuDevice(-1), "memory_budget >= 0");
}

// host_memory.h: the parsers behind CpuDevice(), fed text.

using internal::CgroupPathOf;
using internal::CombineHostMemory;
using internal::HostMemory;
using internal::ParseCgroupLimit;
using internal::ParseMemInfoField;

constexpr const char* kMemInfo =
    "MemTotal:       263842588 kB\n"
    "MemFree:        100000000 kB\n"
    "MemAvailable:  123 kB\n"
    "HugePages_Total:       4\n"
    "Buffers:            0 kB";

TEST(HostMemoryTest, ParseMemInfoFieldReadsKilobytes) {
  EXPECT_EQ(ParseMemInfoField(kMemInfo, "MemAvailable"), 123 * 1024);
  EXPECT_EQ(ParseMemInfoField(kMemInfo, "MemTotal"), int64_t{263842588} * 1024);
  EXPECT_EQ(ParseMemInfoField(kMemInfo, "Buffers"), 0);          // last line, no newline
  EXPECT_EQ(ParseMemInfoField(kMemInfo, "HugePages_Total"), 4);  // no unit
}

TEST(HostMemoryTest, ParseMemInfoFieldMissingOrMalformedIsNullopt) {
  EXPECT_EQ(ParseMemInfoField(kMemInfo, "SwapTotal"), std::nullopt);
  EXPECT_EQ(ParseMemInfoField(kMemInfo, "Mem"), std::nullopt);  // not a prefix match
  EXPECT_EQ(ParseMemInfoField("", "MemAvailable"), std::nullopt);
  EXPECT_EQ(ParseMemInfoField("MemAvailable: lots kB\n", "MemAvailable"), std::nullopt);
  EXPECT_EQ(ParseMemInfoField("MemAvailable: -5 kB\n", "MemAvailable"), std::nullopt);
  EXPECT_EQ(ParseMemInfoField("MemAvailable: 99999999999999999999 kB\n", "MemAvailable"),
            std::nullopt);
  EXPECT_EQ(ParseMemInfoField("MemAvailable: 9007199254740993 kB\n", "MemAvailable"),
            std::nullopt);  // overflows int64 once multiplied by 1024
}

TEST(HostMemoryTest, ParseCgroupLimit) {
  EXPECT_EQ(ParseCgroupLimit("max"), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("max\n"), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("9223372036854771712"), std::nullopt);  // v1 "no limit"
  EXPECT_EQ(ParseCgroupLimit("9223372036854771712\n"), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("1073741824\n"), int64_t{1073741824});
  EXPECT_EQ(ParseCgroupLimit("0\n"), 0);
  EXPECT_EQ(ParseCgroupLimit(""), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("garbage"), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("12abc"), std::nullopt);
  EXPECT_EQ(ParseCgroupLimit("-1"), std::nullopt);
}

TEST(HostMemoryTest, CgroupPathOfV2) {
  EXPECT_EQ(CgroupPathOf("0::/user.slice/session-3.scope\n", true), "/user.slice/session-3.scope");
  EXPECT_EQ(CgroupPathOf("0::/\n", true), "/");
  // A hybrid host lists v1 controllers and the v2 line.
  const char* hybrid = "12:memory:/docker/abc\n1:name=systemd:/init.scope\n0::/init.scope\n";
  EXPECT_EQ(CgroupPathOf(hybrid, true), "/init.scope");
  EXPECT_EQ(CgroupPathOf("5:memory:/x\n", true), std::nullopt);
}

TEST(HostMemoryTest, CgroupPathOfV1FindsTheMemoryController) {
  const char* v1 =
      "11:cpuset:/\n"
      "7:cpu,cpuacct:/docker/deadbeef\n"
      "4:blkio,memory:/docker/deadbeef\n"
      "1:name=systemd:/docker/deadbeef\n";
  EXPECT_EQ(CgroupPathOf(v1, false), "/docker/deadbeef");
  EXPECT_EQ(CgroupPathOf("3:memory:/kubepods/pod1\n", false), "/kubepods/pod1");
  EXPECT_EQ(CgroupPathOf("2:memory_extra:/x\n0::/y\n", false), std::nullopt);
  EXPECT_EQ(CgroupPathOf("", false), std::nullopt);
  EXPECT_EQ(CgroupPathOf("not a cgroup line", false), std::nullopt);
}

TEST(HostMemoryTest, CombineHostMemoryTakesTheMinimum) {
  const int64_t kGiB = int64_t{1} << 30;
  // The cgroup limit is smaller than the machine.
  HostMemory m = CombineHostMemory(64 * kGiB, 32 * kGiB, 8 * kGiB, 3 * kGiB);
  EXPECT_EQ(m.total, 8 * kGiB);
  EXPECT_EQ(m.available, 5 * kGiB);
  // The machine has less free than the cgroup's headroom.
  m = CombineHostMemory(64 * kGiB, 2 * kGiB, 8 * kGiB, 3 * kGiB);
  EXPECT_EQ(m.total, 8 * kGiB);
  EXPECT_EQ(m.available, 2 * kGiB);
  // No cgroup limit.
  m = CombineHostMemory(64 * kGiB, 32 * kGiB, std::nullopt, std::nullopt);
  EXPECT_EQ(m.total, 64 * kGiB);
  EXPECT_EQ(m.available, 32 * kGiB);
  // Usage above the limit leaves nothing, never a negative number.
  m = CombineHostMemory(64 * kGiB, 32 * kGiB, 8 * kGiB, 9 * kGiB);
  EXPECT_EQ(m.total, 8 * kGiB);
  EXPECT_EQ(m.available, 0);
  // No /proc/meminfo: the cgroup alone.
  m = CombineHostMemory(std::nullopt, std::nullopt, 8 * kGiB, 3 * kGiB);
  EXPECT_EQ(m.total, 8 * kGiB);
  EXPECT_EQ(m.available, 5 * kGiB);
}

TEST(HostMemoryTest, ReadHostMemoryOnThisMachine) {
  const HostMemory m = internal::ReadHostMemory();
  EXPECT_GT(m.total, 0);
  EXPECT_GT(m.available, 0);
  EXPECT_LE(m.available, m.total);
}

}  // namespace
}  // namespace blockkv
