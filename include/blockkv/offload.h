// SPDX-License-Identifier: Apache-2.0
// Offload and restore: a host tier and a disk tier below a BlockedKVCache, so an engine can
// preempt a sequence without recomputing it and keep more than device memory holds.
//
//   auto store = OffloadStore::Create(cache.get(), {.host_blocks = 1024});
//   std::vector<OffloadHandle> handles(table.size());
//   Result<OffloadTicket> out = (*store)->Offload(table, /*group=*/0, handles);
//   ... the device blocks go back to the cache once the copy is done (out->Wait()) ...
//   std::vector<BlockId> fresh(handles.size());
//   Result<OffloadTicket> in = (*store)->Restore(handles, /*group=*/0, fresh);
//   Status s = in->Wait();   // before any kernel reads or writes `fresh`
//
// What a handle is: one offloaded block of one cache group, wherever its bytes are now — the
// host tier (a slot of pinned memory on CUDA, aligned memory on the CPU), the disk tier (a slot
// of one file, with an XXH3-64 checksum verified on every read), or still the device block it
// came from when its copy failed. Handles stay valid until restored or dropped; Spill moves a
// host handle to disk without changing it.
//
// Copies are asynchronous and run in submission order on the store's worker thread (on CUDA it
// queues them on the device's copy stream and waits on an event; on the CPU it copies). Each call
// returns an OffloadTicket; effects that touch the scheduling thread's state (device blocks going
// back to their owner, host and disk slots becoming free) are applied by that thread, in Poll,
// Wait, and at the start of every store call. Hazards are tracked per block: a device block being
// read by an offload stays allocated until the copy is done, and a handle with a copy in flight is
// waited for before another operation uses it; the blocks a Restore returns hold their contents
// only once its ticket succeeds, and the caller must not run kernels on them before.
//
// Failure never loses data:
// - an offload whose copy fails (a device error; the disk full or failing) keeps its device
//   blocks: its handles then refer to them (Tier::kDevice) and a Restore hands them back
//   without a copy; the ticket reports the error (disk full is kResourceExhausted);
// - a restore whose copy fails (a checksum mismatch or short file: kDataLoss naming the block)
//   keeps its handles as they were, and the blocks it returned stay the caller's, contents
//   unspecified;
// - a spill whose write fails leaves the handle on the host.
// Every call validates all of its arguments and capacity before it changes anything.
//
// Not thread-safe, like the rest of blockkv: one thread (the scheduler) calls the store and its
// tickets; only the copies run elsewhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/kv_cache.h"
#include "blockkv/status.h"

namespace blockkv {

enum class Tier : uint8_t { kDevice, kHost, kDisk };
const char* TierName(Tier tier);  // "device", "host", "disk"

// One file of the disk tier. The default is a POSIX file (pwrite/pread); tests wrap it to inject
// short writes, ENOSPC and flipped bytes. Called from the store's worker thread only.
class BlockFile {
 public:
  virtual ~BlockFile() = default;
  // Writes all of `data` at `offset`: ENOSPC / EDQUOT is kResourceExhausted, any other error
  // kUnavailable, each naming the path, offset and errno text.
  virtual Status Write(int64_t offset, std::span<const std::byte> data) = 0;
  // Reads exactly data.size() bytes at `offset`: the end of the file first (a truncated file) is
  // kDataLoss, an I/O error kUnavailable.
  virtual Status Read(int64_t offset, std::span<std::byte> data) = 0;
};
using BlockFileOpener = std::function<Result<std::unique_ptr<BlockFile>>(const std::string& path)>;
// Creates (or truncates) `path`, mode 0600, and probes it: a page written at offset 0 must read
// back the same, so a file that loses what is written (/dev/null, /dev/zero) is
// kInvalidArgument and one that cannot be written (/dev/full: kResourceExhausted) the write's
// error, each naming the path, here rather than at the first restore. A regular file is removed
// when the BlockFile is destroyed (a device node such as /dev/full is left alone).
Result<std::unique_ptr<BlockFile>> OpenPosixBlockFile(const std::string& path);

struct OffloadConfig {
  // Host tier size: `host_blocks` blocks of every cache group, or, when it is 0, as many as
  // `host_bytes` holds (a block of every group counted together, as device planning does).
  int64_t host_bytes = 0;
  int32_t host_blocks = 0;
  // Disk tier: "" = none. The same two ways to size it.
  std::string disk_path{};
  int64_t disk_bytes = 0;
  int32_t disk_blocks = 0;
  BlockFileOpener open_file{};  // empty: OpenPosixBlockFile (another opener's file is not probed)

  // Sizes >= 0, at least one host block, disk sizes only with a path. kInvalidArgument names
  // the field.
  Status Validate() const;
};

// One offloaded block. `store` is the id of the store that made it (OffloadStore::id(), never
// 0): a handle of another store is kInvalidArgument wherever a handle is taken, and changes
// nothing. A handle rebuilt from index and generation alone (store 0: the Python module's packed
// int64 carries only those) is known by its generation, which every store of the process draws
// from one counter: another store's handle then matches no live handle (kNotFound) unless 2^32
// handles were made since.
struct OffloadHandle {
  int32_t index = -1;
  uint32_t generation = 0;
  uint32_t store = 0;
  friend bool operator==(const OffloadHandle&, const OffloadHandle&) = default;
};

struct OffloadStats {
  int64_t offloaded_blocks = 0;  // blocks whose offload copy succeeded (to host or disk)
  int64_t restored_blocks = 0;   // blocks whose restore copy succeeded (a kept device block too)
  int64_t spilled_blocks = 0;    // host → disk moves that succeeded
  int64_t copied_to_host = 0;    // CopyToHost (the prefix cache's demotions)
  int64_t copied_to_device = 0;  // CopyToDevice (its promotions)
  int64_t failed_copies = 0;     // tickets that failed
  int64_t bytes_written = 0;     // bytes copied off the device or onto the disk
  int64_t bytes_read = 0;        // bytes copied back onto the device
};

class OffloadStore;

// The completion of one Offload / Restore / Spill. Cheap to copy; valid while its store lives.
class OffloadTicket {
 public:
  OffloadTicket() = default;  // a ticket with nothing to wait for: done, OK
  // True when the copies are done; their effects are applied then.
  bool Poll();
  // Blocks until the copies are done and returns their status (the same on every call): the
  // first failure, or OK.
  Status Wait();
  // One ticket for both: done when both are, failed when either failed. When they come from one
  // store it covers every copy submitted from the first to the last of them, so join tickets of
  // consecutive calls. Tickets of two stores are kInvalidArgument (an empty one joins any).
  static Result<OffloadTicket> Join(const OffloadTicket& a, const OffloadTicket& b);

 private:
  friend class OffloadStore;
  OffloadTicket(OffloadStore* store, uint64_t job) : store_(store), first_(job), last_(job) {}
  OffloadStore* store_ = nullptr;
  uint64_t first_ = 0;  // the copies covered: jobs [first_, last_]
  uint64_t last_ = 0;
};

class OffloadStore {
 public:
  // Where device blocks come from (Restore) and go back to (after an Offload): the cache's own
  // Reserve / Free by default, a StateManager's block pools when it owns the store.
  class BlockOwner {
   public:
    virtual ~BlockOwner() = default;
    // out.size() fresh blocks of `group`, all or nothing (kResourceExhausted).
    virtual Status Take(int group, std::span<BlockId> out) = 0;
    // Gives back blocks the store held (its references: an offload's sources once copied).
    virtual void Release(int group, std::span<const BlockId> blocks) = 0;
    // Offload takes over the caller's hold on `blocks` (distinct ids in range): each must be held
    // by the caller beyond the `store_holds[b]` references the store holds already (one per
    // handle on it). kFailedPrecondition naming the first that is not (free, or held only by the
    // store), and nothing changes; otherwise the owner records the hand-over.
    virtual Status Adopt(int group, std::span<const BlockId> blocks,
                         std::span<const int32_t> store_holds) = 0;
    // The store hands blocks it held back to the caller without a copy (a Restore of handles
    // whose offload failed): the reverse of Adopt.
    virtual void GiveBack(int group, std::span<const BlockId> blocks) = 0;
  };

  // A store for the blocks of `cache`, with `owner` (nullptr: the cache's Reserve / Free) giving
  // and taking device blocks. Allocates the host tier (pinned when the cache is on CUDA) and
  // opens the disk file. kInvalidArgument for a bad config, kResourceExhausted when host memory
  // is short, the opener's error for the file. REQUIRES: `cache` and `owner` outlive the store.
  static Result<std::unique_ptr<OffloadStore>> Create(BlockedKVCache* cache,
                                                      const OffloadConfig& config,
                                                      BlockOwner* owner = nullptr);
  OffloadStore(const OffloadStore&) = delete;
  OffloadStore& operator=(const OffloadStore&) = delete;
  // Waits for every copy, then gives the device blocks it still holds back to their owner.
  ~OffloadStore();

  // Copies `blocks` of `group` to `tier` (kHost or kDisk), one handle each into out[0, n); the
  // store owns the blocks from now on and gives them back to their owner when the copy is done.
  // kOutOfRange (bad group or id), kInvalidArgument (a repeated id, out too short, tier kDevice
  // or kDisk without a disk tier), kResourceExhausted (too few free slots in the tier, naming
  // both numbers), kFailedPrecondition (a block the caller does not hold: never reserved, freed,
  // or already the store's because an offload of it is in flight or failed and kept it);
  // nothing changes on failure.
  Result<OffloadTicket> Offload(std::span<const BlockId> blocks, int group,
                                std::span<OffloadHandle> out, Tier tier = Tier::kHost);
  // New device blocks for `handles` into out[0, n), each of its handle's cache group (a handle
  // whose offload failed gives back its own block at once), copied from wherever each handle is
  // in one job: the handles are released when it succeeds, and all kept when it fails. `group`
  // is the group every handle must belong to, or kAnyGroup. kNotFound (a stale or unknown
  // handle), kInvalidArgument (a handle of another store or group, a repeated one, out too short),
  // kResourceExhausted (the owner has too few blocks); nothing changes on failure.
  static constexpr int kAnyGroup = -1;
  Result<OffloadTicket> Restore(std::span<const OffloadHandle> handles, int group,
                                std::span<BlockId> out);
  // Moves host handles to the disk tier (handles elsewhere are left as they are).
  // kFailedPrecondition without a disk tier, kResourceExhausted when it is too full, kNotFound
  // for a stale handle; nothing changes on failure.
  Result<OffloadTicket> Spill(std::span<const OffloadHandle> handles);
  // Synchronous copies on the calling thread, for the prefix cache's host level: device block
  // `block` of `group` (which stays the caller's) into a new host handle; and a host handle's
  // bytes into device block `block` of its group (the handle stays). kOutOfRange (bad group or
  // id), kResourceExhausted (no free host slot), kNotFound (a stale handle), kFailedPrecondition
  // (a handle not on the host, a block with a copy in flight (busy), or, for CopyToDevice, a
  // block the store holds); a device error is kInternal and changes nothing.
  Result<OffloadHandle> CopyToHost(int group, BlockId block);
  Status CopyToDevice(OffloadHandle handle, BlockId block);
  // (These two and Drop do not reap finished copies unless they wait for a handle's, so they
  // may be called while the owner is inside Take: from an eviction listener.)
  // Forgets handles without restoring them (a cancelled request): their slots become free, a
  // kept device block goes back to its owner. kNotFound for a stale handle (nothing dropped).
  Status Drop(std::span<const OffloadHandle> handles);

  // Where `handle`'s bytes are now; kNotFound when it is stale, kInvalidArgument when it is
  // another store's.
  Result<Tier> tier(OffloadHandle handle) const;
  // True while a copy in flight reads or writes device block `block` of `group`.
  bool busy(int group, BlockId block) const;
  // The device blocks of `group` the store holds: sources of offloads in flight, and blocks kept
  // by offloads that failed. Each holds one of its owner's references.
  std::vector<BlockId> held_blocks(int group) const;
  int32_t host_blocks() const;                // slots per cache group
  int32_t disk_blocks() const;                // slots per cache group
  int32_t free_host_blocks(int group) const;  // REQUIRES: a valid group
  int32_t free_disk_blocks(int group) const;  // REQUIRES: a valid group
  int64_t live_handles() const;
  // This store's id, unique among the stores of the process (OffloadHandle::store).
  uint32_t id() const;
  const OffloadStats& stats() const;
  int num_groups() const;
  int64_t block_bytes(int group) const;  // bytes of one block of `group`, every layer

  // Applies the effects of every copy done so far; Poll, Wait and every call do it too.
  void Reap();
  // Blocks until every copy submitted so far is done, then reaps them.
  void WaitAll();

  // Handles, slots and in-flight marks agree: every live handle's slot is used in its tier and
  // no two handles share one; free slots have no handle.
  Status CheckInvariants() const;

 private:
  struct Impl;
  friend class OffloadTicket;
  explicit OffloadStore(std::unique_ptr<Impl> impl);
  // The default owner's hand-over marks (BlockedKVCache::Group::lent), which the cache's Free
  // checks: Lend checks that every block is reserved and not lent, then marks them all.
  static Status LendFromCache(BlockedKVCache& cache, int group, std::span<const BlockId> blocks);
  static void ReturnToCache(BlockedKVCache& cache, int group, std::span<const BlockId> blocks);
  bool PollJob(uint64_t last);
  Status WaitJob(uint64_t first, uint64_t last);

  std::unique_ptr<Impl> impl_;
};

}  // namespace blockkv
