// SPDX-License-Identifier: Apache-2.0
#include "blockkv/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "blockkv/device.h"
#include "cuda_test_util.h"

namespace blockkv {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;
// cudaMemGetInfo moves in pages of up to 2 MiB, and the driver may take a little for itself.
constexpr int64_t kSlack = 64 * kMiB;

std::shared_ptr<Device> Gpu0() {
  Result<std::shared_ptr<Device>> device = CudaDevice(0);
  EXPECT_TRUE(device.ok()) << device.status();
  return device.ok() ? *device : nullptr;
}

// Runs everywhere: this is the path CI takes.
TEST(CudaDeviceTest, WithoutAGpuIsUnavailableWithAClearMessage) {
  if (blockkv_test::GpuCount() > 0) GTEST_SKIP() << "this machine has a GPU";
  Result<std::shared_ptr<Device>> device = CudaDevice(0);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(device.status().message().find("CudaDevice(0): no CUDA device is available"),
            std::string::npos)
      << device.status();
  // Asking again gives the same answer (failures are not cached as devices).
  EXPECT_EQ(CudaDevice(0).status().code(), StatusCode::kUnavailable);
}

TEST(CudaDeviceTest, NegativeOrdinalIsInvalidArgument) {
  Result<std::shared_ptr<Device>> device = CudaDevice(-1);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaDeviceTest, CudaStreamOfAHostDeviceIsInvalidArgument) {
  Result<CUstream_st*> stream = CudaStream(*CpuDevice());
  ASSERT_FALSE(stream.ok());
  EXPECT_EQ(stream.status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaDeviceTest, OrdinalPastTheLastGpuIsUnavailable) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  const int count = blockkv_test::GpuCount();
  Result<std::shared_ptr<Device>> device = CudaDevice(count);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(device.status().message().find("CudaDevice(" + std::to_string(count) + ")"),
            std::string::npos)
      << device.status();
}

TEST(CudaDeviceTest, ReportsItsKindOrdinalNameAndMemory) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> gpu = Gpu0();
  ASSERT_NE(gpu, nullptr);
  EXPECT_EQ(gpu->kind(), DeviceKind::kCuda);
  EXPECT_EQ(gpu->ordinal(), 0);
  EXPECT_EQ(gpu->name().rfind("cuda:0 (", 0), 0u) << gpu->name();

  size_t free = 0;
  size_t total = 0;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  EXPECT_EQ(gpu->total_memory(), static_cast<int64_t>(total));
  EXPECT_GT(gpu->available_memory(), 0);
  EXPECT_LE(gpu->available_memory(), gpu->total_memory());
  EXPECT_NEAR(static_cast<double>(gpu->available_memory()), static_cast<double>(free),
              static_cast<double>(kSlack));
}

TEST(CudaDeviceTest, EveryCallGivesTheSameInstance) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> first = Gpu0();
  ASSERT_NE(first, nullptr);
  std::vector<std::shared_ptr<Device>> seen(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < seen.size(); ++i) {
    threads.emplace_back([&seen, i] { seen[i] = *CudaDevice(0); });
  }
  for (std::thread& t : threads) t.join();
  for (const std::shared_ptr<Device>& d : seen) EXPECT_EQ(d.get(), first.get());
}

TEST(CudaDeviceTest, AllocateGivesAlignedDeviceMemoryNotManaged) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> gpu = Gpu0();
  ASSERT_NE(gpu, nullptr);
  for (int64_t bytes : {int64_t{1}, int64_t{1000}, kMiB + 3}) {
    Result<DeviceBuffer> buffer = gpu->Allocate(bytes);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_EQ(buffer->size(), bytes);
    EXPECT_EQ(buffer->device().get(), gpu.get());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % kDeviceAlignment, 0u);
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, buffer->data()), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
    EXPECT_EQ(attributes.device, 0);
  }
}

TEST(CudaDeviceTest, AllocateZeroIsEmptyAndNegativeIsInvalid) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> gpu = Gpu0();
  ASSERT_NE(gpu, nullptr);
  Result<DeviceBuffer> empty = gpu->Allocate(0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->data(), nullptr);
  EXPECT_EQ(gpu->Allocate(-1).status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaDeviceTest, AllocatingMoreThanTheGpuHasIsResourceExhausted) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> gpu = Gpu0();
  ASSERT_NE(gpu, nullptr);
  Result<DeviceBuffer> buffer = gpu->Allocate(gpu->total_memory() + kGiB);
  ASSERT_FALSE(buffer.ok());
  EXPECT_EQ(buffer.status().code(), StatusCode::kResourceExhausted) << buffer.status();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the out-of-memory error was cleared
  // And the device still works.
  EXPECT_TRUE(gpu->Allocate(kMiB).ok());
}

TEST(CudaDeviceTest, FreeingABufferGivesItsMemoryBack) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> gpu = Gpu0();
  ASSERT_NE(gpu, nullptr);
  const int64_t bytes = std::min<int64_t>(2 * kGiB, gpu->available_memory() / 2);
  const int64_t before = gpu->available_memory();
  {
    Result<DeviceBuffer> buffer = gpu->Allocate(bytes);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_LE(gpu->available_memory(), before - bytes + kSlack);
  }
  EXPECT_GE(gpu->available_memory(), before - kSlack);
}

TEST(CudaDeviceTest, CopiesRoundTripThroughDeviceMemory) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> gpu = Gpu0();
  ASSERT_NE(gpu, nullptr);
  constexpr int64_t kBytes = 1 << 16;
  std::vector<uint8_t> in(kBytes);
  for (int64_t i = 0; i < kBytes; ++i) in[i] = static_cast<uint8_t>(i * 7 + 3);
  Result<DeviceBuffer> a = gpu->Allocate(kBytes);
  Result<DeviceBuffer> b = gpu->Allocate(kBytes);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(gpu->CopyFromHost(a->data(), in.data(), kBytes).ok());
  ASSERT_TRUE(gpu->CopyWithin(b->data(), a->data(), kBytes).ok());
  std::vector<uint8_t> out(kBytes, 0);
  ASSERT_TRUE(gpu->CopyToHost(out.data(), b->data(), kBytes).ok());
  EXPECT_EQ(out, in);
  EXPECT_EQ(gpu->CopyWithin(b->data(), a->data(), -1).code(), StatusCode::kInvalidArgument);
}

TEST(CudaDeviceTest, OneNonBlockingStreamPerDevice) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> gpu = Gpu0();
  ASSERT_NE(gpu, nullptr);
  Result<CUstream_st*> stream = CudaStream(*gpu);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_NE(*stream, nullptr);
  EXPECT_EQ(*CudaStream(*gpu), *stream);
  unsigned int flags = 0;
  ASSERT_EQ(cudaStreamGetFlags(*stream, &flags), cudaSuccess);
  EXPECT_EQ(flags & cudaStreamNonBlocking, cudaStreamNonBlocking);

  // It works for asynchronous copies.
  Result<DeviceBuffer> buffer = gpu->Allocate(4096);
  ASSERT_TRUE(buffer.ok());
  std::vector<uint8_t> in(4096, 0x5a);
  std::vector<uint8_t> out(4096, 0);
  ASSERT_EQ(cudaMemcpyAsync(buffer->data(), in.data(), 4096, cudaMemcpyHostToDevice, *stream),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(out.data(), buffer->data(), 4096, cudaMemcpyDeviceToHost, *stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(*stream), cudaSuccess);
  EXPECT_EQ(out, in);
}

// EmptyCache hands memory cached by the stream-ordered allocator back to the driver.
TEST(CudaDeviceTest, EmptyCacheTrimsTheDefaultMemoryPool) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::shared_ptr<Device> gpu = Gpu0();
  ASSERT_NE(gpu, nullptr);
  int pools = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0), cudaSuccess);
  if (pools == 0) GTEST_SKIP() << "this GPU has no stream-ordered memory pools";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  uint64_t old_threshold = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &old_threshold),
            cudaSuccess);
  uint64_t keep_everything = UINT64_MAX;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything),
            cudaSuccess);

  const int64_t bytes = std::min<int64_t>(kGiB, gpu->available_memory() / 4);
  const int64_t before = gpu->available_memory();
  void* data = nullptr;
  ASSERT_EQ(cudaMallocAsync(&data, static_cast<size_t>(bytes), cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(data, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  const int64_t cached = gpu->available_memory();
  EXPECT_LE(cached, before - bytes + kSlack) << "the pool should still hold the memory";
  gpu->EmptyCache();
  EXPECT_GE(gpu->available_memory(), before - kSlack) << "EmptyCache should release it";

  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &old_threshold),
            cudaSuccess);
}

// The calling thread's current device is the same after blockkv's calls as before.
TEST(CudaDeviceTest, LeavesTheCurrentDeviceAsItFoundIt) {
  BLOCKKV_SKIP_WITHOUT_GPUS(2);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  Result<DeviceBuffer> buffer = (*gpu)->Allocate(kMiB);
  ASSERT_TRUE(buffer.ok());
  EXPECT_GT((*gpu)->available_memory(), 0);
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 1);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, buffer->data()), cudaSuccess);
  EXPECT_EQ(attributes.device, 0);
  *buffer = DeviceBuffer();  // cudaFree on device 0 from a thread whose device is 1
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

}  // namespace
}  // namespace blockkv
