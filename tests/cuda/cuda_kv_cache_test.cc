// SPDX-License-Identifier: Apache-2.0
// A BlockedKVCache whose storage lives in GPU memory: planned, allocated, reserved and freed as
// on the host, and written and read back through cudaMemcpy at a known block and slot.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "blockkv/kv_cache.h"
#include "blockkv/tensor.h"
#include "cuda_test_util.h"

namespace blockkv {
namespace {

// 3 layers, 16 tokens per block, 4 KV heads of 64, fp16: 3·16·2·4·64·2 = 48 KiB per block.
KVCacheConfig SmallConfig() {
  return KVCacheConfig{.block_size = 16, .cache_shape = {3, 4, 64}, .cache_dtype = DType::kFloat16};
}

std::unique_ptr<BlockedKVCache> MakeGpuCache(int32_t num_blocks) {
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!gpu.ok()) return nullptr;
  auto cache = BlockedKVCache::Create(
      {SmallConfig()}, MemoryConfig{.mode = AllocationMode::kAllocate, .size = num_blocks}, *gpu);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? std::move(*cache) : nullptr;
}

TEST(CudaKVCacheTest, StorageIsDeviceMemoryOfThePlannedSize) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::unique_ptr<BlockedKVCache> cache = MakeGpuCache(32);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->num_blocks(), 32);
  EXPECT_EQ(cache->plan().bytes_per_block, 48 * 1024);
  EXPECT_TRUE(cache->CheckInvariants().ok());
  for (int64_t layer = 0; layer < 3; ++layer) {
    Result<TensorView> view = cache->GetCache(layer);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->device, DeviceKind::kCuda);
    EXPECT_EQ(view->device_ordinal, 0);
    EXPECT_EQ(view->ndim, 5);
    EXPECT_EQ(view->shape[0], 32);
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, view->data), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);  // device memory, not managed or host
  }
}

TEST(CudaKVCacheTest, ReserveAndFreeFollowTheAllocator) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::unique_ptr<BlockedKVCache> cache = MakeGpuCache(8);
  ASSERT_NE(cache, nullptr);
  Result<std::vector<BlockId>> blocks = cache->Reserve(3);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  EXPECT_EQ(*blocks, (std::vector<BlockId>{0, 1, 2}));
  EXPECT_EQ(cache->free_blocks(), std::vector<int32_t>{5});
  EXPECT_EQ(cache->Reserve(6).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(cache->Free(*blocks).ok());
  EXPECT_EQ(cache->free_blocks(), std::vector<int32_t>{8});
  EXPECT_TRUE(cache->CheckInvariants().ok());
}

// Writes one token's K (and V) at (block, slot) of one layer through the K/V plane views, reads
// the whole layer back, and finds them exactly where the documented layout
// [num_blocks, block_size, 2, num_kv_heads, head_size] puts them, with nothing else touched.
TEST(CudaKVCacheTest, WritesLandWhereTheLayoutSays) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::unique_ptr<BlockedKVCache> cache = MakeGpuCache(8);
  ASSERT_NE(cache, nullptr);
  const KVCacheConfig config = SmallConfig();
  const int64_t heads = config.num_kv_heads();
  const int64_t dim = config.head_size();
  const int64_t token_elements = heads * dim;  // one token of K, or of V
  const int64_t layer_elements = 8 * config.block_size * 2 * token_elements;
  constexpr int64_t kLayer = 1;

  Result<std::vector<BlockId>> blocks = cache->Reserve(6);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  const BlockId block = (*blocks)[5];
  const int64_t slot = 9;

  Result<TensorView> layer = cache->GetCache(kLayer);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ASSERT_EQ(cudaMemset(layer->data, 0, static_cast<size_t>(layer_elements) * 2), cudaSuccess);
  Result<std::pair<TensorView, TensorView>> kv = SplitKV(*layer);
  ASSERT_TRUE(kv.ok()) << kv.status();
  const auto& [k, v] = *kv;

  std::vector<uint16_t> k_in(static_cast<size_t>(token_elements));
  std::vector<uint16_t> v_in(static_cast<size_t>(token_elements));
  for (int64_t i = 0; i < token_elements; ++i) {
    k_in[i] = static_cast<uint16_t>(0x1000 + i);
    v_in[i] = static_cast<uint16_t>(0x8000 + i);
  }
  // Within one token the [heads, dim] elements are contiguous in either plane.
  ASSERT_EQ(k.stride(2), dim);
  ASSERT_EQ(k.stride(3), 1);
  auto* k_at = static_cast<uint16_t*>(k.data) + block * k.stride(0) + slot * k.stride(1);
  auto* v_at = static_cast<uint16_t*>(v.data) + block * v.stride(0) + slot * v.stride(1);
  ASSERT_EQ(cudaMemcpy(k_at, k_in.data(), k_in.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(v_at, v_in.data(), v_in.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);

  std::vector<uint16_t> out(static_cast<size_t>(layer_elements));
  ASSERT_EQ(cudaMemcpy(out.data(), layer->data, out.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  // Independent arithmetic: element offset of (block, slot, plane, 0, 0) in the layer.
  const int64_t k_offset = ((block * config.block_size + slot) * 2 + 0) * token_elements;
  const int64_t v_offset = ((block * config.block_size + slot) * 2 + 1) * token_elements;
  int64_t nonzero = 0;
  for (int64_t i = 0; i < layer_elements; ++i) {
    if (i >= k_offset && i < k_offset + token_elements) {
      ASSERT_EQ(out[i], k_in[i - k_offset]) << "K element " << i - k_offset;
    } else if (i >= v_offset && i < v_offset + token_elements) {
      ASSERT_EQ(out[i], v_in[i - v_offset]) << "V element " << i - v_offset;
    } else if (out[i] != 0) {
      ++nonzero;
    }
  }
  EXPECT_EQ(nonzero, 0) << "a write landed outside its token";
  ASSERT_TRUE(cache->Free(*blocks).ok());
}

// RESERVE on a GPU plans from cudaMemGetInfo's free memory minus what MemoryConfig keeps free.
TEST(CudaKVCacheTest, ReservePlansFromFreeDeviceMemory) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  constexpr int64_t kUsable = int64_t{256} << 20;  // leave all but ~256 MiB free
  const int64_t available = (*gpu)->available_memory();
  ASSERT_GT(available, 2 * kUsable);
  auto cache = BlockedKVCache::Create(
      {SmallConfig()}, MemoryConfig{.mode = AllocationMode::kReserve, .size = available - kUsable},
      *gpu);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const int64_t expected = kUsable / (48 * 1024);
  // Free memory moves a little between the two readings (2 MiB pages, the driver).
  EXPECT_NEAR((*cache)->num_blocks(), static_cast<double>(expected),
              static_cast<double>(expected / 10));
  EXPECT_TRUE((*cache)->CheckInvariants().ok());
}

}  // namespace
}  // namespace blockkv
