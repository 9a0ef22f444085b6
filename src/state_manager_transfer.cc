// SPDX-License-Identifier: Apache-2.0
// Sequence transfer between engines (docs/transfer.md): ExportSequence, ImportSequence,
// CancelExport and CompleteExports over internal::TransferEndpoint (transfer.h).
//
// Descriptor (all little-endian; a u64 length before every string):
//   magic "BKVXFER\0", u32 version
//   string layout, u64 fingerprint (XXH3-64 of layout), i32 tp_rank, i32 tp_size
//   string the sender worker's UCX address, u64 transfer id
//   i64 uid, i64 seen_tokens, u64 token count, i32 tokens[count]
//   string namespace, i64 adapter_id, i32 retention priority, u32 count, string block_bytes[count]
//   u32 regions, per region: u64 base, u64 length, string packed rkey
//   u32 groups, per group: u32 region, u64 base, i32 num_blocks, i32 released, u32 blocks,
//                          i32 ids[blocks] (table entries [released, released + blocks))
//   u64 XXH3-64 of every byte before it
#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "blockkv/state_manager.h"
#include "internal/block_size.h"
#include "internal/checksum.h"
#include "internal/strings.h"
#include "internal/uid_map.h"
#include "snapshot_codec.h"
#include "state_manager_impl.h"
#include "state_manager_keys.h"
#include "transfer.h"

namespace blockkv {

using internal::StrCat;
using internal::TransferEndpoint;
using internal::TransferGet;
using internal::TransferRegion;

namespace {

constexpr std::array<char, 8> kMagic = {'B', 'K', 'V', 'X', 'F', 'E', 'R', '\0'};
// 2: the tensor-parallel rank and world size; 3: the sequence's key extras and priority.
constexpr uint32_t kVersion = 3;

std::string Hex(uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x0000000000000000";
  for (int i = 17; i >= 2; --i, v >>= 4) s[static_cast<size_t>(i)] = kDigits[v & 15];
  return s;
}

// Reads the descriptor; any field running past the end is kInvalidArgument naming it.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <class T>
  Status Get(T* out, std::string_view what) {
    if (bytes_.size() - at_ < sizeof(T)) return Truncated(what);
    std::memcpy(out, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Status::Ok();
  }
  // A count of items of `item_bytes` each that the rest of the descriptor must hold.
  template <class T>
  Status GetCount(T* n, uint64_t item_bytes, std::string_view what) {
    BLOCKKV_RETURN_IF_ERROR(Get(n, what));
    if (item_bytes > 0 && static_cast<uint64_t>(*n) > (bytes_.size() - at_) / item_bytes) {
      return Truncated(what);
    }
    return Status::Ok();
  }
  Status GetString(std::string* out, std::string_view what) {
    uint64_t n = 0;
    BLOCKKV_RETURN_IF_ERROR(GetCount(&n, 1, what));
    out->assign(reinterpret_cast<const char*>(bytes_.data() + at_), static_cast<size_t>(n));
    at_ += static_cast<size_t>(n);
    return Status::Ok();
  }
  template <class T>
  Status GetArray(size_t n, std::vector<T>* out, std::string_view what) {
    if (n > (bytes_.size() - at_) / sizeof(T)) return Truncated(what);
    out->resize(n);
    if (n > 0) std::memcpy(out->data(), bytes_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return Status::Ok();
  }
  size_t position() const { return at_; }

 private:
  Status Truncated(std::string_view what) const {
    return InvalidArgumentError(StrCat("ImportSequence: the descriptor is truncated: ", what,
                                       " at byte ", at_, " runs past its end (", bytes_.size(),
                                       " bytes)"));
  }
  std::span<const std::byte> bytes_;
  size_t at_ = 0;
};

// A descriptor's per-group part.
struct RemoteGroup {
  uint32_t region = 0;
  uint64_t base = 0;
  int32_t num_blocks = 0;
  int32_t released = 0;
  std::vector<BlockId> ids;
};

struct Descriptor {
  std::string layout;
  uint64_t fingerprint = 0;
  int32_t tp_rank = 0;
  int32_t tp_size = 0;
  std::string address;
  uint64_t transfer_id = 0;
  SeqId uid = 0;
  int64_t seen_tokens = 0;
  std::vector<TokenId> tokens;
  SequenceOptions options;  // its key extras (namespace, adapter, per-block bytes) and priority
  std::vector<TransferRegion> regions;
  std::vector<RemoteGroup> groups;
};

Status Parse(std::span<const std::byte> bytes, Descriptor* d) {
  constexpr size_t kMin = sizeof(kMagic) + sizeof(uint32_t) + sizeof(uint64_t);
  if (bytes.size() < kMin) {
    return InvalidArgumentError(StrCat("ImportSequence: the descriptor has ", bytes.size(),
                                       " bytes, fewer than the ", kMin, " of an empty one"));
  }
  if (std::memcmp(bytes.data(), kMagic.data(), kMagic.size()) != 0) {
    return InvalidArgumentError(
        "ImportSequence: not a sequence descriptor (its magic is not BKVXFER)");
  }
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + kMagic.size(), sizeof(version));
  if (version != kVersion) {
    return InvalidArgumentError(StrCat("ImportSequence: descriptor version ", version,
                                       "; this blockkv reads version ", kVersion));
  }
  const std::span<const std::byte> body = bytes.first(bytes.size() - sizeof(uint64_t));
  uint64_t checksum = 0;
  std::memcpy(&checksum, bytes.data() + body.size(), sizeof(checksum));
  if (const uint64_t actual = internal::Checksum64(body.data(), body.size()); actual != checksum) {
    return InvalidArgumentError(StrCat("ImportSequence: the descriptor is corrupt: checksum ",
                                       Hex(actual), ", recorded ", Hex(checksum)));
  }
  Reader r(body.subspan(kMagic.size() + sizeof(uint32_t)));
  BLOCKKV_RETURN_IF_ERROR(r.GetString(&d->layout, "layout"));
  BLOCKKV_RETURN_IF_ERROR(r.Get(&d->fingerprint, "fingerprint"));
  BLOCKKV_RETURN_IF_ERROR(r.Get(&d->tp_rank, "tp_rank"));
  BLOCKKV_RETURN_IF_ERROR(r.Get(&d->tp_size, "tp_size"));
  BLOCKKV_RETURN_IF_ERROR(r.GetString(&d->address, "sender address"));
  BLOCKKV_RETURN_IF_ERROR(r.Get(&d->transfer_id, "transfer id"));
  BLOCKKV_RETURN_IF_ERROR(r.Get(&d->uid, "uid"));
  BLOCKKV_RETURN_IF_ERROR(r.Get(&d->seen_tokens, "seen tokens"));
  uint64_t n_tokens = 0;
  BLOCKKV_RETURN_IF_ERROR(r.GetCount(&n_tokens, sizeof(TokenId), "token count"));
  BLOCKKV_RETURN_IF_ERROR(r.GetArray(static_cast<size_t>(n_tokens), &d->tokens, "tokens"));
  BLOCKKV_RETURN_IF_ERROR(r.GetString(&d->options.keys.ns, "namespace"));
  BLOCKKV_RETURN_IF_ERROR(r.Get(&d->options.keys.adapter_id, "adapter id"));
  BLOCKKV_RETURN_IF_ERROR(r.Get(&d->options.priority, "priority"));
  uint32_t n_extra = 0;
  BLOCKKV_RETURN_IF_ERROR(r.GetCount(&n_extra, sizeof(uint64_t), "block bytes count"));
  d->options.keys.block_bytes.resize(n_extra);
  for (std::string& extra : d->options.keys.block_bytes) {
    BLOCKKV_RETURN_IF_ERROR(r.GetString(&extra, "block bytes"));
  }
  uint32_t n_regions = 0;
  BLOCKKV_RETURN_IF_ERROR(r.GetCount(&n_regions, 24, "region count"));
  d->regions.resize(n_regions);
  for (TransferRegion& region : d->regions) {
    BLOCKKV_RETURN_IF_ERROR(r.Get(&region.base, "region base"));
    BLOCKKV_RETURN_IF_ERROR(r.Get(&region.length, "region length"));
    BLOCKKV_RETURN_IF_ERROR(r.GetString(&region.rkey, "region rkey"));
  }
  uint32_t n_groups = 0;
  BLOCKKV_RETURN_IF_ERROR(r.GetCount(&n_groups, 24, "group count"));
  d->groups.resize(n_groups);
  for (RemoteGroup& g : d->groups) {
    BLOCKKV_RETURN_IF_ERROR(r.Get(&g.region, "group region"));
    BLOCKKV_RETURN_IF_ERROR(r.Get(&g.base, "group base"));
    BLOCKKV_RETURN_IF_ERROR(r.Get(&g.num_blocks, "group num_blocks"));
    BLOCKKV_RETURN_IF_ERROR(r.Get(&g.released, "group released"));
    uint32_t n = 0;
    BLOCKKV_RETURN_IF_ERROR(r.GetCount(&n, sizeof(BlockId), "group block count"));
    BLOCKKV_RETURN_IF_ERROR(r.GetArray(n, &g.ids, "group block ids"));
  }
  if (r.position() + kMagic.size() + sizeof(uint32_t) != body.size()) {
    return InvalidArgumentError(StrCat("ImportSequence: the descriptor has ",
                                       body.size() - r.position() - kMagic.size() - 4,
                                       " bytes after its last field"));
  }
  return Status::Ok();
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Status internal::ValidateTransferConfig(const TransferConfig& config) {
  if (config.timeout_ms <= 0) {
    return InvalidArgumentError(
        StrCat("TransferConfig.timeout_ms is ", config.timeout_ms, "; it must be > 0"));
  }
  if (config.export_timeout_ms < 0) {
    return InvalidArgumentError(StrCat("TransferConfig.export_timeout_ms is ",
                                       config.export_timeout_ms, "; it must be >= 0 (0: never)"));
  }
  if (config.tp_size < 1 || config.tp_rank < 0 || config.tp_rank >= config.tp_size) {
    return InvalidArgumentError(StrCat("TransferConfig: tp_rank is ", config.tp_rank,
                                       " and tp_size ", config.tp_size,
                                       "; they must satisfy 0 <= tp_rank < tp_size"));
  }
  return Status::Ok();
}

// ---- setup --------------------------------------------------------------------------------------

std::string StateManager::Impl::TransferLayout() const {
  std::string s;
  for (int g = 0; g < num_groups(); ++g) {
    const KVCacheConfig& c = cache_->config(g);
    s += StrCat(g == 0 ? "" : "; ", "group ", g, ": type ", static_cast<int>(c.type),
                ", block_size ", c.block_size, ", shape [");
    for (size_t i = 0; i < c.cache_shape.size(); ++i) {
      s += StrCat(i == 0 ? "" : ", ", c.cache_shape[i]);
    }
    s += StrCat("], ", DTypeName(c.cache_dtype), ", latent_dim ", c.latent_dim, ", rope_dim ",
                c.rope_dim, ", layer block bytes ", internal::SnapshotCodec::LayerBlockBytes(c));
  }
  return s;
}

Status StateManager::Impl::EnableTransfer() {
  if (Status valid = internal::ValidateTransferConfig(*config_.transfer); !valid.ok()) {
    return {valid.code(), StrCat("StateManagerConfig.transfer: ", valid.message())};
  }
  // One registration per memory pool (groups sharing a pool share it).
  std::vector<TransferEndpoint::Memory> memory;
  transfer_region_.assign(static_cast<size_t>(num_groups()), 0);
  std::vector<const void*> seen;
  for (int g = 0; g < num_groups(); ++g) {
    BLOCKKV_ASSIGN_OR_RETURN(TensorView storage, cache_->GetGroupStorage(g));
    const auto at = std::find(seen.begin(), seen.end(), storage.data);
    if (at != seen.end()) {
      transfer_region_[static_cast<size_t>(g)] = static_cast<uint32_t>(at - seen.begin());
      continue;
    }
    transfer_region_[static_cast<size_t>(g)] = static_cast<uint32_t>(seen.size());
    seen.push_back(storage.data);
    const KVCacheConfig& c = cache_->config(g);
    memory.push_back({.data = storage.data,
                      .length = static_cast<size_t>(c.num_caches()) *
                                static_cast<size_t>(cache_->num_blocks(g)) *
                                static_cast<size_t>(internal::SnapshotCodec::LayerBlockBytes(c))});
  }
  Result<std::unique_ptr<TransferEndpoint>> endpoint =
      TransferEndpoint::Open(*config_.transfer, memory);
  if (!endpoint.ok()) {
    return {endpoint.status().code(),
            StrCat("StateManagerConfig.transfer: ", endpoint.status().message())};
  }
  transfer_ = std::move(*endpoint);
  transfer_layout_ = TransferLayout();
  transfer_fingerprint_ = internal::Checksum64(transfer_layout_.data(), transfer_layout_.size());
  return Status::Ok();
}

Status StateManager::Impl::RequireTransfer(std::string_view who) const {
  if (transfer_ == nullptr) {
    return FailedPreconditionError(
        StrCat(who, ": sequence transfer is off (StateManagerConfig.transfer is not set)"));
  }
  return Status::Ok();
}

// ---- sender -------------------------------------------------------------------------------------

Result<std::vector<std::byte>> StateManager::Impl::ExportSequence(SeqId uid) {
  BLOCKKV_RETURN_IF_ERROR(RequireTransfer("ExportSequence"));
  CompleteExports();
  Sequence* seq = Find(uid);
  if (seq == nullptr) {
    return NotFoundError(StrCat("ExportSequence: sequence ", uid, " is not tracked"));
  }
  if (seq->exported_) {
    return FailedPreconditionError(
        StrCat("ExportSequence: sequence ", uid, " is exported already; CancelExport it first"));
  }
  BLOCKKV_RETURN_IF_ERROR(RequireResident(*seq, StrCat("ExportSequence: sequence ", uid)));
  if (seq->in_flight_tokens_ != 0) {
    return FailedPreconditionError(StrCat("ExportSequence: sequence ", uid, " has ",
                                          seq->in_flight_tokens_,
                                          " tokens in flight; export after PostForward"));
  }
  const uint64_t id = transfer_->AddExport();
  internal::snapshot::Encoder e;
  e.Append(std::as_bytes(std::span(kMagic)));
  e.Put<uint32_t>(kVersion);
  e.PutString(transfer_layout_);
  e.Put<uint64_t>(transfer_fingerprint_);
  e.Put<int32_t>(config_.transfer->tp_rank);
  e.Put<int32_t>(config_.transfer->tp_size);
  e.PutString(transfer_->address());
  e.Put<uint64_t>(id);
  e.Put<int64_t>(uid);
  e.Put<int64_t>(seq->seen_tokens_);
  const std::vector<TokenId>* tokens = nullptr;
  if (prefix_ != nullptr && keys_[seq->slot_].registered) tokens = &keys_[seq->slot_].tokens;
  e.Put<uint64_t>(tokens != nullptr ? tokens->size() : 0);
  if (tokens != nullptr) e.Append(std::as_bytes(std::span(*tokens)));
  // The keys its blocks are cached under here, so the receiver caches them under the same: a
  // tenant's blocks stay its own, an adapter's KV is never taken for the base model's.
  const SequenceKeys* keys = tokens != nullptr ? &keys_[seq->slot_] : nullptr;
  const BlockKeyExtras none;
  const BlockKeyExtras& extras = keys != nullptr ? keys->extras : none;
  e.PutString(extras.ns);
  e.Put<int64_t>(extras.adapter_id);
  e.Put<int32_t>(keys != nullptr ? keys->priority : kDefaultRetentionPriority);
  e.Put<uint32_t>(static_cast<uint32_t>(extras.block_bytes.size()));
  for (const std::string& extra : extras.block_bytes) e.PutString(extra);
  const std::vector<TransferRegion>& regions = transfer_->regions();
  e.Put<uint32_t>(static_cast<uint32_t>(regions.size()));
  for (const TransferRegion& region : regions) {
    e.Put<uint64_t>(region.base);
    e.Put<uint64_t>(region.length);
    e.PutString(region.rkey);
  }
  e.Put<uint32_t>(static_cast<uint32_t>(num_groups()));
  for (int g = 0; g < num_groups(); ++g) {
    const Sequence::GroupState& state = seq->groups_[g];
    const auto used = static_cast<int32_t>(block_sizes_[g].BlocksFor(seq->seen_tokens_));
    const int32_t released = std::min(state.released, used);
    const uint32_t region = transfer_region_[static_cast<size_t>(g)];
    e.Put<uint32_t>(region);
    e.Put<uint64_t>(regions[region].base);
    e.Put<int32_t>(cache_->num_blocks(g));
    e.Put<int32_t>(released);
    e.Put<uint32_t>(static_cast<uint32_t>(used - released));
    e.Append(std::as_bytes(std::span(state.row + released, static_cast<size_t>(used - released))));
  }
  std::vector<std::byte> out = e.Take();
  const uint64_t checksum = internal::Checksum64(out.data(), out.size());
  const auto* c = reinterpret_cast<const std::byte*>(&checksum);
  out.insert(out.end(), c, c + sizeof(checksum));
  seq->exported_ = true;
  const int32_t after_ms = config_.transfer->export_timeout_ms;
  exports_.push_back({.id = id,
                      .uid = uid,
                      .expires_ns = after_ms == 0 ? std::numeric_limits<int64_t>::max()
                                                  : NowNs() + int64_t{after_ms} * 1'000'000});
  return out;
}

int32_t StateManager::Impl::CompleteExports() {
  if (transfer_ == nullptr || exports_.empty()) return 0;
  // Expired: the ones no receiver was granted are un-pinned and stay here (a granted one waits for
  // its receiver's DONE or ABORT, or CancelExport).
  if (const int32_t after_ms = config_.transfer->export_timeout_ms; after_ms > 0) {
    const int64_t now = NowNs();
    std::erase_if(exports_, [&](const PendingExport& p) {
      if (p.expires_ns > now || !transfer_->ExpireExport(p.id, after_ms)) return false;
      if (Sequence* seq = Find(p.uid)) seq->exported_ = false;
      return true;
    });
  }
  if (!transfer_->has_done()) return 0;
  int32_t done = 0;
  for (const uint64_t id : transfer_->TakeDone()) {
    const auto it = std::find_if(exports_.begin(), exports_.end(),
                                 [id](const PendingExport& p) { return p.id == id; });
    if (it == exports_.end()) continue;
    const SeqId uid = it->uid;
    exports_.erase(it);
    if (Sequence* seq = Find(uid); seq != nullptr && seq->exported_) {
      seq->exported_ = false;
      const Status flushed = FlushSequence(uid);
      BLOCKKV_CHECK(flushed.ok(), "an exported sequence could not be flushed");
      ++done;
    }
  }
  return done;
}

Result<CancelledExport> StateManager::Impl::CancelExport(SeqId uid) {
  BLOCKKV_RETURN_IF_ERROR(RequireTransfer("CancelExport"));
  CompleteExports();
  const auto it = std::find_if(exports_.begin(), exports_.end(),
                               [uid](const PendingExport& p) { return p.uid == uid; });
  if (it == exports_.end()) {
    return NotFoundError(StrCat("CancelExport: sequence ", uid, " has no pending export"));
  }
  CancelledExport taken = CancelledExport::kUnclaimed;
  switch (transfer_->CancelExport(it->id)) {
    case TransferEndpoint::Cancelled::kPending:
    case TransferEndpoint::Cancelled::kUnknown:
      break;
    case TransferEndpoint::Cancelled::kGranted:
      taken = CancelledExport::kGranted;
      break;
    case TransferEndpoint::Cancelled::kDone:
      // The receiver's DONE arrived between CompleteExports and now: it is the receiver's.
      CompleteExports();
      return FailedPreconditionError(StrCat(
          "CancelExport: sequence ", uid, " was imported by its receiver already; it is flushed"));
  }
  if (Sequence* seq = Find(uid)) seq->exported_ = false;
  exports_.erase(it);
  return taken;
}

// ---- receiver -----------------------------------------------------------------------------------

Result<Sequence*> StateManager::Impl::ImportSequence(std::span<const std::byte> bytes) {
  BLOCKKV_ASSIGN_OR_RETURN(const ImportTicket ticket, StartImport(bytes));
  // Started last, so it is the last pending import.
  (void)ticket.Wait();
  BLOCKKV_RETURN_IF_ERROR(FinishImport(imports_.size() - 1));
  return Find(ticket.uid());
}

Result<ImportTicket> StateManager::Impl::StartImport(std::span<const std::byte> bytes) {
  BLOCKKV_RETURN_IF_ERROR(RequireTransfer("ImportSequence"));
  CompleteExports();
  Descriptor d;
  BLOCKKV_RETURN_IF_ERROR(Parse(bytes, &d));
  if (const TransferConfig& mine = *config_.transfer;
      d.tp_rank != mine.tp_rank || d.tp_size != mine.tp_size) {
    return InvalidArgumentError(
        StrCat("ImportSequence: sequence ", d.uid, " comes from tensor-parallel rank ", d.tp_rank,
               " of ", d.tp_size, "; this engine is rank ", mine.tp_rank, " of ", mine.tp_size,
               " (TransferConfig.tp_rank / tp_size): each rank imports its own rank's shard"));
  }
  if (d.fingerprint != transfer_fingerprint_ || d.layout != transfer_layout_) {
    return InvalidArgumentError(StrCat("ImportSequence: the sender's KV layout (fingerprint ",
                                       Hex(d.fingerprint), ": ", d.layout,
                                       ") differs from this engine's (fingerprint ",
                                       Hex(transfer_fingerprint_), ": ", transfer_layout_, ")"));
  }
  const SeqId uid = d.uid;
  if (d.groups.size() != static_cast<size_t>(num_groups())) {
    return InvalidArgumentError(StrCat("ImportSequence: the descriptor has ", d.groups.size(),
                                       " cache groups, this engine ", num_groups()));
  }
  if (d.seen_tokens < 0 || d.seen_tokens > token_limit_) {
    return InvalidArgumentError(StrCat("ImportSequence: sequence ", uid, " has ", d.seen_tokens,
                                       " tokens; this engine holds at most ", token_limit_,
                                       " per sequence (max_context and the block tables)"));
  }
  for (size_t i = 0; i < d.tokens.size(); ++i) {
    if (d.tokens[i] < 0) {
      return InvalidArgumentError(
          StrCat("ImportSequence: token ", i, " of sequence ", uid, " is ", d.tokens[i]));
    }
  }
  if (static_cast<int64_t>(d.tokens.size()) > config_.max_context) {
    return InvalidArgumentError(StrCat("ImportSequence: sequence ", uid, " has ", d.tokens.size(),
                                       " known tokens, max_context=", config_.max_context));
  }
  // Every group's blocks and where they are on the sender, checked before anything is taken.
  std::vector<int32_t> needed(static_cast<size_t>(num_groups()), 0);
  for (int g = 0; g < num_groups(); ++g) {
    const RemoteGroup& rg = d.groups[static_cast<size_t>(g)];
    const auto used = static_cast<int32_t>(block_sizes_[g].BlocksFor(d.seen_tokens));
    if (rg.released < 0 || rg.released > used ||
        static_cast<int64_t>(rg.ids.size()) != used - rg.released) {
      return InvalidArgumentError(StrCat("ImportSequence: group ", g, " of the descriptor holds ",
                                         rg.ids.size(), " blocks after ", rg.released,
                                         " released; ", d.seen_tokens, " tokens need ", used));
    }
    if (rg.region >= d.regions.size()) {
      return InvalidArgumentError(StrCat("ImportSequence: group ", g, " names region ", rg.region,
                                         " of ", d.regions.size()));
    }
    const KVCacheConfig& c = cache_->config(g);
    const auto lbb = static_cast<uint64_t>(internal::SnapshotCodec::LayerBlockBytes(c));
    const TransferRegion& region = d.regions[rg.region];
    const uint64_t span = static_cast<uint64_t>(c.num_caches()) *
                          static_cast<uint64_t>(std::max(rg.num_blocks, 0)) * lbb;
    if (rg.num_blocks <= 0 || rg.base < region.base || rg.base - region.base > region.length ||
        span > region.length - (rg.base - region.base)) {
      return InvalidArgumentError(StrCat("ImportSequence: group ", g, "'s memory (", rg.num_blocks,
                                         " blocks at ", Hex(rg.base),
                                         ") lies outside the sender's registered region"));
    }
    for (const BlockId id : rg.ids) {
      if (id < 0 || id >= rg.num_blocks) {
        return InvalidArgumentError(StrCat("ImportSequence: group ", g, " names block ", id,
                                           " of the sender's ", rg.num_blocks));
      }
    }
    needed[static_cast<size_t>(g)] = static_cast<int32_t>(rg.ids.size());
  }
  if (Find(uid) != nullptr) {
    return AlreadyExistsError(StrCat("ImportSequence: sequence ", uid, " is already tracked"));
  }
  if (slots_.free_blocks() == 0) {
    return ResourceExhaustedError(StrCat("ImportSequence: no tracking slot for sequence ", uid,
                                         ": all ", config_.max_tracked_sequences, " are in use"));
  }
  if (d.options.priority < kMinRetentionPriority || d.options.priority > kMaxRetentionPriority) {
    return InvalidArgumentError(StrCat("ImportSequence: sequence ", uid, " has priority ",
                                       d.options.priority, ", outside [", kMinRetentionPriority,
                                       ", ", kMaxRetentionPriority, "]"));
  }
  // The leading full blocks this engine caches already are not copied: their entries share the
  // cached blocks, matched under the sequence's own key extras (prefix caching on, the tokens
  // known). The hit is the longest prefix, in whole blocks of every full-attention group, that
  // every one of them caches (as the scheduler's lookup). A sliding-window group's blocks (at
  // most its window) and a STATE group's slot (the state after every token) are always read. A
  // full-attention table with released blocks copies everything.
  std::vector<std::vector<BlockId>> hits(static_cast<size_t>(num_groups()));
  int64_t hit_tokens = 0;
  const auto full_attention = [&](int g) {
    return cache_->config(g).type != KVCacheType::kState && SlidingWindow(g) == 0;
  };
  bool skip_cached = prefix_ != nullptr && static_cast<int64_t>(d.tokens.size()) >= d.seen_tokens;
  int64_t step = 0;  // the lcm of the full-attention groups' block sizes; 0: there are none
  for (int g = 0; g < num_groups() && skip_cached; ++g) {
    if (!full_attention(g)) continue;
    skip_cached = d.groups[static_cast<size_t>(g)].released == 0;
    step = std::lcm(std::max<int64_t>(step, 1), int64_t{kv_block_size(g)});
  }
  skip_cached = skip_cached && step > 0;
  if (skip_cached) {
    const std::span<const TokenId> tokens =
        std::span(d.tokens).first(static_cast<size_t>(d.seen_tokens));
    const int32_t ns = prefix_->InternNamespace(d.options.keys.ns);
    hit_tokens = d.seen_tokens;
    for (int g = 0; g < num_groups(); ++g) {
      if (!full_attention(g)) continue;
      std::vector<BlockId>& blocks = hits[static_cast<size_t>(g)];
      const auto full = static_cast<int32_t>(d.seen_tokens / kv_block_size(g));
      blocks.resize(static_cast<size_t>(full));
      BlockHash last;
      const int32_t run = prefix_->Match(g, tokens, ns, d.options.keys, full, blocks, &last);
      hit_tokens = std::min(hit_tokens, int64_t{run} * kv_block_size(g));
    }
    hit_tokens -= hit_tokens % step;
  }
  for (int g = 0; g < num_groups(); ++g) {
    hits[static_cast<size_t>(g)].resize(
        full_attention(g) ? static_cast<size_t>(hit_tokens / kv_block_size(g)) : 0);
  }
  // All or nothing: every pool's need against its free blocks before any is taken (a cached
  // block the hit revives is no longer free).
  std::vector<int64_t> pool_need(static_cast<size_t>(num_groups()), 0);
  for (int g = 0; g < num_groups(); ++g) {
    const std::vector<BlockId>& shared = hits[static_cast<size_t>(g)];
    int64_t& need = pool_need[static_cast<size_t>(pool_lead_[g])];
    need += needed[static_cast<size_t>(g)] - std::ssize(shared);
    for (const BlockId b : shared) need += pools_[g].is_evictable(b) ? 1 : 0;
  }
  for (int g = 0; g < num_groups(); ++g) {
    if (pool_need[static_cast<size_t>(g)] > pools_[g].free_blocks()) {
      return ResourceExhaustedError(
          StrCat("ImportSequence: sequence ", uid, " needs ", pool_need[static_cast<size_t>(g)],
                 " blocks of cache group ", g, "'s pool, ", pools_[g].free_blocks(), " are free"));
    }
  }
  std::vector<std::vector<BlockId>> local(static_cast<size_t>(num_groups()));
  std::vector<std::vector<size_t>> order(static_cast<size_t>(num_groups()));  // by remote id
  const auto give_back = [&] {
    for (int g = 0; g < num_groups(); ++g) {
      const Status released = pools_[g].Release(local[static_cast<size_t>(g)]);
      BLOCKKV_CHECK(released.ok(), "ImportSequence: a block it took had no reference");
    }
  };
  for (int g = 0; g < num_groups(); ++g) {
    const std::vector<BlockId>& shared = hits[static_cast<size_t>(g)];
    if (shared.empty()) continue;
    const Status referenced = pools_[g].AddRef(shared);
    BLOCKKV_CHECK(referenced.ok(), "ImportSequence: a matched block was neither held nor cached");
  }
  for (int g = 0; g < num_groups(); ++g) {
    std::vector<BlockId>& blocks = local[static_cast<size_t>(g)];
    blocks = hits[static_cast<size_t>(g)];  // entries [0, skip) are cached blocks
    const size_t skip = blocks.size();
    blocks.resize(static_cast<size_t>(needed[static_cast<size_t>(g)]));
    const auto fresh = static_cast<int32_t>(blocks.size() - skip);
    const Status taken = pools_[g].Take(fresh, std::span(blocks).subspan(skip));
    if (!taken.ok()) {
      blocks.resize(skip);
      give_back();
      return taken;
    }
    // Which local block holds which table entry is ours to choose: the k-th smallest local id
    // takes the entry of the k-th smallest remote id, so a run of consecutive remote ids lands in
    // consecutive local ones and is one get per layer (free lists hand out blocks in the order
    // they were freed, which need not be ascending on either side).
    std::vector<size_t>& by_remote = order[static_cast<size_t>(g)];  // the entries to read
    by_remote.resize(blocks.size() - skip);
    std::iota(by_remote.begin(), by_remote.end(), skip);
    const std::vector<BlockId>& ids = d.groups[static_cast<size_t>(g)].ids;
    std::sort(by_remote.begin(), by_remote.end(),
              [&ids](size_t a, size_t b) { return ids[a] < ids[b]; });
    std::vector<BlockId> ascending(blocks.begin() + static_cast<std::ptrdiff_t>(skip),
                                   blocks.end());
    std::sort(ascending.begin(), ascending.end());
    for (size_t k = 0; k < by_remote.size(); ++k) blocks[by_remote[k]] = ascending[k];
  }
  // One get per layer and run of blocks consecutive on both sides.
  std::vector<TransferGet> gets;
  for (int g = 0; g < num_groups(); ++g) {
    const RemoteGroup& rg = d.groups[static_cast<size_t>(g)];
    const std::vector<BlockId>& mine = local[static_cast<size_t>(g)];
    const std::vector<size_t>& by_remote = order[static_cast<size_t>(g)];
    const KVCacheConfig& c = cache_->config(g);
    const auto lbb = static_cast<uint64_t>(internal::SnapshotCodec::LayerBlockBytes(c));
    BLOCKKV_ASSIGN_OR_RETURN(TensorView storage, cache_->GetGroupStorage(g));
    auto* const base = static_cast<std::byte*>(storage.data);
    const auto local_blocks = static_cast<uint64_t>(cache_->num_blocks(g));
    const auto remote_blocks = static_cast<uint64_t>(rg.num_blocks);
    for (int64_t layer = 0; layer < c.num_caches(); ++layer) {
      const auto l = static_cast<uint64_t>(layer);
      for (size_t k = 0; k < by_remote.size();) {
        const size_t i = by_remote[k];
        size_t n = 1;
        while (k + n < by_remote.size() &&
               mine[by_remote[k + n]] == mine[i] + static_cast<BlockId>(n) &&
               rg.ids[by_remote[k + n]] == rg.ids[i] + static_cast<BlockId>(n)) {
          ++n;
        }
        gets.push_back(
            {.local = base + (l * local_blocks + static_cast<uint64_t>(mine[i])) * lbb,
             .remote = rg.base + (l * remote_blocks + static_cast<uint64_t>(rg.ids[i])) * lbb,
             .length = n * lbb,
             .region = rg.region});
        k += n;
      }
    }
  }
  std::vector<std::string> rkeys;
  rkeys.reserve(d.regions.size());
  for (TransferRegion& region : d.regions) rkeys.push_back(std::move(region.rkey));
  // Tracked at once, pinned while the transfer thread reads its blocks (FinishImport commits or
  // drops it).
  Sequence* seq = nullptr;
  if (prefix_ != nullptr && !d.tokens.empty() &&
      static_cast<int64_t>(d.tokens.size()) >= d.seen_tokens) {
    Result<Sequence*> added = AddSequence(uid, d.tokens, d.options);
    BLOCKKV_CHECK(added.ok(), "ImportSequence: AddSequence failed after its checks");
    seq = *added;
    keys_[seq->slot_].looked_up = true;  // its KV is here: no prefix lookup at its first Schedule
  } else {
    seq = CreateInSlot(uid);
  }
  seq->seen_tokens_ = d.seen_tokens;
  seq->cached_prefix_tokens_ = hit_tokens;
  for (int g = 0; g < num_groups(); ++g) {
    const RemoteGroup& rg = d.groups[static_cast<size_t>(g)];
    Sequence::GroupState& state = seq->groups_[g];
    const std::vector<BlockId>& mine = local[static_cast<size_t>(g)];
    std::copy(mine.begin(), mine.end(), state.row + rg.released);
    state.released = rg.released;
    state.allocated = rg.released + static_cast<int32_t>(mine.size());
  }
  seq->importing_ = true;
  std::shared_future<Status> done =
      transfer_->Import(std::move(d.address), std::move(rkeys), std::move(gets), d.transfer_id,
                        config_.transfer->timeout_ms);
  imports_.push_back(ImportTicket(uid, std::move(done)));
  return imports_.back();
}

Status StateManager::Impl::FinishImport(size_t i) {
  const ImportTicket pending = imports_[i];
  imports_.erase(imports_.begin() + static_cast<std::ptrdiff_t>(i));
  Sequence* seq = Find(pending.uid());
  BLOCKKV_CHECK(seq != nullptr && seq->importing_, "an import's sequence was not tracked, pinned");
  seq->importing_ = false;
  const Status moved = pending.Wait();
  if (!moved.ok()) {
    // Nothing of it was published: its slot and blocks go back as they came (shared cached
    // blocks become evictable again).
    const Status flushed = FlushSequence(pending.uid());
    BLOCKKV_CHECK(flushed.ok(), "a failed import could not be flushed");
    return {moved.code(), StrCat("ImportSequence: sequence ", pending.uid(), ": ", moved.message(),
                                 "; nothing was imported, the sender keeps it")};
  }
  // The sender accepted (DONE is sent): the sequence is ours now.
  if (prefix_ != nullptr) PublishFullBlocks(*seq);
  return Status::Ok();
}

std::vector<std::pair<SeqId, Status>> StateManager::Impl::CompleteImports() {
  std::vector<std::pair<SeqId, Status>> finished;
  for (size_t i = 0; i < imports_.size();) {
    if (!imports_[i].Poll()) {
      ++i;
      continue;
    }
    const SeqId uid = imports_[i].uid();
    finished.emplace_back(uid, FinishImport(i));  // erases imports_[i]
  }
  return finished;
}

// ---- the API (state_manager.h) ----------------------------------------------------------------

Result<std::vector<std::byte>> StateManager::ExportSequence(SeqId uid) {
  return impl_->ExportSequence(uid);
}
Result<Sequence*> StateManager::ImportSequence(std::span<const std::byte> descriptor) {
  return impl_->ImportSequence(descriptor);
}
Result<ImportTicket> StateManager::StartImport(std::span<const std::byte> descriptor) {
  return impl_->StartImport(descriptor);
}
std::vector<std::pair<SeqId, Status>> StateManager::CompleteImports() {
  return impl_->CompleteImports();
}
int32_t StateManager::pending_imports() const { return impl_->pending_imports(); }

bool ImportTicket::Poll() const {
  return !done_.valid() || done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

Status ImportTicket::Wait() const {
  if (!done_.valid()) return Status::Ok();
  try {
    return done_.get();
  } catch (const std::future_error&) {  // its endpoint closed before the import ran
    return UnavailableError(StrCat("ImportSequence: sequence ", uid_,
                                   ": its StateManager was destroyed before the transfer ran"));
  }
}
Result<CancelledExport> StateManager::CancelExport(SeqId uid) { return impl_->CancelExport(uid); }
int32_t StateManager::CompleteExports() { return impl_->CompleteExports(); }
int32_t StateManager::pending_exports() const { return impl_->pending_exports(); }

}  // namespace blockkv
