// SPDX-License-Identifier: Apache-2.0
// OffloadStore with a failing disk tier: nothing is ever lost. Writes that fail (ENOSPC, a write
// cut short part-way) keep the device blocks, and a Restore hands the same
// blocks back with their bytes; a failed spill keeps the handle on the host; reads that come back
// corrupt (a flipped byte, a short read, a file cut short or changed behind the store's back) are
// kDataLoss naming the handle and slot, never wrong KV, and keep the handles.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "blockkv/offload.h"
#include "unit/offload_test_util.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using ::blockkv_test::Bytes;
using ::blockkv_test::FaultPlan;
using ::blockkv_test::FillRandom;
using ::blockkv_test::ReadBlock;
using ::blockkv_test::StoreState;
using ::blockkv_test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int32_t kBlocks = 16;

class OffloadFaultTest : public ::testing::Test {
 protected:
  void SetUp() override { Open({.host_blocks = 4, .disk_blocks = 4}); }

  // (Re)creates the cache and a store whose disk file goes through plan_ (config's path and
  // opener are filled in here unless given).
  void Open(OffloadConfig config) {
    store_.reset();
    cache_ = blockkv_test::MakeCache({blockkv_test::SmallGroup()}, kBlocks);
    ASSERT_NE(cache_, nullptr);
    if (config.disk_path.empty()) config.disk_path = dir_.File("tier");
    if (!config.open_file) config.open_file = blockkv_test::FaultyOpener(plan_);
    Result<std::unique_ptr<OffloadStore>> store = OffloadStore::Create(cache_.get(), config);
    ASSERT_OK(store);
    store_ = std::move(*store);
  }

  // Reserves and fills `n` blocks.
  void Fill(int32_t n) {
    Result<std::vector<BlockId>> blocks = cache_->Reserve(n);
    ASSERT_OK(blocks);
    blocks_ = *blocks;
    bytes_.clear();
    for (BlockId b : blocks_) bytes_.push_back(FillRandom(*cache_, 0, b, rng_));
  }

  // Offloads blocks_ to `tier` and waits: the ticket's status.
  Status OffloadAll(Tier tier) {
    handles_.assign(blocks_.size(), OffloadHandle{});
    Result<OffloadTicket> ticket = store_->Offload(blocks_, 0, handles_, tier);
    if (!ticket.ok()) return ticket.status();
    return ticket->Wait();
  }

  // After a failed offload: every handle refers to its own device block, still allocated and
  // holding its bytes, and no slot is used.
  void ExpectKeptOnDevice() {
    for (const OffloadHandle& h : handles_) {
      Result<Tier> where = store_->tier(h);
      ASSERT_OK(where);
      EXPECT_EQ(*where, Tier::kDevice);
    }
    EXPECT_EQ(cache_->free_blocks()[0], kBlocks - static_cast<int32_t>(blocks_.size()));
    EXPECT_EQ(store_->free_disk_blocks(0), store_->disk_blocks());
    EXPECT_EQ(store_->free_host_blocks(0), store_->host_blocks());
    for (size_t i = 0; i < blocks_.size(); ++i) {
      EXPECT_TRUE(ReadBlock(*cache_, 0, blocks_[i]) == bytes_[i]) << "block " << blocks_[i];
      EXPECT_FALSE(store_->busy(0, blocks_[i]));
    }
    EXPECT_OK(store_->CheckInvariants());
    EXPECT_OK(cache_->CheckInvariants());
  }

  // Restores handles_ and checks they come back as the same blocks, without a copy.
  void ExpectRestoredInPlace() {
    std::vector<BlockId> out(handles_.size(), kNoBlock);
    Result<OffloadTicket> ticket = store_->Restore(handles_, 0, out);
    ASSERT_OK(ticket);
    EXPECT_TRUE(ticket->Poll());  // nothing to copy
    ASSERT_OK(ticket->Wait());
    EXPECT_EQ(out, blocks_);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      EXPECT_TRUE(ReadBlock(*cache_, 0, out[i]) == bytes_[i]);
    }
    EXPECT_EQ(store_->live_handles(), 0);
    EXPECT_EQ(cache_->free_blocks()[0], kBlocks - static_cast<int32_t>(blocks_.size()));
    EXPECT_OK(store_->CheckInvariants());
  }

  // Restores handles_ into fresh blocks and checks every byte.
  void ExpectRestoredExactly() {
    std::vector<BlockId> out(handles_.size(), kNoBlock);
    Result<OffloadTicket> ticket = store_->Restore(handles_, 0, out);
    ASSERT_OK(ticket);
    ASSERT_OK(ticket->Wait());
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_TRUE(ReadBlock(*cache_, 0, out[i]) == bytes_[i]) << "handle " << i;
    }
    EXPECT_EQ(store_->live_handles(), 0);
    EXPECT_OK(store_->CheckInvariants());
  }

  std::mt19937_64 rng_{21};
  TempDir dir_;
  std::shared_ptr<FaultPlan> plan_ = std::make_shared<FaultPlan>();
  std::unique_ptr<BlockedKVCache> cache_;
  std::unique_ptr<OffloadStore> store_;
  std::vector<BlockId> blocks_;
  std::vector<Bytes> bytes_;
  std::vector<OffloadHandle> handles_;
};

// --- writes that fail: the device blocks stay --------------------------------------------------

TEST_F(OffloadFaultTest, DiskFullKeepsTheDeviceBlocksAndRestoreHandsThemBack) {
  Fill(3);
  {
    std::lock_guard lock(plan_->mu);
    plan_->writes_ok = 1;  // the second block's write fails: the whole offload fails
    plan_->failing_writes = 1;
  }
  const Status s = OffloadAll(Tier::kDisk);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("No space left on device"), HasSubstr("handle"),
                                 HasSubstr("disk slot")));
  ExpectKeptOnDevice();
  EXPECT_EQ(store_->stats().failed_copies, 1);
  EXPECT_EQ(store_->stats().offloaded_blocks, 0);
  EXPECT_EQ(store_->live_handles(), 3);
  ExpectRestoredInPlace();
  EXPECT_EQ(store_->stats().restored_blocks, 3);
}

TEST_F(OffloadFaultTest, AWriteThatFailsPartWayLosesNothing) {
  Fill(2);
  {
    std::lock_guard lock(plan_->mu);
    plan_->writes_ok = 0;
    plan_->failing_writes = 1;
    plan_->short_write_bytes = 300;  // part of the block reaches the file, then EIO
    plan_->write_error = UnavailableError("injected: Input/output error (errno 5)");
  }
  const Status s = OffloadAll(Tier::kDisk);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  ExpectKeptOnDevice();
  // The slot the short write touched is free again and is simply overwritten by the next
  // offload, whose bytes and checksum are its own.
  ExpectRestoredInPlace();
  Fill(2);
  ASSERT_OK(OffloadAll(Tier::kDisk));
  EXPECT_EQ(cache_->free_blocks()[0], kBlocks - 2);  // the first two are the caller's again
  ExpectRestoredExactly();
}

TEST_F(OffloadFaultTest, AFailedOffloadsHandleCanBeDroppedOrSpilledAndKeepsItsBlock) {
  Fill(2);
  {
    std::lock_guard lock(plan_->mu);
    plan_->writes_ok = 0;
    plan_->failing_writes = 2;
  }
  ASSERT_CODE(OffloadAll(Tier::kDisk), StatusCode::kResourceExhausted);
  ExpectKeptOnDevice();
  // Spill leaves a device handle where it is.
  Result<OffloadTicket> spill = store_->Spill(handles_);
  ASSERT_OK(spill);
  ASSERT_OK(spill->Wait());
  EXPECT_EQ(*store_->tier(handles_[0]), Tier::kDevice);
  // Drop gives its kept block back to the cache.
  ASSERT_OK(store_->Drop(std::span(&handles_[0], 1)));
  EXPECT_EQ(cache_->free_blocks()[0], kBlocks - 1);
  EXPECT_EQ(store_->live_handles(), 1);
  EXPECT_OK(store_->CheckInvariants());
  // And the destructor gives back the other.
  store_.reset();
  EXPECT_EQ(cache_->free_blocks()[0], kBlocks);
  EXPECT_OK(cache_->CheckInvariants());
}

TEST_F(OffloadFaultTest, ARestoreOfDeviceAndDiskHandlesCopiesOnlyTheDiskOnes) {
  Fill(2);
  {
    std::lock_guard lock(plan_->mu);
    plan_->writes_ok = 0;
    plan_->failing_writes = 1;
  }
  ASSERT_CODE(OffloadAll(Tier::kDisk), StatusCode::kResourceExhausted);
  const std::vector<BlockId> kept = blocks_;
  const std::vector<Bytes> kept_bytes = bytes_;
  const std::vector<OffloadHandle> kept_handles = handles_;
  Fill(2);
  ASSERT_OK(OffloadAll(Tier::kDisk));
  const std::vector<OffloadHandle> mixed{handles_[0], kept_handles[1], handles_[1],
                                         kept_handles[0]};
  std::vector<BlockId> out(4, kNoBlock);
  Result<OffloadTicket> ticket = store_->Restore(mixed, 0, out);
  ASSERT_OK(ticket);
  ASSERT_OK(ticket->Wait());
  EXPECT_EQ(out[1], kept[1]);
  EXPECT_EQ(out[3], kept[0]);
  EXPECT_TRUE(ReadBlock(*cache_, 0, out[0]) == bytes_[0]);
  EXPECT_TRUE(ReadBlock(*cache_, 0, out[1]) == kept_bytes[1]);
  EXPECT_TRUE(ReadBlock(*cache_, 0, out[2]) == bytes_[1]);
  EXPECT_TRUE(ReadBlock(*cache_, 0, out[3]) == kept_bytes[0]);
  EXPECT_EQ(cache_->free_blocks()[0], kBlocks - 4);
  EXPECT_EQ(store_->live_handles(), 0);
  EXPECT_OK(store_->CheckInvariants());
}

TEST_F(OffloadFaultTest, ASpillThatFailsKeepsTheHandleOnTheHost) {
  Fill(3);
  ASSERT_OK(OffloadAll(Tier::kHost));
  {
    std::lock_guard lock(plan_->mu);
    plan_->writes_ok = 2;
    plan_->failing_writes = 1;
  }
  Result<OffloadTicket> spill = store_->Spill(handles_);
  ASSERT_OK(spill);
  EXPECT_CODE(spill->Wait(), StatusCode::kResourceExhausted);
  for (const OffloadHandle& h : handles_) EXPECT_EQ(*store_->tier(h), Tier::kHost);
  EXPECT_EQ(store_->free_disk_blocks(0), 4);
  EXPECT_EQ(store_->free_host_blocks(0), 1);
  EXPECT_EQ(store_->stats().spilled_blocks, 0);
  EXPECT_EQ(store_->stats().failed_copies, 1);
  EXPECT_OK(store_->CheckInvariants());
  ExpectRestoredExactly();
}

// A file that does not keep what is written to it is refused when the tier opens, naming it:
// before, /dev/null accepted offloads and freed the device blocks, and the loss showed only at
// restore. /dev/full's probe write fails with ENOSPC; /dev/null reads back nothing, /dev/zero
// zeros. Device nodes are left in place.
TEST(DiskTierProbeTest, AFileThatDoesNotReadBackIsRefusedWhenTheTierOpens) {
  struct Case {
    const char* path;
    StatusCode code;
    const char* why;
  };
  for (const Case& c : {Case{"/dev/null", StatusCode::kInvalidArgument, "does not read back"},
                        Case{"/dev/zero", StatusCode::kInvalidArgument, "does not read back"},
                        Case{"/dev/full", StatusCode::kResourceExhausted, "errno 28"}}) {
    struct stat st {};
    if (::stat(c.path, &st) != 0 || !S_ISCHR(st.st_mode)) continue;
    const Result<std::unique_ptr<BlockFile>> file = OpenPosixBlockFile(c.path);
    if (file.status().code() == StatusCode::kUnavailable) continue;  // cannot be opened here
    EXPECT_CODE(file, c.code) << c.path;
    EXPECT_THAT(file.status().message(), AllOf(HasSubstr(c.path), HasSubstr(c.why)));
    // Through the store: Create fails the same way and the cache is as it was.
    auto cache = blockkv_test::MakeCache({blockkv_test::SmallGroup()}, kBlocks);
    ASSERT_NE(cache, nullptr);
    const Result<std::unique_ptr<OffloadStore>> store = OffloadStore::Create(
        cache.get(), {.host_blocks = 4, .disk_path = c.path, .disk_blocks = 4});
    EXPECT_CODE(store, c.code) << c.path;
    EXPECT_THAT(store.status().message(), HasSubstr(c.path));
    EXPECT_EQ(cache->free_blocks()[0], kBlocks);
    ASSERT_EQ(::stat(c.path, &st), 0) << c.path << " was removed: " << std::strerror(errno);
    EXPECT_TRUE(S_ISCHR(st.st_mode));
  }
}

// A file the process may not open for writing (root may write anything but a read-only sysfs
// attribute, which /sys always has) is PERMISSION_DENIED, not NOT_FOUND or UNAVAILABLE.
TEST(PosixBlockFileTest, AFileThatMayNotBeWrittenIsPermissionDenied) {
  const std::string path = "/sys/devices/system/cpu/online";
  const Result<std::unique_ptr<BlockFile>> file = OpenPosixBlockFile(path);
  EXPECT_CODE(file, StatusCode::kPermissionDenied);
  EXPECT_THAT(file.status().message(), HasSubstr(path));
  auto cache = blockkv_test::MakeCache({blockkv_test::SmallGroup()}, kBlocks);
  ASSERT_NE(cache, nullptr);
  const Result<std::unique_ptr<OffloadStore>> store =
      OffloadStore::Create(cache.get(), {.host_blocks = 4, .disk_path = path, .disk_blocks = 4});
  EXPECT_CODE(store, StatusCode::kPermissionDenied);
  EXPECT_EQ(cache->free_blocks()[0], kBlocks);
}

// The POSIX file removes a regular file it made, and nothing else (regression: its destructor
// unlinked whatever path it was given, /dev/full included).
TEST(PosixBlockFileTest, RemovesOnlyARegularFile) {
  TempDir dir;
  const std::string regular = dir.File("tier");
  {
    Result<std::unique_ptr<BlockFile>> file = OpenPosixBlockFile(regular);
    ASSERT_OK(file);
    EXPECT_EQ(::access(regular.c_str(), F_OK), 0);
  }
  EXPECT_NE(::access(regular.c_str(), F_OK), 0);
  const std::string fifo = dir.File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  {
    // A fifo cannot hold blocks (pwrite: ESPIPE): its probe fails and the file it opened is
    // destroyed, which must not remove the fifo.
    Result<std::unique_ptr<BlockFile>> file = OpenPosixBlockFile(fifo);
    EXPECT_CODE(file, StatusCode::kUnavailable);
    EXPECT_THAT(file.status().message(), HasSubstr(fifo));
  }
  EXPECT_EQ(::access(fifo.c_str(), F_OK), 0) << "the fifo was removed";
}

TEST(PosixBlockFileTest, ReadsWhatItWroteAndAShortFileIsDataLoss) {
  TempDir dir;
  Result<std::unique_ptr<BlockFile>> file = OpenPosixBlockFile(dir.File("tier"));
  ASSERT_OK(file);
  std::mt19937_64 rng(22);
  const Bytes data = blockkv_test::RandomBytes(rng, 5000);
  ASSERT_OK((*file)->Write(3000, data));
  Bytes back(data.size());
  ASSERT_OK((*file)->Read(3000, back));
  EXPECT_TRUE(back == data);
  Bytes past(100);
  const Status s = (*file)->Read(7950, past);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("ended after 50"), HasSubstr("truncated")));
}

// --- reads that come back wrong: kDataLoss, the handles stay -----------------------------------

// After a failed restore: the error names the first handle's index and slot, the handles are all
// still on disk, and the blocks the restore took stay the caller's.
void ExpectFailedRestore(const Status& s, const std::vector<OffloadHandle>& handles,
                         const OffloadStore& store) {
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("restore of handle " + std::to_string(handles[0].index)),
                                 HasSubstr("disk slot")));
  for (const OffloadHandle& h : handles) EXPECT_EQ(*store.tier(h), Tier::kDisk);
  EXPECT_OK(store.CheckInvariants());
}

TEST_F(OffloadFaultTest, AFlippedByteOnReadIsDataLossAndARetryRestoresExactly) {
  Fill(3);
  ASSERT_OK(OffloadAll(Tier::kDisk));
  {
    std::lock_guard lock(plan_->mu);
    plan_->flip_reads = 1;
  }
  const StoreState before = StoreState::Of(*cache_, *store_);
  std::vector<BlockId> out(3, kNoBlock);
  Result<OffloadTicket> ticket = store_->Restore(handles_, 0, out);
  ASSERT_OK(ticket);
  const Status s = ticket->Wait();
  ExpectFailedRestore(s, handles_, *store_);
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch"));
  StoreState after = StoreState::Of(*cache_, *store_);
  EXPECT_EQ(after.cache_free[0], before.cache_free[0] - 3);  // the restore's blocks are ours
  EXPECT_EQ(after.live_handles, before.live_handles);
  EXPECT_EQ(after.free_disk, before.free_disk);
  EXPECT_EQ(after.stats.failed_copies, 1);
  EXPECT_EQ(after.stats.restored_blocks, 0);
  ASSERT_OK(cache_->Free(out));
  // The file itself is intact: restoring again gives every byte back.
  ExpectRestoredExactly();
}

TEST_F(OffloadFaultTest, AShortReadIsDataLossAndARetryRestoresExactly) {
  Fill(2);
  ASSERT_OK(OffloadAll(Tier::kDisk));
  {
    std::lock_guard lock(plan_->mu);
    plan_->truncated_reads = 1;
  }
  std::vector<BlockId> out(2, kNoBlock);
  Result<OffloadTicket> ticket = store_->Restore(handles_, 0, out);
  ASSERT_OK(ticket);
  const Status s = ticket->Wait();
  ExpectFailedRestore(s, handles_, *store_);
  EXPECT_THAT(s.message(), HasSubstr("half the bytes"));
  ASSERT_OK(cache_->Free(out));
  ExpectRestoredExactly();
}

// The file changed behind the store's back: every restore of the damaged block fails, the other
// handles restore, and the damaged one can still be dropped.
TEST_F(OffloadFaultTest, ACorruptFileIsDataLossNamingTheBlockEveryTime) {
  Fill(3);
  ASSERT_OK(OffloadAll(Tier::kDisk));
  int64_t damaged_offset = 0;
  {
    std::lock_guard lock(plan_->mu);
    ASSERT_EQ(plan_->write_offsets.size(), 3u);
    damaged_offset = plan_->write_offsets[1];  // handles_[1]'s slot
  }
  const int fd = ::open(dir_.File("tier").c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  std::byte b{};
  ASSERT_EQ(::pread(fd, &b, 1, damaged_offset + 333), 1);
  b ^= std::byte{0x01};
  ASSERT_EQ(::pwrite(fd, &b, 1, damaged_offset + 333), 1);
  ::close(fd);

  const std::vector<OffloadHandle> damaged{handles_[1]};
  for (int attempt = 0; attempt < 2; ++attempt) {
    BlockId out = kNoBlock;
    Result<OffloadTicket> ticket = store_->Restore(damaged, 0, std::span(&out, 1));
    ASSERT_OK(ticket);
    const Status s = ticket->Wait();
    ExpectFailedRestore(s, damaged, *store_);
    EXPECT_THAT(s.message(), HasSubstr("checksum mismatch"));
    ASSERT_OK(cache_->Free(std::span(&out, 1)));
  }
  std::vector<BlockId> out(2, kNoBlock);
  Result<OffloadTicket> rest =
      store_->Restore(std::vector<OffloadHandle>{handles_[0], handles_[2]}, 0, out);
  ASSERT_OK(rest);
  ASSERT_OK(rest->Wait());
  EXPECT_TRUE(ReadBlock(*cache_, 0, out[0]) == bytes_[0]);
  EXPECT_TRUE(ReadBlock(*cache_, 0, out[1]) == bytes_[2]);
  ASSERT_OK(store_->Drop(damaged));
  EXPECT_EQ(store_->live_handles(), 0);
  EXPECT_EQ(store_->free_disk_blocks(0), 4);
  EXPECT_OK(store_->CheckInvariants());
}

TEST_F(OffloadFaultTest, ATruncatedFileIsDataLoss) {
  Fill(2);
  ASSERT_OK(OffloadAll(Tier::kDisk));
  ASSERT_EQ(::truncate(dir_.File("tier").c_str(), 100), 0) << std::strerror(errno);
  std::vector<BlockId> out(2, kNoBlock);
  Result<OffloadTicket> ticket = store_->Restore(handles_, 0, out);
  ASSERT_OK(ticket);
  const Status s = ticket->Wait();
  ExpectFailedRestore(s, handles_, *store_);
  EXPECT_THAT(s.message(), HasSubstr("truncated"));
  EXPECT_EQ(store_->live_handles(), 2);
}

}  // namespace
}  // namespace blockkv
