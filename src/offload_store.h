// SPDX-License-Identifier: Apache-2.0
// OffloadStore's internals, shared by offload.cc (the calls) and offload_worker.cc (the worker
// thread and the bookkeeping it hands back to the scheduling thread).
//
// The scheduling thread owns every table here; the worker owns nothing but the job it runs. A
// job is handed over under mu_ and handed back (done, with its status and checksums) under mu_,
// so the worker never touches a table and the scheduling thread never touches a running job.
// Jobs run in submission order, which is what makes reusing a slot safe as soon as the
// scheduling thread frees it: any later write to it runs after every earlier read.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "blockkv/offload.h"
#include "internal/block_mover.h"

namespace blockkv {
namespace internal::offload {

// One block copy of a job. `checksum` is written by the worker for copies onto the disk.
struct Copy {
  enum Kind : uint8_t { kToHost, kToDisk, kHostToDisk, kFromHost, kFromDisk };
  Kind kind;
  int group;
  BlockId block;  // device block (kNoBlock for kHostToDisk)
  int32_t host_slot;
  int32_t disk_slot;
  int32_t handle;
  uint64_t checksum;
};

enum class Op : uint8_t { kOffload, kRestore, kSpill };

struct Job {
  uint64_t id = 0;
  Op op = Op::kOffload;
  std::vector<Copy> copies;
  Status status;  // written by the worker before done
  bool done = false;
};

}  // namespace internal::offload

struct OffloadStore::Impl {
  using Copy = internal::offload::Copy;
  using Job = internal::offload::Job;
  using Op = internal::offload::Op;

  struct Entry {
    uint32_t generation = 0;
    bool live = false;
    int group = 0;
    Tier tier = Tier::kHost;
    uint64_t job = 0;           // the job in flight on this handle, 0 when none
    BlockId device = kNoBlock;  // source block while its offload runs, or kept when it failed
    int32_t host_slot = -1;
    int32_t disk_slot = -1;
    uint64_t checksum = 0;  // of the disk copy
  };
  struct Group {
    internal::BlockLayout layout;
    internal::HostBuffer host;       // host_blocks · block_bytes
    std::vector<int32_t> free_host;  // free host slots, a stack
    std::vector<int32_t> free_disk;
    int64_t disk_base = 0;        // offset of slot 0 in the file
    std::vector<int32_t> busy;    // [num_blocks]: jobs in flight on the device block
    std::vector<int32_t> held;    // [num_blocks]: live handles holding the device block
    std::vector<uint32_t> marks;  // [num_blocks]: == mark_epoch when seen in this call
  };

  uint32_t id = 0;  // OffloadHandle::store of this store's handles
  BlockedKVCache* cache = nullptr;
  std::unique_ptr<BlockOwner> own_owner;  // the cache's Reserve / Free by default
  BlockOwner* owner = nullptr;
  std::vector<Group> groups;
  int32_t host_blocks = 0;
  int32_t disk_blocks = 0;
  std::unique_ptr<BlockFile> file;
  std::string disk_path;
  std::vector<Entry> entries;
  std::vector<int32_t> free_entries;
  int64_t live_handles = 0;
  OffloadStats stats;
  uint32_t mark_epoch = 0;
  std::vector<uint32_t> handle_marks;  // [entries]: == mark_epoch when seen in this call
  // A new mark_epoch for a call that looks for repeated blocks or handles. When it wraps around,
  // every mark of both kinds is cleared, so that no mark left from before can equal a later one.
  uint32_t NextMarkEpoch();

  // Jobs submitted and not yet reaped, oldest first (scheduling thread); failures of reaped ones.
  std::deque<std::unique_ptr<Job>> jobs;
  uint64_t next_job = 1;
  std::unordered_map<uint64_t, Status> failed;

  std::unique_ptr<internal::BlockMover> sync_mover;  // CopyToHost / CopyToDevice

  // Worker side.
  std::unique_ptr<internal::BlockMover> mover;
  internal::HostBuffer staging;  // one block of the largest group: disk reads and writes
  std::mutex mu;
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  std::deque<Job*> queue;  // guarded by mu
  bool stop = false;       // guarded by mu
  std::thread worker;

  // ---- worker thread ----
  void Run();
  Status Execute(Job& job);
  std::byte* HostSlot(int group, int32_t slot) const {
    const Group& g = groups[group];
    return g.host.data() + slot * g.layout.block_bytes();
  }
  int64_t DiskOffset(int group, int32_t slot) const {
    return groups[group].disk_base + slot * groups[group].layout.block_bytes();
  }
  Status WriteDisk(Copy& copy, const std::byte* data);
  Status ReadDisk(const Copy& copy, std::byte* data);

  // ---- scheduling thread ----
  uint64_t Submit(Op op, std::vector<Copy> copies);
  void Reap();
  void Apply(Job& job);
  bool IsDone(uint64_t job) const { return jobs.empty() || job < jobs.front()->id; }
  // Blocks until `job` is done, then reaps.
  void WaitFor(uint64_t job);
  // The first failure among reaped jobs [first, last], or OK.
  Status StatusOf(uint64_t first, uint64_t last) const {
    if (failed.empty()) return Status::Ok();
    for (uint64_t job = first; job <= last; ++job) {
      if (const auto it = failed.find(job); it != failed.end()) return it->second;
    }
    return Status::Ok();
  }
  // Waits for copies in flight on `handles`, then checks them (live, not repeated, of `group`
  // unless group < 0).
  Status CheckHandles(std::span<const OffloadHandle> handles, int group, const char* what);
  // Whether `h` names a live entry of this generation (of this store, or store 0: unstated).
  bool IsLive(OffloadHandle h) const {
    return (h.store == 0 || h.store == id) && h.index >= 0 &&
           h.index < static_cast<int32_t>(entries.size()) && entries[h.index].live &&
           entries[h.index].generation == h.generation;
  }
  // kInvalidArgument for a handle that states another store, naming `what`.
  Status CheckStore(OffloadHandle h, const std::string& what) const;
  OffloadHandle HandleOf(int32_t index) const { return {index, entries[index].generation, id}; }
  int32_t NewEntry();
  void FreeEntry(int32_t index);
  void FreeSlots(Entry& entry);
};

}  // namespace blockkv
