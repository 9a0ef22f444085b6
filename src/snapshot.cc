// SPDX-License-Identifier: Apache-2.0
// StateManager::SaveSnapshot and LoadSnapshot: a whole cache in one versioned, checksummed file.
// docs/snapshots.md describes the format field by field; in short, all little-endian:
//
//   header    magic "BKVSNAP\0", u32 version, u32 byte-order mark 0x01020304, u32 sections (4),
//             u32 0                                                                  (24 bytes)
//   sections  CONF, BLKS, SEQS, PRFX in this order, each: tag[4], u32 0, u64 length, payload,
//             u64 XXH3-64 of the tag through the payload
//   trailer   "END.", u32 0, u64 file length, u64 XXH3-64 of every byte before it   (24 bytes)
//
// Save streams block contents from the device through a bounded host buffer, so a save to a
// file needs host memory for the metadata only. Load checks every checksum, parses every section
// into staging structures, cross-checks them (snapshot_load.cc), and only then
// replaces the manager's state here, in ApplySnapshot.
#include "snapshot_codec.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/check.h"
#include "internal/host_memory.h"
#include "internal/strings.h"
#include "internal/uid_map.h"
#include "state_manager_keys.h"
#include "state_manager_offload.h"

namespace blockkv {

using internal::StrCat;

Status StateManager::Impl::CheckSnapshotable() const {
  for (int32_t slot = 0; slot < config_.max_tracked_sequences; ++slot) {
    if (!slots_.IsUsed(slot)) continue;
    const Sequence& seq = sequences_[slot];
    if (seq.in_flight_tokens_ != 0) {
      return FailedPreconditionError(StrCat("cannot snapshot: sequence ", seq.uid_, " has ",
                                            seq.in_flight_tokens_,
                                            " tokens in flight; take the snapshot after its "
                                            "PostForward"));
    }
    // A snapshot holds device blocks only, not the offload tiers.
    if (seq.preempted_ || (parked_ != nullptr && parked_[slot].resuming)) {
      return FailedPreconditionError(
          StrCat("cannot snapshot: sequence ", seq.uid_,
                 seq.preempted_ ? " is preempted (its blocks are in the offload tiers)"
                                : " is being resumed (its copy is not settled)",
                 "; resume and schedule it, or flush it, first"));
    }
  }
  for (int g = 0; g < num_groups(); ++g) {
    if (const int32_t held = engine_held_blocks(g); held > 0) {
      return FailedPreconditionError(StrCat("cannot snapshot: ", held, " blocks of cache group ", g,
                                            " from AllocateBlocks are not in any sequence's table; "
                                            "extend a sequence with them or free them first"));
    }
  }
  for (int g = 0; offload_ != nullptr && g < num_groups(); ++g) {
    if (const size_t held = offload_->held_blocks(g).size(); held > 0) {
      return FailedPreconditionError(StrCat("cannot snapshot: the offload store holds ", held,
                                            " blocks of cache group ", g,
                                            " (copies in flight); wait for their tickets first"));
    }
  }
  return Status::Ok();
}

namespace internal {
namespace {

using snapshot::Bytes;

// errno of a failed file operation as a status: the code says what the caller can do next.
Status IoError(std::string_view what, const std::string& path, int err, bool reading) {
  std::string message = StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return NotFoundError(std::move(message));
    case EACCES:
    case EPERM:
    case EROFS:
      return PermissionDeniedError(std::move(message));
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return ResourceExhaustedError(std::move(message));
    case EIO:
      return reading ? DataLossError(std::move(message)) : UnavailableError(std::move(message));
    default:
      return UnavailableError(std::move(message));
  }
}

Status WriteAll(int fd, Bytes bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("SaveSnapshot: writing", path, errno, /*reading=*/false);
    bytes = bytes.subspan(static_cast<size_t>(n));
  }
  return Status::Ok();
}

// The rename is durable once the directory holding the file is synced.
Status SyncDirectory(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("SaveSnapshot: opening directory", dir, errno, false);
  // Some file systems cannot sync a directory (EINVAL): the rename is as durable as they allow.
  const bool failed = ::fsync(fd) != 0 && errno != EINVAL;
  const int err = errno;
  ::close(fd);
  if (failed) return IoError("SaveSnapshot: syncing directory", dir, err, false);
  return Status::Ok();
}

// The whole file at `path`, which must be a regular file that host memory can hold.
Status ReadFile(const std::string& path, std::vector<std::byte>* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError("LoadSnapshot: opening", path, errno, /*reading=*/true);
  struct stat st {};
  Status s;
  if (::fstat(fd, &st) != 0) {
    s = IoError("LoadSnapshot: stat of", path, errno, true);
  } else if (!S_ISREG(st.st_mode)) {
    s = InvalidArgumentError(StrCat("LoadSnapshot: ", path, " is not a regular file"));
  } else if (const int64_t available = ReadHostMemory().available; st.st_size > available) {
    s = ResourceExhaustedError(StrCat("LoadSnapshot: ", path, " has ", st.st_size,
                                      " bytes, more than the ", available,
                                      " bytes of host memory available to stage it"));
  }
  if (s.ok()) {
    out->resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < out->size()) {
      const ssize_t n = ::read(fd, out->data() + got, out->size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        s = IoError("LoadSnapshot: reading", path, errno, true);
        break;
      }
      if (n == 0) break;  // the file shrank: the parser reports it truncated
      got += static_cast<size_t>(n);
    }
    out->resize(got);
  }
  ::close(fd);
  return s;
}

}  // namespace

// ---- load -------------------------------------------------------------------------------------

Status SnapshotCodec::Apply(StateManager::Impl& m, const snapshot::Staged& s) {
  // Offload copies in flight read and write device blocks: let them finish before the blocks
  // are overwritten, and give back the blocks they hold.
  if (m.offload_ != nullptr) m.offload_->WaitAll();
  // Block contents first: the only step that can fail (a device error).
  const Status written = WriteBlocks(m, s);
  // Empty the manager: every sequence flushed, then every cached block dropped.
  std::vector<SeqId> uids;
  m.by_uid_->ForEach([&](SeqId uid, int32_t) { uids.push_back(uid); });
  for (const SeqId uid : uids) {
    const Status flushed = m.FlushSequence(uid);
    BLOCKKV_CHECK(flushed.ok(), "LoadSnapshot: a tracked sequence could not be flushed");
  }
  if (m.offload_ != nullptr) m.offload_->WaitAll();  // blocks the flushes gave back
  m.ResetPrefixCache();  // every cached block, and the host level's copies when there is one
  if (!written.ok()) {
    return InternalError(StrCat("LoadSnapshot: ", written.message(),
                                "; the manager was emptied, since its blocks' contents are now "
                                "unspecified"));
  }
  // Every block of every pool taken with one reference, so that sequences and cached blocks
  // land on their own ids; that reference is dropped at the end. (Groups sharing a memory pool,
  // MemoryConfig::shared_pool, take its blocks once, at the pool's first group.)
  const auto groups = static_cast<size_t>(m.num_groups());
  std::vector<std::vector<BlockId>> all(groups);
  for (size_t g = 0; g < groups; ++g) {
    if (m.pool_lead_[g] != static_cast<int>(g)) continue;
    all[g].resize(static_cast<size_t>(m.pools_[g].num_blocks()));
    const Status taken = m.pools_[g].Take(m.pools_[g].num_blocks(), all[g]);
    BLOCKKV_CHECK(taken.ok(), "LoadSnapshot: an emptied manager still held blocks");
  }
  PlaceSequences(m, s);
  for (size_t g = 0; g < groups && m.prefix_ != nullptr; ++g) {
    for (const snapshot::StagedCached& c : s.cached[g]) {
      m.prefix_->Restore(static_cast<int>(g), c.View(), c.priority);
    }
  }
  // Drop the extra reference, per pool: held blocks keep their tables' references; unreferenced
  // cached blocks become evictable in the saved order (group after group in a shared pool); the
  // rest go back to the allocator highest id first, so that it hands out the lowest free id
  // first, as a fresh one does.
  for (size_t lead = 0; lead < groups; ++lead) {
    if (m.pool_lead_[lead] != static_cast<int>(lead)) continue;
    BlockPool& pool = m.pools_[lead];
    std::vector<BlockId> held;
    std::vector<BlockId> unused;
    for (BlockId b = pool.num_blocks() - 1; b >= 0; --b) {
      bool referenced = false;
      for (size_t g = lead; g < groups; ++g) {
        referenced = referenced || (m.pool_lead_[g] == static_cast<int>(lead) &&
                                    s.refs[g][static_cast<size_t>(b)] > 0);
      }
      if (referenced) {
        held.push_back(b);
      } else if (!pool.is_cached(b)) {
        unused.push_back(b);
      }
    }
    BLOCKKV_CHECK(pool.Release(held).ok(), "LoadSnapshot: a held block lost its reference");
    for (size_t g = lead; g < groups; ++g) {
      if (m.pool_lead_[g] != static_cast<int>(lead)) continue;
      BLOCKKV_CHECK(m.pools_[g].Release(s.evictable[g]).ok(),
                    "LoadSnapshot: an evictable block lost its reference");
    }
    BLOCKKV_CHECK(pool.Release(unused).ok(), "LoadSnapshot: an unused block lost its reference");
  }
  return Status::Ok();
}

Status SnapshotCodec::WriteBlocks(StateManager::Impl& m, const snapshot::Staged& s) {
  Device& device = *m.cache_->device();
  for (int g = 0; g < m.num_groups(); ++g) {
    const auto num_blocks = static_cast<size_t>(m.cache_->num_blocks(g));
    const snapshot::StagedBlocks& blocks = s.blocks[static_cast<size_t>(g)];
    const KVCacheConfig& c = m.cache_->config(g);
    const auto layer_block = static_cast<size_t>(LayerBlockBytes(c));
    BLOCKKV_ASSIGN_OR_RETURN(TensorView storage, m.cache_->GetGroupStorage(g));
    auto* base = static_cast<std::byte*>(storage.data);
    const size_t count = blocks.ids.size();
    for (size_t layer = 0; layer < static_cast<size_t>(c.num_caches()); ++layer) {
      BLOCKKV_RETURN_IF_ERROR(
          snapshot::ForEachRun(blocks.ids, count, [&](size_t i, size_t n) -> Status {
            std::byte* dst =
                base + (layer * num_blocks + static_cast<size_t>(blocks.ids[i])) * layer_block;
            const std::byte* src = blocks.data.data() + (layer * count + i) * layer_block;
            const Status copied =
                device.CopyFromHost(dst, src, static_cast<int64_t>(n * layer_block));
            if (copied.ok()) return Status::Ok();
            return {copied.code(), StrCat("copying blocks of cache group ", g,
                                          " to the device: ", copied.message())};
          }));
    }
  }
  return Status::Ok();
}

// Each sequence into its own slot, with its tables (one reference per held entry) and keys; the
// other slots go back to the slot allocator highest first, so the lowest is handed out next.
void SnapshotCodec::PlaceSequences(StateManager::Impl& m, const snapshot::Staged& s) {
  const auto tracked = static_cast<size_t>(m.config_.max_tracked_sequences);
  std::vector<BlockId> slots(tracked);
  const Status allocated = m.slots_.Allocate(static_cast<int32_t>(tracked), slots);
  BLOCKKV_CHECK(allocated.ok(), "LoadSnapshot: an emptied manager still held slots");
  std::vector<uint8_t> taken(tracked, 0);
  for (const snapshot::StagedSequence& staged : s.sequences) {
    Sequence& seq = m.sequences_[staged.slot];
    taken[static_cast<size_t>(staged.slot)] = 1;
    seq.uid_ = staged.uid;
    seq.slot_ = staged.slot;
    seq.seen_tokens_ = staged.seen_tokens;
    seq.in_flight_tokens_ = 0;
    seq.table_version_ = ++m.last_table_version_;
    seq.cached_prefix_tokens_ = staged.cached_prefix_tokens;
    seq.preempted_ = false;  // a snapshot holds no preempted sequence
    for (int g = 0; g < m.num_groups(); ++g) {
      const std::vector<BlockId>& row = staged.rows[static_cast<size_t>(g)];
      Sequence::GroupState& state = seq.groups_[g];
      state.allocated = static_cast<int32_t>(row.size());
      state.released = staged.released[static_cast<size_t>(g)];
      std::copy(row.begin(), row.end(), state.row);
      const Status shared =
          m.pools_[g].AddRef(std::span(row).subspan(static_cast<size_t>(state.released)));
      BLOCKKV_CHECK(shared.ok(), "LoadSnapshot: a table names a block not taken");
    }
    m.by_uid_->Insert(staged.uid, staged.slot);
    if (m.prefix_ != nullptr) {
      StateManager::Impl::SequenceKeys& keys = m.keys_[staged.slot];
      keys = staged.keys;
      keys.ns_id = m.prefix_->InternNamespace(keys.extras.ns);
    }
  }
  std::vector<BlockId> unused;
  for (size_t slot = tracked; slot-- > 0;) {
    if (taken[slot] == 0) unused.push_back(static_cast<BlockId>(slot));
  }
  const Status freed = m.slots_.Free(unused);
  BLOCKKV_CHECK(freed.ok(), "LoadSnapshot: a free slot could not be returned");
}

}  // namespace internal

// ---- the public calls -------------------------------------------------------------------------

// A started import's transfer is still writing into the blocks it took: a save would record
// them half read, a load would give them to the snapshot's sequences.
Status StateManager::Impl::RefuseWhileImporting(std::string_view who) const {
  if (imports_.empty()) return Status::Ok();
  return FailedPreconditionError(StrCat(who, ": ", imports_.size(),
                                        " started imports' blocks are still being read; "
                                        "CompleteImports once their transfers have finished"));
}

Result<std::vector<std::byte>> StateManager::Impl::SaveSnapshot() const {
  using internal::SnapshotCodec;
  BLOCKKV_RETURN_IF_ERROR(RefuseWhileImporting("SaveSnapshot"));
  BLOCKKV_ASSIGN_OR_RETURN(SnapshotCodec::SavePlan plan, SnapshotCodec::Plan(*this));
  if (const int64_t available = internal::ReadHostMemory().available;
      plan.file_length > static_cast<uint64_t>(available)) {
    return ResourceExhaustedError(StrCat("SaveSnapshot: the snapshot takes ", plan.file_length,
                                         " bytes, more than the ", available,
                                         " bytes of host memory available"));
  }
  std::vector<std::byte> bytes;
  bytes.reserve(plan.file_length);
  BLOCKKV_RETURN_IF_ERROR(SnapshotCodec::Write(*this, plan, [&](std::span<const std::byte> b) {
    bytes.insert(bytes.end(), b.begin(), b.end());
    return Status::Ok();
  }));
  return bytes;
}

Status StateManager::Impl::SaveSnapshot(const std::string& path) const {
  using internal::SnapshotCodec;
  BLOCKKV_RETURN_IF_ERROR(RefuseWhileImporting("SaveSnapshot"));
  const std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());  // a save killed part-way (kill -9) left it; none is in progress now
  BLOCKKV_ASSIGN_OR_RETURN(SnapshotCodec::SavePlan plan, SnapshotCodec::Plan(*this));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return internal::IoError("SaveSnapshot: creating", tmp, errno, /*reading=*/false);
  Status s = SnapshotCodec::Write(
      *this, plan, [&](std::span<const std::byte> b) { return internal::WriteAll(fd, b, tmp); });
  if (s.ok() && ::fsync(fd) != 0) s = internal::IoError("SaveSnapshot: syncing", tmp, errno, false);
  if (::close(fd) != 0 && s.ok()) {
    s = internal::IoError("SaveSnapshot: closing", tmp, errno, false);
  }
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = internal::IoError(StrCat("SaveSnapshot: renaming ", tmp, " to"), path, errno, false);
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return internal::SyncDirectory(path);
}

Status StateManager::Impl::LoadSnapshot(const std::string& path) {
  ::unlink((path + ".tmp").c_str());  // a stale one of a save killed part-way (as SaveSnapshot)
  std::vector<std::byte> bytes;
  BLOCKKV_RETURN_IF_ERROR(internal::ReadFile(path, &bytes));
  const Status s = LoadSnapshot(bytes);
  if (s.ok()) return Status::Ok();
  return {s.code(), StrCat(path, ": ", s.message())};
}

Status StateManager::Impl::LoadSnapshot(std::span<const std::byte> bytes) {
  using internal::SnapshotCodec;
  if (!exports_.empty()) {
    return FailedPreconditionError(
        StrCat("LoadSnapshot: ", exports_.size(), " exports are pending; CancelExport them first"));
  }
  BLOCKKV_RETURN_IF_ERROR(RefuseWhileImporting("LoadSnapshot"));
  internal::snapshot::Staged staged;
  BLOCKKV_RETURN_IF_ERROR(SnapshotCodec::Parse(*this, bytes, &staged));
  return SnapshotCodec::Apply(*this, staged);
}

}  // namespace blockkv
