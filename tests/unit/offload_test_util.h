// SPDX-License-Identifier: Apache-2.0
// What the OffloadStore tests share: a host cache of several groups, block contents read and
// written through GetCache (independently of the store's own layout arithmetic), a snapshot of
// every count a failed call must leave alone, a temporary directory for the disk tier, and
// FaultyFile, a BlockFile wrapper that injects errors, short writes, corrupt reads and stalls.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/kv_cache.h"
#include "blockkv/offload.h"
#include "blockkv/status.h"

namespace blockkv_test {

using Bytes = std::vector<std::byte>;

// Group 0: 2 layers, 4 tokens, 2 heads of 8, fp16: 2·4·2·2·8·2 = 512 bytes per block.
inline blockkv::KVCacheConfig SmallGroup() {
  return {.block_size = 4, .cache_shape = {2, 2, 8}, .cache_dtype = blockkv::DType::kFloat16};
}
// Group 1: 3 layers, 2 tokens, 1 head of 12, fp32: 3·2·2·1·12·4 = 576 bytes per block.
inline blockkv::KVCacheConfig OddGroup() {
  return {.block_size = 2, .cache_shape = {3, 1, 12}, .cache_dtype = blockkv::DType::kFloat32};
}
inline constexpr int64_t kSmallBlockBytes = 512;
inline constexpr int64_t kOddBlockBytes = 576;

// A CpuDevice cache of `num_blocks` blocks in every group (ALLOCATE mode).
inline std::unique_ptr<blockkv::BlockedKVCache> MakeCache(
    std::vector<blockkv::KVCacheConfig> configs, int32_t num_blocks,
    std::shared_ptr<blockkv::Device> device = blockkv::CpuDevice()) {
  auto cache = blockkv::BlockedKVCache::Create(
      std::move(configs),
      blockkv::MemoryConfig{.mode = blockkv::AllocationMode::kAllocate, .size = num_blocks},
      std::move(device));
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? std::move(*cache) : nullptr;
}

// Where layer `layer` of block `block` of `group` starts, and how long it is, from GetCache.
inline std::span<std::byte> LayerChunk(const blockkv::BlockedKVCache& cache, int group,
                                       int64_t layer, blockkv::BlockId block) {
  const blockkv::Result<blockkv::TensorView> view = cache.GetCache(layer, group);
  EXPECT_TRUE(view.ok()) << view.status();
  const int64_t chunk = view->stride(0) * static_cast<int64_t>(blockkv::ElementSize(view->dtype));
  return {static_cast<std::byte*>(view->data) + block * chunk, static_cast<size_t>(chunk)};
}

// Every layer of one block, back to back.
inline Bytes ReadBlock(const blockkv::BlockedKVCache& cache, int group, blockkv::BlockId block) {
  Bytes out;
  for (int64_t l = 0; l < cache.config(group).num_caches(); ++l) {
    const std::span<std::byte> chunk = LayerChunk(cache, group, l, block);
    out.insert(out.end(), chunk.begin(), chunk.end());
  }
  return out;
}

inline void WriteBlock(blockkv::BlockedKVCache& cache, int group, blockkv::BlockId block,
                       const Bytes& bytes) {
  size_t at = 0;
  for (int64_t l = 0; l < cache.config(group).num_caches(); ++l) {
    const std::span<std::byte> chunk = LayerChunk(cache, group, l, block);
    ASSERT_LE(at + chunk.size(), bytes.size());
    std::memcpy(chunk.data(), bytes.data() + at, chunk.size());
    at += chunk.size();
  }
  ASSERT_EQ(at, bytes.size());
}

inline Bytes RandomBytes(std::mt19937_64& rng, int64_t n) {
  Bytes out(static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); i += 8) {
    const uint64_t word = rng();
    std::memcpy(out.data() + i, &word, std::min<size_t>(8, out.size() - i));
  }
  return out;
}

// Fills every layer of `block` with random bytes and returns them.
inline Bytes FillRandom(blockkv::BlockedKVCache& cache, int group, blockkv::BlockId block,
                        std::mt19937_64& rng) {
  const blockkv::Result<int64_t> bytes = cache.config(group).bytes_per_block();
  Bytes data = RandomBytes(rng, *bytes);
  WriteBlock(cache, group, block, data);
  return data;
}

// Every count a failed call must leave as it was.
struct StoreState {
  std::vector<int32_t> cache_free;
  int64_t live_handles = 0;
  std::vector<int32_t> free_host;
  std::vector<int32_t> free_disk;
  blockkv::OffloadStats stats;

  static StoreState Of(const blockkv::BlockedKVCache& cache, const blockkv::OffloadStore& store) {
    StoreState s;
    s.cache_free = cache.free_blocks();
    s.live_handles = store.live_handles();
    for (int g = 0; g < store.num_groups(); ++g) {
      s.free_host.push_back(store.free_host_blocks(g));
      s.free_disk.push_back(store.free_disk_blocks(g));
    }
    s.stats = store.stats();
    return s;
  }
  friend bool operator==(const StoreState& a, const StoreState& b) {
    return a.cache_free == b.cache_free && a.live_handles == b.live_handles &&
           a.free_host == b.free_host && a.free_disk == b.free_disk &&
           a.stats.offloaded_blocks == b.stats.offloaded_blocks &&
           a.stats.restored_blocks == b.stats.restored_blocks &&
           a.stats.spilled_blocks == b.stats.spilled_blocks &&
           a.stats.failed_copies == b.stats.failed_copies &&
           a.stats.bytes_written == b.stats.bytes_written &&
           a.stats.bytes_read == b.stats.bytes_read;
  }
  friend std::ostream& operator<<(std::ostream& os, const StoreState& s) {
    os << "{cache_free";
    for (int32_t f : s.cache_free) os << " " << f;
    os << ", live " << s.live_handles << ", host";
    for (int32_t f : s.free_host) os << " " << f;
    os << ", disk";
    for (int32_t f : s.free_disk) os << " " << f;
    return os << ", offloaded " << s.stats.offloaded_blocks << ", restored "
              << s.stats.restored_blocks << ", spilled " << s.stats.spilled_blocks << ", failed "
              << s.stats.failed_copies << "}";
  }
};

// A directory of its own under the test temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "blockkv_offload_XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
    EXPECT_FALSE(path_.empty()) << "mkdtemp " << pattern << ": " << std::strerror(errno);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// What FaultyFile does to the calls it sees. Shared between the test (scheduling) thread and the
// store's worker, so every field is read and written under `mu`.
struct FaultPlan {
  std::mutex mu;
  std::condition_variable cv;
  // Writes: after `writes_ok` more good writes, the next `failing_writes` fail; a failing write
  // first writes `short_write_bytes` of its data (a write that fails part-way), then returns
  // `write_error`. A negative writes_ok never fails.
  int64_t writes_ok = -1;
  int64_t failing_writes = 0;
  size_t short_write_bytes = 0;
  blockkv::Status write_error =
      blockkv::ResourceExhaustedError("injected: No space left on device (errno 28)");
  // Reads: the next `flip_reads` reads flip one byte of what they read; the next
  // `truncated_reads` return only half their bytes (kDataLoss, as a file cut short).
  int64_t flip_reads = 0;
  int64_t truncated_reads = 0;
  // While `stalled`, every call waits (to hold a job in flight); `entered` counts calls that
  // reached the file.
  bool stalled = false;
  int64_t entered = 0;
  // Every write's offset, in order.
  std::vector<int64_t> write_offsets;

  void Stall() {
    std::lock_guard lock(mu);
    stalled = true;
  }
  void Release() {
    {
      std::lock_guard lock(mu);
      stalled = false;
    }
    cv.notify_all();
  }
  // Waits until `n` calls have reached the file in all.
  void AwaitEntered(int64_t n) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return entered >= n; });
  }
};

class FaultyFile final : public blockkv::BlockFile {
 public:
  FaultyFile(std::unique_ptr<blockkv::BlockFile> file, std::shared_ptr<FaultPlan> plan)
      : file_(std::move(file)), plan_(std::move(plan)) {}

  blockkv::Status Write(int64_t offset, std::span<const std::byte> data) override {
    size_t short_bytes = 0;
    blockkv::Status error;
    bool fail = false;
    {
      std::unique_lock lock(plan_->mu);
      Enter(lock);
      plan_->write_offsets.push_back(offset);
      if (plan_->writes_ok == 0 && plan_->failing_writes > 0) {
        --plan_->failing_writes;
        fail = true;
        short_bytes = std::min(plan_->short_write_bytes, data.size());
        error = plan_->write_error;
      } else if (plan_->writes_ok > 0) {
        --plan_->writes_ok;
      }
    }
    if (!fail) return file_->Write(offset, data);
    if (short_bytes > 0) {
      const blockkv::Status s = file_->Write(offset, data.first(short_bytes));
      if (!s.ok()) return s;
    }
    return error;
  }

  blockkv::Status Read(int64_t offset, std::span<std::byte> data) override {
    bool flip = false;
    bool truncated = false;
    {
      std::unique_lock lock(plan_->mu);
      Enter(lock);
      if (plan_->flip_reads > 0) {
        --plan_->flip_reads;
        flip = true;
      } else if (plan_->truncated_reads > 0) {
        --plan_->truncated_reads;
        truncated = true;
      }
    }
    if (truncated) {
      const blockkv::Status s = file_->Read(offset, data.first(data.size() / 2));
      if (!s.ok()) return s;
      return blockkv::DataLossError("injected: read ended after half the bytes");
    }
    blockkv::Status s = file_->Read(offset, data);
    if (s.ok() && flip && !data.empty()) data[data.size() / 3] ^= std::byte{0x10};
    return s;
  }

 private:
  void Enter(std::unique_lock<std::mutex>& lock) {
    ++plan_->entered;
    plan_->cv.notify_all();
    plan_->cv.wait(lock, [&] { return !plan_->stalled; });
  }

  std::unique_ptr<blockkv::BlockFile> file_;
  std::shared_ptr<FaultPlan> plan_;
};

// An opener that wraps the POSIX file at the given path in a FaultyFile driven by `plan`.
inline blockkv::BlockFileOpener FaultyOpener(std::shared_ptr<FaultPlan> plan) {
  return [plan](const std::string& path) -> blockkv::Result<std::unique_ptr<blockkv::BlockFile>> {
    blockkv::Result<std::unique_ptr<blockkv::BlockFile>> file = blockkv::OpenPosixBlockFile(path);
    if (!file.ok()) return file.status();
    return std::unique_ptr<blockkv::BlockFile>(
        std::make_unique<FaultyFile>(std::move(*file), plan));
  };
}

}  // namespace blockkv_test
