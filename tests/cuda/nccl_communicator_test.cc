// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator over communicators made with ncclCommInitAll in this one process: one rank
// per GPU, each driven by its own thread (an NCCL collective blocks until every rank enters it).
#include "blockkv/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "blockkv/kv_cache.h"
#include "cuda_test_util.h"

namespace blockkv {
namespace {

// `n` NCCL ranks on GPUs 0..n-1, each with its own non-blocking stream; destroyed with it.
class NcclGroup {
 public:
  explicit NcclGroup(int n) : comms_(n), streams_(n) {
    std::vector<int> devices(n);
    for (int i = 0; i < n; ++i) devices[i] = i;
    ok_ = ncclCommInitAll(comms_.data(), n, devices.data()) == ncclSuccess;
    for (int i = 0; i < n && ok_; ++i) {
      ok_ = cudaSetDevice(i) == cudaSuccess &&
            cudaStreamCreateWithFlags(&streams_[i], cudaStreamNonBlocking) == cudaSuccess;
    }
  }
  ~NcclGroup() {
    for (size_t i = 0; i < comms_.size(); ++i) {
      if (streams_[i] != nullptr) cudaStreamDestroy(streams_[i]);
      if (comms_[i] != nullptr) ncclCommDestroy(comms_[i]);
    }
  }
  bool ok() const { return ok_; }
  int size() const { return static_cast<int>(comms_.size()); }
  ncclComm_t comm(int i) const { return comms_[i]; }
  cudaStream_t stream(int i) const { return streams_[i]; }

 private:
  std::vector<ncclComm_t> comms_;
  std::vector<cudaStream_t> streams_;
  bool ok_ = false;
};

// Runs body(rank) on one thread per rank, each with its GPU current, and waits for all.
template <class Body>
void OnEveryRank(int n, Body body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([r, &body] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      body(r);
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(NcclCommunicatorTest, NullCommIsInvalidArgument) {
  Result<std::unique_ptr<NcclCommunicator>> comm = NcclCommunicator::Create(nullptr, nullptr);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
}

TEST(NcclCommunicatorTest, WorldOfOneReducesToItsOwnValue) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  NcclGroup group(1);
  ASSERT_TRUE(group.ok());
  auto comm = NcclCommunicator::Create(group.comm(0), group.stream(0));
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->world_size(), 1);
  EXPECT_EQ((*comm)->rank(), 0);
  EXPECT_EQ((*comm)->device(), 0);
  EXPECT_EQ(*(*comm)->AllReduceMin(int64_t{1} << 40), int64_t{1} << 40);
  EXPECT_EQ(*(*comm)->AllReduceMin(-5), -5);
  EXPECT_TRUE((*comm)->Barrier().ok());
}

TEST(NcclCommunicatorTest, AllReduceMinAcrossGpus) {
  BLOCKKV_SKIP_WITHOUT_GPUS(2);
  const int n = std::min(blockkv_test::GpuCount(), 8);
  NcclGroup group(n);
  ASSERT_TRUE(group.ok());
  std::vector<int64_t> results(n, 0);
  OnEveryRank(n, [&](int r) {
    auto comm = NcclCommunicator::Create(group.comm(r), group.stream(r));
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_EQ((*comm)->rank(), r);
    EXPECT_EQ((*comm)->world_size(), n);
    ASSERT_TRUE((*comm)->Barrier().ok());
    Result<int64_t> min = (*comm)->AllReduceMin((int64_t{1} << 40) - 3 * r);
    ASSERT_TRUE(min.ok()) << min.status();
    results[r] = *min;
  });
  for (int64_t result : results) EXPECT_EQ(result, (int64_t{1} << 40) - 3 * (n - 1));
}

// The point of it all: tensor-parallel ranks on several GPUs agree on one num_blocks.
TEST(NcclCommunicatorTest, KVCacheRanksAgreeOnNumBlocks) {
  BLOCKKV_SKIP_WITHOUT_GPUS(2);
  const int n = std::min(blockkv_test::GpuCount(), 8);
  NcclGroup group(n);
  ASSERT_TRUE(group.ok());
  const KVCacheConfig config{.block_size = 16, .cache_shape = {4, 8, 128}};
  std::vector<int32_t> num_blocks(n, -1);
  OnEveryRank(n, [&](int r) {
    auto comm = NcclCommunicator::Create(group.comm(r), group.stream(r));
    ASSERT_TRUE(comm.ok()) << comm.status();
    Result<std::shared_ptr<Device>> gpu = CudaDevice(r);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    // Rank r may use (r + 1) · 64 MiB: the smallest is rank 0's.
    const int64_t usable = int64_t{r + 1} << 26;
    const MemoryConfig memory{.mode = AllocationMode::kReserve,
                              .size = (*gpu)->available_memory() - usable};
    auto cache = BlockedKVCache::Create({config}, memory, *gpu, comm->get());
    ASSERT_TRUE(cache.ok()) << cache.status();
    num_blocks[r] = (*cache)->num_blocks();
  });
  const int64_t rank0_blocks = (int64_t{1} << 26) / *config.bytes_per_block();
  for (int32_t blocks : num_blocks) {
    EXPECT_EQ(blocks, num_blocks[0]);
    EXPECT_NEAR(blocks, static_cast<double>(rank0_blocks),
                static_cast<double>(rank0_blocks / 10 + 1));
  }
}

}  // namespace
}  // namespace blockkv
