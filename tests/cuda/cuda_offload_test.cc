// SPDX-License-Identifier: Apache-2.0
// OffloadStore on a GPU cache: byte-exact round trips between device memory and the pinned host
// tier (cudaMemcpy2DAsync on the copy stream), through the disk tier (staged in pinned memory),
// host → spill → disk → device, two cache groups of different shapes, restores into other block
// ids, and a disk that is full (nothing lost: the device blocks come back as they were). Block
// contents are written and read with plain cudaMemcpy, per layer, independently of the store.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "blockkv/kv_cache.h"
#include "blockkv/offload.h"
#include "cuda_test_util.h"

namespace blockkv {
namespace {

using Bytes = std::vector<uint8_t>;

// 3 layers, 16 tokens, 4 KV heads of 64, fp16: 48 KiB per block (16 KiB per layer).
KVCacheConfig GroupA() {
  return {.block_size = 16, .cache_shape = {3, 4, 64}, .cache_dtype = DType::kFloat16};
}
// 5 layers, 8 tokens, 2 KV heads of 40, fp32: 5 · 5 KiB per block.
KVCacheConfig GroupB() {
  return {.block_size = 8, .cache_shape = {5, 2, 40}, .cache_dtype = DType::kFloat32};
}
constexpr int32_t kBlocks = 24;

std::unique_ptr<BlockedKVCache> MakeGpuCache(std::vector<KVCacheConfig> groups) {
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!gpu.ok()) return nullptr;
  auto cache = BlockedKVCache::Create(
      std::move(groups), MemoryConfig{.mode = AllocationMode::kAllocate, .size = kBlocks}, *gpu);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? std::move(*cache) : nullptr;
}

// Layer `layer` of block `block` of group g: its device address and size.
std::pair<uint8_t*, size_t> Chunk(const BlockedKVCache& cache, int g, int64_t layer,
                                  BlockId block) {
  const Result<TensorView> view = cache.GetCache(layer, g);
  EXPECT_TRUE(view.ok()) << view.status();
  const auto chunk = static_cast<size_t>(view->stride(0)) * ElementSize(view->dtype);
  return {static_cast<uint8_t*>(view->data) + static_cast<size_t>(block) * chunk, chunk};
}

Bytes ReadBlock(const BlockedKVCache& cache, int g, BlockId block) {
  Bytes out;
  for (int64_t l = 0; l < cache.config(g).num_caches(); ++l) {
    const auto [at, size] = Chunk(cache, g, l, block);
    const size_t offset = out.size();
    out.resize(offset + size);
    EXPECT_EQ(cudaMemcpy(out.data() + offset, at, size, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return out;
}

Bytes FillRandom(BlockedKVCache& cache, int g, BlockId block, std::mt19937& rng) {
  Bytes bytes(static_cast<size_t>(*cache.config(g).bytes_per_block()));
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  size_t offset = 0;
  for (int64_t l = 0; l < cache.config(g).num_caches(); ++l) {
    const auto [at, size] = Chunk(cache, g, l, block);
    EXPECT_EQ(cudaMemcpy(at, bytes.data() + offset, size, cudaMemcpyHostToDevice), cudaSuccess);
    offset += size;
  }
  return bytes;
}

struct Env {
  std::unique_ptr<BlockedKVCache> cache;
  std::unique_ptr<OffloadStore> store;
};

Env MakeEnv(std::vector<KVCacheConfig> groups, const OffloadConfig& config) {
  Env env;
  env.cache = MakeGpuCache(std::move(groups));
  if (env.cache == nullptr) return env;
  Result<std::unique_ptr<OffloadStore>> store = OffloadStore::Create(env.cache.get(), config);
  EXPECT_TRUE(store.ok()) << store.status();
  if (store.ok()) env.store = std::move(*store);
  return env;
}

std::string TempPath(const char* name) {
  return ::testing::TempDir() + "blockkv_cuda_offload_" + std::to_string(::getpid()) + "_" + name;
}

// Offloads n filled blocks of group g to `tier` (spilling them to disk first when `spill`),
// occupies the blocks that frees, restores into others and compares every layer.
void RoundTrip(Env& env, int g, int32_t n, Tier tier, bool spill, std::mt19937& rng) {
  Result<std::vector<BlockId>> blocks = env.cache->Reserve(n, g);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  std::vector<Bytes> want;
  for (BlockId b : *blocks) want.push_back(FillRandom(*env.cache, g, b, rng));
  std::vector<OffloadHandle> handles(static_cast<size_t>(n));
  Result<OffloadTicket> out = env.store->Offload(*blocks, g, handles, tier);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE(out->Wait().ok());
  if (spill) {
    Result<OffloadTicket> s = env.store->Spill(handles);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(s->Wait().ok());
    for (const OffloadHandle& h : handles) EXPECT_EQ(*env.store->tier(h), Tier::kDisk);
  }
  // The freed blocks are taken and overwritten, so the restore must land elsewhere.
  Result<std::vector<BlockId>> taken = env.cache->Reserve(n, g);
  ASSERT_TRUE(taken.ok()) << taken.status();
  for (BlockId b : *taken) FillRandom(*env.cache, g, b, rng);
  std::vector<BlockId> restored(static_cast<size_t>(n), kNoBlock);
  Result<OffloadTicket> in = env.store->Restore(handles, g, restored);
  ASSERT_TRUE(in.ok()) << in.status();
  const Status copied = in->Wait();
  ASSERT_TRUE(copied.ok()) << copied;
  for (int32_t i = 0; i < n; ++i) {
    EXPECT_EQ(std::count(taken->begin(), taken->end(), restored[i]), 0);
    EXPECT_TRUE(ReadBlock(*env.cache, g, restored[i]) == want[i])
        << "group " << g << " block " << i << " restored into " << restored[i];
  }
  EXPECT_EQ(env.store->live_handles(), 0);
  EXPECT_TRUE(env.store->CheckInvariants().ok());
  ASSERT_TRUE(env.cache->Free(*taken, g).ok());
  ASSERT_TRUE(env.cache->Free(restored, g).ok());
}

TEST(CudaOffloadTest, HostTierRoundTripIsByteExact) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1);
  Env env = MakeEnv({GroupA()}, {.host_blocks = 8});
  ASSERT_NE(env.store, nullptr);
  RoundTrip(env, 0, 8, Tier::kHost, /*spill=*/false, rng);
  EXPECT_EQ(env.store->stats().bytes_written, 8 * 48 * 1024);
  EXPECT_EQ(env.cache->free_blocks()[0], kBlocks);
}

TEST(CudaOffloadTest, DiskTierAndSpillRoundTripsAreByteExact) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(2);
  Env env =
      MakeEnv({GroupA()}, {.host_blocks = 6, .disk_path = TempPath("disk"), .disk_blocks = 6});
  ASSERT_NE(env.store, nullptr);
  RoundTrip(env, 0, 6, Tier::kDisk, /*spill=*/false, rng);
  RoundTrip(env, 0, 5, Tier::kHost, /*spill=*/true, rng);
}

TEST(CudaOffloadTest, GroupsOfDifferentShapesRoundTrip) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  Env env = MakeEnv({GroupA(), GroupB()},
                    {.host_blocks = 4, .disk_path = TempPath("groups"), .disk_blocks = 4});
  ASSERT_NE(env.store, nullptr);
  for (int g = 0; g < 2; ++g) {
    RoundTrip(env, g, 4, Tier::kHost, /*spill=*/false, rng);
    RoundTrip(env, g, 3, Tier::kDisk, /*spill=*/false, rng);
    RoundTrip(env, g, 2, Tier::kHost, /*spill=*/true, rng);
  }
}

// Many offloads queued on the copy stream at once, then all restored: the worker's event waits
// keep them in order.
TEST(CudaOffloadTest, ManyTicketsInFlightRoundTrip) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(4);
  Env env = MakeEnv({GroupA()}, {.host_blocks = 16});
  ASSERT_NE(env.store, nullptr);
  Result<std::vector<BlockId>> blocks = env.cache->Reserve(16);
  ASSERT_TRUE(blocks.ok());
  std::vector<Bytes> want;
  for (BlockId b : *blocks) want.push_back(FillRandom(*env.cache, 0, b, rng));
  std::vector<OffloadHandle> handles(16);
  std::vector<OffloadTicket> tickets;
  for (size_t i = 0; i < 16; ++i) {
    Result<OffloadTicket> t =
        env.store->Offload(std::span(&(*blocks)[i], 1), 0, std::span(&handles[i], 1));
    ASSERT_TRUE(t.ok()) << t.status();
    tickets.push_back(*t);
  }
  // Restoring the first half waits for their offloads first.
  std::vector<BlockId> out(16, kNoBlock);
  Result<OffloadTicket> first =
      env.store->Restore(std::span(handles).first(8), 0, std::span(out).first(8));
  ASSERT_TRUE(first.ok()) << first.status();
  for (OffloadTicket& t : tickets) ASSERT_TRUE(t.Wait().ok());
  Result<OffloadTicket> second =
      env.store->Restore(std::span(handles).last(8), 0, std::span(out).last(8));
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(OffloadTicket::Join(*first, *second)->Wait().ok());
  for (size_t i = 0; i < 16; ++i) {
    EXPECT_TRUE(ReadBlock(*env.cache, 0, out[i]) == want[i]) << "block " << i;
  }
  EXPECT_TRUE(env.store->CheckInvariants().ok());
}

// A disk tier that passed its probe when it opened and then fills up: every write is ENOSPC.
class FullDisk final : public BlockFile {
 public:
  explicit FullDisk(std::unique_ptr<BlockFile> file) : file_(std::move(file)) {}
  Status Write(int64_t /*offset*/, std::span<const std::byte> /*data*/) override {
    return ResourceExhaustedError("injected: No space left on device (errno 28)");
  }
  Status Read(int64_t offset, std::span<std::byte> data) override {
    return file_->Read(offset, data);
  }

 private:
  std::unique_ptr<BlockFile> file_;
};

// The disk full: the offload fails, the device blocks stay as they were, and the restore hands
// the same blocks back. (/dev/full itself is refused when the store opens: its probe write fails.)
TEST(CudaOffloadTest, DiskFullKeepsTheDeviceBlocks) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  const BlockFileOpener full = [](const std::string& path) -> Result<std::unique_ptr<BlockFile>> {
    Result<std::unique_ptr<BlockFile>> file = OpenPosixBlockFile(path);
    if (!file.ok()) return file.status();
    return std::unique_ptr<BlockFile>(std::make_unique<FullDisk>(std::move(*file)));
  };
  Env env = MakeEnv(
      {GroupA()},
      {.host_blocks = 2, .disk_path = TempPath("full"), .disk_blocks = 4, .open_file = full});
  ASSERT_NE(env.store, nullptr);
  Result<std::vector<BlockId>> blocks = env.cache->Reserve(3);
  ASSERT_TRUE(blocks.ok());
  std::vector<Bytes> want;
  for (BlockId b : *blocks) want.push_back(FillRandom(*env.cache, 0, b, rng));
  std::vector<OffloadHandle> handles(3);
  Result<OffloadTicket> out = env.store->Offload(*blocks, 0, handles, Tier::kDisk);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->Wait().code(), StatusCode::kResourceExhausted);
  for (const OffloadHandle& h : handles) EXPECT_EQ(*env.store->tier(h), Tier::kDevice);
  EXPECT_EQ(env.cache->free_blocks()[0], kBlocks - 3);
  std::vector<BlockId> back(3, kNoBlock);
  Result<OffloadTicket> in = env.store->Restore(handles, 0, back);
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_TRUE(in->Wait().ok());
  EXPECT_EQ(back, *blocks);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(ReadBlock(*env.cache, 0, back[i]) == want[i]);
  EXPECT_TRUE(env.store->CheckInvariants().ok());
}

}  // namespace
}  // namespace blockkv
