// SPDX-License-Identifier: Apache-2.0
// RaggedBatch's device mirror on a GPU: after every step, each array read back from the device
// with cudaMemcpy equals the host array (growing, shrinking and empty batches, two cache groups,
// ScheduleBatch and InsertSequence + Finalize); the host arena is pinned and the device arrays
// keep their addresses; and a step's staging is not overwritten while the previous step's copy is
// still queued behind other work on the default stream.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "blockkv/cuda_device.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "cuda_test_util.h"

namespace blockkv {
namespace {

using Bytes = std::vector<uint8_t>;

// One layer of one KV head of 8 fp16 values: the batch is what is tested, not the cache.
KVCacheConfig Group(int32_t block_size, int32_t max_blocks) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {1, 1, 8},
                       .cache_dtype = DType::kFloat16,
                       .max_blocks_per_allocation_group = max_blocks};
}

std::unique_ptr<StateManager> MakeGpuManager(std::vector<KVCacheConfig> groups,
                                             int32_t seq_count = 64) {
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!gpu.ok()) return nullptr;
  StateManagerConfig config;
  config.max_tracked_sequences = 256;
  config.max_ragged_batch_size = 512;
  config.max_ragged_sequence_count = seq_count;
  config.memory_config = MemoryConfig{.mode = AllocationMode::kAllocate, .size = 512};
  auto manager = StateManager::Create(std::move(config), std::move(groups), *gpu);
  EXPECT_TRUE(manager.ok()) << manager.status();
  return manager.ok() ? std::move(*manager) : nullptr;
}

std::unique_ptr<RaggedBatch> MakeBatch(const StateManager& manager) {
  auto batch = RaggedBatch::Create(manager);
  EXPECT_TRUE(batch.ok()) << batch.status();
  return batch.ok() ? std::move(*batch) : nullptr;
}

size_t BytesOf(const TensorView& view) {
  return static_cast<size_t>(view.numel()) * ElementSize(view.dtype);
}

Bytes HostBytes(const Result<TensorView>& view) {
  EXPECT_TRUE(view.ok()) << view.status();
  if (!view.ok()) return {};
  EXPECT_EQ(view->device, DeviceKind::kCpu);
  const auto* data = static_cast<const uint8_t*>(view->data);
  return Bytes(data, data + BytesOf(*view));
}

// The device view's bytes, read back with cudaMemcpy (on the legacy default stream, so after the
// batch's copy).
Bytes DeviceBytes(const Result<TensorView>& view) {
  EXPECT_TRUE(view.ok()) << view.status();
  if (!view.ok()) return {};
  EXPECT_EQ(view->device, DeviceKind::kCuda);
  EXPECT_EQ(view->device_ordinal, 0);
  Bytes out(BytesOf(*view));
  if (!out.empty()) {
    EXPECT_EQ(cudaMemcpy(out.data(), view->data, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return out;
}

// Every array but kv_ptrs, host then device, in one list of byte vectors.
std::vector<Bytes> AllArrays(const RaggedBatch& b, int n_groups, bool on_device) {
  auto read = [on_device](const Result<TensorView>& view) {
    return on_device ? DeviceBytes(view) : HostBytes(view);
  };
  std::vector<Bytes> out = {read(b.input_ids(on_device)), read(b.tokens_to_seq(on_device)),
                            read(b.inflight_seq_descriptors(on_device)),
                            read(b.batch_metadata(on_device))};
  for (int g = 0; g < n_groups; ++g) {
    out.push_back(read(b.block_tables(g, on_device)));
    out.push_back(read(b.kv_indptr(g, on_device)));
    out.push_back(read(b.kv_indices(g, on_device)));
    out.push_back(read(b.kv_last_page_len(g, on_device)));
    out.push_back(read(b.slot_mapping(g, on_device)));
  }
  return out;
}

void ExpectMirrorEqualsHost(const RaggedBatch& b, int n_groups) {
  const std::vector<Bytes> host = AllArrays(b, n_groups, false);
  const std::vector<Bytes> device = AllArrays(b, n_groups, true);
  ASSERT_EQ(host.size(), device.size());
  for (size_t a = 0; a < host.size(); ++a) EXPECT_EQ(host[a], device[a]) << "array " << a;
  // The device kv_ptrs hold the device rows' addresses.
  for (int g = 0; g < n_groups; ++g) {
    const Result<TensorView> tables = b.block_tables(g, true);
    const Result<TensorView> ptrs = b.kv_ptrs(g, true);
    ASSERT_TRUE(tables.ok() && ptrs.ok());
    std::vector<int64_t> got(static_cast<size_t>(ptrs->numel()));
    if (!got.empty()) {
      ASSERT_EQ(
          cudaMemcpy(got.data(), ptrs->data, got.size() * sizeof(int64_t), cudaMemcpyDeviceToHost),
          cudaSuccess);
    }
    const auto* rows = static_cast<const BlockId*>(tables->data);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i],
                reinterpret_cast<intptr_t>(rows + static_cast<int64_t>(i) * tables->shape[1]));
    }
  }
}

std::vector<TokenId> TokensFor(std::span<const SeqId> uids, std::span<const int64_t> lengths,
                               int step) {
  std::vector<TokenId> tokens;
  for (size_t i = 0; i < uids.size(); ++i) {
    for (int64_t t = 0; t < lengths[i]; ++t)
      tokens.push_back(static_cast<TokenId>(uids[i] * 100 + step + t));
  }
  return tokens;
}

// A prompt for a sequence the manager does not track yet, one token for the others.
std::vector<int64_t> LengthsFor(const StateManager& manager, std::span<const SeqId> uids) {
  std::vector<int64_t> lengths;
  for (SeqId uid : uids) lengths.push_back(manager.GetSequence(uid) == nullptr ? 3 + uid % 13 : 1);
  return lengths;
}

TEST(CudaRaggedBatchTest, MirrorEqualsTheHostOverManySteps) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  auto manager = MakeGpuManager({Group(16, 16), Group(32, 8)});
  ASSERT_NE(manager, nullptr);
  auto batch = MakeBatch(*manager);
  ASSERT_NE(batch, nullptr);
  // Growing to 48 sequences, shrinking to 2, empty, and back: decode steps in between cross
  // block boundaries.
  std::vector<std::vector<SeqId>> steps;
  for (int n : {1, 3, 8, 20, 48, 48, 48, 30, 2, 0, 5, 48, 17}) {
    std::vector<SeqId> uids(static_cast<size_t>(n));
    std::iota(uids.begin(), uids.end(), SeqId{1});
    for (int repeat = 0; repeat < 3; ++repeat) steps.push_back(uids);
  }
  void* first_input_ids = nullptr;
  for (size_t step = 0; step < steps.size(); ++step) {
    SCOPED_TRACE(step);
    const std::vector<SeqId>& uids = steps[step];
    const std::vector<int64_t> lengths = LengthsFor(*manager, uids);
    const std::vector<TokenId> tokens = TokensFor(uids, lengths, static_cast<int>(step));
    const bool padding = step % 3 != 0;
    if (step % 2 == 0) {
      ASSERT_TRUE(
          manager->ScheduleBatch({.uids = uids, .lengths = lengths}, tokens, *batch, padding).ok());
    } else {
      batch->Clear();
      ASSERT_TRUE(manager->Schedule({.uids = uids, .lengths = lengths}).ok());
      size_t at = 0;
      for (size_t i = 0; i < uids.size(); ++i) {
        const std::span<const TokenId> mine(tokens.data() + at, static_cast<size_t>(lengths[i]));
        ASSERT_TRUE(batch->InsertSequence(*manager->GetSequence(uids[i]), mine).ok());
        at += static_cast<size_t>(lengths[i]);
      }
      ASSERT_TRUE(batch->Finalize(padding).ok());
    }
    ExpectMirrorEqualsHost(*batch, 2);
    // Fixed device addresses: engines capture CUDA graphs over them.
    const Result<TensorView> ids = batch->input_ids(true);
    ASSERT_TRUE(ids.ok());
    if (step == 0) first_input_ids = ids->data;
    EXPECT_EQ(ids->data, first_input_ids);
    ASSERT_TRUE(manager->PostForward(*batch).ok());
  }
  ASSERT_TRUE(manager->CheckInvariants().ok());
}

TEST(CudaRaggedBatchTest, HostArraysArePinnedAndDeviceArraysAreDeviceMemory) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  auto manager = MakeGpuManager({Group(16, 16)});
  ASSERT_NE(manager, nullptr);
  auto batch = MakeBatch(*manager);
  ASSERT_NE(batch, nullptr);
  const std::vector<SeqId> uids = {1};
  const std::vector<int64_t> lengths = {5};
  ASSERT_TRUE(
      manager
          ->ScheduleBatch({.uids = uids, .lengths = lengths}, TokensFor(uids, lengths, 0), *batch)
          .ok());
  cudaPointerAttributes host{};
  ASSERT_EQ(cudaPointerGetAttributes(&host, batch->slot_mapping()->data), cudaSuccess);
  EXPECT_EQ(host.type, cudaMemoryTypeHost);  // page-locked: the copy is asynchronous DMA
  cudaPointerAttributes device{};
  ASSERT_EQ(cudaPointerGetAttributes(&device, batch->slot_mapping(0, true)->data), cudaSuccess);
  EXPECT_EQ(device.type, cudaMemoryTypeDevice);
}

void CUDART_CB Sleep(void* milliseconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(milliseconds)));
}

// Step 1's copy is held back on the default stream behind a host function that sleeps; step 2
// is scheduled at once. A copy of the device mirror queued right after step 1 (device to device,
// same stream) must hold step 1's arrays: step 2 waited for step 1's copy before it wrote the
// staging.
TEST(CudaRaggedBatchTest, TheNextStepWaitsForTheCopyBeforeWritingTheStaging) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  auto manager = MakeGpuManager({Group(16, 16)});
  ASSERT_NE(manager, nullptr);
  auto batch = MakeBatch(*manager);
  ASSERT_NE(batch, nullptr);
  std::vector<SeqId> uids(32);
  std::iota(uids.begin(), uids.end(), SeqId{1});
  std::vector<int64_t> lengths = LengthsFor(*manager, uids);
  ASSERT_TRUE(
      manager
          ->ScheduleBatch({.uids = uids, .lengths = lengths}, TokensFor(uids, lengths, 0), *batch)
          .ok());
  ASSERT_TRUE(manager->PostForward(*batch).ok());

  int sleep_ms = 200;
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, Sleep, &sleep_ms), cudaSuccess);
  lengths = LengthsFor(*manager, uids);
  ASSERT_TRUE(
      manager
          ->ScheduleBatch({.uids = uids, .lengths = lengths}, TokensFor(uids, lengths, 1), *batch)
          .ok());
  const Result<TensorView> slots = batch->slot_mapping(0, true);
  ASSERT_TRUE(slots.ok());
  const Bytes step1 = HostBytes(batch->slot_mapping());
  void* snapshot = nullptr;
  ASSERT_EQ(cudaMalloc(&snapshot, step1.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(snapshot, slots->data, step1.size(), cudaMemcpyDeviceToDevice,
                            cudaStreamLegacy),
            cudaSuccess);
  ASSERT_TRUE(manager->PostForward(*batch).ok());

  // Step 2 at once: different slots (one token further on).
  lengths = LengthsFor(*manager, uids);
  ASSERT_TRUE(
      manager
          ->ScheduleBatch({.uids = uids, .lengths = lengths}, TokensFor(uids, lengths, 2), *batch)
          .ok());
  EXPECT_NE(HostBytes(batch->slot_mapping()), step1);
  Bytes got(step1.size());
  ASSERT_EQ(cudaMemcpy(got.data(), snapshot, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, step1);
  ExpectMirrorEqualsHost(*batch, 1);
  ASSERT_EQ(cudaFree(snapshot), cudaSuccess);
}

}  // namespace
}  // namespace blockkv
