// SPDX-License-Identifier: Apache-2.0
// The snapshot codec shared by snapshot.cc (saving, files, applying a parsed snapshot),
// snapshot_save.cc (encoding) and snapshot_load.cc (parsing and checking): the format's
// constants, the field encoder and decoder, the checksumming writer, and the staging structures a
// load fills before it changes anything. docs/snapshots.md describes the format.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/check.h"
#include "internal/checksum.h"
#include "internal/strings.h"
#include "state_manager_impl.h"
#include "state_manager_keys.h"

namespace blockkv::internal {
namespace snapshot {

static_assert(std::endian::native == std::endian::little,
              "snapshots are written little-endian; add byte swaps for this machine");

using Bytes = std::span<const std::byte>;
using Tag = std::array<char, 4>;

inline constexpr std::array<char, 8> kMagic = {'B', 'K', 'V', 'S', 'N', 'A', 'P', '\0'};
inline constexpr uint32_t kFormatVersion = 2;  // 2: CONF holds each group's kind (issue 21)
inline constexpr uint32_t kByteOrderMark = 0x01020304;
inline constexpr size_t kHeaderBytes = 24;         // magic, version, mark, sections, 0
inline constexpr size_t kSectionHeaderBytes = 16;  // tag, 0, payload length
inline constexpr size_t kChecksumBytes = 8;
inline constexpr size_t kTrailerBytes = 24;                  // tag, 0, file length, checksum
inline constexpr size_t kCopyChunkBytes = size_t{16} << 20;  // host buffer of a save's copies
enum SectionId : size_t { kConfig, kBlocks, kSequences, kPrefix, kNumSections };
inline constexpr std::array<Tag, kNumSections> kTags = {
    {{'C', 'O', 'N', 'F'}, {'B', 'L', 'K', 'S'}, {'S', 'E', 'Q', 'S'}, {'P', 'R', 'F', 'X'}}};
inline constexpr Tag kEndTag = {'E', 'N', 'D', '.'};
inline constexpr uint8_t kHashXxh3 = 0;    // prefix_cache.hash_function: the default
inline constexpr uint8_t kHashCustom = 1;  // any other (never saved)

inline uint64_t Checksum(Bytes bytes) { return Checksum64(bytes.data(), bytes.size()); }
inline std::string_view TagName(SectionId id) { return {kTags[id].data(), kTags[id].size()}; }

// kDataLoss about the byte at `offset` of the file, in section `id`.
inline Status SectionError(SectionId id, size_t offset, std::string_view what) {
  return DataLossError(StrCat("snapshot ", TagName(id), " section, offset ", offset, ": ", what));
}

// Appends little-endian fields to a byte vector: metadata sections are built whole, then written.
class Encoder {
 public:
  template <class T>
  void Put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    Append(std::as_bytes(std::span(&value, 1)));
  }
  void PutBool(bool value) { Put<uint8_t>(value ? 1 : 0); }
  void PutHash(const BlockHash& hash) {
    Put(hash.lo);
    Put(hash.hi);
  }
  void PutString(std::string_view s) {  // u64 length, then the bytes
    Put<uint64_t>(s.size());
    Append(std::as_bytes(std::span(s)));
  }
  void Append(Bytes bytes) { bytes_.insert(bytes_.end(), bytes.begin(), bytes.end()); }
  const std::vector<std::byte>& bytes() const { return bytes_; }
  std::vector<std::byte> Take() { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

// Reads what Encoder wrote from one section's payload. A field running past the payload, or a
// value Fail is called about, is kDataLoss naming the section and the field's file offset.
class Decoder {
 public:
  Decoder(Bytes payload, size_t payload_offset, SectionId section)
      : payload_(payload), offset_(payload_offset), section_(section) {}

  template <class T>
  Status Get(T* out, std::string_view what) {
    static_assert(std::is_trivially_copyable_v<T>);
    mark_ = at_;
    if (payload_.size() - at_ < sizeof(T)) return Truncated(what);
    std::memcpy(out, payload_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Status::Ok();
  }
  Status GetBool(bool* out, std::string_view what) {
    uint8_t value = 0;
    BLOCKKV_RETURN_IF_ERROR(Get(&value, what));
    if (value > 1) return Fail(StrCat(what, " is ", int{value}, ", not 0 or 1"));
    *out = value == 1;
    return Status::Ok();
  }
  Status GetHash(BlockHash* out, std::string_view what) {
    const size_t start = at_;
    BLOCKKV_RETURN_IF_ERROR(Get(&out->lo, what));
    BLOCKKV_RETURN_IF_ERROR(Get(&out->hi, what));
    mark_ = start;
    return Status::Ok();
  }
  // A count of at most `limit` items of at least `item_bytes` each, which the rest of the payload
  // must be able to hold (so that no garbage count makes a huge allocation).
  Status GetCount(uint64_t* n, uint64_t limit, uint64_t item_bytes, std::string_view what) {
    BLOCKKV_RETURN_IF_ERROR(Get(n, what));
    if (*n > limit) return Fail(StrCat(what, " is ", *n, ", more than the limit ", limit));
    if (item_bytes > 0 && *n > (payload_.size() - at_) / item_bytes) return Truncated(what);
    return Status::Ok();
  }
  Status GetBytes(uint64_t n, Bytes* out, std::string_view what) {
    mark_ = at_;
    if (n > payload_.size() - at_) return Truncated(what);
    *out = payload_.subspan(at_, static_cast<size_t>(n));
    at_ += static_cast<size_t>(n);
    return Status::Ok();
  }
  Status GetString(std::string* out, std::string_view what) {
    uint64_t n = 0;
    Bytes bytes;
    BLOCKKV_RETURN_IF_ERROR(GetCount(&n, UINT64_MAX, 1, what));
    BLOCKKV_RETURN_IF_ERROR(GetBytes(n, &bytes, what));
    out->assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return Status::Ok();
  }
  // n elements of T (no count before them).
  template <class T>
  Status GetArray(uint64_t n, std::vector<T>* out, std::string_view what) {
    mark_ = at_;
    if (n > (payload_.size() - at_) / sizeof(T)) return Truncated(what);
    out->resize(static_cast<size_t>(n));
    if (n > 0) std::memcpy(out->data(), payload_.data() + at_, out->size() * sizeof(T));
    at_ += out->size() * sizeof(T);
    return Status::Ok();
  }

  // kDataLoss about the field read last, or about the one at payload position `at`.
  Status Fail(std::string_view what) const { return FailAt(mark_, what); }
  Status FailAt(size_t at, std::string_view what) const {
    return SectionError(section_, offset_ + at, what);
  }
  // kDataLoss when bytes are left after the last field.
  Status Finish() const {
    if (at_ == payload_.size()) return Status::Ok();
    return FailAt(at_, StrCat(payload_.size() - at_, " bytes left after the section's last field"));
  }
  size_t position() const { return at_; }  // in the payload
  size_t FileOffset(size_t at) const { return offset_ + at; }

 private:
  Status Truncated(std::string_view what) const {
    return Fail(StrCat(what, " runs past the end of the section (", payload_.size() - mark_,
                       " bytes left)"));
  }

  Bytes payload_;
  size_t offset_;  // file offset of payload_[0]
  SectionId section_;
  size_t at_ = 0;
  size_t mark_ = 0;  // where the field read last starts
};

// Writes a snapshot through a sink, hashing every section and the whole file as it goes.
class Writer {
 public:
  using Sink = std::function<Status(Bytes)>;
  explicit Writer(const Sink& sink) : sink_(sink) {}

  Status Header();
  Status Section(SectionId id, Bytes payload);
  // A section written piece by piece: Begin with its payload length, Data until it is all
  // written, End.
  Status Begin(SectionId id, uint64_t length);
  Status Data(Bytes bytes);
  Status End();
  Status Finish();  // the trailer
  uint64_t written() const { return written_; }

 private:
  Status Put(Bytes bytes, bool in_section);

  const Sink& sink_;
  Checksum64Stream file_hash_;
  Checksum64Stream section_hash_;
  uint64_t section_left_ = 0;
  uint64_t written_ = 0;
};

struct Staged;
struct StagedSequence;

}  // namespace snapshot

// Reads a StateManager's private state into a snapshot and rebuilds it from one (a friend).
class SnapshotCodec {
 public:
  using Keys = StateManager::Impl::SequenceKeys;  // what a sequence's keys are staged as
  using Sink = snapshot::Writer::Sink;
  // What a save writes besides block contents, built before its first byte is written.
  struct SavePlan {
    std::vector<std::byte> config;  // payloads
    std::vector<std::byte> sequences;
    std::vector<std::byte> prefix;
    std::vector<std::vector<BlockId>> used;  // per group: the blocks whose contents are saved
    uint64_t blocks_length = 0;              // of the BLKS payload
    uint64_t file_length = 0;
  };

  // Saving (snapshot.cc). Plan refuses what a snapshot cannot hold.
  static Result<SavePlan> Plan(const StateManager::Impl& m);
  static Status Write(const StateManager::Impl& m, const SavePlan& plan, const Sink& sink);

  // Loading: Parse checks everything (snapshot_load.cc); Apply then replaces the
  // manager's state and can fail only on a device error (snapshot.cc).
  static Status Parse(const StateManager::Impl& m, snapshot::Bytes bytes, snapshot::Staged* out);
  static Status Apply(StateManager::Impl& m, const snapshot::Staged& s);

  // Bytes of one block of group `g` in one layer, and in all of its layers.
  static int64_t LayerBlockBytes(const KVCacheConfig& c);
  static uint64_t BlockBytes(const StateManager::Impl& m, int g);

 private:
  static std::vector<std::byte> EncodeConfig(const StateManager::Impl& m);
  static std::vector<uint64_t> ChainIds(const StateManager::Impl& m);
  static std::vector<std::byte> EncodeSequences(const StateManager::Impl& m,
                                                const std::vector<uint64_t>& chain_ids);
  static std::vector<std::byte> EncodePrefix(const StateManager::Impl& m,
                                             const std::vector<uint64_t>& chain_ids);
  static Status WriteContents(const StateManager::Impl& m, int g, std::span<const BlockId> used,
                              snapshot::Writer& w);

  static Status ParseConfig(const StateManager::Impl& m, snapshot::Decoder& d);
  static Status ParseBlocks(const StateManager::Impl& m, snapshot::Decoder& d, snapshot::Staged* s);
  static Status ParseSequences(const StateManager::Impl& m, snapshot::Decoder& d,
                               snapshot::Staged* s);
  static Status ParseKeys(const StateManager::Impl& m, snapshot::Decoder& d,
                          snapshot::StagedSequence* q);
  static Status ParsePrefix(const StateManager::Impl& m, snapshot::Decoder& d, snapshot::Staged* s);
  static Status CheckKeysAgainstCache(const StateManager::Impl& m, const snapshot::Staged& s);

  static Status WriteBlocks(StateManager::Impl& m, const snapshot::Staged& s);
  static void PlaceSequences(StateManager::Impl& m, const snapshot::Staged& s);
};

namespace snapshot {

// Calls f(i, n) for each run ids[i, i + n) of consecutive block ids, n <= max_run: one device
// copy per run and layer instead of one per block. Stops at the first error f returns.
template <class F>
Status ForEachRun(std::span<const BlockId> ids, size_t max_run, F&& f) {
  for (size_t i = 0; i < ids.size();) {
    size_t n = 1;
    while (i + n < ids.size() && n < max_run && ids[i + n] == ids[i] + static_cast<BlockId>(n)) {
      ++n;
    }
    BLOCKKV_RETURN_IF_ERROR(f(i, n));
    i += n;
  }
  return Status::Ok();
}

// ---- what a load stages before it changes anything ----

struct StagedBlocks {
  std::vector<BlockId> ids;  // ascending
  Bytes data;                // [num_caches][ids][one layer's block], in the caller's bytes
  size_t ids_offset = 0;     // file offset of ids[0], for messages
};

struct StagedSequence {
  SeqId uid = 0;
  int32_t slot = 0;
  int64_t seen_tokens = 0;
  int64_t cached_prefix_tokens = 0;
  std::vector<int32_t> released;           // per group
  std::vector<std::vector<BlockId>> rows;  // per group, entries [0, allocated)
  SnapshotCodec::Keys keys;                // with prefix caching; ns_id is set when applied
  size_t offset = 0;                       // file offset of its record, for messages
};

struct StagedCached {
  BlockId block = kNoBlock;
  int32_t priority = 0;
  uint64_t chain_id = 0;
  uint64_t parent_id = 0;
  BlockHash key;
  BlockHash parent_key;
  int64_t adapter_id = 0;
  std::string ns;
  std::string bytes;
  std::vector<TokenId> tokens;

  PrefixCache::CachedBlock View() const {
    return {.block = block,
            .chain_id = chain_id,
            .parent_id = parent_id,
            .key = key,
            .parent_key = parent_key,
            .adapter_id = adapter_id,
            .ns = ns,
            .bytes = bytes,
            .tokens = tokens};
  }
};

struct Staged {
  std::vector<StagedBlocks> blocks;               // per group
  std::vector<std::vector<int32_t>> refs;         // per group [num_blocks]: table references
  std::vector<StagedSequence> sequences;          // in slot order
  std::vector<std::vector<StagedCached>> cached;  // per group, in restore order
  std::vector<std::vector<int32_t>> cached_at;    // per group [num_blocks]: index in cached, or -1
  std::vector<std::vector<BlockId>> evictable;    // per group, in eviction order
  uint64_t chain_ids = 0;                         // chain ids are 1..chain_ids
  size_t chain_ids_offset = 0;
};

}  // namespace snapshot
}  // namespace blockkv::internal
