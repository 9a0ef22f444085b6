// SPDX-License-Identifier: Apache-2.0
// PlanKVCache arithmetic and BlockedKVCache on a budgeted host device: num_blocks, layout,
// layer offsets, SplitKV, allocator routing, collectives through a Communicator, and logging.
#include "blockkv/kv_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "blockkv/log.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max();

// Group A: 2 layers, 16 tokens, 4 heads of 8, fp16: 2·16·2·4·8·2 = 4096 bytes per block.
KVCacheConfig GroupA() {
  return KVCacheConfig{.block_size = 16, .cache_shape = {2, 4, 8}, .cache_dtype = DType::kFloat16};
}
// Group B: 3 layers, 8 tokens, 2 heads of 16, fp32: 3·8·2·2·16·4 = 6144 bytes per block.
KVCacheConfig GroupB() {
  return KVCacheConfig{.block_size = 8, .cache_shape = {3, 2, 16}, .cache_dtype = DType::kFloat32};
}
constexpr int64_t kBytesA = 4096;
constexpr int64_t kBytesB = 6144;

MemoryConfig Reserve(int64_t keep_free) {
  return MemoryConfig{.mode = AllocationMode::kReserve, .size = keep_free};
}
MemoryConfig Allocate(int64_t blocks) {
  return MemoryConfig{.mode = AllocationMode::kAllocate, .size = blocks};
}

// --- PlanKVCache -------------------------------------------------------------------------------

TEST(PlanKVCacheTest, BytesPerBlockSumsGroups) {
  const std::vector<KVCacheConfig> configs{GroupA(), GroupB()};
  Result<KVCachePlan> plan = PlanKVCache(configs, Allocate(10), 1 << 20);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->bytes_per_block, kBytesA + kBytesB);
  EXPECT_EQ(plan->bytes_per_block, 10240);
  EXPECT_EQ(plan->num_blocks, 10);
  EXPECT_EQ(plan->total_bytes, 102400);
}

TEST(PlanKVCacheTest, ReserveKeepsSizeFreeAndFloorsTheRest) {
  const std::vector<KVCacheConfig> configs{GroupA(), GroupB()};
  Result<KVCachePlan> plan = PlanKVCache(configs, Reserve(100'000), 1'000'000);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->num_blocks, (1'000'000 - 100'000) / 10240);
  EXPECT_EQ(plan->num_blocks, 87);
  EXPECT_EQ(plan->total_bytes, 87 * 10240);
  EXPECT_LE(plan->total_bytes + 100'000, 1'000'000);
}

TEST(PlanKVCacheTest, ReserveExactlyOneBlockFits) {
  const std::vector<KVCacheConfig> configs{GroupA()};
  Result<KVCachePlan> plan = PlanKVCache(configs, Reserve(1000), 1000 + kBytesA);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->num_blocks, 1);
  EXPECT_EQ(plan->total_bytes, kBytesA);
}

TEST(PlanKVCacheTest, ReserveWithTooLittleMemoryNamesBothNumbers) {
  const std::vector<KVCacheConfig> configs{GroupA(), GroupB()};
  Result<KVCachePlan> plan = PlanKVCache(configs, Reserve(1000), 1000 + 10239);
  ASSERT_CODE(plan, StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), AllOf(HasSubstr("10240"), HasSubstr("10239")));

  // Less available than the reserve itself: nothing usable, never a negative number.
  plan = PlanKVCache(configs, Reserve(5000), 4000);
  ASSERT_CODE(plan, StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), AllOf(HasSubstr("10240"), HasSubstr(" 0 bytes")));
  EXPECT_THAT(plan.status().message(), ::testing::Not(HasSubstr("-1000")));
}

TEST(PlanKVCacheTest, AllocateUsesSizeAsTheBlockCount) {
  const std::vector<KVCacheConfig> configs{GroupA(), GroupB()};
  Result<KVCachePlan> plan = PlanKVCache(configs, Allocate(50), 50 * 10240);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->num_blocks, 50);
  EXPECT_EQ(plan->total_bytes, 512'000);
}

TEST(PlanKVCacheTest, AllocateMoreThanAvailableIsResourceExhausted) {
  const std::vector<KVCacheConfig> configs{GroupA(), GroupB()};
  Result<KVCachePlan> plan = PlanKVCache(configs, Allocate(50), 50 * 10240 - 1);
  ASSERT_CODE(plan, StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), AllOf(HasSubstr("512000"), HasSubstr("511999")));
}

TEST(PlanKVCacheTest, MoreThanInt32BlocksIsOutOfRange) {
  // 2 bytes per block: block_size 1, one layer, one head of size 1, int8.
  const std::vector<KVCacheConfig> tiny{
      KVCacheConfig{.block_size = 1, .cache_shape = {1, 1, 1}, .cache_dtype = DType::kInt8}};
  constexpr int64_t kHuge = std::numeric_limits<int64_t>::max();

  Result<KVCachePlan> plan = PlanKVCache(tiny, Allocate(kMaxBlocks + 1), kHuge);
  ASSERT_CODE(plan, StatusCode::kOutOfRange);
  EXPECT_THAT(plan.status().message(), HasSubstr(std::to_string(kMaxBlocks + 1)));

  plan = PlanKVCache(tiny, Reserve(1), kHuge);
  EXPECT_CODE(plan, StatusCode::kOutOfRange);

  // Exactly 2^31 − 1 is allowed, in both modes.
  plan = PlanKVCache(tiny, Allocate(kMaxBlocks), kHuge);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->num_blocks, kMaxBlocks);
  EXPECT_EQ(plan->total_bytes, 2 * kMaxBlocks);
  plan = PlanKVCache(tiny, Reserve(100), 100 + 2 * kMaxBlocks + 1);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->num_blocks, kMaxBlocks);
}

TEST(PlanKVCacheTest, OverflowingConfigIsInvalidArgument) {
  KVCacheConfig big = GroupA();
  big.cache_shape = {int64_t{1} << 40, int64_t{1} << 20, 1};
  std::vector<KVCacheConfig> configs{GroupA(), big};
  Result<KVCachePlan> plan = PlanKVCache(configs, Allocate(1), 1 << 20);
  ASSERT_CODE(plan, StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("cache group 1"));

  // Each group fits in int64 (2^62 bytes per block) but their sum does not.
  KVCacheConfig half{.block_size = 1,
                     .cache_shape = {int64_t{1} << 30, int64_t{1} << 30, 2},
                     .cache_dtype = DType::kInt8};
  configs = {half, half};
  EXPECT_CODE(PlanKVCache(configs, Allocate(1), std::numeric_limits<int64_t>::max()),
              StatusCode::kInvalidArgument);

  // One group's bytes per block fits, but num_blocks times it does not.
  configs = {half};
  EXPECT_CODE(PlanKVCache(configs, Allocate(4), std::numeric_limits<int64_t>::max()),
              StatusCode::kInvalidArgument);
}

TEST(PlanKVCacheTest, InvalidInputsAreInvalidArgument) {
  const std::vector<KVCacheConfig> none;
  EXPECT_CODE(PlanKVCache(none, Allocate(1), 1 << 20), StatusCode::kInvalidArgument);

  const std::vector<KVCacheConfig> configs{GroupA()};
  Result<KVCachePlan> plan = PlanKVCache(configs, Reserve(0), 1 << 20);
  EXPECT_CODE(plan, StatusCode::kInvalidArgument);
  plan = PlanKVCache(configs, Allocate(-3), 1 << 20);
  EXPECT_CODE(plan, StatusCode::kInvalidArgument);
  plan = PlanKVCache(configs, Reserve(10), -1);
  ASSERT_CODE(plan, StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("-1"));

  KVCacheConfig zero_block = GroupB();
  zero_block.block_size = 0;
  const std::vector<KVCacheConfig> bad{GroupA(), zero_block};
  plan = PlanKVCache(bad, Allocate(1), 1 << 20);
  ASSERT_CODE(plan, StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), AllOf(HasSubstr("cache group 1"), HasSubstr("block_size")));
}

// --- BlockedKVCache ------------------------------------------------------------------------------

// One group: 3 layers, 4 tokens, 2 heads of 8, fp32: 3·4·2·2·8·4 = 1536 bytes per block.
constexpr int64_t kLayers = 3, kBlockSize = 4, kHeads = 2, kHeadSize = 8;
constexpr int64_t kBytesPerBlock = kLayers * kBlockSize * 2 * kHeads * kHeadSize * 4;
constexpr int64_t kReserve = 1000;

KVCacheConfig SmallConfig() {
  return KVCacheConfig{.block_size = kBlockSize,
                       .cache_shape = {kLayers, kHeads, kHeadSize},
                       .cache_dtype = DType::kFloat32};
}

// A budget that fits exactly `blocks` blocks of SmallConfig() after the reserve, plus some slack
// that is less than one block.
int64_t BudgetFor(int64_t blocks, int64_t bytes_per_block = kBytesPerBlock) {
  return kReserve + blocks * bytes_per_block + bytes_per_block / 3;
}

std::unique_ptr<BlockedKVCache> CreateOrDie(std::vector<KVCacheConfig> configs, MemoryConfig memory,
                                            std::shared_ptr<Device> device,
                                            Communicator* comm = nullptr) {
  Result<std::unique_ptr<BlockedKVCache>> cache =
      BlockedKVCache::Create(std::move(configs), memory, std::move(device), comm);
  EXPECT_OK(cache);
  return std::move(cache).value();
}

TEST(BlockedKVCacheTest, CreatePlansFromTheDeviceBudget) {
  std::shared_ptr<Device> device = CpuDevice(BudgetFor(10));
  auto cache = CreateOrDie({SmallConfig()}, Reserve(kReserve), device);
  EXPECT_EQ(cache->num_blocks(), 10);
  EXPECT_EQ(cache->num_groups(), 1);
  EXPECT_EQ(cache->plan().bytes_per_block, kBytesPerBlock);
  EXPECT_EQ(cache->plan().total_bytes, 10 * kBytesPerBlock);
  EXPECT_EQ(device->available_memory(), BudgetFor(10) - 10 * kBytesPerBlock);
  EXPECT_EQ(cache->device(), device);
  EXPECT_THAT(cache->free_blocks(), ElementsAre(10));
  EXPECT_EQ(cache->allocator().num_blocks(), 10);
  EXPECT_EQ(cache->config().block_size, kBlockSize);
  EXPECT_OK(cache->CheckInvariants());

  cache.reset();
  EXPECT_EQ(device->available_memory(), BudgetFor(10));
}

TEST(BlockedKVCacheTest, GetCacheHasTheBlockedShapeAndContiguousStrides) {
  auto cache = CreateOrDie({SmallConfig()}, Reserve(kReserve), CpuDevice(BudgetFor(10)));
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    Result<TensorView> view = cache->GetCache(layer);
    ASSERT_OK(view);
    EXPECT_EQ(view->ndim, 5);
    EXPECT_EQ(view->dtype, DType::kFloat32);
    EXPECT_EQ(view->device, DeviceKind::kCpu);
    EXPECT_EQ(view->numel(), 10 * kBlockSize * 2 * kHeads * kHeadSize);
    const std::vector<int64_t> shape(view->shape.begin(), view->shape.begin() + 5);
    const std::vector<int64_t> strides(view->strides.begin(), view->strides.begin() + 5);
    EXPECT_THAT(shape, ElementsAre(10, kBlockSize, 2, kHeads, kHeadSize));
    EXPECT_THAT(strides, ElementsAre(kBlockSize * 2 * kHeads * kHeadSize, 2 * kHeads * kHeadSize,
                                     kHeads * kHeadSize, kHeadSize, 1));
    EXPECT_TRUE(view->is_contiguous());
  }
}

TEST(BlockedKVCacheTest, LayersAreConsecutiveSlicesOfTheGroupStorage) {
  auto cache = CreateOrDie({SmallConfig()}, Reserve(kReserve), CpuDevice(BudgetFor(10)));
  Result<TensorView> storage = cache->GetGroupStorage();
  ASSERT_OK(storage);
  EXPECT_EQ(storage->ndim, 6);
  const std::vector<int64_t> shape(storage->shape.begin(), storage->shape.begin() + 6);
  EXPECT_THAT(shape, ElementsAre(kLayers, 10, kBlockSize, 2, kHeads, kHeadSize));
  EXPECT_TRUE(storage->is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(storage->data) % kDeviceAlignment, 0u);

  const int64_t layer_bytes = 10 * kBlockSize * 2 * kHeads * kHeadSize * 4;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    Result<TensorView> view = cache->GetCache(layer);
    ASSERT_OK(view);
    EXPECT_EQ(static_cast<char*>(view->data) - static_cast<char*>(storage->data),
              layer * layer_bytes);
  }
}

TEST(BlockedKVCacheTest, SplitKVOfALayerGivesKAndVPlanes) {
  auto cache = CreateOrDie({SmallConfig()}, Reserve(kReserve), CpuDevice(BudgetFor(10)));
  Result<TensorView> layer = cache->GetCache(1);
  ASSERT_OK(layer);
  Result<std::pair<TensorView, TensorView>> kv = SplitKV(*layer);
  ASSERT_OK(kv);
  const auto& [k, v] = *kv;
  EXPECT_EQ(k.data, layer->data);
  EXPECT_EQ(static_cast<char*>(v.data) - static_cast<char*>(k.data),
            kHeads * kHeadSize * 4);  // V is H·D elements after K
  for (const TensorView* t : {&k, &v}) {
    EXPECT_EQ(t->ndim, 4);
    EXPECT_EQ(t->shape[0], 10);
    EXPECT_EQ(t->shape[1], kBlockSize);
    EXPECT_EQ(t->shape[2], kHeads);
    EXPECT_EQ(t->shape[3], kHeadSize);
    EXPECT_EQ(t->stride(0), kBlockSize * 2 * kHeads * kHeadSize);
    EXPECT_EQ(t->stride(1), 2 * kHeads * kHeadSize);
    EXPECT_EQ(t->stride(2), kHeadSize);
    EXPECT_EQ(t->stride(3), 1);
  }
}

float KeyValue(int64_t layer, int64_t blk, int64_t off, int64_t kv, int64_t h, int64_t d) {
  return static_cast<float>(((((layer * 100 + blk) * 10 + off) * 2 + kv) * 10 + h) * 10 + d);
}

TEST(BlockedKVCacheTest, WritesThroughKAndVViewsLandAtTheBlockedLayout) {
  auto cache = CreateOrDie({SmallConfig()}, Reserve(kReserve), CpuDevice(BudgetFor(10)));
  const int64_t blocks = cache->num_blocks();
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    TensorView view = *cache->GetCache(layer);
    auto [k, v] = *SplitKV(view);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      for (int64_t off = 0; off < kBlockSize; ++off) {
        for (int64_t h = 0; h < kHeads; ++h) {
          for (int64_t d = 0; d < kHeadSize; ++d) {
            const int64_t at = blk * k.stride(0) + off * k.stride(1) + h * k.stride(2) + d;
            static_cast<float*>(k.data)[at] = KeyValue(layer, blk, off, 0, h, d);
            static_cast<float*>(v.data)[at] = KeyValue(layer, blk, off, 1, h, d);
          }
        }
      }
    }
  }
  // Read back through the documented 5-D formula, from the group storage.
  const float* base = static_cast<const float*>(cache->GetGroupStorage()->data);
  const int64_t layer_elements = blocks * kBlockSize * 2 * kHeads * kHeadSize;
  int64_t mismatches = 0;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      for (int64_t off = 0; off < kBlockSize; ++off) {
        for (int64_t kv = 0; kv < 2; ++kv) {
          for (int64_t h = 0; h < kHeads; ++h) {
            for (int64_t d = 0; d < kHeadSize; ++d) {
              const int64_t at = layer * layer_elements +
                                 ((blk * kBlockSize + off) * 2 + kv) * kHeads * kHeadSize +
                                 h * kHeadSize + d;
              if (base[at] != KeyValue(layer, blk, off, kv, h, d)) ++mismatches;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(BlockedKVCacheTest, TwoGroupsShareNumBlocksAndRouteToTheirOwnAllocator) {
  const int64_t bytes_per_block = kBytesA + kBytesB;
  std::shared_ptr<Device> device = CpuDevice(BudgetFor(6, bytes_per_block));
  auto cache = CreateOrDie({GroupA(), GroupB()}, Reserve(kReserve), device);
  EXPECT_EQ(cache->num_groups(), 2);
  EXPECT_EQ(cache->num_blocks(), 6);
  EXPECT_EQ(cache->plan().bytes_per_block, bytes_per_block);
  EXPECT_EQ(cache->allocator(0).num_blocks(), 6);
  EXPECT_EQ(cache->allocator(1).num_blocks(), 6);
  EXPECT_EQ(device->available_memory(), BudgetFor(6, bytes_per_block) - 6 * bytes_per_block);
  EXPECT_EQ(cache->config(1).block_size, 8);

  // Each group's layers have that group's shape.
  Result<TensorView> b2 = cache->GetCache(2, 1);
  ASSERT_OK(b2);
  const std::vector<int64_t> shape(b2->shape.begin(), b2->shape.begin() + 5);
  EXPECT_THAT(shape, ElementsAre(6, 8, 2, 2, 16));
  EXPECT_EQ(b2->dtype, DType::kFloat32);
  EXPECT_CODE(cache->GetCache(2, 0), StatusCode::kOutOfRange);  // group A has 2 layers

  Result<std::vector<BlockId>> in_b = cache->Reserve(4, 1);
  ASSERT_OK(in_b);
  EXPECT_THAT(*in_b, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(cache->free_blocks(), ElementsAre(6, 2));
  // Those ids are not allocated in group A: freeing them there fails and changes nothing.
  EXPECT_CODE(cache->Free(*in_b, 0), StatusCode::kFailedPrecondition);
  EXPECT_THAT(cache->free_blocks(), ElementsAre(6, 2));

  std::array<BlockId, 3> out{};
  ASSERT_OK(cache->Reserve(3, out, 0));
  EXPECT_THAT(out, ElementsAre(0, 1, 2));
  EXPECT_THAT(cache->free_blocks(), ElementsAre(3, 2));
  EXPECT_CODE(cache->Reserve(3, 1), StatusCode::kResourceExhausted);
  EXPECT_OK(cache->CheckInvariants());

  ASSERT_OK(cache->Free(*in_b, 1));
  ASSERT_OK(cache->Free(out, 0));
  EXPECT_THAT(cache->free_blocks(), ElementsAre(6, 6));
  EXPECT_OK(cache->CheckInvariants());
}

TEST(BlockedKVCacheTest, BadCacheIdOrGroupIsOutOfRange) {
  auto cache = CreateOrDie({SmallConfig()}, Reserve(kReserve), CpuDevice(BudgetFor(4)));
  for (int64_t bad : {int64_t{-1}, kLayers, int64_t{1} << 40}) {
    Result<TensorView> view = cache->GetCache(bad);
    ASSERT_CODE(view, StatusCode::kOutOfRange);
    EXPECT_THAT(view.status().message(), HasSubstr(std::to_string(bad)));
  }
  for (int bad : {-1, 1}) {
    EXPECT_CODE(cache->GetCache(0, bad), StatusCode::kOutOfRange);
    EXPECT_CODE(cache->GetGroupStorage(bad), StatusCode::kOutOfRange);
    EXPECT_CODE(cache->Reserve(1, bad), StatusCode::kOutOfRange);
    std::array<BlockId, 1> out{};
    EXPECT_CODE(cache->Reserve(1, out, bad), StatusCode::kOutOfRange);
    const std::vector<BlockId> ids{0};
    EXPECT_CODE(cache->Free(ids, bad), StatusCode::kOutOfRange);
  }
  EXPECT_THAT(cache->free_blocks(), ElementsAre(4));
}

TEST(BlockedKVCacheTest, ReserveAndFreeFollowAllocatorSemantics) {
  auto cache = CreateOrDie({SmallConfig()}, Reserve(kReserve), CpuDevice(BudgetFor(4)));
  Result<std::vector<BlockId>> ids = cache->Reserve(3);
  ASSERT_OK(ids);
  ASSERT_OK(cache->Free(*ids));
  EXPECT_THAT(*cache->Reserve(4), ElementsAre(2, 1, 0, 3));
  EXPECT_CODE(cache->Reserve(1), StatusCode::kResourceExhausted);
  EXPECT_CODE(cache->Reserve(-1), StatusCode::kInvalidArgument);
  const std::vector<BlockId> bad{0, 4};
  EXPECT_CODE(cache->Free(bad), StatusCode::kOutOfRange);
  EXPECT_THAT(cache->free_blocks(), ElementsAre(0));
  EXPECT_OK(cache->CheckInvariants());
}

TEST(BlockedKVCacheTest, AllocateModeCreatesExactlySizeBlocks) {
  std::shared_ptr<Device> device = CpuDevice(1 << 20);
  auto cache = CreateOrDie({SmallConfig()}, Allocate(7), device);
  EXPECT_EQ(cache->num_blocks(), 7);
  EXPECT_EQ(device->available_memory(), (1 << 20) - 7 * kBytesPerBlock);
}

TEST(BlockedKVCacheTest, CreateWithTooLittleBudgetFailsAndAllocatesNothing) {
  std::shared_ptr<Device> device = CpuDevice(kReserve + kBytesPerBlock - 1);
  Result<std::unique_ptr<BlockedKVCache>> cache =
      BlockedKVCache::Create({SmallConfig()}, Reserve(kReserve), device);
  ASSERT_CODE(cache, StatusCode::kResourceExhausted);
  EXPECT_THAT(cache.status().message(), HasSubstr(std::to_string(kBytesPerBlock)));
  EXPECT_EQ(device->available_memory(), kReserve + kBytesPerBlock - 1);

  EXPECT_CODE(BlockedKVCache::Create({SmallConfig()}, Allocate(1000), device),
              StatusCode::kResourceExhausted);
  EXPECT_EQ(device->available_memory(), kReserve + kBytesPerBlock - 1);
}

TEST(BlockedKVCacheTest, CreateRejectsNullDeviceAndBadConfigs) {
  EXPECT_CODE(BlockedKVCache::Create({SmallConfig()}, Reserve(kReserve), nullptr),
              StatusCode::kInvalidArgument);
  std::shared_ptr<Device> device = CpuDevice(1 << 20);
  EXPECT_CODE(BlockedKVCache::Create({}, Reserve(kReserve), device), StatusCode::kInvalidArgument);
  KVCacheConfig bad = SmallConfig();
  bad.block_size = -1;
  EXPECT_CODE(BlockedKVCache::Create({bad}, Reserve(kReserve), device),
              StatusCode::kInvalidArgument);
  EXPECT_CODE(BlockedKVCache::Create({SmallConfig()}, Reserve(0), device),
              StatusCode::kInvalidArgument);
  EXPECT_EQ(device->available_memory(), 1 << 20);
}

// A device whose available_memory() promises more than Allocate() will give: only the first
// `successes` allocations succeed. Shows that a Create failing half-way frees what it took.
class FlakyDevice final : public Device {
 public:
  explicit FlakyDevice(int successes) : inner_(CpuDevice(int64_t{1} << 30)), left_(successes) {}
  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int ordinal() const override { return 0; }
  std::string name() const override { return "flaky"; }
  int64_t total_memory() const override { return int64_t{1} << 30; }
  int64_t available_memory() const override { return int64_t{1} << 30; }
  Result<DeviceBuffer> Allocate(int64_t bytes) override {
    if (left_-- <= 0) return ResourceExhaustedError("flaky device refuses");
    BLOCKKV_ASSIGN_OR_RETURN(DeviceBuffer inner, inner_->Allocate(bytes));
    void* data = inner.data();
    held_.push_back(std::move(inner));
    ++outstanding_;
    return MakeBuffer(data, bytes);
  }
  void EmptyCache() override {}
  int outstanding() const { return outstanding_; }

 protected:
  void Deallocate(void* data, int64_t /*bytes*/) override {
    for (DeviceBuffer& b : held_) {
      if (b.data() == data) b = DeviceBuffer();
    }
    --outstanding_;
  }

 private:
  std::shared_ptr<Device> inner_;
  std::vector<DeviceBuffer> held_;
  int left_;
  int outstanding_ = 0;
};

TEST(BlockedKVCacheTest, CreateFailingOnALaterGroupReleasesEarlierGroups) {
  auto device = std::make_shared<FlakyDevice>(1);
  Result<std::unique_ptr<BlockedKVCache>> cache =
      BlockedKVCache::Create({GroupA(), GroupB()}, Allocate(4), device);
  ASSERT_CODE(cache, StatusCode::kResourceExhausted);
  EXPECT_THAT(cache.status().message(), HasSubstr("group 1"));
  EXPECT_EQ(device->outstanding(), 0);
}

TEST(BlockedKVCacheTest, LocalCommunicatorChangesNothing) {
  LocalCommunicator local;
  auto with = CreateOrDie({SmallConfig()}, Reserve(kReserve), CpuDevice(BudgetFor(9)), &local);
  auto without = CreateOrDie({SmallConfig()}, Reserve(kReserve), CpuDevice(BudgetFor(9)));
  EXPECT_EQ(with->num_blocks(), 9);
  EXPECT_EQ(with->num_blocks(), without->num_blocks());
  EXPECT_EQ(with->plan().total_bytes, without->plan().total_bytes);
}

// Rank 0 of a two-rank world whose other rank can fit `other_blocks`.
class FakeCommunicator final : public Communicator {
 public:
  // The other rank offers `other_blocks` in the plan's all-reduce, then whether it allocated.
  explicit FakeCommunicator(int64_t other_blocks, bool other_allocates = true)
      : other_blocks_(other_blocks), other_allocates_(other_allocates) {}
  int world_size() const override { return 2; }
  int rank() const override { return 0; }
  Result<int64_t> AllReduceMin(int64_t value) override {
    reduced_.push_back(value);
    const int64_t other = reduced_.size() == 1 ? other_blocks_ : int64_t{other_allocates_};
    return std::min(value, other);
  }
  Status Barrier() override {
    ++barriers_;
    return Status::Ok();
  }
  const std::vector<int64_t>& reduced() const { return reduced_; }
  int barriers() const { return barriers_; }

 private:
  int64_t other_blocks_;
  bool other_allocates_;
  std::vector<int64_t> reduced_;
  int barriers_ = 0;
};

TEST(BlockedKVCacheTest, CommunicatorAgreesOnTheMinimumAcrossRanks) {
  FakeCommunicator comm(/*other_blocks=*/4);
  std::shared_ptr<Device> device = CpuDevice(BudgetFor(10));
  auto cache = CreateOrDie({SmallConfig()}, Reserve(kReserve), device, &comm);
  // This rank offered what it could fit, then said it allocated.
  EXPECT_THAT(comm.reduced(), ElementsAre(10, 1));
  EXPECT_EQ(comm.barriers(), 1);
  EXPECT_EQ(cache->num_blocks(), 4);
  EXPECT_EQ(cache->plan().total_bytes, 4 * kBytesPerBlock);
  EXPECT_THAT(cache->free_blocks(), ElementsAre(4));
  EXPECT_EQ(device->available_memory(), BudgetFor(10) - 4 * kBytesPerBlock);
  EXPECT_OK(cache->CheckInvariants());
}

TEST(BlockedKVCacheTest, ARankWhoseAllocationFailsFailsEveryRank) {
  FakeCommunicator comm(/*other_blocks=*/4, /*other_allocates=*/false);
  std::shared_ptr<Device> device = CpuDevice(BudgetFor(10));
  auto cache = BlockedKVCache::Create({SmallConfig()}, Reserve(kReserve), device, &comm);
  EXPECT_EQ(cache.status().code(), StatusCode::kResourceExhausted) << cache.status();
  EXPECT_THAT(cache.status().message(), HasSubstr("another rank of 2 could not allocate"));
  EXPECT_THAT(comm.reduced(), ElementsAre(10, 1));
  EXPECT_EQ(device->available_memory(), BudgetFor(10));  // this rank's buffers were released
}

TEST(BlockedKVCacheTest, CommunicatorWithARankThatFitsNothingFailsEveryRank) {
  FakeCommunicator comm(/*other_blocks=*/0);
  std::shared_ptr<Device> device = CpuDevice(BudgetFor(10));
  Result<std::unique_ptr<BlockedKVCache>> cache =
      BlockedKVCache::Create({SmallConfig()}, Reserve(kReserve), device, &comm);
  ASSERT_CODE(cache, StatusCode::kResourceExhausted);
  EXPECT_THAT(comm.reduced(), ElementsAre(10));
  EXPECT_EQ(device->available_memory(), BudgetFor(10));
}

TEST(BlockedKVCacheTest, RankThatCannotPlanStillEntersTheCollectives) {
  FakeCommunicator comm(/*other_blocks=*/100);
  std::shared_ptr<Device> device = CpuDevice(kReserve);  // not one block
  EXPECT_CODE(BlockedKVCache::Create({SmallConfig()}, Reserve(kReserve), device, &comm),
              StatusCode::kResourceExhausted);
  EXPECT_EQ(comm.barriers(), 1);
  EXPECT_THAT(comm.reduced(), ElementsAre(0));

  FakeCommunicator comm2(/*other_blocks=*/100);
  EXPECT_CODE(BlockedKVCache::Create({SmallConfig()}, Reserve(kReserve), nullptr, &comm2),
              StatusCode::kInvalidArgument);
  EXPECT_EQ(comm2.barriers(), 1);
  EXPECT_THAT(comm2.reduced(), ElementsAre(0));
}

TEST(BlockedKVCacheTest, AllocateModeDoesNotUseTheCommunicator) {
  FakeCommunicator comm(/*other_blocks=*/1);
  auto cache = CreateOrDie({SmallConfig()}, Allocate(5), CpuDevice(1 << 20), &comm);
  EXPECT_EQ(cache->num_blocks(), 5);
  EXPECT_TRUE(comm.reduced().empty());
  EXPECT_EQ(comm.barriers(), 0);
}

// Captures log lines while alive; restores the default sink and the level after.
class LogCapture {
 public:
  LogCapture() : level_(GetLogLevel()) {
    SetLogLevel(LogLevel::kInfo);
    SetLogSink([this](LogLevel level, std::string_view line) {
      if (level == LogLevel::kInfo) lines_.emplace_back(line);
    });
  }
  ~LogCapture() {
    SetLogSink({});
    SetLogLevel(level_);
  }
  const std::vector<std::string>& lines() const { return lines_; }

 private:
  LogLevel level_;
  std::vector<std::string> lines_;
};

TEST(BlockedKVCacheTest, LogsOneLinePerGroupWithItsShape) {
  std::vector<std::string> lines;
  {
    LogCapture capture;
    auto cache = CreateOrDie({GroupA(), GroupB()}, Allocate(6), CpuDevice(1 << 20));
    lines = capture.lines();
  }
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[0], AllOf(HasSubstr("group 0"), HasSubstr("[2, 6, 16, 2, 4, 8]"),
                              HasSubstr("fp16"), HasSubstr("6 blocks")));
  EXPECT_THAT(lines[1],
              AllOf(HasSubstr("group 1"), HasSubstr("[3, 6, 8, 2, 2, 16]"), HasSubstr("fp32")));
  for (const std::string& line : lines) EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(BlockedKVCacheTest, FailedCreateLogsNothing) {
  LogCapture capture;
  EXPECT_CODE(BlockedKVCache::Create({SmallConfig()}, Reserve(kReserve), CpuDevice(10)),
              StatusCode::kResourceExhausted);
  EXPECT_TRUE(capture.lines().empty());
}

TEST(BlockedKVCacheDeathTest, ConfigOfABadGroupAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto cache = CreateOrDie({SmallConfig()}, Allocate(1), CpuDevice(1 << 20));
  EXPECT_DEATH((void)cache->config(1), "group out of range");
  EXPECT_DEATH((void)cache->allocator(-1), "group out of range");
}

}  // namespace
}  // namespace blockkv
