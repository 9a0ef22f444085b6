// SPDX-License-Identifier: Apache-2.0
// OffloadStore: the calls, their checks and the store's creation (offload.h). The worker thread
// and the bookkeeping of finished jobs are in offload_worker.cc; the shared state is in
// offload_store.h.
#include "blockkv/offload.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "internal/block_mover.h"
#include "internal/check.h"
#include "internal/checked_math.h"
#include "internal/strings.h"
#include "offload_store.h"

namespace blockkv {

using internal::StrCat;
using internal::offload::Copy;
using internal::offload::Op;

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

// The cache's Reserve / Free. A block the store holds is marked lent in the cache, so that the
// cache's Free refuses it and a second store over the same cache cannot take it too.
class CacheOwner final : public OffloadStore::BlockOwner {
 public:
  using Lend = Status (*)(BlockedKVCache&, int, std::span<const BlockId>);
  using Return = void (*)(BlockedKVCache&, int, std::span<const BlockId>);
  CacheOwner(BlockedKVCache* cache, Lend lend, Return give_back)
      : cache_(cache), lend_(lend), return_(give_back) {}
  Status Take(int group, std::span<BlockId> out) override {
    return cache_->Reserve(static_cast<int32_t>(out.size()), out, group);
  }
  void Release(int group, std::span<const BlockId> blocks) override {
    return_(*cache_, group, blocks);
    const Status s = cache_->Free(blocks, group);
    BLOCKKV_CHECK(s.ok(), s.message().c_str());
  }
  Status Adopt(int group, std::span<const BlockId> blocks,
               std::span<const int32_t> /*store_holds: the lent marks count them*/) override {
    return lend_(*cache_, group, blocks);
  }
  void GiveBack(int group, std::span<const BlockId> blocks) override {
    return_(*cache_, group, blocks);
  }

 private:
  BlockedKVCache* cache_;
  Lend lend_;
  Return return_;
};

}  // namespace

Status OffloadStore::LendFromCache(BlockedKVCache& cache, int group,
                                   std::span<const BlockId> blocks) {
  std::vector<uint8_t>& lent = cache.pool(group).lent;
  const BlockedAllocator& allocator = cache.pool(group).allocator;
  for (const BlockId b : blocks) {
    if (!allocator.IsUsed(b)) {
      return FailedPreconditionError(StrCat("Offload: block ", b, " of group ", group,
                                            " is free: offload only blocks reserved from the "
                                            "cache"));
    }
    if (!lent.empty() && lent[b] != 0) {
      return FailedPreconditionError(
          StrCat("Offload: block ", b, " of group ", group,
                 " is an offload store's already (an offload of it is in flight, or failed and "
                 "kept it)"));
    }
  }
  if (lent.empty()) lent.assign(static_cast<size_t>(cache.num_blocks(group)), 0);
  for (const BlockId b : blocks) lent[b] = 1;
  return Status::Ok();
}

void OffloadStore::ReturnToCache(BlockedKVCache& cache, int group,
                                 std::span<const BlockId> blocks) {
  // (Also blocks a failed Restore took and gives back, which were never lent.)
  std::vector<uint8_t>& lent = cache.pool(group).lent;
  if (lent.empty()) return;
  for (const BlockId b : blocks) lent[b] = 0;
}

// ---- OffloadStore -------------------------------------------------------------------------------

Result<std::unique_ptr<OffloadStore>> OffloadStore::Create(BlockedKVCache* cache,
                                                           const OffloadConfig& config,
                                                           BlockOwner* owner) {
  if (cache == nullptr) return InvalidArgumentError("OffloadStore::Create: cache is null");
  BLOCKKV_RETURN_IF_ERROR(config.Validate());
  auto impl = std::make_unique<Impl>();
  static std::atomic<uint32_t> next_id{1};
  impl->id = next_id.fetch_add(1, std::memory_order_relaxed);
  if (impl->id == 0) impl->id = next_id.fetch_add(1, std::memory_order_relaxed);
  impl->cache = cache;
  if (owner == nullptr) {
    impl->own_owner = std::make_unique<CacheOwner>(cache, &LendFromCache, &ReturnToCache);
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
    group.layout.layer_stride = group.layout.chunk_bytes * cache->num_blocks(g);
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
    group.busy.assign(static_cast<size_t>(cache->num_blocks(g)), 0);
    group.held.assign(static_cast<size_t>(cache->num_blocks(g)), 0);
    group.marks.assign(static_cast<size_t>(cache->num_blocks(g)), 0);
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
      --impl_->groups[e.group].held[e.device];
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

Result<OffloadTicket> OffloadTicket::Join(const OffloadTicket& a, const OffloadTicket& b) {
  if (a.store_ == nullptr) return b;
  if (b.store_ == nullptr) return a;
  if (a.store_ != b.store_) {
    return InvalidArgumentError(
        "OffloadTicket::Join: the tickets are of two stores; wait for each on its own");
  }
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
  const int32_t num_blocks = m.cache->num_blocks(group);
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
  // Last, because it records the hand-over: the caller must hold every block.
  BLOCKKV_RETURN_IF_ERROR(m.owner->Adopt(group, blocks, g.held));
  std::vector<Copy> copies;
  copies.reserve(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int32_t index = m.NewEntry();
    Impl::Entry& e = m.entries[index];
    e.group = group;
    e.tier = tier;
    e.device = blocks[i];
    ++g.held[blocks[i]];
    const int32_t slot = free_slots.back();
    free_slots.pop_back();
    (tier == Tier::kHost ? e.host_slot : e.disk_slot) = slot;
    copies.push_back({tier == Tier::kHost ? Copy::kToHost : Copy::kToDisk, group, blocks[i],
                      e.host_slot, e.disk_slot, index, 0});
    out[i] = m.HandleOf(index);
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
      m.owner->GiveBack(e.group, std::span(&e.device, 1));
      --m.groups[e.group].held[e.device];
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
  if (group < 0 || group >= num_groups() || block < 0 || block >= m.cache->num_blocks(group)) {
    return OutOfRangeError(
        StrCat("CopyToHost: block ", block, " of group ", group, " does not exist"));
  }
  Impl::Group& g = m.groups[group];
  if (g.busy[block] != 0) {
    return FailedPreconditionError(StrCat("CopyToHost: block ", block, " of group ", group,
                                          " has a copy in flight; wait for its ticket"));
  }
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
  m.stats.copied_to_host += 1;
  m.stats.bytes_written += g.layout.block_bytes();
  return m.HandleOf(index);
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
  if (block < 0 || block >= m.cache->num_blocks(e.group)) {
    return OutOfRangeError(StrCat("CopyToDevice: block ", block, " does not exist"));
  }
  Impl::Group& g = m.groups[e.group];
  if (g.busy[block] != 0 || g.held[block] != 0) {
    return FailedPreconditionError(
        StrCat("CopyToDevice: block ", block, " of group ", e.group,
               g.busy[block] != 0 ? " has a copy in flight; wait for its ticket"
                                  : " is held by the store (an offload failed and kept it)"));
  }
  BLOCKKV_RETURN_IF_ERROR(
      m.sync_mover->FromHost(g.layout, m.HostSlot(e.group, e.host_slot), block));
  BLOCKKV_RETURN_IF_ERROR(m.sync_mover->Finish());
  m.stats.copied_to_device += 1;
  m.stats.bytes_read += g.layout.block_bytes();
  return Status::Ok();
}

Status OffloadStore::Drop(std::span<const OffloadHandle> handles) {
  Impl& m = *impl_;
  BLOCKKV_RETURN_IF_ERROR(m.CheckHandles(handles, -1, "Drop"));
  for (const OffloadHandle& h : handles) {
    Impl::Entry& e = m.entries[h.index];
    if (e.tier == Tier::kDevice) {
      m.owner->Release(e.group, std::span(&e.device, 1));
      --m.groups[e.group].held[e.device];
    }
    m.FreeEntry(h.index);
  }
  return Status::Ok();
}

Result<Tier> OffloadStore::tier(OffloadHandle handle) const {
  const Impl& m = *impl_;
  BLOCKKV_RETURN_IF_ERROR(m.CheckStore(handle, "handle"));
  if (!m.IsLive(handle)) {
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
uint32_t OffloadStore::id() const { return impl_->id; }
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
  for (size_t g = 0; g < m.groups.size(); ++g) {
    std::vector<int32_t> held(m.groups[g].held.size(), 0);
    for (const Impl::Entry& e : m.entries) {
      if (e.live && e.group == static_cast<int>(g) && e.device != kNoBlock) ++held[e.device];
    }
    if (held != m.groups[g].held) {
      return InternalError(StrCat("group ", g,
                                  ": the counts of handles holding device blocks "
                                  "disagree with the handles"));
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
