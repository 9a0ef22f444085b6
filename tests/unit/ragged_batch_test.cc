// SPDX-License-Identifier: Apache-2.0
// RaggedBatch over a real StateManager on a budgeted host device: DeepSpeed's
// test_ragged_wrapper.py scenarios (counts, input ids, token→sequence map, descriptors,
// metadata), to_padded, the CSR page table and slot mapping checked against the sequences' block
// tables, and every error code the contract names. The device mirror is exercised without a GPU
// through a fake device that reports kCuda and keeps its memory on the host; the global operator
// new of this binary counts allocations, to check that steady-state steps make none.
#include "blockkv/ragged_batch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "unit/test_util.h"

namespace {
std::atomic<int64_t> g_heap_allocations{0};
}  // namespace

// Counting replacements of the global allocation functions (the others forward to these). g++
// inlines them into the standard library and then flags the malloc/free pair as a mismatch of
// new and free: a false positive for a replaced operator new.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t size) {
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t /*size*/) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace blockkv {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr int64_t kDeviceBudget = 64LL << 20;
constexpr int64_t kNumBlocks = 256;

// One layer of 1 head of 8 fp16 values: small blocks, many of them.
KVCacheConfig Group(int32_t block_size, int32_t max_blocks = 64) {
  return KVCacheConfig{.block_size = block_size,
                       .cache_shape = {1, 1, 8},
                       .cache_dtype = DType::kFloat16,
                       .max_blocks_per_allocation_group = max_blocks};
}

StateManagerConfig Config(int32_t tracked = 2048, int32_t batch = 768, int32_t seq_count = 512) {
  StateManagerConfig config;
  config.max_tracked_sequences = tracked;
  config.max_ragged_batch_size = batch;
  config.max_ragged_sequence_count = seq_count;
  config.memory_config = MemoryConfig{.mode = AllocationMode::kAllocate, .size = kNumBlocks};
  return config;
}

std::unique_ptr<StateManager> MakeManager(StateManagerConfig config,
                                          std::vector<KVCacheConfig> groups = {Group(64)}) {
  Result<std::unique_ptr<StateManager>> manager =
      StateManager::Create(std::move(config), std::move(groups), CpuDevice(kDeviceBudget));
  EXPECT_OK(manager);
  return manager.ok() ? std::move(*manager) : nullptr;
}

std::unique_ptr<RaggedBatch> MakeBatch(const StateManager& manager) {
  Result<std::unique_ptr<RaggedBatch>> batch = RaggedBatch::Create(manager);
  EXPECT_OK(batch);
  return batch.ok() ? std::move(*batch) : nullptr;
}

std::vector<TokenId> RandomTokens(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<TokenId> token(0, 99);
  std::vector<TokenId> tokens(static_cast<size_t>(n));
  for (TokenId& t : tokens) t = token(rng);
  return tokens;
}

// Schedules `n` new tokens for `uid` (alone) and returns its sequence.
const Sequence* Schedule(StateManager& manager, SeqId uid, int64_t n) {
  const std::vector<SeqId> uids = {uid};
  const std::vector<int64_t> lengths = {n};
  EXPECT_OK(manager.Schedule({.uids = uids, .lengths = lengths}));
  return manager.GetSequence(uid);
}

// Runs one forward of `n` tokens for `uid` without a batch: its history grows by `n`.
void AddHistory(StateManager& manager, SeqId uid, int64_t n) {
  Schedule(manager, uid, n);
  const std::vector<SeqId> uids = {uid};
  ASSERT_OK(manager.PostForward(uids));
}

// The elements of a contiguous host view of T.
template <class T>
std::vector<T> Read(const Result<TensorView>& view) {
  EXPECT_OK(view);
  if (!view.ok()) return {};
  EXPECT_EQ(view->dtype, sizeof(T) == 4 ? DType::kInt32 : DType::kInt64);
  EXPECT_EQ(view->device, DeviceKind::kCpu);
  EXPECT_TRUE(view->is_contiguous());
  const T* data = static_cast<const T*>(view->data);
  return std::vector<T>(data, data + view->numel());
}

std::vector<int32_t> ReadInt32(const Result<TensorView>& view) { return Read<int32_t>(view); }
std::vector<int64_t> ReadInt64(const Result<TensorView>& view) { return Read<int64_t>(view); }

// Claims to be CUDA device 3 but keeps its memory on the host, so the mirror path runs anywhere.
class FakeCudaDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  int ordinal() const override { return 3; }
  std::string name() const override { return "cuda:3 (fake, host memory)"; }
  int64_t total_memory() const override { return kDeviceBudget; }
  int64_t available_memory() const override { return kDeviceBudget - allocated_; }
  Result<DeviceBuffer> Allocate(int64_t bytes) override {
    if (bytes < 0) return InvalidArgumentError("negative size");
    if (bytes == 0) return DeviceBuffer();
    const int64_t rounded = (bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment;
    allocated_ += bytes;
    ++allocations;
    return MakeBuffer(std::aligned_alloc(kDeviceAlignment, static_cast<size_t>(rounded)), bytes);
  }
  void EmptyCache() override {}
  Status CopyFromHost(void* dst, const void* host_src, int64_t bytes) override {
    if (fail_copies) return InternalError("fake device: copy failed");
    std::memcpy(dst, host_src, static_cast<size_t>(bytes));
    ++copies;
    copied_bytes += bytes;
    return Status::Ok();
  }
  Status CopyWithin(void* dst, const void* src, int64_t bytes) override {
    std::memmove(dst, src, static_cast<size_t>(bytes));
    return Status::Ok();
  }

  int allocations = 0;
  int copies = 0;
  int64_t copied_bytes = 0;
  bool fail_copies = false;

 protected:
  void Deallocate(void* data, int64_t bytes) override {
    std::free(data);
    allocated_ -= bytes;
  }

 private:
  int64_t allocated_ = 0;
};

// ---- to_padded --------------------------------------------------------------------------------

TEST(PaddedTokenCountTest, MatchesDeepSpeedGoldens) {
  EXPECT_EQ(PaddedTokenCount(0), 0);
  EXPECT_EQ(PaddedTokenCount(1), 64);
  EXPECT_EQ(PaddedTokenCount(64), 64);
  EXPECT_EQ(PaddedTokenCount(65), 128);
  EXPECT_EQ(PaddedTokenCount(512), 512);
  EXPECT_EQ(PaddedTokenCount(513), 640);
  EXPECT_EQ(PaddedTokenCount(768), 768);
}

// ---- DeepSpeed's test_ragged_wrapper.py -------------------------------------------------------

TEST(RaggedBatchTest, NewBatchIsEmptyForDeepSpeedConfigs) {
  for (auto [seq_count, batch_size] : {std::pair{128, 512}, std::pair{128, 1024}}) {
    auto manager = MakeManager(Config(/*tracked=*/seq_count, batch_size, seq_count));
    ASSERT_NE(manager, nullptr);
    auto batch = MakeBatch(*manager);
    ASSERT_NE(batch, nullptr);
    EXPECT_EQ(batch->current_tokens(), 0);
    EXPECT_EQ(batch->current_sequences(), 0);
    EXPECT_FALSE(batch->finalized());
  }
}

TEST(RaggedBatchTest, SingleSequenceRoundTripsAndClears) {
  for (int64_t length : {1, 37, 128, 512}) {
    SCOPED_TRACE(length);
    auto manager = MakeManager(Config());
    auto batch = MakeBatch(*manager);
    const std::vector<TokenId> tokens = RandomTokens(length, static_cast<uint32_t>(length));
    const Sequence* seq = Schedule(*manager, /*uid=*/7, length);
    ASSERT_OK(batch->InsertSequence(*seq, tokens));
    ASSERT_OK(batch->Finalize());

    EXPECT_EQ(batch->current_tokens(), length);
    EXPECT_EQ(batch->current_sequences(), 1);
    EXPECT_EQ(batch->padded_tokens(), length);
    EXPECT_EQ(ReadInt64(batch->input_ids()), std::vector<int64_t>(tokens.begin(), tokens.end()));
    EXPECT_EQ(ReadInt32(batch->tokens_to_seq()), std::vector<int32_t>(tokens.size(), 0));
    EXPECT_THAT(ReadInt32(batch->batch_metadata()), ElementsAre(length, 1));

    batch->Clear();
    EXPECT_EQ(batch->current_tokens(), 0);
    EXPECT_EQ(batch->current_sequences(), 0);
  }
}

TEST(RaggedBatchTest, SeveralSequencesGiveDeepSpeedLayout) {
  const std::vector<std::vector<int64_t>> cases = {
      {128, 128}, {1, 32, 243}, {64, 1, 1, 1, 1, 393, 27, 2}};
  for (const std::vector<int64_t>& lengths : cases) {
    SCOPED_TRACE(::testing::PrintToString(lengths));
    auto manager = MakeManager(Config());
    auto batch = MakeBatch(*manager);
    std::vector<SeqId> uids(lengths.size());
    std::iota(uids.begin(), uids.end(), SeqId{100});
    ASSERT_OK(manager->Schedule({.uids = uids, .lengths = lengths}));

    std::vector<TokenId> all_tokens;
    std::vector<int32_t> expected_to_seq;
    std::vector<int32_t> expected_descriptors;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const std::vector<TokenId> tokens = RandomTokens(lengths[i], static_cast<uint32_t>(i));
      expected_descriptors.insert(
          expected_descriptors.end(),
          {static_cast<int32_t>(all_tokens.size()), static_cast<int32_t>(lengths[i]), 0, 0});
      all_tokens.insert(all_tokens.end(), tokens.begin(), tokens.end());
      expected_to_seq.insert(expected_to_seq.end(), tokens.size(), static_cast<int32_t>(i));
      ASSERT_OK(batch->InsertSequence(*manager->GetSequence(uids[i]), tokens));
      EXPECT_EQ(batch->current_tokens(), std::ssize(all_tokens));
      EXPECT_EQ(batch->current_sequences(), std::ssize(expected_descriptors) / 4);
    }
    ASSERT_OK(batch->Finalize());
    const auto total = static_cast<int32_t>(all_tokens.size());
    EXPECT_EQ(ReadInt64(batch->input_ids()),
              std::vector<int64_t>(all_tokens.begin(), all_tokens.end()));
    EXPECT_EQ(ReadInt32(batch->tokens_to_seq()), expected_to_seq);
    EXPECT_EQ(ReadInt32(batch->inflight_seq_descriptors()), expected_descriptors);
    EXPECT_THAT(ReadInt32(batch->batch_metadata()),
                ElementsAre(total, static_cast<int32_t>(lengths.size())));
  }
}

// ---- CSR page table and slot mapping ----------------------------------------------------------

// The expected arrays of one cache group, built from the sequences' block tables.
struct ExpectedGroup {
  std::vector<int32_t> indptr = {0};
  std::vector<int32_t> indices;
  std::vector<int32_t> last_page_len;
  std::vector<int64_t> slot_mapping;
};

void AddExpected(ExpectedGroup& e, const Sequence& seq, int group, int32_t block_size) {
  const std::span<const BlockId> table = seq.block_table(group);
  const int64_t total = seq.seen_tokens() + seq.in_flight_tokens();
  const int64_t used = (total + block_size - 1) / block_size;
  e.indices.insert(e.indices.end(), table.begin(), table.begin() + used);
  e.indptr.push_back(static_cast<int32_t>(e.indices.size()));
  e.last_page_len.push_back(total == 0 ? 0 : static_cast<int32_t>((total - 1) % block_size + 1));
  for (int64_t pos = seq.seen_tokens(); pos < total; ++pos) {
    e.slot_mapping.push_back(int64_t{table[static_cast<size_t>(pos / block_size)]} * block_size +
                             pos % block_size);
  }
}

void ExpectGroupMatches(const RaggedBatch& batch, int group, const ExpectedGroup& e) {
  EXPECT_EQ(ReadInt32(batch.kv_indptr(group)), e.indptr);
  EXPECT_EQ(ReadInt32(batch.kv_indices(group)), e.indices);
  EXPECT_EQ(ReadInt32(batch.kv_last_page_len(group)), e.last_page_len);
  EXPECT_EQ(ReadInt64(batch.slot_mapping(group)), e.slot_mapping);
}

TEST(RaggedBatchTest, CsrAndSlotMappingFollowBlockTablesOfSequencesWithHistory) {
  auto manager = MakeManager(Config(), {Group(16)});
  auto batch = MakeBatch(*manager);
  AddHistory(*manager, 1, 40);
  AddHistory(*manager, 3, 32);
  const std::vector<SeqId> uids = {1, 2, 3};
  const std::vector<int64_t> lengths = {30, 5, 1};
  ASSERT_OK(manager->Schedule({.uids = uids, .lengths = lengths}));

  ExpectedGroup expected;
  for (size_t i = 0; i < uids.size(); ++i) {
    const Sequence& seq = *manager->GetSequence(uids[i]);
    ASSERT_OK(batch->InsertSequence(seq, RandomTokens(lengths[i], 1)));
    AddExpected(expected, seq, 0, 16);
  }
  ASSERT_OK(batch->Finalize());
  // seen+n = 70, 5, 33 tokens at block size 16: 5, 1 and 3 blocks, the last holding 6, 5, 1.
  EXPECT_THAT(expected.indptr, ElementsAre(0, 5, 6, 9));
  EXPECT_THAT(expected.last_page_len, ElementsAre(6, 5, 1));
  ExpectGroupMatches(*batch, 0, expected);
  EXPECT_THAT(ReadInt32(batch->inflight_seq_descriptors()),
              ElementsAre(0, 30, 40, 0, 30, 5, 0, 0, 35, 1, 32, 0));
}

TEST(RaggedBatchTest, DenseTablesHoldEachRowThenNoBlockAndKvPtrsPointAtRows) {
  auto manager = MakeManager(Config(), {Group(16, /*max_blocks=*/8)});
  auto batch = MakeBatch(*manager);
  AddHistory(*manager, 1, 40);
  const Sequence* a = Schedule(*manager, 1, 30);
  const Sequence* b = Schedule(*manager, 2, 5);
  ASSERT_OK(batch->InsertSequence(*a, RandomTokens(30, 2)));
  ASSERT_OK(batch->InsertSequence(*b, RandomTokens(5, 3)));
  ASSERT_OK(batch->Finalize());

  Result<TensorView> tables = batch->block_tables();
  ASSERT_OK(tables);
  EXPECT_EQ(tables->ndim, 2);
  EXPECT_EQ(tables->size(0), 2);
  EXPECT_EQ(tables->size(1), 8);
  std::vector<int32_t> expected(16, kNoBlock);
  std::copy(a->block_table().begin(), a->block_table().end(), expected.begin());
  std::copy(b->block_table().begin(), b->block_table().end(), expected.begin() + 8);
  EXPECT_EQ(ReadInt32(tables), expected);

  const auto* rows = static_cast<const BlockId*>(tables->data);
  EXPECT_THAT(ReadInt64(batch->kv_ptrs()),
              ElementsAre(reinterpret_cast<intptr_t>(rows), reinterpret_cast<intptr_t>(rows + 8)));
}

TEST(RaggedBatchTest, RowsOfAnEarlierStepAreClearedWhenAShorterTableTakesThem) {
  auto manager = MakeManager(Config(), {Group(16, /*max_blocks=*/8)});
  auto batch = MakeBatch(*manager);
  const Sequence* longer = Schedule(*manager, 1, 100);  // 7 blocks in row 0
  ASSERT_OK(batch->InsertSequence(*longer, RandomTokens(100, 4)));
  ASSERT_OK(batch->Finalize());
  batch->Clear();

  const Sequence* shorter = Schedule(*manager, 2, 3);  // 1 block, now in row 0
  ASSERT_OK(batch->InsertSequence(*shorter, RandomTokens(3, 5)));
  ASSERT_OK(batch->Finalize());
  std::vector<int32_t> expected(8, kNoBlock);
  expected[0] = shorter->block_table()[0];
  EXPECT_EQ(ReadInt32(batch->block_tables()), expected);
}

TEST(RaggedBatchTest, ReleasedLeadingBlocksStayNoBlockInCsr) {
  auto manager = MakeManager(Config(), {Group(16)});
  auto batch = MakeBatch(*manager);
  AddHistory(*manager, 1, 40);  // blocks 0 and 1 are full and wholly before seen
  ASSERT_OK(manager->FreeLeadingBlocks(1, 1));
  const Sequence* seq = Schedule(*manager, 1, 1);
  ASSERT_EQ(seq->block_table()[0], kNoBlock);
  ASSERT_OK(batch->InsertSequence(*seq, RandomTokens(1, 6)));
  ASSERT_OK(batch->Finalize());
  EXPECT_THAT(ReadInt32(batch->kv_indices()),
              ElementsAre(kNoBlock, seq->block_table()[1], seq->block_table()[2]));
  EXPECT_THAT(ReadInt32(batch->kv_last_page_len()), ElementsAre(9));  // 41 = 2·16 + 9
  EXPECT_THAT(ReadInt64(batch->slot_mapping()),
              ElementsAre(int64_t{seq->block_table()[2]} * 16 + 8));
}

TEST(RaggedBatchTest, SequenceWithNoTokensHasNoPagesAndLastPageLenZero) {
  auto manager = MakeManager(Config(), {Group(16)});
  auto batch = MakeBatch(*manager);
  Result<Sequence*> fresh = manager->GetOrCreateSequence(9);
  ASSERT_OK(fresh);
  ASSERT_OK(batch->InsertSequence(**fresh, {}));
  ASSERT_OK(batch->Finalize());
  EXPECT_THAT(ReadInt32(batch->kv_indptr()), ElementsAre(0, 0));
  EXPECT_THAT(ReadInt32(batch->kv_indices()), ElementsAre());
  EXPECT_THAT(ReadInt32(batch->kv_last_page_len()), ElementsAre(0));
  EXPECT_THAT(ReadInt32(batch->inflight_seq_descriptors()), ElementsAre(0, 0, 0, 0));
}

TEST(RaggedBatchTest, TwoCacheGroupsWithDifferentBlockSizesGetTheirOwnTables) {
  auto manager = MakeManager(Config(), {Group(16, 8), Group(32, 4)});
  auto batch = MakeBatch(*manager);
  AddHistory(*manager, 1, 20);
  const Sequence* seq = Schedule(*manager, 1, 30);  // 50 tokens: 4 blocks of 16, 2 of 32
  ASSERT_EQ(seq->cur_allocated_blocks(0), 4);
  ASSERT_EQ(seq->cur_allocated_blocks(1), 2);
  ASSERT_OK(batch->InsertSequence(*seq, RandomTokens(30, 7)));
  ASSERT_OK(batch->Finalize());

  ExpectedGroup small;
  ExpectedGroup large;
  AddExpected(small, *seq, 0, 16);
  AddExpected(large, *seq, 1, 32);
  EXPECT_THAT(small.last_page_len, ElementsAre(2));   // 50 = 3·16 + 2
  EXPECT_THAT(large.last_page_len, ElementsAre(18));  // 50 = 32 + 18
  ExpectGroupMatches(*batch, 0, small);
  ExpectGroupMatches(*batch, 1, large);
  Result<TensorView> large_tables = batch->block_tables(1);
  ASSERT_OK(large_tables);
  EXPECT_EQ(large_tables->size(1), 4);
  EXPECT_THAT(ReadInt32(large_tables),
              ElementsAre(seq->block_table(1)[0], seq->block_table(1)[1], kNoBlock, kNoBlock));
  EXPECT_CODE(batch->slot_mapping(2), StatusCode::kOutOfRange);
  EXPECT_CODE(batch->block_tables(-1), StatusCode::kOutOfRange);
}

// ---- padding ----------------------------------------------------------------------------------

TEST(RaggedBatchTest, PaddingFillsTokensMapAndSlotsWithMinusOne) {
  auto manager = MakeManager(Config(), {Group(16)});
  auto batch = MakeBatch(*manager);
  const std::vector<TokenId> tokens = RandomTokens(70, 8);
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 70), tokens));
  ASSERT_OK(batch->Finalize(/*padding=*/true));
  EXPECT_EQ(batch->current_tokens(), 70);
  EXPECT_EQ(batch->padded_tokens(), 128);

  const std::vector<int64_t> ids = ReadInt64(batch->input_ids());
  const std::vector<int32_t> to_seq = ReadInt32(batch->tokens_to_seq());
  const std::vector<int64_t> slots = ReadInt64(batch->slot_mapping());
  ASSERT_EQ(ids.size(), 128u);
  ASSERT_EQ(to_seq.size(), 128u);
  ASSERT_EQ(slots.size(), 128u);
  EXPECT_EQ(std::vector<int64_t>(ids.begin(), ids.begin() + 70),
            std::vector<int64_t>(tokens.begin(), tokens.end()));
  EXPECT_THAT(std::vector<int64_t>(ids.begin() + 70, ids.end()), Each(-1));
  EXPECT_THAT(std::vector<int32_t>(to_seq.begin(), to_seq.begin() + 70), Each(0));
  EXPECT_THAT(std::vector<int32_t>(to_seq.begin() + 70, to_seq.end()), Each(-1));
  EXPECT_THAT(std::vector<int64_t>(slots.begin(), slots.begin() + 70), Each(::testing::Ge(0)));
  EXPECT_THAT(std::vector<int64_t>(slots.begin() + 70, slots.end()), Each(-1));
  EXPECT_THAT(ReadInt32(batch->batch_metadata()), ElementsAre(70, 1));
}

// ---- empty batch, lifecycle -------------------------------------------------------------------

TEST(RaggedBatchTest, EmptyBatchFinalizesWithZeroSizedArrays) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  ASSERT_OK(batch->Finalize(/*padding=*/true));
  EXPECT_TRUE(batch->finalized());
  EXPECT_EQ(batch->padded_tokens(), 0);
  EXPECT_THAT(ReadInt32(batch->batch_metadata()), ElementsAre(0, 0));
  EXPECT_THAT(ReadInt64(batch->input_ids()), ElementsAre());
  EXPECT_THAT(ReadInt32(batch->tokens_to_seq()), ElementsAre());
  EXPECT_THAT(ReadInt32(batch->kv_indptr()), ElementsAre(0));
  EXPECT_THAT(ReadInt32(batch->kv_indices()), ElementsAre());
  EXPECT_THAT(ReadInt64(batch->slot_mapping()), ElementsAre());
  Result<TensorView> descriptors = batch->inflight_seq_descriptors();
  ASSERT_OK(descriptors);
  EXPECT_THAT(std::vector<int64_t>(descriptors->shape.begin(), descriptors->shape.begin() + 2),
              ElementsAre(0, 4));
}

TEST(RaggedBatchTest, AccessorsFailBeforeFinalizeAndAfterClear) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  EXPECT_CODE(batch->input_ids(), StatusCode::kFailedPrecondition);
  EXPECT_CODE(batch->kv_indices(), StatusCode::kFailedPrecondition);
  ASSERT_OK(batch->Finalize());
  EXPECT_OK(batch->input_ids());
  batch->Clear();
  EXPECT_FALSE(batch->finalized());
  EXPECT_CODE(batch->tokens_to_seq(), StatusCode::kFailedPrecondition);
  EXPECT_CODE(batch->slot_mapping(), StatusCode::kFailedPrecondition);
}

TEST(RaggedBatchTest, OnDeviceOnAHostCacheIsFailedPrecondition) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  ASSERT_OK(batch->Finalize());
  Result<TensorView> ids = batch->input_ids(/*on_device=*/true);
  EXPECT_CODE(ids, StatusCode::kFailedPrecondition);
  EXPECT_THAT(ids.status().message(), HasSubstr("host"));
  EXPECT_CODE(batch->block_tables(0, /*on_device=*/true), StatusCode::kFailedPrecondition);
  EXPECT_CODE(batch->slot_mapping(0, /*on_device=*/true), StatusCode::kFailedPrecondition);
}

TEST(RaggedBatchTest, InsertAfterFinalizeIsFailedPreconditionUntilClear) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 4), RandomTokens(4, 9)));
  ASSERT_OK(batch->Finalize());
  const Sequence* second = Schedule(*manager, 2, 3);
  const std::vector<TokenId> tokens = RandomTokens(3, 10);
  Status late = batch->InsertSequence(*second, tokens);
  EXPECT_CODE(late, StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.message(), HasSubstr("Clear"));
  EXPECT_EQ(batch->current_sequences(), 1);
  batch->Clear();
  EXPECT_OK(batch->InsertSequence(*second, tokens));
}

TEST(RaggedBatchTest, FinalizeFailsWhenAnInsertedSequenceMovedOn) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 4), RandomTokens(4, 11)));
  const std::vector<SeqId> uids = {1};
  ASSERT_OK(manager->PostForward(uids));
  Status finalized = batch->Finalize();
  EXPECT_CODE(finalized, StatusCode::kFailedPrecondition);
  EXPECT_THAT(finalized.message(), HasSubstr("sequence 1"));
  EXPECT_FALSE(batch->finalized());
}

TEST(RaggedBatchTest, FinalizeFailsWhenAnInsertedSequenceWasFlushed) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 4), RandomTokens(4, 21)));
  ASSERT_OK(manager->FlushSequence(1));
  EXPECT_CODE(batch->Finalize(), StatusCode::kFailedPrecondition);
  batch->Clear();
  EXPECT_OK(batch->Finalize());
  EXPECT_THAT(ReadInt32(batch->batch_metadata()), ElementsAre(0, 0));
}

// ---- insert errors ----------------------------------------------------------------------------

TEST(RaggedBatchTest, SequenceLimitIsResourceExhaustedAndAddsNothing) {
  auto manager = MakeManager(Config(/*tracked=*/8, /*batch=*/64, /*seq_count=*/2));
  auto batch = MakeBatch(*manager);
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 1), RandomTokens(1, 12)));
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 2, 1), RandomTokens(1, 13)));
  Status full = batch->InsertSequence(*Schedule(*manager, 3, 1), RandomTokens(1, 14));
  EXPECT_CODE(full, StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("sequence limit: 2"));
  EXPECT_EQ(batch->current_sequences(), 2);
  EXPECT_EQ(batch->current_tokens(), 2);
  ASSERT_OK(batch->Finalize());
  EXPECT_THAT(ReadInt32(batch->batch_metadata()), ElementsAre(2, 2));
}

TEST(RaggedBatchTest, TokenLimitIsResourceExhaustedAndAddsNothing) {
  auto manager = MakeManager(Config(/*tracked=*/8, /*batch=*/128, /*seq_count=*/4));
  auto batch = MakeBatch(*manager);
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 100), RandomTokens(100, 15)));
  Status full = batch->InsertSequence(*Schedule(*manager, 2, 29), RandomTokens(29, 16));
  EXPECT_CODE(full, StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("token limit: 128"));
  EXPECT_EQ(batch->current_sequences(), 1);
  EXPECT_EQ(batch->current_tokens(), 100);
  EXPECT_OK(batch->InsertSequence(*Schedule(*manager, 3, 28), RandomTokens(28, 17)));
  EXPECT_EQ(batch->current_tokens(), 128);
}

TEST(RaggedBatchTest, DoubleInsertIsAlreadyExists) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  const Sequence* seq = Schedule(*manager, 5, 2);
  const std::vector<TokenId> tokens = RandomTokens(2, 18);
  ASSERT_OK(batch->InsertSequence(*seq, tokens));
  Status again = batch->InsertSequence(*seq, tokens);
  EXPECT_CODE(again, StatusCode::kAlreadyExists);
  EXPECT_THAT(again.message(), HasSubstr("sequence 5"));
  EXPECT_EQ(batch->current_tokens(), 2);
  EXPECT_EQ(batch->current_sequences(), 1);
  batch->Clear();  // clears the mark: the same sequence goes into the next batch
  EXPECT_OK(batch->InsertSequence(*seq, tokens));
}

TEST(RaggedBatchTest, TokenCountOtherThanInFlightIsFailedPrecondition) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  const Sequence* seq = Schedule(*manager, 1, 4);
  Status mismatch = batch->InsertSequence(*seq, RandomTokens(5, 19));
  EXPECT_CODE(mismatch, StatusCode::kFailedPrecondition);
  EXPECT_THAT(mismatch.message(), HasSubstr("Schedule"));
  EXPECT_EQ(batch->current_tokens(), 0);
  EXPECT_EQ(batch->current_sequences(), 0);
}

TEST(RaggedBatchTest, SequenceWithoutBlocksIsFailedPrecondition) {
  auto manager = MakeManager(Config());
  auto batch = MakeBatch(*manager);
  Result<Sequence*> seq = manager->GetOrCreateSequence(3);
  ASSERT_OK(seq);
  Status unscheduled = batch->InsertSequence(**seq, RandomTokens(4, 20));
  EXPECT_CODE(unscheduled, StatusCode::kFailedPrecondition);
  EXPECT_EQ(batch->current_sequences(), 0);
}

// ---- steady state -----------------------------------------------------------------------------

// One decode-like step: every uid gets one token, inserted, finalized, read, cleared.
void RunStep(StateManager& manager, RaggedBatch& batch, std::span<const SeqId> uids,
             int64_t* allocations_in_batch) {
  const std::vector<int64_t> lengths(uids.size(), 1);
  ASSERT_OK(manager.Schedule({.uids = uids, .lengths = lengths}));
  const std::vector<TokenId> token = {42};
  const int64_t before = g_heap_allocations.load();
  for (SeqId uid : uids) ASSERT_OK(batch.InsertSequence(*manager.GetSequence(uid), token));
  ASSERT_OK(batch.Finalize(/*padding=*/true));
  ASSERT_OK(batch.slot_mapping());
  ASSERT_OK(batch.kv_indices());
  batch.Clear();
  *allocations_in_batch = g_heap_allocations.load() - before;
  ASSERT_OK(manager.PostForward(uids));
}

TEST(RaggedBatchTest, SteadyStateStepsMakeNoHeapAllocation) {
  auto manager = MakeManager(Config(), {Group(16)});
  auto batch = MakeBatch(*manager);
  std::vector<SeqId> uids(32);
  std::iota(uids.begin(), uids.end(), SeqId{1});
  const int64_t before_probe = g_heap_allocations.load();
  auto probe = std::make_unique<int64_t>(1);  // the counter does see allocations
  ASSERT_GT(g_heap_allocations.load(), before_probe);
  for (int step = 0; step < 20; ++step) {
    SCOPED_TRACE(step);
    int64_t allocations = -1;
    RunStep(*manager, *batch, uids, &allocations);
    EXPECT_EQ(allocations, 0);
  }
}

// ---- device mirror ----------------------------------------------------------------------------

std::unique_ptr<StateManager> MakeManagerOn(std::shared_ptr<Device> device,
                                            StateManagerConfig config = Config(),
                                            std::vector<KVCacheConfig> groups = {Group(16, 8)}) {
  Result<std::unique_ptr<StateManager>> manager =
      StateManager::Create(std::move(config), std::move(groups), std::move(device));
  EXPECT_OK(manager);
  return manager.ok() ? std::move(*manager) : nullptr;
}

void ExpectMirrorEqual(const Result<TensorView>& host, const Result<TensorView>& device) {
  ASSERT_OK(host);
  ASSERT_OK(device);
  EXPECT_EQ(device->device, DeviceKind::kCuda);
  EXPECT_EQ(device->device_ordinal, 3);
  EXPECT_EQ(device->dtype, host->dtype);
  EXPECT_EQ(device->ndim, host->ndim);
  EXPECT_EQ(device->shape, host->shape);
  EXPECT_NE(device->data, host->data);
  const size_t bytes = static_cast<size_t>(host->numel()) * ElementSize(host->dtype);
  EXPECT_EQ(std::memcmp(device->data, host->data, bytes), 0);
}

TEST(RaggedBatchMirrorTest, FinalizeCopiesEveryArrayToTheDevice) {
  auto device = std::make_shared<FakeCudaDevice>();
  auto manager = MakeManagerOn(device);
  auto batch = MakeBatch(*manager);
  AddHistory(*manager, 1, 40);
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 30), RandomTokens(30, 22)));
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 2, 5), RandomTokens(5, 23)));
  ASSERT_OK(batch->Finalize(/*padding=*/true));

  const RaggedBatch& b = *batch;
  ExpectMirrorEqual(b.input_ids(), b.input_ids(true));
  ExpectMirrorEqual(b.tokens_to_seq(), b.tokens_to_seq(true));
  ExpectMirrorEqual(b.inflight_seq_descriptors(), b.inflight_seq_descriptors(true));
  ExpectMirrorEqual(b.batch_metadata(), b.batch_metadata(true));
  ExpectMirrorEqual(b.block_tables(), b.block_tables(0, true));
  ExpectMirrorEqual(b.kv_indptr(), b.kv_indptr(0, true));
  ExpectMirrorEqual(b.kv_indices(), b.kv_indices(0, true));
  ExpectMirrorEqual(b.kv_last_page_len(), b.kv_last_page_len(0, true));
  ExpectMirrorEqual(b.slot_mapping(), b.slot_mapping(0, true));

  // The device kv_ptrs point at the device rows, the host ones at the host rows.
  Result<TensorView> device_tables = b.block_tables(0, true);
  ASSERT_OK(device_tables);
  const auto* rows = static_cast<const BlockId*>(device_tables->data);
  Result<TensorView> device_ptrs = b.kv_ptrs(0, true);
  ASSERT_OK(device_ptrs);
  const auto* ptrs = static_cast<const int64_t*>(device_ptrs->data);
  EXPECT_THAT(std::vector<int64_t>(ptrs, ptrs + 2),
              ElementsAre(reinterpret_cast<intptr_t>(rows), reinterpret_cast<intptr_t>(rows + 8)));
}

TEST(RaggedBatchMirrorTest, BuffersAreAllocatedOnceInCreate) {
  auto device = std::make_shared<FakeCudaDevice>();
  auto manager = MakeManagerOn(device);
  const int cache_allocations = device->allocations;
  auto batch = MakeBatch(*manager);
  const int batch_allocations = device->allocations - cache_allocations;
  EXPECT_EQ(batch_allocations, 1);  // one arena holds every array
  EXPECT_EQ(device->copies, 1);     // the whole arena, once
  const std::vector<SeqId> uids = {1, 2, 3};
  for (int step = 0; step < 3; ++step) {
    int64_t heap = -1;
    RunStep(*manager, *batch, uids, &heap);
    EXPECT_EQ(heap, 0);
  }
  EXPECT_EQ(device->allocations, cache_allocations + batch_allocations);
}

TEST(RaggedBatchMirrorTest, CopyFailureIsReturnedAndLeavesTheBatchUnfinalized) {
  auto device = std::make_shared<FakeCudaDevice>();
  auto manager = MakeManagerOn(device);
  auto batch = MakeBatch(*manager);
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 3), RandomTokens(3, 24)));
  device->fail_copies = true;
  EXPECT_CODE(batch->Finalize(), StatusCode::kInternal);
  EXPECT_FALSE(batch->finalized());
  EXPECT_CODE(batch->input_ids(/*on_device=*/true), StatusCode::kFailedPrecondition);
  device->fail_copies = false;
  ASSERT_OK(batch->Finalize());
  EXPECT_OK(batch->input_ids(/*on_device=*/true));
}

}  // namespace
}  // namespace blockkv

namespace blockkv {
namespace {

TEST(RaggedBatchOwnership, RejectsASequenceOfAnotherManager) {
  std::unique_ptr<StateManager> mine = MakeManager(Config());
  std::unique_ptr<StateManager> other = MakeManager(Config());
  std::unique_ptr<RaggedBatch> batch = MakeBatch(*mine);
  const Sequence* foreign = Schedule(*other, 1, 4);
  const std::vector<TokenId> tokens = RandomTokens(4, 1);
  const Status s = batch->InsertSequence(*foreign, tokens);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("not tracked by this batch's state manager"));
  EXPECT_EQ(batch->current_sequences(), 0);
}

TEST(RaggedBatchOwnership, RejectsAFlushedSequence) {
  std::unique_ptr<StateManager> manager = MakeManager(Config());
  std::unique_ptr<RaggedBatch> batch = MakeBatch(*manager);
  const Sequence* seq = Schedule(*manager, 1, 4);
  ASSERT_OK(manager->FlushSequence(1));
  const std::vector<TokenId> tokens = RandomTokens(4, 2);
  EXPECT_EQ(batch->InsertSequence(*seq, tokens).code(), StatusCode::kInvalidArgument);
}

TEST(RaggedBatchFinalize, FailingAgainChangesNothing) {
  std::unique_ptr<StateManager> manager = MakeManager(Config());
  std::unique_ptr<RaggedBatch> batch = MakeBatch(*manager);
  const Sequence* a = Schedule(*manager, 1, 3);
  const Sequence* b = Schedule(*manager, 2, 5);
  ASSERT_OK(batch->InsertSequence(*a, RandomTokens(3, 3)));
  ASSERT_OK(batch->InsertSequence(*b, RandomTokens(5, 4)));
  ASSERT_OK(batch->Finalize());
  const std::vector<int64_t> slots = ReadInt64(batch->slot_mapping());
  const std::vector<int32_t> descriptors = ReadInt32(batch->inflight_seq_descriptors());
  // Sequence 2 moves on after the batch was built: finalizing again must fail and leave the
  // batch as it was, still finalized.
  const std::vector<SeqId> second = {2};
  ASSERT_OK(manager->PostForward(second));
  EXPECT_EQ(batch->Finalize().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(batch->finalized());
  EXPECT_EQ(ReadInt64(batch->slot_mapping()), slots);
  EXPECT_EQ(ReadInt32(batch->inflight_seq_descriptors()), descriptors);
}

}  // namespace
}  // namespace blockkv

// ---- StateManager::ScheduleBatch --------------------------------------------------------------

namespace blockkv {
namespace {

// Every array of a finalized batch, by group.
struct Arrays {
  std::vector<int64_t> input_ids;
  std::vector<int32_t> tokens_to_seq, descriptors, metadata;
  std::vector<std::vector<int32_t>> tables, indptr, indices, last_page_len;
  std::vector<std::vector<int64_t>> slots;
  bool operator==(const Arrays&) const = default;
};

Arrays ReadAll(const RaggedBatch& batch, int groups) {
  Arrays a;
  a.input_ids = ReadInt64(batch.input_ids());
  a.tokens_to_seq = ReadInt32(batch.tokens_to_seq());
  a.descriptors = ReadInt32(batch.inflight_seq_descriptors());
  a.metadata = ReadInt32(batch.batch_metadata());
  for (int g = 0; g < groups; ++g) {
    a.tables.push_back(ReadInt32(batch.block_tables(g)));
    a.indptr.push_back(ReadInt32(batch.kv_indptr(g)));
    a.indices.push_back(ReadInt32(batch.kv_indices(g)));
    a.last_page_len.push_back(ReadInt32(batch.kv_last_page_len(g)));
    a.slots.push_back(ReadInt64(batch.slot_mapping(g)));
  }
  return a;
}

// The tokens of every uid, one after another: lengths[i] of them, from a per-uid pattern.
std::vector<TokenId> TokensFor(std::span<const SeqId> uids, std::span<const int64_t> lengths,
                               int step) {
  std::vector<TokenId> tokens;
  for (size_t i = 0; i < uids.size(); ++i) {
    for (int64_t t = 0; t < lengths[i]; ++t)
      tokens.push_back(static_cast<TokenId>(uids[i] * 100 + step + t));
  }
  return tokens;
}

// Two managers run the same random program of prefills, decodes, finishes and new arrivals over
// `groups`; one builds each step's batch with ScheduleBatch, the other with Schedule +
// InsertSequence + Finalize. Every array of every step must be the same.
void ExpectScheduleBatchBuildsWhatInsertAndFinalizeBuild(const std::vector<KVCacheConfig>& groups) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const auto n_groups = static_cast<int>(groups.size());
  auto fused = MakeManager(Config(), groups);
  auto separate = MakeManager(Config(), groups);
  auto fused_batch = MakeBatch(*fused);
  auto separate_batch = MakeBatch(*separate);
  std::vector<SeqId> running;
  SeqId next_uid = 1;
  for (int step = 0; step < 60; ++step) {
    SCOPED_TRACE(step);
    // Some finish, some arrive with a prompt; the rest decode one token (or sit out with 0).
    std::vector<SeqId> uids;
    for (const SeqId uid : running) {
      if (rng() % 10 == 0) {
        ASSERT_OK(fused->FlushSequence(uid));
        ASSERT_OK(separate->FlushSequence(uid));
      } else {
        uids.push_back(uid);
      }
    }
    for (auto n = rng() % 3; n > 0; --n) uids.push_back(next_uid++);
    std::shuffle(uids.begin(), uids.end(), rng);
    std::vector<int64_t> lengths;
    for (const SeqId uid : uids) {
      const bool running_already = separate->GetSequence(uid) != nullptr;
      lengths.push_back(running_already ? (rng() % 8 == 0 ? 0 : 1) : 1 + rng() % 40);
    }
    running = uids;
    const bool padding = rng() % 2 == 0;
    const std::vector<TokenId> tokens = TokensFor(uids, lengths, step);

    ASSERT_OK(
        fused->ScheduleBatch({.uids = uids, .lengths = lengths}, tokens, *fused_batch, padding));
    ASSERT_OK(separate->Schedule({.uids = uids, .lengths = lengths}));
    separate_batch->Clear();
    size_t at = 0;
    for (size_t i = 0; i < uids.size(); ++i) {
      const std::span<const TokenId> mine(tokens.data() + at, static_cast<size_t>(lengths[i]));
      ASSERT_OK(separate_batch->InsertSequence(*separate->GetSequence(uids[i]), mine));
      at += static_cast<size_t>(lengths[i]);
    }
    ASSERT_OK(separate_batch->Finalize(padding));

    EXPECT_TRUE(fused_batch->finalized());
    EXPECT_EQ(fused_batch->current_sequences(), separate_batch->current_sequences());
    EXPECT_EQ(fused_batch->current_tokens(), separate_batch->current_tokens());
    EXPECT_EQ(fused_batch->padded_tokens(), separate_batch->padded_tokens());
    ASSERT_TRUE(ReadAll(*fused_batch, n_groups) == ReadAll(*separate_batch, n_groups));
    ASSERT_OK(fused->PostForward(*fused_batch));
    ASSERT_OK(separate->PostForward(*separate_batch));
    ASSERT_OK(fused->CheckInvariants());
  }
}

TEST(ScheduleBatchTest, BuildsTheBatchThatScheduleInsertAndFinalizeBuild) {
  ExpectScheduleBatchBuildsWhatInsertAndFinalizeBuild({Group(16), Group(32)});
}

// One cache group takes the batch writer's path with that group's arrays hoisted.
TEST(ScheduleBatchTest, BuildsTheBatchThatScheduleInsertAndFinalizeBuildForOneGroup) {
  ExpectScheduleBatchBuildsWhatInsertAndFinalizeBuild({Group(16)});
}

TEST(ScheduleBatchTest, APrefixHitGetsThePromptsTokensAtThePositionsItRuns) {
  StateManagerConfig config = Config();
  config.prefix_cache.enabled = true;
  auto manager = MakeManager(config, {Group(16)});
  auto batch = MakeBatch(*manager);
  std::vector<TokenId> prompt(40);
  std::iota(prompt.begin(), prompt.end(), 100);
  const std::vector<TokenId> tokens(prompt.begin(), prompt.end());
  // The first request computes the prompt and publishes its two full blocks.
  ASSERT_OK(manager->AddSequence(1, prompt));
  const std::vector<SeqId> first = {1};
  const std::vector<int64_t> length = {40};
  ASSERT_OK(manager->ScheduleBatch({.uids = first, .lengths = length}, tokens, *batch));
  ASSERT_OK(manager->PostForward(*batch));
  // The second hits 32 cached tokens: its batch entry is the last 8, at positions 32...
  ASSERT_OK(manager->AddSequence(2, prompt));
  const std::vector<SeqId> second = {2};
  ASSERT_OK(manager->ScheduleBatch({.uids = second, .lengths = length}, tokens, *batch));
  EXPECT_EQ(manager->GetSequence(2)->cached_prefix_tokens(), 32);
  EXPECT_THAT(ReadInt64(batch->input_ids()), ElementsAreArray(tokens.begin() + 32, tokens.end()));
  EXPECT_THAT(ReadInt32(batch->inflight_seq_descriptors()), ElementsAre(0, 8, 32, 0));
  EXPECT_THAT(ReadInt32(batch->kv_indptr()), ElementsAre(0, 3));
  ASSERT_OK(manager->PostForward(*batch));
  EXPECT_EQ(manager->GetSequence(2)->seen_tokens(), 40);

  // A third request's first chunk, 4 tokens passed from the prompt's start: it runs positions
  // 32..35 after the hit, and its batch entry holds the prompt's tokens there.
  ASSERT_OK(manager->AddSequence(3, prompt));
  const std::vector<SeqId> third = {3};
  const std::vector<int64_t> chunk = {4};
  const std::vector<TokenId> chunk_tokens(tokens.begin(), tokens.begin() + 4);
  ASSERT_OK(manager->ScheduleBatch({.uids = third, .lengths = chunk}, chunk_tokens, *batch));
  EXPECT_THAT(ReadInt32(batch->inflight_seq_descriptors()), ElementsAre(0, 4, 32, 0));
  EXPECT_THAT(ReadInt64(batch->input_ids()),
              ElementsAreArray(tokens.begin() + 32, tokens.begin() + 36));
  ASSERT_OK(manager->PostForward(*batch));
  ASSERT_OK(manager->CheckInvariants());
}

// A failed ScheduleBatch leaves the manager and the batch (finalized, from the step before) as
// they were.
TEST(ScheduleBatchTest, ErrorsChangeNeitherTheManagerNorTheBatch) {
  auto manager = MakeManager(Config(/*tracked=*/2048, /*batch=*/768, /*seq_count=*/512));
  auto batch = MakeBatch(*manager);
  const std::vector<SeqId> uids = {1, 2};
  const std::vector<int64_t> lengths = {70, 3};
  ASSERT_OK(manager->ScheduleBatch({.uids = uids, .lengths = lengths}, TokensFor(uids, lengths, 0),
                                   *batch));
  const Arrays before = ReadAll(*batch, 1);
  const std::vector<int32_t> free_before = manager->free_blocks();

  auto other = MakeManager(Config());
  auto foreign = MakeBatch(*other);
  const std::vector<SeqId> three = {3};
  const std::vector<int64_t> one = {1};
  const std::vector<TokenId> seven = {7};
  const Status wrong_batch =
      manager->ScheduleBatch({.uids = three, .lengths = one}, seven, *foreign);
  EXPECT_CODE(wrong_batch, StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_batch.message(), HasSubstr("another state manager"));
  const Status short_tokens = manager->ScheduleBatch({.uids = three, .lengths = one}, {}, *batch);
  EXPECT_CODE(short_tokens, StatusCode::kInvalidArgument);
  EXPECT_THAT(short_tokens.message(), HasSubstr("0 tokens given, but the lengths add up to 1"));
  const std::vector<SeqId> twice = {3, 3};
  const std::vector<int64_t> ones = {1, 1};
  const std::vector<TokenId> sevens = {7, 7};
  EXPECT_CODE(manager->ScheduleBatch({.uids = twice, .lengths = ones}, sevens, *batch),
              StatusCode::kInvalidArgument);
  // More blocks than the pool holds: ResourceExhausted naming the limit.
  const std::vector<int64_t> huge = {int64_t{kNumBlocks} * 64 + 1};
  SchedulingResult result = SchedulingResult::kSuccess;
  const Status full =
      manager->ScheduleBatch({.uids = three, .lengths = huge}, TokensFor(three, huge, 0), *batch,
                             /*padding=*/false, &result);
  EXPECT_CODE(full, StatusCode::kResourceExhausted);
  EXPECT_NE(result, SchedulingResult::kSuccess);

  EXPECT_EQ(manager->GetSequence(3), nullptr);
  EXPECT_EQ(manager->free_blocks(), free_before);
  EXPECT_EQ(manager->GetSequence(1)->in_flight_tokens(), 70);
  EXPECT_TRUE(batch->finalized());
  EXPECT_TRUE(ReadAll(*batch, 1) == before);
  ASSERT_OK(manager->PostForward(*batch));
  ASSERT_OK(manager->CheckInvariants());
}

TEST(ScheduleBatchTest, SteadyStateStepsMakeNoHeapAllocation) {
  auto manager = MakeManager(Config(), {Group(16)});
  auto batch = MakeBatch(*manager);
  std::vector<SeqId> uids(32);
  std::iota(uids.begin(), uids.end(), SeqId{1});
  const std::vector<int64_t> lengths(uids.size(), 1);
  const std::vector<TokenId> tokens(uids.size(), 42);
  ASSERT_OK(manager->ScheduleBatch({.uids = uids, .lengths = lengths}, tokens,
                                   *batch));  // creates the sequences
  ASSERT_OK(manager->PostForward(*batch));
  for (int step = 0; step < 40; ++step) {  // crosses block boundaries
    SCOPED_TRACE(step);
    const int64_t before = g_heap_allocations.load();
    ASSERT_OK(manager->ScheduleBatch({.uids = uids, .lengths = lengths}, tokens, *batch,
                                     /*padding=*/true));
    ASSERT_OK(manager->PostForward(*batch));
    EXPECT_EQ(g_heap_allocations.load() - before, 0);
  }
}

TEST(ScheduleBatchTest, CopiesTheBatchToTheDeviceMirror) {
  auto device = std::make_shared<FakeCudaDevice>();
  auto manager = MakeManagerOn(device);
  auto batch = MakeBatch(*manager);
  const std::vector<SeqId> uids = {1, 2};
  const std::vector<int64_t> lengths = {30, 5};
  ASSERT_OK(manager->ScheduleBatch({.uids = uids, .lengths = lengths}, TokensFor(uids, lengths, 0),
                                   *batch));
  ExpectMirrorEqual(batch->input_ids(), batch->input_ids(true));
  ExpectMirrorEqual(batch->kv_indices(), batch->kv_indices(0, true));
  ExpectMirrorEqual(batch->slot_mapping(), batch->slot_mapping(0, true));
  ASSERT_OK(manager->PostForward(*batch));

  // A failed copy: the forward is scheduled and the host arrays built, the batch unfinalized;
  // Finalize copies again.
  device->fail_copies = true;
  const std::vector<int64_t> ones = {1, 1};
  const std::vector<TokenId> next = {7, 8};
  EXPECT_CODE(manager->ScheduleBatch({.uids = uids, .lengths = ones}, next, *batch),
              StatusCode::kInternal);
  EXPECT_FALSE(batch->finalized());
  EXPECT_EQ(manager->GetSequence(1)->in_flight_tokens(), 1);
  device->fail_copies = false;
  ASSERT_OK(batch->Finalize());
  ExpectMirrorEqual(batch->input_ids(), batch->input_ids(true));
  EXPECT_THAT(ReadInt64(batch->input_ids()), ElementsAre(7, 8));
  ASSERT_OK(manager->PostForward(*batch));
  ASSERT_OK(manager->CheckInvariants());
}

// Every array of every group on the device equals the host's, and the device kv_ptrs point at
// the device rows.
void ExpectWholeMirrorEqual(const RaggedBatch& b, int n_groups) {
  ExpectMirrorEqual(b.input_ids(), b.input_ids(true));
  ExpectMirrorEqual(b.tokens_to_seq(), b.tokens_to_seq(true));
  ExpectMirrorEqual(b.inflight_seq_descriptors(), b.inflight_seq_descriptors(true));
  ExpectMirrorEqual(b.batch_metadata(), b.batch_metadata(true));
  for (int g = 0; g < n_groups; ++g) {
    SCOPED_TRACE(g);
    ExpectMirrorEqual(b.block_tables(g), b.block_tables(g, true));
    ExpectMirrorEqual(b.kv_indptr(g), b.kv_indptr(g, true));
    ExpectMirrorEqual(b.kv_indices(g), b.kv_indices(g, true));
    ExpectMirrorEqual(b.kv_last_page_len(g), b.kv_last_page_len(g, true));
    ExpectMirrorEqual(b.slot_mapping(g), b.slot_mapping(g, true));
    Result<TensorView> tables = b.block_tables(g, true);
    Result<TensorView> ptrs = b.kv_ptrs(g, true);
    ASSERT_OK(tables);
    ASSERT_OK(ptrs);
    const auto* rows = static_cast<const BlockId*>(tables->data);
    const auto* row_ptrs = static_cast<const int64_t*>(ptrs->data);
    for (int64_t i = 0; i < ptrs->numel(); ++i) {
      EXPECT_EQ(row_ptrs[i], reinterpret_cast<intptr_t>(rows + i * tables->shape[1]));
    }
  }
}

// Growing, shrinking and empty batches over two cache groups, through ScheduleBatch and through
// InsertSequence + Finalize, padded and not: after every step the whole mirror is the host's.
TEST(RaggedBatchMirrorTest, MirrorEqualsTheHostOverGrowingAndShrinkingBatchesOfTwoGroups) {
  auto device = std::make_shared<FakeCudaDevice>();
  auto manager = MakeManagerOn(device, Config(), {Group(16, 8), Group(32, 4)});
  auto batch = MakeBatch(*manager);
  const std::vector<std::vector<SeqId>> steps = {
      {1}, {1, 2, 3}, {1, 2, 3, 4, 5, 6}, {2, 5}, {}, {6, 5, 4, 3, 2, 1, 7}, {7}, {1, 7}};
  for (size_t step = 0; step < steps.size(); ++step) {
    SCOPED_TRACE(step);
    const std::vector<SeqId>& uids = steps[step];
    std::vector<int64_t> lengths;
    for (SeqId uid : uids) {
      const Sequence* seq = manager->GetSequence(uid);
      lengths.push_back(seq == nullptr ? 5 + uid : 1);  // a prompt, then decode steps
    }
    const std::vector<TokenId> tokens = TokensFor(uids, lengths, static_cast<int>(step));
    const bool padding = step % 3 != 0;
    if (step % 2 == 0) {
      ASSERT_OK(
          manager->ScheduleBatch({.uids = uids, .lengths = lengths}, tokens, *batch, padding));
    } else {
      batch->Clear();
      ASSERT_OK(manager->Schedule({.uids = uids, .lengths = lengths}));
      size_t at = 0;
      for (size_t i = 0; i < uids.size(); ++i) {
        const std::span<const TokenId> mine(tokens.data() + at, static_cast<size_t>(lengths[i]));
        ASSERT_OK(batch->InsertSequence(*manager->GetSequence(uids[i]), mine));
        at += static_cast<size_t>(lengths[i]);
      }
      ASSERT_OK(batch->Finalize(padding));
    }
    ASSERT_EQ(batch->current_sequences(), std::ssize(uids));
    ExpectWholeMirrorEqual(*batch, 2);
    ASSERT_OK(manager->PostForward(*batch));
  }
}

// max_ragged_sequence_count 8 and 8 decoding sequences: the used parts lie close together, and
// one copy per step carries them.
TEST(RaggedBatchMirrorTest, AStepNearTheSequenceLimitIsOneCopy) {
  auto device = std::make_shared<FakeCudaDevice>();
  auto manager = MakeManagerOn(device, Config(/*tracked=*/16, /*batch=*/64, /*seq_count=*/8));
  auto batch = MakeBatch(*manager);
  std::vector<SeqId> uids(8);
  std::iota(uids.begin(), uids.end(), SeqId{1});
  const std::vector<int64_t> ones(uids.size(), 1);
  for (int step = 0; step < 20; ++step) {  // crosses block boundaries
    SCOPED_TRACE(step);
    const int before = device->copies;
    ASSERT_OK(manager->ScheduleBatch({.uids = uids, .lengths = ones}, TokensFor(uids, ones, step),
                                     *batch));
    EXPECT_EQ(device->copies - before, 1);
    ExpectWholeMirrorEqual(*batch, 1);
    ASSERT_OK(manager->PostForward(*batch));
  }
}

// One short sequence in a batch sized for 512 of 64 blocks: the unused rows of block_tables
// (128 KiB) are not carried; the step is two copies of a few KiB instead.
TEST(RaggedBatchMirrorTest, LargeUnusedCapacityIsNotCopied) {
  auto device = std::make_shared<FakeCudaDevice>();
  auto manager = MakeManagerOn(device, Config(), {Group(16, 64)});
  auto batch = MakeBatch(*manager);
  const int copies = device->copies;
  const int64_t bytes = device->copied_bytes;
  ASSERT_OK(batch->InsertSequence(*Schedule(*manager, 1, 3), RandomTokens(3, 25)));
  ASSERT_OK(batch->Finalize());
  EXPECT_EQ(device->copies - copies, 2);
  EXPECT_LT(device->copied_bytes - bytes, 64 << 10);
  ExpectWholeMirrorEqual(*batch, 1);
}

}  // namespace
}  // namespace blockkv
