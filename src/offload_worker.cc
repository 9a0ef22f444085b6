// SPDX-License-Identifier: Apache-2.0
// OffloadStore's worker thread and the bookkeeping of finished jobs (offload_store.h).
#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "internal/check.h"
#include "internal/checksum.h"
#include "internal/strings.h"
#include "offload_store.h"

namespace blockkv {

using internal::Checksum64;
using internal::StrCat;

// ---- the worker -------------------------------------------------------------------------------

void OffloadStore::Impl::Run() {
  for (;;) {
    Job* job = nullptr;
    {
      std::unique_lock lock(mu);
      work_cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop, and nothing left to do
      job = queue.front();
    }
    Status status = Execute(*job);
    {
      std::lock_guard lock(mu);
      job->status = std::move(status);
      job->done = true;
      queue.pop_front();
    }
    done_cv.notify_all();
  }
}

Status OffloadStore::Impl::WriteDisk(Copy& copy, const std::byte* data) {
  const int64_t bytes = groups[copy.group].layout.block_bytes();
  copy.checksum = Checksum64(data, static_cast<size_t>(bytes));
  Status s = file->Write(DiskOffset(copy.group, copy.disk_slot),
                         std::span(data, static_cast<size_t>(bytes)));
  if (s.ok()) return s;
  return {s.code(), StrCat("offload of handle ", copy.handle, " (group ", copy.group,
                           ", disk slot ", copy.disk_slot, ") to ", disk_path, ": ", s.message())};
}

Status OffloadStore::Impl::ReadDisk(const Copy& copy, std::byte* data) {
  const int64_t bytes = groups[copy.group].layout.block_bytes();
  const int64_t offset = DiskOffset(copy.group, copy.disk_slot);
  const auto where = [&] {
    return StrCat("restore of handle ", copy.handle, " (group ", copy.group, ", disk slot ",
                  copy.disk_slot, " at offset ", offset, " of ", disk_path, ")");
  };
  Status s = file->Read(offset, std::span(data, static_cast<size_t>(bytes)));
  if (!s.ok()) return {s.code(), StrCat(where(), ": ", s.message())};
  const uint64_t sum = Checksum64(data, static_cast<size_t>(bytes));
  if (sum != copy.checksum) {
    return DataLossError(StrCat(where(), ": checksum mismatch (stored ", copy.checksum, ", read ",
                                sum, "): the file was changed or corrupted"));
  }
  return Status::Ok();
}

Status OffloadStore::Impl::Execute(Job& job) {
  for (Copy& c : job.copies) {
    const internal::BlockLayout& layout = groups[c.group].layout;
    switch (c.kind) {
      case Copy::kToHost:
        BLOCKKV_RETURN_IF_ERROR(mover->ToHost(layout, c.block, HostSlot(c.group, c.host_slot)));
        break;
      case Copy::kFromHost:
        BLOCKKV_RETURN_IF_ERROR(mover->FromHost(layout, HostSlot(c.group, c.host_slot), c.block));
        break;
      case Copy::kToDisk:
        BLOCKKV_RETURN_IF_ERROR(mover->ToHost(layout, c.block, staging.data()));
        BLOCKKV_RETURN_IF_ERROR(mover->Finish());
        BLOCKKV_RETURN_IF_ERROR(WriteDisk(c, staging.data()));
        break;
      case Copy::kHostToDisk:
        BLOCKKV_RETURN_IF_ERROR(WriteDisk(c, HostSlot(c.group, c.host_slot)));
        break;
      case Copy::kFromDisk:
        // Staged and verified before the device sees a byte.
        BLOCKKV_RETURN_IF_ERROR(ReadDisk(c, staging.data()));
        BLOCKKV_RETURN_IF_ERROR(mover->FromHost(layout, staging.data(), c.block));
        BLOCKKV_RETURN_IF_ERROR(mover->Finish());  // before the staging buffer is reused
        break;
    }
  }
  return mover->Finish();
}

// ---- the scheduling thread --------------------------------------------------------------------

uint64_t OffloadStore::Impl::Submit(Op op, std::vector<Copy> copies) {
  auto job = std::make_unique<Job>();
  job->id = next_job++;
  job->op = op;
  job->copies = std::move(copies);
  for (const Copy& c : job->copies) {
    entries[c.handle].job = job->id;
    if (c.block != kNoBlock) ++groups[c.group].busy[c.block];
  }
  Job* raw = job.get();
  jobs.push_back(std::move(job));
  {
    std::lock_guard lock(mu);
    queue.push_back(raw);
  }
  work_cv.notify_one();
  return raw->id;
}

void OffloadStore::Impl::Reap() {
  for (;;) {
    {
      std::lock_guard lock(mu);
      if (jobs.empty() || !jobs.front()->done) return;
    }
    std::unique_ptr<Job> job = std::move(jobs.front());
    jobs.pop_front();
    Apply(*job);
  }
}

void OffloadStore::Impl::WaitFor(uint64_t job) {
  if (!IsDone(job)) {
    std::unique_lock lock(mu);
    Job* target = nullptr;
    for (const auto& j : jobs) {
      if (j->id == job) target = j.get();
    }
    BLOCKKV_CHECK(target != nullptr, "a job not yet reaped is in the list");
    done_cv.wait(lock, [&] { return target->done; });
  }
  Reap();
}

void OffloadStore::Impl::FreeSlots(Entry& entry) {
  Group& g = groups[entry.group];
  if (entry.host_slot >= 0) g.free_host.push_back(entry.host_slot);
  if (entry.disk_slot >= 0) g.free_disk.push_back(entry.disk_slot);
  entry.host_slot = -1;
  entry.disk_slot = -1;
}

void OffloadStore::Impl::Apply(Job& job) {
  const bool ok = job.status.ok();
  if (!ok) {
    ++stats.failed_copies;
    failed.emplace(job.id, job.status);
  }
  const auto n = static_cast<int64_t>(job.copies.size());
  std::vector<std::vector<BlockId>> release(groups.size());
  for (const Copy& c : job.copies) {
    Entry& e = entries[c.handle];
    e.job = 0;
    if (c.block != kNoBlock) --groups[c.group].busy[c.block];
    switch (job.op) {
      case Op::kOffload:
        if (ok) {
          release[c.group].push_back(e.device);
          --groups[c.group].held[e.device];
          e.device = kNoBlock;
          e.checksum = c.checksum;
        } else {
          FreeSlots(e);  // the device block is kept: nothing lost
          e.tier = Tier::kDevice;
        }
        break;
      case Op::kRestore:
        if (ok) FreeEntry(c.handle);
        break;
      case Op::kSpill:
        if (ok) {
          groups[c.group].free_host.push_back(e.host_slot);
          e.host_slot = -1;
          e.tier = Tier::kDisk;
          e.checksum = c.checksum;
        } else {
          groups[c.group].free_disk.push_back(e.disk_slot);
          e.disk_slot = -1;
        }
        break;
    }
  }
  for (size_t g = 0; g < release.size(); ++g) {
    if (!release[g].empty()) owner->Release(static_cast<int>(g), release[g]);
  }
  if (!ok) return;
  int64_t bytes = 0;
  for (const Copy& c : job.copies) bytes += groups[c.group].layout.block_bytes();
  switch (job.op) {
    case Op::kOffload:
      stats.offloaded_blocks += n;
      stats.bytes_written += bytes;
      break;
    case Op::kRestore:
      stats.restored_blocks += n;
      stats.bytes_read += bytes;
      break;
    case Op::kSpill:
      stats.spilled_blocks += n;
      stats.bytes_written += bytes;
      break;
  }
}

namespace {

// Generations of every store of the process come from one counter, so that a handle rebuilt
// without its store's id (store 0) still matches no other store's handle. 0 is never handed out.
std::atomic<uint32_t> g_next_generation{1};

uint32_t NextGeneration() {
  uint32_t g = g_next_generation.fetch_add(1, std::memory_order_relaxed);
  if (g == 0) g = g_next_generation.fetch_add(1, std::memory_order_relaxed);
  return g;
}

}  // namespace

Status OffloadStore::Impl::CheckStore(OffloadHandle h, const std::string& what) const {
  if (h.store == 0 || h.store == id) return Status::Ok();
  return InvalidArgumentError(StrCat(what, " (index ", h.index, ", generation ", h.generation,
                                     ") is a handle of offload store ", h.store,
                                     ", not of this store (", id, ")"));
}

int32_t OffloadStore::Impl::NewEntry() {
  int32_t index;
  if (!free_entries.empty()) {
    index = free_entries.back();
    free_entries.pop_back();
  } else {
    index = static_cast<int32_t>(entries.size());
    entries.emplace_back();
    handle_marks.push_back(0);
  }
  Entry& e = entries[index];
  e.live = true;
  e.generation = NextGeneration();
  e.job = 0;
  e.device = kNoBlock;
  e.host_slot = -1;
  e.disk_slot = -1;
  e.checksum = 0;
  ++live_handles;
  return index;
}

void OffloadStore::Impl::FreeEntry(int32_t index) {
  Entry& e = entries[index];
  FreeSlots(e);
  e.live = false;
  free_entries.push_back(index);
  --live_handles;
}

uint32_t OffloadStore::Impl::NextMarkEpoch() {
  if (++mark_epoch == 0) {
    for (Group& g : groups) std::fill(g.marks.begin(), g.marks.end(), 0);
    std::fill(handle_marks.begin(), handle_marks.end(), 0);
    mark_epoch = 1;
  }
  return mark_epoch;
}

Status OffloadStore::Impl::CheckHandles(std::span<const OffloadHandle> handles, int group,
                                        const char* what) {
  // Copies in flight on these handles finish first, so that the checks see what they did: a
  // restore that succeeds releases its handles, which are then stale here, not used again.
  for (const OffloadHandle& h : handles) {
    if (h.index >= 0 && h.index < static_cast<int32_t>(entries.size()) &&
        entries[h.index].job != 0) {
      WaitFor(entries[h.index].job);
    }
  }
  NextMarkEpoch();
  for (size_t i = 0; i < handles.size(); ++i) {
    const OffloadHandle h = handles[i];
    BLOCKKV_RETURN_IF_ERROR(CheckStore(h, StrCat(what, ": handles[", i, "]")));
    if (!IsLive(h)) {
      return NotFoundError(StrCat(what, ": handles[", i, "] (index ", h.index, ", generation ",
                                  h.generation, ") is not a live handle of this store"));
    }
    if (group >= 0 && entries[h.index].group != group) {
      return InvalidArgumentError(StrCat(what, ": handles[", i, "] belongs to cache group ",
                                         entries[h.index].group, ", not ", group));
    }
    if (handle_marks[h.index] == mark_epoch) {
      return InvalidArgumentError(
          StrCat(what, ": handles[", i, "] (index ", h.index, ") is repeated"));
    }
    handle_marks[h.index] = mark_epoch;
  }
  return Status::Ok();
}

}  // namespace blockkv
