// SPDX-License-Identifier: Apache-2.0
// SaveSnapshot's half of the codec: encoding the manager's metadata into the CONF, SEQS and PRFX
// sections, and writing a snapshot through a sink with the block contents streamed from the
// device. The format is described in snapshot.cc and docs/snapshots.md.
#include <algorithm>
#include <string>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/check.h"
#include "internal/strings.h"
#include "snapshot_codec.h"
#include "state_manager_keys.h"

namespace blockkv::internal {

using snapshot::Bytes;

// ---- save -------------------------------------------------------------------------------------

namespace snapshot {

Status Writer::Header() {
  Encoder e;
  e.Append(std::as_bytes(std::span(kMagic)));
  e.Put<uint32_t>(kFormatVersion);
  e.Put<uint32_t>(kByteOrderMark);
  e.Put<uint32_t>(kNumSections);
  e.Put<uint32_t>(0);
  return Put(e.bytes(), /*in_section=*/false);
}

Status Writer::Section(SectionId id, Bytes payload) {
  BLOCKKV_RETURN_IF_ERROR(Begin(id, payload.size()));
  BLOCKKV_RETURN_IF_ERROR(Data(payload));
  return End();
}

Status Writer::Begin(SectionId id, uint64_t length) {
  section_hash_ = Checksum64Stream();
  section_left_ = length;
  Encoder e;
  e.Append(std::as_bytes(std::span(kTags[id])));
  e.Put<uint32_t>(0);
  e.Put<uint64_t>(length);
  return Put(e.bytes(), /*in_section=*/true);
}

Status Writer::Data(Bytes bytes) {
  BLOCKKV_CHECK(bytes.size() <= section_left_, "SaveSnapshot: a section outgrew its length");
  section_left_ -= bytes.size();
  return Put(bytes, /*in_section=*/true);
}

Status Writer::End() {
  BLOCKKV_CHECK(section_left_ == 0, "SaveSnapshot: a section fell short of its length");
  const uint64_t checksum = section_hash_.Digest();
  return Put(std::as_bytes(std::span(&checksum, 1)), /*in_section=*/false);
}

Status Writer::Finish() {
  Encoder e;
  e.Append(std::as_bytes(std::span(kEndTag)));
  e.Put<uint32_t>(0);
  e.Put<uint64_t>(written_ + kTrailerBytes);
  BLOCKKV_RETURN_IF_ERROR(Put(e.bytes(), /*in_section=*/false));
  const uint64_t checksum = file_hash_.Digest();
  return Put(std::as_bytes(std::span(&checksum, 1)), /*in_section=*/false);
}

Status Writer::Put(Bytes bytes, bool in_section) {
  if (in_section) section_hash_.Update(bytes.data(), bytes.size());
  file_hash_.Update(bytes.data(), bytes.size());
  written_ += bytes.size();
  return sink_(bytes);
}

}  // namespace snapshot

namespace {

// Chain ids as saved: 1..n in the order of the manager's own (0 stays 0, "none"). A saved cache
// is then the same bytes whatever ids earlier history used up, and a loaded one saves again
// byte for byte.
uint64_t SavedChainId(const std::vector<uint64_t>& ids, uint64_t id) {
  if (id == 0) return 0;
  return static_cast<uint64_t>(std::lower_bound(ids.begin(), ids.end(), id) - ids.begin()) + 1;
}

}  // namespace

std::vector<std::byte> SnapshotCodec::EncodeConfig(const StateManager::Impl& m) {
  snapshot::Encoder e;
  e.Put<uint32_t>(static_cast<uint32_t>(m.num_groups()));
  for (int g = 0; g < m.num_groups(); ++g) {
    const KVCacheConfig& c = m.cache_->config(g);
    e.Put<int32_t>(c.block_size);
    e.Put<int32_t>(c.num_allocation_groups);
    for (const int64_t dim : c.cache_shape) e.Put<int64_t>(dim);
    e.Put<int32_t>(static_cast<int32_t>(c.cache_dtype));
    e.Put<int32_t>(c.max_blocks_per_allocation_group);
    e.Put<int32_t>(static_cast<int32_t>(c.type));  // format 2: the group's kind and its fields
    e.Put<int64_t>(c.latent_dim);
    e.Put<int64_t>(c.rope_dim);
    e.Put<int64_t>(c.state_bytes);
    e.Put<int32_t>(m.cache_->num_blocks(g));
  }
  e.Put<int32_t>(m.config_.max_tracked_sequences);
  e.Put<int64_t>(m.config_.max_context);
  const PrefixCacheConfig& prefix = m.config_.prefix_cache;
  e.PutBool(m.prefix_ != nullptr);
  e.Put<uint64_t>(prefix.hash_seed);
  const bool custom = prefix.hash_function != nullptr && prefix.hash_function != Xxh3BlockHash;
  e.Put<uint8_t>(custom ? snapshot::kHashCustom : snapshot::kHashXxh3);
  // Per group its window, or for the STATE group with checkpoints, their interval.
  for (int g = 0; g < m.num_groups(); ++g) {
    e.Put<int64_t>(g == m.checkpoint_group_ ? m.checkpoint_tokens_ : m.SlidingWindow(g));
  }
  return e.Take();
}

std::vector<uint64_t> SnapshotCodec::ChainIds(const StateManager::Impl& m) {
  std::vector<uint64_t> ids;
  if (m.prefix_ == nullptr) return ids;
  for (int g = 0; g < m.num_groups(); ++g) {
    for (const PrefixCache::CachedBlock& b : m.prefix_->CachedBlocks(g)) {
      ids.push_back(b.chain_id);
      if (b.parent_id != 0) ids.push_back(b.parent_id);
    }
  }
  for (int32_t slot = 0; slot < m.config_.max_tracked_sequences; ++slot) {
    if (!m.slots_.IsUsed(slot)) continue;
    for (const Keys::Group& g : m.keys_[slot].groups) {
      if (g.last.id != 0) ids.push_back(g.last.id);
    }
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

// Every tracked sequence in slot order: uid, slot, seen and cached-prefix tokens, per group its
// table entries [0, allocated) (released ones kNoBlock), and with prefix caching its keys.
std::vector<std::byte> SnapshotCodec::EncodeSequences(const StateManager::Impl& m,
                                                      const std::vector<uint64_t>& chain_ids) {
  snapshot::Encoder e;
  e.Put<uint64_t>(static_cast<uint64_t>(m.n_tracked_sequences()));
  for (int32_t slot = 0; slot < m.config_.max_tracked_sequences; ++slot) {
    if (!m.slots_.IsUsed(slot)) continue;
    const Sequence& seq = m.sequences_[slot];
    e.Put<int64_t>(seq.uid_);
    e.Put<int32_t>(slot);
    e.Put<int64_t>(seq.seen_tokens_);
    e.Put<int64_t>(seq.cached_prefix_tokens_);
    for (int g = 0; g < m.num_groups(); ++g) {
      e.Put<int32_t>(seq.groups_[g].allocated);
      e.Put<int32_t>(seq.groups_[g].released);
      e.Append(std::as_bytes(seq.block_table(g)));
    }
    if (m.prefix_ == nullptr) continue;
    const Keys& keys = m.keys_[slot];
    e.PutBool(keys.registered);
    e.PutBool(keys.looked_up);
    e.Put<int32_t>(keys.priority);
    e.PutString(keys.extras.ns);
    e.Put<int64_t>(keys.extras.adapter_id);
    e.Put<uint64_t>(keys.extras.block_bytes.size());
    for (const std::string& bytes : keys.extras.block_bytes) e.PutString(bytes);
    e.Put<uint64_t>(keys.tokens.size());
    e.Append(std::as_bytes(std::span(keys.tokens)));
    for (const Keys::Group& g : keys.groups) {
      e.Put<int32_t>(g.published);
      e.Put<uint64_t>(SavedChainId(chain_ids, g.last.id));
      e.PutHash(g.last.key);
    }
  }
  return e.Take();
}

// Per group every cached block in PrefixCache::CachedBlocks' order (restoring in it rebuilds the
// index as it is), then the evictable blocks in eviction order. Empty without prefix caching.
std::vector<std::byte> SnapshotCodec::EncodePrefix(const StateManager::Impl& m,
                                                   const std::vector<uint64_t>& chain_ids) {
  snapshot::Encoder e;
  if (m.prefix_ == nullptr) return e.Take();
  e.Put<uint64_t>(chain_ids.size());
  for (int g = 0; g < m.num_groups(); ++g) {
    const std::vector<PrefixCache::CachedBlock> cached = m.prefix_->CachedBlocks(g);
    e.Put<uint64_t>(cached.size());
    for (const PrefixCache::CachedBlock& b : cached) {
      e.Put<int32_t>(b.block);
      e.Put<int32_t>(m.pools_[g].priority(b.block));
      e.Put<uint64_t>(SavedChainId(chain_ids, b.chain_id));
      e.Put<uint64_t>(SavedChainId(chain_ids, b.parent_id));
      e.PutHash(b.key);
      e.PutHash(b.parent_key);
      e.Put<int64_t>(b.adapter_id);
      e.PutString(b.ns);
      e.PutString(b.bytes);
      e.Append(std::as_bytes(b.tokens));
    }
    // (A shared memory pool's order holds every group's blocks: each group saves its own.)
    std::vector<BlockId> evictable;
    m.pools_[g].ForEachEvictable([&](BlockId b) {
      if (m.pools_[g].cached_group(b) == g) evictable.push_back(b);
    });
    e.Put<uint64_t>(evictable.size());
    e.Append(std::as_bytes(std::span(evictable)));
  }
  return e.Take();
}

Result<SnapshotCodec::SavePlan> SnapshotCodec::Plan(const StateManager::Impl& m) {
  BLOCKKV_RETURN_IF_ERROR(m.CheckSnapshotable());
  if (m.prefix_ != nullptr && m.config_.prefix_cache.hash_function != nullptr &&
      m.config_.prefix_cache.hash_function != Xxh3BlockHash) {
    return FailedPreconditionError(
        "cannot snapshot: prefix_cache.hash_function is a custom function; a snapshot holds "
        "keys made by the default XXH3 only");
  }
  SavePlan plan;
  plan.config = EncodeConfig(m);
  const std::vector<uint64_t> chain_ids = ChainIds(m);
  plan.sequences = EncodeSequences(m, chain_ids);
  plan.prefix = EncodePrefix(m, chain_ids);
  plan.used.resize(static_cast<size_t>(m.num_groups()));
  for (int g = 0; g < m.num_groups(); ++g) {
    std::vector<BlockId>& used = plan.used[static_cast<size_t>(g)];
    if (!m.cache_->shared_pool()) {
      for (BlockId b = 0; b < m.pools_[g].num_blocks(); ++b) {
        if (m.cache_->allocator(g).IsUsed(b)) used.push_back(b);
      }
    } else {
      // A shared memory pool's used blocks belong to one group each: the group whose tables
      // hold it or that cached it (a snapshotable manager has no other holder).
      std::vector<uint8_t> mine(static_cast<size_t>(m.pools_[g].num_blocks()), 0);
      for (int32_t slot = 0; slot < m.config_.max_tracked_sequences; ++slot) {
        if (!m.slots_.IsUsed(slot)) continue;
        for (const BlockId b : m.sequences_[slot].block_table(g)) {
          if (b != kNoBlock) mine[static_cast<size_t>(b)] = 1;
        }
      }
      for (BlockId b = 0; b < m.pools_[g].num_blocks(); ++b) {
        const bool cached = m.pools_[g].is_cached(b) && m.pools_[g].cached_group(b) == g;
        if (mine[static_cast<size_t>(b)] != 0 || cached) used.push_back(b);
      }
    }
    plan.blocks_length += 16 + used.size() * (sizeof(BlockId) + BlockBytes(m, g));
  }
  plan.file_length = snapshot::kHeaderBytes + snapshot::kTrailerBytes +
                     snapshot::kNumSections * (snapshot::kSectionHeaderBytes + 8) +
                     plan.config.size() + plan.blocks_length + plan.sequences.size() +
                     plan.prefix.size();
  return plan;
}

uint64_t SnapshotCodec::BlockBytes(const StateManager::Impl& m, int g) {
  const KVCacheConfig& c = m.cache_->config(g);
  return static_cast<uint64_t>(c.num_caches() * LayerBlockBytes(c));
}

int64_t SnapshotCodec::LayerBlockBytes(const KVCacheConfig& c) {
  return c.elements_per_layer_block() * static_cast<int64_t>(ElementSize(c.cache_dtype));
}

Status SnapshotCodec::Write(const StateManager::Impl& m, const SavePlan& plan, const Sink& sink) {
  snapshot::Writer w(sink);
  BLOCKKV_RETURN_IF_ERROR(w.Header());
  BLOCKKV_RETURN_IF_ERROR(w.Section(snapshot::kConfig, plan.config));
  BLOCKKV_RETURN_IF_ERROR(w.Begin(snapshot::kBlocks, plan.blocks_length));
  for (int g = 0; g < m.num_groups(); ++g) {
    const std::vector<BlockId>& used = plan.used[static_cast<size_t>(g)];
    snapshot::Encoder head;
    head.Put<uint64_t>(BlockBytes(m, g));
    head.Put<uint64_t>(used.size());
    head.Append(std::as_bytes(std::span(used)));
    BLOCKKV_RETURN_IF_ERROR(w.Data(head.bytes()));
    BLOCKKV_RETURN_IF_ERROR(WriteContents(m, g, used, w));
  }
  BLOCKKV_RETURN_IF_ERROR(w.End());
  BLOCKKV_RETURN_IF_ERROR(w.Section(snapshot::kSequences, plan.sequences));
  BLOCKKV_RETURN_IF_ERROR(w.Section(snapshot::kPrefix, plan.prefix));
  BLOCKKV_RETURN_IF_ERROR(w.Finish());
  BLOCKKV_CHECK(w.written() == plan.file_length, "SaveSnapshot: planned and written sizes differ");
  return Status::Ok();
}

// Block contents, layer-major: [num_caches][used blocks][one layer's block], copied to the host
// in runs of consecutive ids through a buffer of at most kCopyChunkBytes (or one layer block).
Status SnapshotCodec::WriteContents(const StateManager::Impl& m, int g,
                                    std::span<const BlockId> used, snapshot::Writer& w) {
  if (used.empty()) return Status::Ok();
  const KVCacheConfig& c = m.cache_->config(g);
  const auto layer_block = static_cast<size_t>(LayerBlockBytes(c));
  BLOCKKV_ASSIGN_OR_RETURN(TensorView storage, m.cache_->GetGroupStorage(g));
  const auto* base = static_cast<const std::byte*>(storage.data);
  Device& device = *m.cache_->device();
  const size_t max_run = std::max<size_t>(1, snapshot::kCopyChunkBytes / layer_block);
  std::vector<std::byte> chunk(std::min(max_run, used.size()) * layer_block);
  const auto num_blocks = static_cast<size_t>(m.cache_->num_blocks(g));
  for (size_t layer = 0; layer < static_cast<size_t>(c.num_caches()); ++layer) {
    BLOCKKV_RETURN_IF_ERROR(snapshot::ForEachRun(used, max_run, [&](size_t i, size_t n) -> Status {
      const std::byte* src =
          base + (layer * num_blocks + static_cast<size_t>(used[i])) * layer_block;
      const Status copied =
          device.CopyToHost(chunk.data(), src, static_cast<int64_t>(n * layer_block));
      if (!copied.ok()) {
        return {copied.code(), StrCat("SaveSnapshot: copying blocks of cache group ", g,
                                      " to the host: ", copied.message())};
      }
      return w.Data(std::span(chunk).first(n * layer_block));
    }));
  }
  return Status::Ok();
}

}  // namespace blockkv::internal
