// SPDX-License-Identifier: Apache-2.0
// LoadSnapshot's first half: checking a snapshot's framing and checksums, then parsing every
// section into staging structures and checking that they describe a state a manager with this
// one's configs could be in. Nothing here changes the manager; SnapshotCodec::Apply
// (snapshot.cc) does, once all of this has passed.
//
// What is checked, beyond the checksums: every config field against the manager's
// (kInvalidArgument); block ids in range, ascending and held once; tables within their capacity,
// kNoBlock exactly in their released entries and every other entry a block the snapshot holds;
// slots and uids unique and no more sequences than slots; seen tokens within max_context and
// the allocated blocks; every held block referenced by a table or cached; cached blocks held
// once, with chain ids that name their parent's before their own; the eviction order naming
// exactly the unreferenced cached blocks, lowest priority first; each sequence's published
// blocks cached, the last one as its keys remember it. What passes is what
// StateManager::CheckInvariants accepts.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/strings.h"
#include "snapshot_codec.h"
#include "state_manager_keys.h"

namespace blockkv::internal {

using snapshot::Bytes;
using snapshot::Decoder;
using snapshot::SectionError;
using snapshot::Staged;
using snapshot::StagedCached;
using snapshot::StagedSequence;

namespace {

template <class T>
T Load(Bytes bytes, size_t at) {
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof(T));
  return value;
}

std::string Hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016" PRIx64, value);
  return text;
}

Status FileError(size_t offset, std::string_view what) {
  return DataLossError(StrCat("snapshot, offset ", offset, ": ", what));
}

}  // namespace

namespace snapshot {
namespace {

// The header, each section's length and checksum, and the trailer; fills each section's payload
// and its file offset.
Status CheckFraming(Bytes file, std::array<Bytes, kNumSections>* payloads,
                    std::array<size_t, kNumSections>* offsets) {
  if (file.size() < kHeaderBytes) {
    return FileError(0, StrCat("truncated: ", file.size(), " bytes, fewer than the ", kHeaderBytes,
                               "-byte header"));
  }
  if (std::memcmp(file.data(), kMagic.data(), kMagic.size()) != 0) {
    return FileError(0, "not a blockkv snapshot (no \"BKVSNAP\" magic)");
  }
  if (const auto version = Load<uint32_t>(file, 8); version != kFormatVersion) {
    return FileError(
        8, StrCat("format version ", version, "; this build reads version ", kFormatVersion));
  }
  if (const auto mark = Load<uint32_t>(file, 12); mark != kByteOrderMark) {
    return FileError(12, StrCat("byte-order mark ", Hex(mark), ", expected ", Hex(kByteOrderMark),
                                " (written on a machine of the other byte order?)"));
  }
  if (Load<uint32_t>(file, 16) != kNumSections || Load<uint32_t>(file, 20) != 0) {
    return FileError(16, StrCat("the header declares ", Load<uint32_t>(file, 16),
                                " sections (flags ", Load<uint32_t>(file, 20), "); version ",
                                kFormatVersion, " has ", kNumSections, " (flags 0)"));
  }
  size_t at = kHeaderBytes;
  for (size_t i = 0; i < kNumSections; ++i) {
    const auto id = static_cast<SectionId>(i);
    const size_t left = file.size() - at;
    if (left < kSectionHeaderBytes + kChecksumBytes) {
      return FileError(at, StrCat("truncated: the file ends before section ", TagName(id)));
    }
    if (std::memcmp(file.data() + at, kTags[i].data(), kTags[i].size()) != 0 ||
        Load<uint32_t>(file, at + 4) != 0) {
      return FileError(at, StrCat("expected section ", TagName(id), " here"));
    }
    const auto length = Load<uint64_t>(file, at + 8);
    if (length > left - kSectionHeaderBytes - kChecksumBytes) {
      return FileError(at + 8, StrCat("truncated: section ", TagName(id), " declares ", length,
                                      " bytes, the file holds ",
                                      left - kSectionHeaderBytes - kChecksumBytes, " more"));
    }
    const size_t end = at + kSectionHeaderBytes + static_cast<size_t>(length);
    const auto stored = Load<uint64_t>(file, end);
    const uint64_t computed = Checksum(file.subspan(at, end - at));
    if (stored != computed) {
      return FileError(end, StrCat("section ", TagName(id), " is corrupt: checksum ", Hex(stored),
                                   " stored, ", Hex(computed), " computed"));
    }
    (*payloads)[i] = file.subspan(at + kSectionHeaderBytes, static_cast<size_t>(length));
    (*offsets)[i] = at + kSectionHeaderBytes;
    at = end + kChecksumBytes;
  }
  if (file.size() - at < kTrailerBytes) {
    return FileError(at, "truncated: the trailer is missing");
  }
  if (std::memcmp(file.data() + at, kEndTag.data(), kEndTag.size()) != 0 ||
      Load<uint32_t>(file, at + 4) != 0) {
    return FileError(at, "expected the trailer here");
  }
  if (const auto length = Load<uint64_t>(file, at + 8); length != file.size()) {
    return FileError(at + 8, StrCat("the trailer gives a file length of ", length,
                                    ", the file has ", file.size(), " bytes"));
  }
  const auto stored = Load<uint64_t>(file, at + 16);
  const uint64_t computed = Checksum(file.first(at + 16));
  if (stored != computed) {
    return FileError(at + 16, StrCat("the file is corrupt: checksum ", Hex(stored), " stored, ",
                                     Hex(computed), " computed"));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace snapshot

namespace {

template <class T>
Status Mismatch(std::string_view field, const T& expected, const T& found) {
  return InvalidArgumentError(StrCat("the snapshot does not fit this manager: ", field,
                                     ": expected ", expected, " (this manager), found ", found,
                                     " (the snapshot)"));
}

// Reads a T and compares it with this manager's value.
template <class T, class U>
Status Expect(Decoder& d, const std::string& field, U expected) {
  T found{};
  BLOCKKV_RETURN_IF_ERROR(d.Get(&found, field));
  if (found == static_cast<T>(expected)) return Status::Ok();
  return Mismatch(field, +static_cast<T>(expected), +found);  // + prints bytes as numbers
}

std::string DTypeLabel(int32_t dtype) {
  const auto d = static_cast<DType>(dtype);
  return IsValidDType(d) ? std::string(DTypeName(d)) : StrCat("dtype #", dtype);
}

}  // namespace

Status SnapshotCodec::Parse(const StateManager::Impl& m, Bytes bytes, Staged* s) {
  std::array<Bytes, snapshot::kNumSections> payloads;
  std::array<size_t, snapshot::kNumSections> offsets{};
  BLOCKKV_RETURN_IF_ERROR(snapshot::CheckFraming(bytes, &payloads, &offsets));
  auto decoder = [&](snapshot::SectionId id) { return Decoder(payloads[id], offsets[id], id); };
  Decoder config = decoder(snapshot::kConfig);
  BLOCKKV_RETURN_IF_ERROR(ParseConfig(m, config));
  Decoder blocks = decoder(snapshot::kBlocks);
  BLOCKKV_RETURN_IF_ERROR(ParseBlocks(m, blocks, s));
  Decoder sequences = decoder(snapshot::kSequences);
  BLOCKKV_RETURN_IF_ERROR(ParseSequences(m, sequences, s));
  Decoder prefix = decoder(snapshot::kPrefix);
  s->chain_ids_offset = offsets[snapshot::kPrefix];
  BLOCKKV_RETURN_IF_ERROR(ParsePrefix(m, prefix, s));
  // Groups sharing a memory pool hold disjoint blocks (one buffer holds both groups' contents).
  if (m.cache_->shared_pool()) {
    std::vector<int> owner(static_cast<size_t>(m.cache_->num_blocks()), -1);  // blocks, not slots
    for (int g = 0; g < m.num_groups(); ++g) {
      if (m.cache_->config(g).type == KVCacheType::kState) continue;  // a pool of its own
      for (const BlockId b : s->blocks[static_cast<size_t>(g)].ids) {
        int& first = owner[static_cast<size_t>(b)];
        if (first >= 0 && m.pool_lead_[first] == m.pool_lead_[g]) {
          return InvalidArgumentError(
              StrCat("the snapshot holds block ", b, " in cache groups ", first, " and ", g,
                     ", which share one pool in this manager (MemoryConfig.shared_pool): it was "
                     "saved from a manager with a pool per group"));
        }
        first = g;
      }
    }
  }
  // Every held block is in a table or cached: a free block has no contents worth saving.
  for (int g = 0; g < m.num_groups(); ++g) {
    const std::vector<BlockId>& ids = s->blocks[static_cast<size_t>(g)].ids;
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto b = static_cast<size_t>(ids[i]);
      if (s->refs[static_cast<size_t>(g)][b] == 0 && s->cached_at[static_cast<size_t>(g)][b] < 0) {
        return SectionError(
            snapshot::kBlocks, s->blocks[static_cast<size_t>(g)].ids_offset + i * sizeof(BlockId),
            StrCat("block ", ids[i], " of cache group ", g, " is neither in a table nor cached"));
      }
    }
  }
  return CheckKeysAgainstCache(m, *s);
}

Status SnapshotCodec::ParseConfig(const StateManager::Impl& m, Decoder& d) {
  BLOCKKV_RETURN_IF_ERROR(Expect<uint32_t>(d, "the number of cache groups", m.num_groups()));
  for (int g = 0; g < m.num_groups(); ++g) {
    const KVCacheConfig& c = m.cache_->config(g);
    const std::string group = StrCat("cache group ", g, " ");
    BLOCKKV_RETURN_IF_ERROR(Expect<int32_t>(d, group + "block_size", c.block_size));
    BLOCKKV_RETURN_IF_ERROR(
        Expect<int32_t>(d, group + "num_allocation_groups", c.num_allocation_groups));
    for (size_t i = 0; i < c.cache_shape.size(); ++i) {
      BLOCKKV_RETURN_IF_ERROR(
          Expect<int64_t>(d, StrCat(group, "cache_shape[", i, "]"), c.cache_shape[i]));
    }
    int32_t dtype = 0;
    BLOCKKV_RETURN_IF_ERROR(d.Get(&dtype, group + "cache_dtype"));
    if (dtype != static_cast<int32_t>(c.cache_dtype)) {
      return Mismatch(group + "cache_dtype", std::string(DTypeName(c.cache_dtype)),
                      DTypeLabel(dtype));
    }
    BLOCKKV_RETURN_IF_ERROR(Expect<int32_t>(d, group + "max_blocks_per_allocation_group",
                                            c.max_blocks_per_allocation_group));
    int32_t type = 0;
    BLOCKKV_RETURN_IF_ERROR(d.Get(&type, group + "type"));
    if (type != static_cast<int32_t>(c.type)) {
      const bool known = type >= 0 && type <= static_cast<int32_t>(KVCacheType::kMla);
      return Mismatch(group + "type", std::string(KVCacheTypeName(c.type)),
                      known ? std::string(KVCacheTypeName(static_cast<KVCacheType>(type)))
                            : StrCat("unknown (", type, ")"));
    }
    BLOCKKV_RETURN_IF_ERROR(Expect<int64_t>(d, group + "latent_dim", c.latent_dim));
    BLOCKKV_RETURN_IF_ERROR(Expect<int64_t>(d, group + "rope_dim", c.rope_dim));
    BLOCKKV_RETURN_IF_ERROR(Expect<int64_t>(d, group + "state_bytes", c.state_bytes));
    BLOCKKV_RETURN_IF_ERROR(Expect<int32_t>(d, group + "num_blocks", m.cache_->num_blocks(g)));
  }
  BLOCKKV_RETURN_IF_ERROR(
      Expect<int32_t>(d, "max_tracked_sequences", m.config_.max_tracked_sequences));
  BLOCKKV_RETURN_IF_ERROR(Expect<int64_t>(d, "max_context", m.config_.max_context));
  bool enabled = false;
  uint64_t seed = 0;
  uint8_t hash = 0;
  std::vector<int64_t> windows;
  BLOCKKV_RETURN_IF_ERROR(d.GetBool(&enabled, "prefix_cache.enabled"));
  BLOCKKV_RETURN_IF_ERROR(d.Get(&seed, "prefix_cache.hash_seed"));
  BLOCKKV_RETURN_IF_ERROR(d.Get(&hash, "prefix_cache.hash_function"));
  BLOCKKV_RETURN_IF_ERROR(
      d.GetArray(static_cast<uint64_t>(m.num_groups()), &windows, "prefix_cache.sliding_windows"));
  BLOCKKV_RETURN_IF_ERROR(d.Finish());
  if (enabled != (m.prefix_ != nullptr)) {
    auto on = [](bool b) { return std::string(b ? "on" : "off"); };
    return Mismatch("prefix_cache.enabled", on(m.prefix_ != nullptr), on(enabled));
  }
  if (!enabled) return Status::Ok();  // the rest configures a prefix cache neither has
  if (seed != m.config_.prefix_cache.hash_seed) {
    return Mismatch("prefix_cache.hash_seed", m.config_.prefix_cache.hash_seed, seed);
  }
  const PrefixCacheConfig& prefix = m.config_.prefix_cache;
  const bool custom = prefix.hash_function != nullptr && prefix.hash_function != Xxh3BlockHash;
  auto name = [](bool is_custom) { return std::string(is_custom ? "custom" : "XXH3"); };
  if (hash > snapshot::kHashCustom || (hash == snapshot::kHashCustom) != custom) {
    return Mismatch("prefix_cache.hash_function", name(custom),
                    hash > snapshot::kHashCustom ? StrCat("#", int{hash})
                                                 : name(hash == snapshot::kHashCustom));
  }
  for (int g = 0; g < m.num_groups(); ++g) {
    if (g == m.checkpoint_group_) {  // the STATE group: its checkpoint interval
      if (windows[static_cast<size_t>(g)] != m.checkpoint_tokens_) {
        return Mismatch("prefix_cache.state_checkpoint_tokens", int64_t{m.checkpoint_tokens_},
                        windows[static_cast<size_t>(g)]);
      }
    } else if (windows[static_cast<size_t>(g)] != m.SlidingWindow(g)) {
      return Mismatch(StrCat("prefix_cache.sliding_windows[", g, "]"), m.SlidingWindow(g),
                      windows[static_cast<size_t>(g)]);
    }
  }
  return Status::Ok();
}

// Per group: bytes per block, the held block ids (ascending), their contents.
Status SnapshotCodec::ParseBlocks(const StateManager::Impl& m, Decoder& d, Staged* s) {
  const auto groups = static_cast<size_t>(m.num_groups());
  s->blocks.resize(groups);
  s->refs.resize(groups);
  s->cached_at.resize(groups);
  for (size_t g = 0; g < groups; ++g) {
    const int32_t num_blocks = m.cache_->num_blocks(static_cast<int>(g));
    s->refs[g].assign(static_cast<size_t>(num_blocks), 0);
    s->cached_at[g].assign(static_cast<size_t>(num_blocks), -1);
    snapshot::StagedBlocks& blocks = s->blocks[g];
    const uint64_t block_bytes = BlockBytes(m, static_cast<int>(g));
    uint64_t found = 0;
    uint64_t count = 0;
    BLOCKKV_RETURN_IF_ERROR(d.Get(&found, "bytes per block"));
    if (found != block_bytes) {
      return d.Fail(StrCat("cache group ", g, " has ", found, " bytes per block; its config gives ",
                           block_bytes));
    }
    BLOCKKV_RETURN_IF_ERROR(d.GetCount(&count, static_cast<uint64_t>(num_blocks),
                                       sizeof(BlockId) + block_bytes,
                                       StrCat("the block count of cache group ", g)));
    const size_t ids_at = d.position();
    blocks.ids_offset = d.FileOffset(ids_at);
    BLOCKKV_RETURN_IF_ERROR(d.GetArray(count, &blocks.ids, "block ids"));
    for (size_t i = 0; i < blocks.ids.size(); ++i) {
      const BlockId b = blocks.ids[i];
      if (b < 0 || b >= num_blocks || (i > 0 && b <= blocks.ids[i - 1])) {
        return d.FailAt(ids_at + i * sizeof(BlockId),
                        StrCat("block id ", b, " of cache group ", g, " is outside [0, ",
                               num_blocks, ") or not above the id before it"));
      }
    }
    BLOCKKV_RETURN_IF_ERROR(d.GetBytes(count * block_bytes, &blocks.data, "block contents"));
  }
  return d.Finish();
}

Status SnapshotCodec::ParseSequences(const StateManager::Impl& m, Decoder& d, Staged* s) {
  const auto groups = static_cast<size_t>(m.num_groups());
  const int32_t tracked = m.config_.max_tracked_sequences;
  uint64_t count = 0;
  BLOCKKV_RETURN_IF_ERROR(
      d.GetCount(&count, static_cast<uint64_t>(tracked), 28 + 8 * groups, "the sequence count"));
  std::vector<uint8_t> slot_taken(static_cast<size_t>(tracked), 0);
  s->sequences.resize(static_cast<size_t>(count));
  for (StagedSequence& q : s->sequences) {
    q.offset = d.FileOffset(d.position());
    BLOCKKV_RETURN_IF_ERROR(d.Get(&q.uid, "uid"));
    BLOCKKV_RETURN_IF_ERROR(d.Get(&q.slot, "tracking slot"));
    if (q.slot < 0 || q.slot >= tracked || slot_taken[static_cast<size_t>(q.slot)] != 0) {
      return d.Fail(StrCat("sequence ", q.uid, ": tracking slot ", q.slot, " is outside [0, ",
                           tracked, ") or holds another sequence"));
    }
    slot_taken[static_cast<size_t>(q.slot)] = 1;
    BLOCKKV_RETURN_IF_ERROR(d.Get(&q.seen_tokens, "seen tokens"));
    if (q.seen_tokens < 0 || q.seen_tokens > m.token_limit_) {
      return d.Fail(StrCat("sequence ", q.uid, ": ", q.seen_tokens, " seen tokens, outside [0, ",
                           m.token_limit_, "]"));
    }
    BLOCKKV_RETURN_IF_ERROR(d.Get(&q.cached_prefix_tokens, "cached prefix tokens"));
    if (q.cached_prefix_tokens < 0 || q.cached_prefix_tokens > q.seen_tokens) {
      return d.Fail(StrCat("sequence ", q.uid, ": ", q.cached_prefix_tokens,
                           " cached prefix tokens, outside [0, seen tokens ", q.seen_tokens, "]"));
    }
    q.released.resize(groups);
    q.rows.resize(groups);
    for (size_t g = 0; g < groups; ++g) {
      int32_t allocated = 0;
      BLOCKKV_RETURN_IF_ERROR(d.Get(&allocated, "allocated blocks"));
      const int32_t capacity = m.max_blocks_per_sequence(static_cast<int>(g));
      const int64_t block_size = m.kv_block_size(static_cast<int>(g));
      if (allocated < 0 || allocated > capacity || q.seen_tokens > allocated * block_size) {
        return d.Fail(StrCat("sequence ", q.uid, " holds ", q.seen_tokens, " tokens in ", allocated,
                             " blocks of cache group ", g, " (of ", block_size,
                             " tokens; its table holds ", capacity, ")"));
      }
      BLOCKKV_RETURN_IF_ERROR(d.Get(&q.released[g], "released blocks"));
      if (q.released[g] < 0 || q.released[g] > allocated) {
        return d.Fail(StrCat("sequence ", q.uid, " released ", q.released[g], " of its ", allocated,
                             " blocks of cache group ", g));
      }
      const size_t row_at = d.position();
      BLOCKKV_RETURN_IF_ERROR(d.GetArray(static_cast<uint64_t>(allocated), &q.rows[g], "table"));
      for (size_t i = 0; i < q.rows[g].size(); ++i) {
        const BlockId b = q.rows[g][i];
        const bool released = i < static_cast<size_t>(q.released[g]);
        const bool held = b >= 0 && b < m.cache_->num_blocks(static_cast<int>(g)) &&
                          std::binary_search(s->blocks[g].ids.begin(), s->blocks[g].ids.end(), b);
        if (released ? b != kNoBlock : !held) {
          return d.FailAt(row_at + i * sizeof(BlockId),
                          StrCat("sequence ", q.uid, " cache group ", g, " entry ", i, " is ", b,
                                 released ? ", not kNoBlock (released)"
                                          : ", a block the blocks section does not hold"));
        }
        if (!released) ++s->refs[g][static_cast<size_t>(b)];
      }
    }
    if (m.prefix_ != nullptr) BLOCKKV_RETURN_IF_ERROR(ParseKeys(m, d, &q));
  }
  BLOCKKV_RETURN_IF_ERROR(d.Finish());
  std::vector<std::pair<SeqId, size_t>> uids;
  for (const StagedSequence& q : s->sequences) uids.emplace_back(q.uid, q.offset);
  std::sort(uids.begin(), uids.end());
  for (size_t i = 1; i < uids.size(); ++i) {
    if (uids[i].first == uids[i - 1].first) {
      return SectionError(snapshot::kSequences, uids[i].second,
                          StrCat("uid ", uids[i].first, " appears twice"));
    }
  }
  return Status::Ok();
}

// A sequence's SequenceKeys: what it registered and how far it has published.
Status SnapshotCodec::ParseKeys(const StateManager::Impl& m, Decoder& d, StagedSequence* q) {
  Keys& k = q->keys;
  BLOCKKV_RETURN_IF_ERROR(d.GetBool(&k.registered, "registered"));
  BLOCKKV_RETURN_IF_ERROR(d.GetBool(&k.looked_up, "looked up"));
  BLOCKKV_RETURN_IF_ERROR(d.Get(&k.priority, "priority"));
  if (k.priority < kMinRetentionPriority || k.priority > kMaxRetentionPriority) {
    return d.Fail(StrCat("sequence ", q->uid, ": priority ", k.priority, " is outside [",
                         kMinRetentionPriority, ", ", kMaxRetentionPriority, "]"));
  }
  BLOCKKV_RETURN_IF_ERROR(d.GetString(&k.extras.ns, "namespace"));
  BLOCKKV_RETURN_IF_ERROR(d.Get(&k.extras.adapter_id, "adapter id"));
  uint64_t n = 0;
  BLOCKKV_RETURN_IF_ERROR(d.GetCount(&n, UINT64_MAX, 8, "the count of per-block bytes"));
  k.extras.block_bytes.resize(static_cast<size_t>(n));
  for (std::string& bytes : k.extras.block_bytes) {
    BLOCKKV_RETURN_IF_ERROR(d.GetString(&bytes, "per-block bytes"));
  }
  BLOCKKV_RETURN_IF_ERROR(d.GetCount(&n, UINT64_MAX, sizeof(TokenId), "the known token count"));
  const size_t tokens_at = d.position();
  BLOCKKV_RETURN_IF_ERROR(d.GetArray(n, &k.tokens, "known tokens"));
  for (size_t i = 0; i < k.tokens.size(); ++i) {
    if (k.tokens[i] < 0) {
      return d.FailAt(tokens_at + i * sizeof(TokenId),
                      StrCat("sequence ", q->uid, ": token ", i, " is ", k.tokens[i]));
    }
  }
  k.groups.resize(static_cast<size_t>(m.num_groups()));
  for (size_t g = 0; g < k.groups.size(); ++g) {
    Keys::Group& state = k.groups[g];
    BLOCKKV_RETURN_IF_ERROR(d.Get(&state.published, "published blocks"));
    BLOCKKV_RETURN_IF_ERROR(d.Get(&state.last.id, "last published chain id"));
    BLOCKKV_RETURN_IF_ERROR(d.GetHash(&state.last.key, "last published key"));
    if (state.published < 0 || state.published > std::ssize(q->rows[g]) ||
        (state.published == 0) != (state.last.id == 0)) {
      return d.Fail(StrCat("sequence ", q->uid, " published ", state.published,
                           " blocks of cache group ", g, " (of ", q->rows[g].size(),
                           "), the last as chain id ", state.last.id));
    }
  }
  return Status::Ok();
}

// Per group: the cached blocks, then the eviction order. Empty without prefix caching.
Status SnapshotCodec::ParsePrefix(const StateManager::Impl& m, Decoder& d, Staged* s) {
  const auto groups = static_cast<size_t>(m.num_groups());
  s->cached.resize(groups);
  s->evictable.resize(groups);
  if (m.prefix_ == nullptr) return d.Finish();
  BLOCKKV_RETURN_IF_ERROR(d.Get(&s->chain_ids, "the chain id count"));
  uint64_t cached_total = 0;
  for (size_t g = 0; g < groups; ++g) {
    const int32_t block_size = m.prefix_->block_size(static_cast<int>(g));  // STATE: interval
    uint64_t count = 0;
    const int32_t num_blocks = m.cache_->num_blocks(static_cast<int>(g));
    BLOCKKV_RETURN_IF_ERROR(d.GetCount(&count, static_cast<uint64_t>(num_blocks),
                                       80 + sizeof(TokenId) * static_cast<uint64_t>(block_size),
                                       StrCat("the cached block count of cache group ", g)));
    cached_total += count;
    s->cached[g].resize(static_cast<size_t>(count));
    for (size_t i = 0; i < s->cached[g].size(); ++i) {
      StagedCached& c = s->cached[g][i];
      BLOCKKV_RETURN_IF_ERROR(d.Get(&c.block, "cached block id"));
      const auto b = static_cast<size_t>(c.block);
      if (c.block < 0 || c.block >= num_blocks ||
          !std::binary_search(s->blocks[g].ids.begin(), s->blocks[g].ids.end(), c.block) ||
          s->cached_at[g][b] >= 0) {
        return d.Fail(StrCat("cached block ", c.block, " of cache group ", g,
                             " is not held in the blocks section, or is listed twice"));
      }
      s->cached_at[g][b] = static_cast<int32_t>(i);
      BLOCKKV_RETURN_IF_ERROR(d.Get(&c.priority, "priority"));
      if (c.priority < kMinRetentionPriority || c.priority > kMaxRetentionPriority) {
        return d.Fail(StrCat("cached block ", c.block, ": priority ", c.priority));
      }
      BLOCKKV_RETURN_IF_ERROR(d.Get(&c.chain_id, "chain id"));
      BLOCKKV_RETURN_IF_ERROR(d.Get(&c.parent_id, "parent chain id"));
      if (c.chain_id == 0 || c.chain_id > s->chain_ids || c.parent_id >= c.chain_id) {
        return d.Fail(StrCat("cached block ", c.block, ": chain id ", c.chain_id, ", parent's ",
                             c.parent_id, "; ids are in [1, ", s->chain_ids,
                             "] and a parent's comes first"));
      }
      BLOCKKV_RETURN_IF_ERROR(d.GetHash(&c.key, "key"));
      BLOCKKV_RETURN_IF_ERROR(d.GetHash(&c.parent_key, "parent key"));
      BLOCKKV_RETURN_IF_ERROR(d.Get(&c.adapter_id, "adapter id"));
      BLOCKKV_RETURN_IF_ERROR(d.GetString(&c.ns, "namespace"));
      BLOCKKV_RETURN_IF_ERROR(d.GetString(&c.bytes, "extra bytes"));
      BLOCKKV_RETURN_IF_ERROR(
          d.GetArray(static_cast<uint64_t>(block_size), &c.tokens, "cached tokens"));
      if (std::any_of(c.tokens.begin(), c.tokens.end(), [](TokenId t) { return t < 0; })) {
        return d.Fail(StrCat("cached block ", c.block, " holds a negative token id"));
      }
    }
    // The eviction order: exactly the unreferenced cached blocks, each once, lowest priority
    // first (within a priority the order is the LRU order, anything goes).
    uint64_t n = 0;
    BLOCKKV_RETURN_IF_ERROR(d.GetCount(&n, count, sizeof(BlockId), "the evictable block count"));
    const size_t order_at = d.position();
    BLOCKKV_RETURN_IF_ERROR(d.GetArray(n, &s->evictable[g], "eviction order"));
    std::vector<uint8_t> listed(static_cast<size_t>(num_blocks), 0);
    int32_t last_priority = kMinRetentionPriority;
    for (size_t i = 0; i < s->evictable[g].size(); ++i) {
      const BlockId b = s->evictable[g][i];
      const bool ok =
          b >= 0 && b < num_blocks && s->cached_at[g][static_cast<size_t>(b)] >= 0 &&
          s->refs[g][static_cast<size_t>(b)] == 0 && listed[static_cast<size_t>(b)] == 0 &&
          s->cached[g][static_cast<size_t>(s->cached_at[g][static_cast<size_t>(b)])].priority >=
              last_priority;
      if (!ok) {
        return d.FailAt(order_at + i * sizeof(BlockId),
                        StrCat("evictable block ", b, " of cache group ", g,
                               " is not an unreferenced cached block, is listed twice, or comes "
                               "after a block of higher priority"));
      }
      listed[static_cast<size_t>(b)] = 1;
      last_priority =
          s->cached[g][static_cast<size_t>(s->cached_at[g][static_cast<size_t>(b)])].priority;
    }
    const auto unreferenced = std::count_if(
        s->cached[g].begin(), s->cached[g].end(),
        [&](const StagedCached& c) { return s->refs[g][static_cast<size_t>(c.block)] == 0; });
    if (static_cast<uint64_t>(unreferenced) != n) {
      return d.FailAt(order_at, StrCat("cache group ", g, " lists ", n, " evictable blocks; ",
                                       unreferenced, " cached blocks are unreferenced"));
    }
  }
  BLOCKKV_RETURN_IF_ERROR(d.Finish());
  // Chain ids are saved as 1..n over the ids in use: each cached block names at most two, each
  // sequence one per group. A larger count is corrupt (and would push later ids towards 2^64).
  const uint64_t most = 2 * cached_total + s->sequences.size() * groups;
  if (s->chain_ids > most) {
    return SectionError(snapshot::kPrefix, s->chain_ids_offset,
                        StrCat("the chain id count ", s->chain_ids, " is more than the ", most,
                               " ids its blocks and sequences can use"));
  }
  return Status::Ok();
}

// Each sequence's published blocks are cached, and the last one it published, when it still
// holds it, is cached as the sequence remembers it (what its next publish chains from).
Status SnapshotCodec::CheckKeysAgainstCache(const StateManager::Impl& m, const Staged& s) {
  if (m.prefix_ == nullptr) return Status::Ok();
  for (const StagedSequence& q : s.sequences) {
    for (size_t g = 0; g < q.rows.size(); ++g) {
      const Keys::Group& state = q.keys.groups[g];
      const std::vector<int32_t>& cached_at = s.cached_at[g];
      std::string wrong;
      for (int32_t i = q.released[g]; i < state.published && wrong.empty(); ++i) {
        if (cached_at[static_cast<size_t>(q.rows[g][static_cast<size_t>(i)])] < 0) {
          wrong = StrCat("its published entry ", i, " is not cached");
        }
      }
      if (wrong.empty() && state.last.id > s.chain_ids) {
        wrong = StrCat("its last publish has chain id ", state.last.id, ", past ", s.chain_ids);
      }
      if (wrong.empty() && state.published > q.released[g]) {
        const BlockId last = q.rows[g][static_cast<size_t>(state.published - 1)];
        const StagedCached& c =
            s.cached[g][static_cast<size_t>(cached_at[static_cast<size_t>(last)])];
        if (c.chain_id != state.last.id || !(c.key == state.last.key)) {
          wrong = StrCat("block ", last, ", its last publish, is cached as chain id ", c.chain_id,
                         ", not ", state.last.id, " with its key");
        }
      }
      if (!wrong.empty()) {
        return SectionError(snapshot::kSequences, q.offset,
                            StrCat("sequence ", q.uid, " cache group ", g, ": ", wrong));
      }
    }
  }
  return Status::Ok();
}

}  // namespace blockkv::internal
