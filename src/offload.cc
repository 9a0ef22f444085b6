// OffloadStore: handles, host and disk slots, and the worker thread that copies (offload.h).
//
// The scheduling thread owns every table here; the worker owns nothing but the job it runs. A
// job is handed over under mu_ and handed back (done, with its status and checksums) under mu_,
// so the worker never touches a table and the scheduling thread never touches a running job.
// Jobs run in submission order, which is what makes reusing a slot safe as soon as the
// scheduling thread frees it: any later write to it runs after every earlier read.
#include "blockkv/offload.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "internal/block_mover.h"
#include "internal/check.h"
#include "internal/checked_math.h"
#include "internal/strings.h"

namespace blockkv {

using internal::StrCat;

Status OffloadConfig::Validate() const {
  auto non_negative = [](const char* field, int64_t value) -> Status {
    if (value < 0) {
      return InvalidArgumentError(StrCat("OffloadConfig.", field, " must be >= 0, got ", value));
    }
    return Status::Ok();
  };
  BLOCKKV_RETURN_IF_ERROR(non_negative("host_bytes", host_bytes));
  BLOCKKV_RETURN_IF_ERROR(non_negative("host_blocks", host_blocks));
  BLOCKKV_RETURN_IF_ERROR(non_negative("disk_bytes", disk_bytes));
  BLOCKKV_RETURN_IF_ERROR(non_negative("disk_blocks", disk_blocks));
  if (host_bytes == 0 && host_blocks == 0) {
    return InvalidArgumentError(
        "OffloadConfig: the host tier needs host_blocks > 0 or host_bytes > 0");
  }
  if (disk_path.empty() && (disk_bytes > 0 || disk_blocks > 0)) {
    return InvalidArgumentError("OffloadConfig: disk_bytes / disk_blocks given without disk_path");
  }
  if (!disk_path.empty() && disk_bytes == 0 && disk_blocks == 0) {
    return InvalidArgumentError(
        StrCat("OffloadConfig: disk_path ", disk_path, " needs disk_blocks > 0 or disk_bytes > 0"));
  }
  return Status::Ok();
}

namespace {

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

class CacheOwner final : public OffloadStore::BlockOwner {
 public:
  explicit CacheOwner(BlockedKVCache* cache) : cache_(cache) {}
  Status Take(int group, std::span<BlockId> out) override {
    return cache_->Reserve(static_cast<int32_t>(out.size()), out, group);
  }
  void Release(int group, std::span<const BlockId> blocks) override {
    const Status s = cache_->Free(blocks, group);
    BLOCKKV_CHECK(s.ok(), s.message().c_str());
  }

 private:
  BlockedKVCache* cache_;
};

}  // namespace

struct OffloadStore::Impl {
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
    std::vector<uint32_t> marks;  // [num_blocks]: == mark_epoch when seen in this call
  };

  BlockedKVCache* cache = nullptr;
  std::unique_ptr<CacheOwner> own_owner;
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
  int32_t NewEntry();
  void FreeEntry(int32_t index);
  void FreeSlots(Entry& entry);
};

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
  copy.checksum = XXH3_64bits(data, static_cast<size_t>(bytes));
  Status s = file->Write(DiskOffset(copy.group, copy.disk_slot),
                         std::span(data, static_cast<size_t>(bytes)));
  if (s.ok()) return s;
  return Status(s.code(),
                StrCat("offload of handle ", copy.handle, " (group ", copy.group, ", disk slot ",
                       copy.disk_slot, ") to ", disk_path, ": ", s.message()));
}

Status OffloadStore::Impl::ReadDisk(const Copy& copy, std::byte* data) {
  const int64_t bytes = groups[copy.group].layout.block_bytes();
  const int64_t offset = DiskOffset(copy.group, copy.disk_slot);
  const auto where = [&] {
    return StrCat("restore of handle ", copy.handle, " (group ", copy.group, ", disk slot ",
                  copy.disk_slot, " at offset ", offset, " of ", disk_path, ")");
  };
  Status s = file->Read(offset, std::span(data, static_cast<size_t>(bytes)));
  if (!s.ok()) return Status(s.code(), StrCat(where(), ": ", s.message()));
  const uint64_t sum = XXH3_64bits(data, static_cast<size_t>(bytes));
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
  const int64_t n = static_cast<int64_t>(job.copies.size());
  std::vector<std::vector<BlockId>> release(groups.size());
  for (const Copy& c : job.copies) {
    Entry& e = entries[c.handle];
    e.job = 0;
    if (c.block != kNoBlock) --groups[c.group].busy[c.block];
    switch (job.op) {
      case Op::kOffload:
        if (ok) {
          release[c.group].push_back(e.device);
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
  ++e.generation;
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
    if (h.index < 0 || h.index >= static_cast<int32_t>(entries.size()) || !entries[h.index].live ||
        entries[h.index].generation != h.generation) {
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

// ---- OffloadStore -------------------------------------------------------------------------------

Result<std::unique_ptr<OffloadStore>> OffloadStore::Create(BlockedKVCache* cache,
                                                           OffloadConfig config,
                                                           BlockOwner* owner) {
  if (cache == nullptr) return InvalidArgumentError("OffloadStore::Create: cache is null");
  BLOCKKV_RETURN_IF_ERROR(config.Validate());
  auto impl = std::make_unique<Impl>();
  impl->cache = cache;
  if (owner == nullptr) {
    impl->own_owner = std::make_unique<CacheOwner>(cache);
    owner = impl->own_owner.get();
  }
  impl->owner = owner;

  // Slots per group: given, or what the bytes hold of one block of every group.
  int64_t all_groups_block = 0;
  for (int g = 0; g < cache->num_groups(); ++g) {
    Result<int64_t> bytes = cache->config(g).bytes_per_block();
    if (!bytes.ok()) return bytes.status();
    all_groups_block += *bytes;
  }
  auto slots = [&](const char* tier, int32_t blocks, int64_t bytes) -> Result<int32_t> {
    if (blocks > 0) return blocks;
    const int64_t n = bytes / all_groups_block;
    if (n < 1) {
      return InvalidArgumentError(StrCat("OffloadConfig: ", tier, "_bytes ", bytes,
                                         " holds no block (one block of every group is ",
                                         all_groups_block, " bytes)"));
    }
    if (n > INT32_MAX) {
      return InvalidArgumentError(StrCat("OffloadConfig: ", tier, "_bytes ", bytes, " holds ", n,
                                         " blocks, more than ", INT32_MAX));
    }
    return static_cast<int32_t>(n);
  };
  Result<int32_t> host = slots("host", config.host_blocks, config.host_bytes);
  if (!host.ok()) return host.status();
  impl->host_blocks = *host;
  if (!config.disk_path.empty()) {
    Result<int32_t> disk = slots("disk", config.disk_blocks, config.disk_bytes);
    if (!disk.ok()) return disk.status();
    impl->disk_blocks = *disk;
  }

  const Device& device = *cache->device();
  int64_t largest = 0;
  int64_t disk_base = 0;
  for (int g = 0; g < cache->num_groups(); ++g) {
    const KVCacheConfig& kv = cache->config(g);
    Result<TensorView> storage = cache->GetGroupStorage(g);
    if (!storage.ok()) return storage.status();
    Impl::Group group;
    group.layout.base = static_cast<std::byte*>(storage->data);
    group.layout.layers = kv.num_caches();
    group.layout.chunk_bytes = kv.elements_per_layer_block() * ElementSize(kv.cache_dtype);
    group.layout.layer_stride = group.layout.chunk_bytes * cache->num_blocks();
    const int64_t block_bytes = group.layout.block_bytes();
    const std::optional<int64_t> host_bytes =
        internal::CheckedMul(block_bytes, int64_t{impl->host_blocks});
    if (!host_bytes) {
      return InvalidArgumentError(StrCat("OffloadConfig: ", impl->host_blocks, " host blocks of ",
                                         block_bytes, " bytes overflow"));
    }
    Result<internal::HostBuffer> buffer = internal::AllocateHostBuffer(device, *host_bytes);
    if (!buffer.ok()) return buffer.status();
    group.host = std::move(*buffer);
    for (int32_t s = impl->host_blocks; s-- > 0;) group.free_host.push_back(s);
    for (int32_t s = impl->disk_blocks; s-- > 0;) group.free_disk.push_back(s);
    group.disk_base = disk_base;
    disk_base += block_bytes * impl->disk_blocks;
    group.busy.assign(static_cast<size_t>(cache->num_blocks()), 0);
    group.marks.assign(static_cast<size_t>(cache->num_blocks()), 0);
    largest = std::max(largest, block_bytes);
    impl->groups.push_back(std::move(group));
  }

  for (std::unique_ptr<internal::BlockMover>* mover : {&impl->mover, &impl->sync_mover}) {
    if (device.kind() == DeviceKind::kCuda) {
      Result<std::unique_ptr<internal::BlockMover>> made = internal::MakeCudaBlockMover(device);
      if (!made.ok()) return made.status();
      *mover = std::move(*made);
    } else {
      *mover = internal::MakeHostBlockMover();
    }
  }
  if (!config.disk_path.empty()) {
    Result<internal::HostBuffer> staging = internal::AllocateHostBuffer(device, largest);
    if (!staging.ok()) return staging.status();
    impl->staging = std::move(*staging);
    const BlockFileOpener& open = config.open_file ? config.open_file : OpenPosixBlockFile;
    Result<std::unique_ptr<BlockFile>> file = open(config.disk_path);
    if (!file.ok()) return file.status();
    impl->file = std::move(*file);
    impl->disk_path = config.disk_path;
  }
  Impl* raw = impl.get();
  impl->worker = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<OffloadStore>(new OffloadStore(std::move(impl)));
}

OffloadStore::OffloadStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

OffloadStore::~OffloadStore() {
  WaitAll();
  {
    std::lock_guard lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->work_cv.notify_one();
  impl_->worker.join();
  for (Impl::Entry& e : impl_->entries) {
    if (e.live && e.tier == Tier::kDevice) {
      impl_->owner->Release(e.group, std::span(&e.device, 1));
    }
  }
}

void OffloadStore::Reap() { impl_->Reap(); }

void OffloadStore::WaitAll() {
  if (!impl_->jobs.empty()) impl_->WaitFor(impl_->jobs.back()->id);
}

bool OffloadStore::PollJob(uint64_t last) {
  impl_->Reap();
  return impl_->IsDone(last);
}

Status OffloadStore::WaitJob(uint64_t first, uint64_t last) {
  impl_->WaitFor(last);  // jobs run in order: the rest are done too
  return impl_->StatusOf(first, last);
}

bool OffloadTicket::Poll() { return store_ == nullptr || store_->PollJob(last_); }

Status OffloadTicket::Wait() {
  return store_ == nullptr ? Status::Ok() : store_->WaitJob(first_, last_);
}

OffloadTicket OffloadTicket::Join(const OffloadTicket& a, const OffloadTicket& b) {
  if (a.store_ == nullptr) return b;
  if (b.store_ == nullptr) return a;
  BLOCKKV_CHECK(a.store_ == b.store_, "OffloadTicket::Join: tickets of two stores");
  OffloadTicket joined = a;
  joined.first_ = std::min(a.first_, b.first_);
  joined.last_ = std::max(a.last_, b.last_);
  return joined;
}

Result<OffloadTicket> OffloadStore::Offload(std::span<const BlockId> blocks, int group,
                                            std::span<OffloadHandle> out, Tier tier) {
  Impl& m = *impl_;
  m.Reap();
  if (group < 0 || group >= num_groups()) {
    return OutOfRangeError(
        StrCat("Offload: cache group ", group, " is not in [0, ", num_groups(), ")"));
  }
  if (tier == Tier::kDevice || (tier == Tier::kDisk && m.file == nullptr)) {
    return InvalidArgumentError(StrCat("Offload: cannot offload to the ", TierName(tier), " tier",
                                       tier == Tier::kDisk ? " (no disk tier)" : ""));
  }
  if (out.size() < blocks.size()) {
    return InvalidArgumentError(
        StrCat("Offload: out holds ", out.size(), " handles for ", blocks.size(), " blocks"));
  }
  Impl::Group& g = m.groups[group];
  m.NextMarkEpoch();
  const int32_t num_blocks = m.cache->num_blocks();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockId b = blocks[i];
    if (b < 0 || b >= num_blocks) {
      return OutOfRangeError(
          StrCat("Offload: blocks[", i, "] = ", b, " is not in [0, ", num_blocks, ")"));
    }
    if (g.marks[b] == m.mark_epoch) {
      return InvalidArgumentError(StrCat("Offload: block ", b, " is repeated"));
    }
    g.marks[b] = m.mark_epoch;
  }
  std::vector<int32_t>& free_slots = tier == Tier::kHost ? g.free_host : g.free_disk;
  if (free_slots.size() < blocks.size()) {
    return ResourceExhaustedError(
        StrCat("Offload: ", blocks.size(), " blocks of group ", group, " do not fit in the ",
               TierName(tier), " tier (", free_slots.size(), " of ",
               tier == Tier::kHost ? m.host_blocks : m.disk_blocks, " slots free)"));
  }
  if (blocks.empty()) return OffloadTicket();
  std::vector<Copy> copies;
  copies.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int32_t index = m.NewEntry();
    Impl::Entry& e = m.entries[index];
    e.group = group;
    e.tier = tier;
    e.device = blocks[i];
    const int32_t slot = free_slots.back();
    free_slots.pop_back();
    (tier == Tier::kHost ? e.host_slot : e.disk_slot) = slot;
    copies.push_back({tier == Tier::kHost ? Copy::kToHost : Copy::kToDisk, group, blocks[i],
                      e.host_slot, e.disk_slot, index, 0});
    out[i] = {index, e.generation};
  }
  return OffloadTicket(this, m.Submit(Op::kOffload, std::move(copies)));
}

Result<OffloadTicket> OffloadStore::Restore(std::span<const OffloadHandle> handles, int group,
                                            std::span<BlockId> out) {
  Impl& m = *impl_;
  m.Reap();
  if (group != kAnyGroup && (group < 0 || group >= num_groups())) {
    return OutOfRangeError(
        StrCat("Restore: cache group ", group, " is not in [0, ", num_groups(), ")"));
  }
  if (out.size() < handles.size()) {
    return InvalidArgumentError(
        StrCat("Restore: out holds ", out.size(), " blocks for ", handles.size(), " handles"));
  }
  BLOCKKV_RETURN_IF_ERROR(m.CheckHandles(handles, group, "Restore"));
  // Fresh blocks for every copied handle, group by group, all or nothing.
  const size_t groups = m.groups.size();
  std::vector<std::vector<BlockId>> fresh(groups);
  for (const OffloadHandle& h : handles) {
    const Impl::Entry& e = m.entries[h.index];
    if (e.tier != Tier::kDevice) fresh[e.group].push_back(kNoBlock);
  }
  for (size_t g = 0; g < groups; ++g) {
    if (fresh[g].empty()) continue;
    if (Status s = m.owner->Take(static_cast<int>(g), fresh[g]); !s.ok()) {
      for (size_t taken = 0; taken < g; ++taken) {
        if (!fresh[taken].empty()) m.owner->Release(static_cast<int>(taken), fresh[taken]);
      }
      return s;
    }
  }
  std::vector<size_t> next(groups, 0);
  std::vector<Copy> copies;
  copies.reserve(handles.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    Impl::Entry& e = m.entries[handles[i].index];
    if (e.tier == Tier::kDevice) {  // its offload failed: the block it kept is handed back
      out[i] = e.device;
      m.FreeEntry(handles[i].index);
      ++m.stats.restored_blocks;
      continue;
    }
    out[i] = fresh[e.group][next[e.group]++];
    copies.push_back({e.tier == Tier::kHost ? Copy::kFromHost : Copy::kFromDisk, e.group, out[i],
                      e.host_slot, e.disk_slot, handles[i].index, e.checksum});
  }
  if (copies.empty()) return OffloadTicket();
  return OffloadTicket(this, m.Submit(Op::kRestore, std::move(copies)));
}

Result<OffloadTicket> OffloadStore::Spill(std::span<const OffloadHandle> handles) {
  Impl& m = *impl_;
  m.Reap();
  if (m.file == nullptr) return FailedPreconditionError("Spill: the store has no disk tier");
  BLOCKKV_RETURN_IF_ERROR(m.CheckHandles(handles, -1, "Spill"));
  std::vector<size_t> need(m.groups.size(), 0);
  for (const OffloadHandle& h : handles) {
    const Impl::Entry& e = m.entries[h.index];
    need[e.group] += e.tier == Tier::kHost;
  }
  for (size_t g = 0; g < need.size(); ++g) {
    if (need[g] > m.groups[g].free_disk.size()) {
      return ResourceExhaustedError(
          StrCat("Spill: ", need[g], " blocks of group ", g, " do not fit in the disk tier (",
                 m.groups[g].free_disk.size(), " of ", m.disk_blocks, " slots free)"));
    }
  }
  std::vector<Copy> copies;
  for (const OffloadHandle& h : handles) {
    Impl::Entry& e = m.entries[h.index];
    if (e.tier != Tier::kHost) continue;
    std::vector<int32_t>& free_disk = m.groups[e.group].free_disk;
    e.disk_slot = free_disk.back();
    free_disk.pop_back();
    copies.push_back({Copy::kHostToDisk, e.group, kNoBlock, e.host_slot, e.disk_slot, h.index, 0});
  }
  if (copies.empty()) return OffloadTicket();
  return OffloadTicket(this, m.Submit(Op::kSpill, std::move(copies)));
}

Result<OffloadHandle> OffloadStore::CopyToHost(int group, BlockId block) {
  Impl& m = *impl_;
  if (group < 0 || group >= num_groups() || block < 0 || block >= m.cache->num_blocks()) {
    return OutOfRangeError(
        StrCat("CopyToHost: block ", block, " of group ", group, " does not exist"));
  }
  Impl::Group& g = m.groups[group];
  BLOCKKV_CHECK(g.busy[block] == 0, "CopyToHost: a copy is in flight on the block");
  if (g.free_host.empty()) {
    return ResourceExhaustedError(StrCat("CopyToHost: the host tier of group ", group, " is full (",
                                         m.host_blocks, " slots)"));
  }
  const int32_t slot = g.free_host.back();
  Status copied = m.sync_mover->ToHost(g.layout, block, m.HostSlot(group, slot));
  if (copied.ok()) copied = m.sync_mover->Finish();
  if (!copied.ok()) return copied;
  g.free_host.pop_back();
  const int32_t index = m.NewEntry();
  Impl::Entry& e = m.entries[index];
  e.group = group;
  e.tier = Tier::kHost;
  e.host_slot = slot;
  m.stats.offloaded_blocks += 1;
  m.stats.bytes_written += g.layout.block_bytes();
  return OffloadHandle{index, e.generation};
}

Status OffloadStore::CopyToDevice(OffloadHandle handle, BlockId block) {
  Impl& m = *impl_;
  BLOCKKV_ASSIGN_OR_RETURN(const Tier where, tier(handle));
  Impl::Entry& e = m.entries[handle.index];
  if (where != Tier::kHost || e.job != 0) {
    return FailedPreconditionError(StrCat("CopyToDevice: handle ", handle.index, " is on the ",
                                          TierName(where), " tier",
                                          e.job != 0 ? " with a copy in flight" : ""));
  }
  if (block < 0 || block >= m.cache->num_blocks()) {
    return OutOfRangeError(StrCat("CopyToDevice: block ", block, " does not exist"));
  }
  Impl::Group& g = m.groups[e.group];
  BLOCKKV_CHECK(g.busy[block] == 0, "CopyToDevice: a copy is in flight on the block");
  BLOCKKV_RETURN_IF_ERROR(
      m.sync_mover->FromHost(g.layout, m.HostSlot(e.group, e.host_slot), block));
  BLOCKKV_RETURN_IF_ERROR(m.sync_mover->Finish());
  m.stats.restored_blocks += 1;
  m.stats.bytes_read += g.layout.block_bytes();
  return Status::Ok();
}

Status OffloadStore::Drop(std::span<const OffloadHandle> handles) {
  Impl& m = *impl_;
  BLOCKKV_RETURN_IF_ERROR(m.CheckHandles(handles, -1, "Drop"));
  for (const OffloadHandle& h : handles) {
    Impl::Entry& e = m.entries[h.index];
    if (e.tier == Tier::kDevice) m.owner->Release(e.group, std::span(&e.device, 1));
    m.FreeEntry(h.index);
  }
  return Status::Ok();
}

Result<Tier> OffloadStore::tier(OffloadHandle handle) const {
  const Impl& m = *impl_;
  if (handle.index < 0 || handle.index >= static_cast<int32_t>(m.entries.size()) ||
      !m.entries[handle.index].live || m.entries[handle.index].generation != handle.generation) {
    return NotFoundError(StrCat("handle (index ", handle.index, ", generation ", handle.generation,
                                ") is not a live handle of this store"));
  }
  return m.entries[handle.index].tier;
}

bool OffloadStore::busy(int group, BlockId block) const {
  return impl_->groups[group].busy[block] > 0;
}
std::vector<BlockId> OffloadStore::held_blocks(int group) const {
  std::vector<BlockId> held;
  for (const Impl::Entry& e : impl_->entries) {
    if (e.live && e.group == group && e.device != kNoBlock) held.push_back(e.device);
  }
  return held;
}

int32_t OffloadStore::host_blocks() const { return impl_->host_blocks; }
int32_t OffloadStore::disk_blocks() const { return impl_->disk_blocks; }
int32_t OffloadStore::free_host_blocks(int group) const {
  return static_cast<int32_t>(impl_->groups[group].free_host.size());
}
int32_t OffloadStore::free_disk_blocks(int group) const {
  return static_cast<int32_t>(impl_->groups[group].free_disk.size());
}
int64_t OffloadStore::live_handles() const { return impl_->live_handles; }
const OffloadStats& OffloadStore::stats() const { return impl_->stats; }
int OffloadStore::num_groups() const { return static_cast<int>(impl_->groups.size()); }
int64_t OffloadStore::block_bytes(int group) const {
  return impl_->groups[group].layout.block_bytes();
}

Status OffloadStore::CheckInvariants() const {
  const Impl& m = *impl_;
  int64_t live = 0;
  std::vector<std::vector<int32_t>> host_owner(m.groups.size());
  std::vector<std::vector<int32_t>> disk_owner(m.groups.size());
  for (size_t g = 0; g < m.groups.size(); ++g) {
    host_owner[g].assign(static_cast<size_t>(m.host_blocks), -1);
    disk_owner[g].assign(static_cast<size_t>(m.disk_blocks), -1);
  }
  auto claim = [](std::vector<int32_t>& owners, int32_t slot, int32_t who, const char* tier) {
    if (slot < 0 || slot >= static_cast<int32_t>(owners.size())) {
      return InternalError(StrCat("handle ", who, ": ", tier, " slot ", slot, " out of range"));
    }
    if (owners[slot] != -1) {
      return InternalError(
          StrCat("handles ", owners[slot], " and ", who, " share ", tier, " slot ", slot));
    }
    owners[slot] = who;
    return Status::Ok();
  };
  for (int32_t i = 0; i < static_cast<int32_t>(m.entries.size()); ++i) {
    const Impl::Entry& e = m.entries[i];
    if (!e.live) continue;
    ++live;
    if (e.host_slot >= 0)
      BLOCKKV_RETURN_IF_ERROR(claim(host_owner[e.group], e.host_slot, i, "host"));
    if (e.disk_slot >= 0)
      BLOCKKV_RETURN_IF_ERROR(claim(disk_owner[e.group], e.disk_slot, i, "disk"));
    const bool placed = e.tier == Tier::kDevice ? e.device != kNoBlock
                        : e.tier == Tier::kHost ? e.host_slot >= 0
                                                : e.disk_slot >= 0;
    if (!placed) {
      return InternalError(
          StrCat("handle ", i, " is on the ", TierName(e.tier), " tier without a place there"));
    }
  }
  if (live != m.live_handles) {
    return InternalError(StrCat("live handles: counted ", live, ", recorded ", m.live_handles));
  }
  for (size_t g = 0; g < m.groups.size(); ++g) {
    int64_t used_host = 0;
    for (int32_t o : host_owner[g]) used_host += o != -1;
    int64_t used_disk = 0;
    for (int32_t o : disk_owner[g]) used_disk += o != -1;
    if (used_host + static_cast<int64_t>(m.groups[g].free_host.size()) != m.host_blocks ||
        used_disk + static_cast<int64_t>(m.groups[g].free_disk.size()) != m.disk_blocks) {
      return InternalError(StrCat("group ", g, ": host slots ", used_host, " used + ",
                                  m.groups[g].free_host.size(), " free != ", m.host_blocks,
                                  " or disk slots ", used_disk, " used + ",
                                  m.groups[g].free_disk.size(), " free != ", m.disk_blocks));
    }
    for (int32_t s : m.groups[g].free_host) {
      if (host_owner[g][s] != -1) {
        return InternalError(
            StrCat("group ", g, ": free host slot ", s, " has handle ", host_owner[g][s]));
      }
    }
  }
  return Status::Ok();
}

}  // namespace blockkv
