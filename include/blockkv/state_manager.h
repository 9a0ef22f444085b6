// SPDX-License-Identifier: Apache-2.0
// StateManager: the sequences of an engine and their block tables over one BlockedKVCache —
// DeepSpeed-FastGen's DSStateManager, DSSequenceDescriptor and the engine's scheduling queries,
// with DeepSpeed's holes closed.
//
//   auto mgr = StateManager::Create(StateManagerConfig{}, {llama}, CpuDevice());
//   // One engine step: ask what fits, then schedule all or nothing.
//   const ScheduleRequest step{.uids = uids, .lengths = lengths};
//   SchedulingResult r = *(*mgr)->CanSchedule(step);
//   Status s = (*mgr)->Schedule(step);              // blocks reserved, in_flight set
//   ... build a RaggedBatch, run the model ...
//   s = (*mgr)->PostForward(uids);                  // seen_tokens += in_flight
//   // (speculative decoding: PostForward(uids, accepted) keeps accepted[i] of them)
//   s = (*mgr)->FlushSequence(uid);                 // a finished sequence's blocks go back
//
// Ownership: the manager creates and owns its BlockedKVCache and a BlockPool per cache group;
// only it reserves and frees blocks, so an engine cannot mix the cache's own Reserve/Free with
// the manager's bookkeeping (kv_cache() is const). Sequences live in tracking slots: a
// Sequence's address is stable until it is flushed.
//
// Thread safety: a StateManager is not thread-safe; callers serialize every call, const ones
// included, but config(), num_groups(), kv_block_size() and max_blocks_per_sequence() (fixed at
// Create). docs/design.md, "Thread safety". CanSchedule is not const: it reuses per-call scratch.
//
// Block tables: for each cache group, a host int32 array
//   [max_tracked_sequences, max_blocks_per_allocation_group]
// whose row `slot` is that sequence's table; entries past the sequence's allocated blocks, and
// entries released by partial freeing, hold kNoBlock. Token t of a sequence lives in block
// row[t / block_size] at offset t % block_size of every cache group with that block size.
//
// Only num_allocation_groups == 1 is supported (DeepSpeed's engine uses no other value; a table
// with several sub-tables has no defined token mapping there): Create rejects more with
// kUnimplemented.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "blockkv/block_pool.h"
#include "blockkv/communicator.h"
#include "blockkv/config.h"
#include "blockkv/device.h"
#include "blockkv/kv_cache.h"
#include "blockkv/kv_events.h"
#include "blockkv/offload.h"
#include "blockkv/prefix_cache.h"
#include "blockkv/remote_tier.h"
#include "blockkv/sequence.h"
#include "blockkv/status.h"
#include "blockkv/transfer.h"

namespace blockkv {
class RaggedBatch;
namespace internal {
class SnapshotCodec;
}  // namespace internal

struct StateManagerConfig {
  int32_t max_tracked_sequences = 2048;
  int32_t max_ragged_batch_size = 768;      // tokens in one forward
  int32_t max_ragged_sequence_count = 512;  // sequences in one forward
  int64_t max_context = 8192;               // tokens one sequence may hold (enforced)
  MemoryConfig memory_config;
  // A host (and optionally disk) tier for PreemptSequence / ResumeSequence, sized by
  // offload_config (DeepSpeed's flag, which did nothing there).
  bool offload = false;
  OffloadConfig offload_config{};
  PrefixCacheConfig prefix_cache{};  // off by default, as in DeepSpeed
  // Publish the prefix cache's events over ZeroMQ in vLLM's format (kv_events.h,
  // docs/kv_events.md). Needs prefix_cache.enabled with max_events > 0.
  std::optional<KVEventsConfig> kv_events{};
  // A prefix tier in Redis shared by every engine (docs/remote_tier.md): needs prefix caching on,
  // one cache group without a sliding window. Unset: no remote tier.
  std::optional<RemoteTierConfig> remote_tier{};
  // Sequence transfer to and from other engines over UCX (transfer.h, docs/transfer.md): the
  // endpoint is created and the KV cache registered at Create. Unset: ExportSequence and
  // ImportSequence are kFailedPrecondition.
  std::optional<TransferConfig> transfer{};

  // Every count > 0, max_ragged_sequence_count <= max_tracked_sequences and
  // <= max_ragged_batch_size, a valid memory_config. kInvalidArgument names the field.
  Status Validate() const;
};

// How a sequence's blocks are keyed and kept in the prefix cache (AddSequence).
struct SequenceOptions {
  BlockKeyExtras keys{};                         // namespace, adapter, per-block bytes
  int32_t priority = kDefaultRetentionPriority;  // 0..100: lower is evicted first
};

// DeepSpeed's SchedulingResult, same values.
enum class SchedulingResult {
  kSuccess = 0,
  kEngineSequenceLimitExceeded = 1,  // more tracked sequences than max_tracked_sequences
  kBatchSequenceLimitExceeded = 2,   // more sequences in the batch than max_ragged_sequence_count
  kBatchTokenLimitExceeded = 3,      // more tokens in the batch than max_ragged_batch_size
  kKVCacheLimitExceeded = 4,         // not enough free blocks
  kSequenceTokenLimitExceeded = 5,   // a sequence would pass max_context or its block table
};

// One forward's sequences: uids[i] runs lengths[i] new tokens (a prompt chunk, or 1 to decode).
// Named fields, so that the two spans cannot be swapped silently:
//   Status s = mgr->Schedule({.uids = uids, .lengths = lengths});
struct ScheduleRequest {
  std::span<const SeqId> uids;
  std::span<const int64_t> lengths;  // [uids.size()], each >= 0
};

// "Success", "EngineSequenceLimitExceeded", ... as DeepSpeed names them.
std::string_view SchedulingResultName(SchedulingResult result);

// What a sequence asks to run next (Query, ComputeKVRequirement). Named fields, so that the two
// limits cannot be swapped silently: mgr->Query(uid, {.max_new_tokens = 8, .max_new_blocks = 2}).
struct KVBudget {
  int64_t max_new_tokens = 0;  // >= 0
  int32_t max_new_blocks = 0;  // >= 0
};

// What a sequence may run next: DeepSpeed's get_kv_requirements.
struct KVRequirement {
  int64_t tokens = 0;  // tokens that can be scheduled
  int32_t blocks = 0;  // new blocks they need (<= 0: none)
};

// DeepSpeed's get_kv_requirements arithmetic for one cache group of `block_size`:
// required = ceil((seen + max_new_tokens) / block_size) − allocated; if it is within
// max_new_blocks, (max_new_tokens, required); otherwise
// ((max_new_blocks + allocated)·block_size − seen, max_new_blocks).
// REQUIRES: block_size > 0, and every argument >= 0 (Query checks them for its callers).
KVRequirement ComputeKVRequirement(int64_t seen_tokens, int32_t allocated_blocks,
                                   const KVBudget& budget, int32_t block_size);

class StateManager {
 public:
  // Validates `config` and `kv_configs`, creates the BlockedKVCache on `device` with
  // config.memory_config (agreeing on num_blocks over `comm` when given), the pools, the slot
  // allocator and the tables.
  static Result<std::unique_ptr<StateManager>> Create(StateManagerConfig config,
                                                      std::vector<KVCacheConfig> kv_configs,
                                                      std::shared_ptr<Device> device,
                                                      Communicator* comm = nullptr);

  StateManager(const StateManager&) = delete;
  StateManager& operator=(const StateManager&) = delete;
  ~StateManager();

  // The sequence `uid`, created (seen 0, no blocks) if unknown. kResourceExhausted when every
  // tracking slot is taken.
  Result<Sequence*> GetOrCreateSequence(SeqId uid);
  // A new sequence whose first tokens are `prompt`: with prefix caching on, its first Schedule
  // takes the longest cached prefix of whole blocks (never the last prompt token, whose logits
  // the engine needs), and its blocks are published as they fill. Without prefix caching it is
  // GetOrCreateSequence for a new uid. kAlreadyExists (tracked uid), kInvalidArgument (a
  // negative token id, a priority outside [0, 100], more tokens than max_context),
  // kResourceExhausted (no tracking slot); nothing changes on failure.
  Result<Sequence*> AddSequence(SeqId uid, std::span<const TokenId> prompt,
                                const SequenceOptions& options = {});
  // Tokens the engine sampled for `uid`, appended to its known tokens so that the blocks they
  // fill can be published too (call before scheduling them). A no-op without prefix caching.
  // kNotFound (unknown uid), kFailedPrecondition (not added with AddSequence), kInvalidArgument
  // (a negative id); nothing changes on failure.
  Status AppendTokens(SeqId uid, std::span<const TokenId> tokens);
  // nullptr when `uid` is not tracked.
  const Sequence* GetSequence(SeqId uid) const;
  // True when `seq` is one of this manager's tracked sequences (not a sequence of another
  // manager, nor a flushed one: flushing sets its slot to -1).
  bool Owns(const Sequence& seq) const;
  // Drops the sequence's references to its blocks (blocks nobody else holds are freed) and its
  // slot. kNotFound for an unknown uid (DeepSpeed only warns).
  Status FlushSequence(SeqId uid);

  // What `uid` may run next, at most budget.max_new_tokens tokens and budget.max_new_blocks new
  // blocks of `group` (DeepSpeed's query / get_kv_requirements), also capped by max_context and the
  // block table capacity. An unknown uid is evaluated as a new sequence; (0, 0) when it is unknown
  // and every tracking slot is taken. kInvalidArgument for negative arguments, kOutOfRange for a
  // bad group.
  Result<KVRequirement> Query(SeqId uid, const KVBudget& budget, int group = 0) const;

  // Whether `lengths[i]` new tokens for each `uids[i]` fit in one forward, checked in DeepSpeed's
  // order (batch sequence count; per sequence, context/table capacity then KV blocks of every
  // cache group against the free counts; tracked sequences; batch tokens). kInvalidArgument (a
  // Status, not a result) for mismatched spans, a negative length or a duplicate uid.
  Result<SchedulingResult> CanSchedule(const ScheduleRequest& request);

  // Schedules one forward, all or nothing: creates unknown sequences, reserves the blocks each
  // needs to hold seen + length tokens in every cache group, and sets in_flight = length. When
  // CanSchedule is not kSuccess: kResourceExhausted naming the limit (kInvalidArgument for bad
  // arguments), `*result` set to it when given, and nothing changed. kResourceExhausted covers
  // every limit, the permanent ones (SequenceTokenLimitExceeded, BatchSequenceLimitExceeded)
  // included: `*result` says which, and whether shrinking the request can help. Scheduling a
  // sequence that still has tokens in flight replaces them, as DeepSpeed's pre_forward does:
  // blocks reserved for them stay in its table and serve the new tokens.
  Status Schedule(const ScheduleRequest& request, SchedulingResult* result = nullptr);

  // Schedule, and the RaggedBatch of that forward built in the same pass over the sequences (what
  // Schedule + InsertSequence of each + Finalize would build; docs/design.md says why it is one
  // call). `tokens` holds each uid's lengths[i] new tokens, one uid after another. A first schedule
  // that hits the prefix cache runs the prompt from the end of the cached prefix, whatever chunk
  // of it was passed: its batch entry gets the prompt's tokens at those positions (as given to
  // AddSequence). `batch` is cleared, then filled and
  // finalized as InsertSequence + Finalize(padding) would. kInvalidArgument when `batch` was
  // created for another manager or tokens.size() is not the sum of `lengths`; kOutOfRange when
  // a sequence's positions would not fit the batch's int32 descriptors; everything Schedule
  // returns. On any of these nothing changes, the batch included. A failed copy to the batch's
  // device mirror returns that error with the forward scheduled and the batch built but not
  // finalized: Finalize() retries the copy.
  Status ScheduleBatch(const ScheduleRequest& request, std::span<const TokenId> tokens,
                       RaggedBatch& batch, bool padding = false,
                       SchedulingResult* result = nullptr);

  // After the forward: seen_tokens += in_flight_tokens, in_flight = 0, for each uid (DeepSpeed's
  // post_forward). kNotFound (nothing changed) if any uid is unknown.
  //
  // Speculative decoding: with `accepted` (one count per uid), uid i keeps only the first
  // accepted[i] of its in-flight tokens (seen_tokens += accepted[i]); the rest are rejected. A
  // sequence that rejects any token gives back, in every cache group, the blocks past
  // ceil(seen_tokens / block_size) (their table entries become kNoBlock, the table version
  // changes) and forgets its known tokens past seen_tokens; the KV the rejected tokens wrote
  // stays in its last block until the next forward overwrites it, and nothing reads it before.
  // Only blocks whose every token is kept are ever published to the prefix cache. A sequence that
  // keeps all its tokens is advanced exactly as without `accepted`. kInvalidArgument (nothing
  // changed) when accepted.size() != uids.size(), a count is outside [0, in_flight_tokens] (the
  // message names both) or a uid repeats; kNotFound as above. An empty `accepted` keeps all.
  Status PostForward(std::span<const SeqId> uids, std::span<const int64_t> accepted = {});
  // The same for every sequence of `batch` (accepted[i]: the i-th inserted sequence), without
  // looking uids up, and with prefix caching on, also records the tokens the batch gave each
  // sequence (its first accepted[i] with `accepted`) as its known tokens (so a decode step needs
  // no AppendTokens). kInvalidArgument when a sequence is not this manager's or an accepted count
  // is out of range (as above), kFailedPrecondition when one was scheduled, advanced or flushed
  // since it was inserted, or a token to record is outside [0, 2^31); nothing changes on failure.
  Status PostForward(const RaggedBatch& batch, std::span<const int64_t> accepted = {});

  // Takes back the last `n` committed tokens of `uid` (seen_tokens -= n), as a rejection in
  // PostForward does: blocks past the new end are given back in every cache group, known tokens
  // past it forgotten. A block the sequence shares (a fork's, a prefix hit's) or has published is
  // never written again: when the new end falls inside one, the sequence first gets a private
  // copy of it (one new block per such group), its other holders and the cached entry keep the
  // original; a fully rolled-back published block stays cached (its tokens were right), the
  // sequence only drops its reference. kInvalidArgument (n < 0, or n > seen_tokens, naming both),
  // kNotFound (unknown uid), kFailedPrecondition (tokens in flight: reject them with
  // PostForward's `accepted`; a preempted sequence; a group whose leading blocks FreeLeadingBlocks
  // released would keep no whole block before the new end), kResourceExhausted (no block for a
  // private copy), or the copy's device error; nothing changes on failure.
  Status Rollback(SeqId uid, int64_t n);

  // Releases the `num_blocks` oldest still-held blocks of `uid` in `group` (sliding-window
  // layers): their table entries become kNoBlock, token positions do not move. Only blocks
  // wholly before seen_tokens may go: kOutOfRange otherwise, kNotFound for an unknown uid.
  Status FreeLeadingBlocks(SeqId uid, int32_t num_blocks, int group = 0);

  // A new sequence `child` with the parent's history: it shares the parent's full blocks
  // (one more reference each) and gets its own copy of the partial last block, so both can
  // append independently (parallel sampling, beam search). kNotFound (no parent),
  // kAlreadyExists (child tracked), kFailedPrecondition (parent has tokens in flight),
  // kResourceExhausted (no slot, or no block for the tail copy); nothing changes on failure.
  Status Fork(SeqId parent, SeqId child);

  // DeepSpeed's step in three calls, for engines ported from it (blockkv.deepspeed):
  // DSStateManager.allocate_blocks, DSSequenceDescriptor.extend_kv_cache and pre_forward.
  // Schedule does the same all or nothing in one call. Blocks AllocateBlocks hands out are the
  // engine's (CheckInvariants counts them) until ExtendSequence appends them to a sequence's
  // table or FreeBlocks takes them back; SaveSnapshot refuses while any are out.
  //
  // Takes out.size() blocks of `group` (evicting unreferenced cached blocks when the free list
  // is short). kResourceExhausted (nothing taken) when fewer are available, kOutOfRange for a
  // bad group.
  Status AllocateBlocks(std::span<BlockId> out, int group = 0);
  // Appends `blocks`, each handed out by AllocateBlocks and not given on since, to the end of
  // uid's table of `group`. kNotFound (unknown uid), kOutOfRange (a bad group or id, or more
  // blocks than the table has room for), kFailedPrecondition (a block the engine does not hold,
  // an id repeated, a preempted sequence); nothing changes on failure.
  Status ExtendSequence(SeqId uid, std::span<const BlockId> blocks, int group = 0);
  // Returns blocks AllocateBlocks handed out that no sequence took. kOutOfRange (a bad group or
  // id), kFailedPrecondition (a block the engine does not hold, an id repeated); all or nothing.
  Status FreeBlocks(std::span<const BlockId> blocks, int group = 0);
  // in_flight_tokens = num_tokens (replacing any in flight, as DeepSpeed's pre_forward does).
  // kInvalidArgument (negative), kNotFound (unknown uid), kOutOfRange (seen + num_tokens past
  // max_context or a table's capacity), kFailedPrecondition (a preempted sequence, or its
  // blocks of some group hold fewer than seen + num_tokens tokens: extend it first).
  Status PreForward(SeqId uid, int64_t num_tokens);
  // Blocks of `group` AllocateBlocks handed out that are still the engine's. REQUIRES: a valid
  // group.
  int32_t engine_held_blocks(int group = 0) const;

  // seen_tokens % block_size: how full the last block is, 0 when full or absent (DeepSpeed's
  // get_remaining_block_capacity, same meaning). 0 for an unknown uid.
  int64_t RemainingBlockCapacity(SeqId uid, int group = 0) const;

  // Prefix cache (nullptr / empty / 0 when StateManagerConfig.prefix_cache.enabled is false).
  const PrefixCache* prefix_cache() const;
  // Events queued since the last drain, for cache-aware routers. With kv_events configured the
  // manager drains them itself (below), so this returns only what it has not published yet.
  CacheEventBatch DrainCacheEvents();
  // The distinct keys `medium` holds for `group` (kDevice: the prefix cache, kHost: the host
  // level), in no particular order: what a subscriber to the events should hold. Empty without
  // prefix caching or that level. REQUIRES: a valid group.
  std::vector<BlockHash> cached_keys(int group = 0,
                                     CacheMedium medium = CacheMedium::kDevice) const;

  // ---- KV events on the wire (StateManagerConfig.kv_events) ----
  // Schedule, ScheduleBatch, PostForward, FlushSequence, ResetPrefixCache and LoadSnapshot end by
  // handing what the prefix cache queued during them (and before them, by other calls) to the
  // publisher as one batch, without blocking (vLLM publishes once per scheduler step). This does
  // the same now; `wait`: then blocks until the publisher thread has sent it (and, when a resync
  // was owed and the queue was full, sends the resync once the queue has room). A no-op without
  // kv_events.
  void PublishKVEvents(bool wait = false);
  // The publisher (endpoints, stats, Flush); nullptr without kv_events.
  KVEventPublisher* kv_event_publisher() const;
  // Drops every cached block no sequence references; returns how many.
  int64_t ResetPrefixCache();

  // ---- snapshots (snapshot.cc; format and guarantees in docs/snapshots.md) ----
  // A snapshot is the whole cache: the configs it needs, the contents of every referenced or
  // cached block, every sequence (slot, seen tokens, tables, known tokens and keys) and the
  // prefix-cache index with its eviction order, in a versioned file where every section and the
  // whole file carry an XXH3-64 checksum.
  //
  // Writes the snapshot to `path` atomically: into `path`.tmp, fsync, rename over `path`, fsync
  // of the directory; on failure no file is left at `path`.tmp and `path` is as it was.
  // kFailedPrecondition (nothing written) while a sequence has tokens in flight or is preempted
  // (or its resume is not settled, or offload copies are in flight), or when
  // prefix_cache.hash_function is a custom one; an I/O error names the file and errno's text:
  // kNotFound (no such directory), kResourceExhausted (disk full, file too large), kUnavailable
  // (any other).
  Status SaveSnapshot(const std::string& path) const;
  // The same bytes in memory. kFailedPrecondition as above; kResourceExhausted when host memory
  // cannot hold them.
  Result<std::vector<std::byte>> SaveSnapshot() const;
  // LoadSnapshot(bytes) of the file at `path`. kNotFound (no such file), kInvalidArgument (not a
  // regular file), kResourceExhausted (larger than the available host memory), kDataLoss (a
  // read error, EIO), kUnavailable (any other I/O error); the manager is unchanged.
  Status LoadSnapshot(const std::string& path);
  // Replaces this manager's whole state with the snapshot's. The manager must have been created
  // with the configs the snapshot was saved with: a difference is kInvalidArgument naming the
  // field, this manager's value and the snapshot's. A truncated or corrupt snapshot (a checksum,
  // the magic or format version wrong) or content no manager could hold (a block id out of
  // range, a table entry naming a block the snapshot does not hold, duplicate uids, counts that
  // do not add up) is kDataLoss naming the section and offset. Everything is parsed and checked
  // before anything changes: on any of these errors the manager is as it was. After a load every
  // sequence keeps its uid, tracking slot, seen tokens, tables and block contents, and the prefix
  // cache hits and evicts as the saved one did; the order in which free blocks are handed out,
  // the prefix-cache stats and undrained events are not part of a snapshot (docs/snapshots.md).
  // Events: AllCleared, then BlockStored for every cached key. A device error writing the block
  // contents is kInternal, and leaves the manager empty (no sequences, nothing cached), since
  // its blocks' contents are then unspecified.
  Status LoadSnapshot(std::span<const std::byte> bytes);

  // ---- offload (state_manager_offload.cc; StateManagerConfig.offload) ----
  // Moves the blocks `uid` holds to the host tier (the disk tier for a group whose host tier is
  // full), so that its device blocks are freed once the copy is done (the ticket) — preemption
  // without recompute. Its table entries become kNoBlock; it keeps its slot, seen_tokens and
  // tokens, and cannot be scheduled, forked or partially freed until resumed. Blocks it shares
  // (a fork, a prefix hit) are copied too, and its other holders keep theirs. A copy that fails
  // keeps the device blocks (nothing is lost; ResumeSequence then takes them back without a
  // copy). kFailedPrecondition (offload off, tokens in flight, already preempted), kNotFound,
  // kResourceExhausted (the tiers are too full: nothing changed).
  Result<OffloadTicket> PreemptSequence(SeqId uid);
  // Brings a preempted sequence back: new blocks, copied from the tiers, its table rewritten.
  // Asynchronous: the next Schedule (or Fork, FreeLeadingBlocks, FlushSequence) naming it waits
  // for the copy; when that copy failed (kDataLoss for a corrupt disk slot), that call returns
  // the error and the sequence is preempted again, its handles kept. kFailedPrecondition (offload
  // off, not preempted), kNotFound, kResourceExhausted (too few free blocks: nothing changed).
  Result<OffloadTicket> ResumeSequence(SeqId uid);
  // nullptr when offload is off.
  const OffloadStore* offload_store() const;
  // With offload and prefix caching both on (one cache group without a sliding window), cached
  // blocks evicted from the device are demoted to the host tier (write-back) and promoted back
  // on a hit. Zeros without that level.
  struct HostPrefixStats {
    int64_t entries = 0;   // blocks held on the host now
    int64_t demoted = 0;   // evicted blocks copied to the host
    int64_t promoted = 0;  // host blocks copied back for a hit
    int64_t dropped = 0;   // host blocks dropped for room or by ResetPrefixCache
  };
  HostPrefixStats host_prefix_stats() const;
  // The remote tier's counters (docs/remote_tier.md); zeros without the tier (not configured, or
  // its server was unreachable when the manager was created).
  RemoteTierStats remote_tier_stats() const;
  // Waits until every block queued for the remote tier so far was stored or failed (each command
  // is bounded by RemoteTierConfig::timeout_ms). Nothing to wait for without the tier.
  void FlushRemoteTier();
  // Fetches ahead, from the remote tier, the blocks of `uid`'s prompt past those the device holds
  // now (at most the blocks free now), and returns at once; the sequence's first Schedule takes
  // what has arrived by then, verified, without waiting, and recomputes the rest (a fetch still
  // in flight is a late miss). Without it, that Schedule fetches and waits (at most timeout_ms).
  // An empty ticket when there is nothing to fetch or the tier is off (its server was
  // unreachable at Create). kFailedPrecondition: no remote tier configured, a sequence not added
  // with AddSequence, or one scheduled already; kNotFound: not tracked. Flushing the sequence
  // drops its fetch. docs/remote_tier.md, "Fetching ahead".
  Result<RemoteFetchTicket> FetchRemotePrefix(SeqId uid);
  // Tensor-parallel ranks agree on their remote tier hits (docs/remote_tier.md, "Tensor
  // parallelism"): each rank keys its own shard, so one rank's tier may lack a block another's
  // holds, and every rank must schedule the same. A collective over `comm` (world size
  // RemoteTierConfig::tp_size, rank tp_rank): every rank calls it with the same `uids`, in the
  // same order, once their FetchRemotePrefix was called. It waits for each fetch ahead, verifies
  // it, and agrees on each sequence's hit: the leading blocks every rank holds, on its device or
  // fetched. Each sequence's first Schedule (and CanSchedule) then takes at most that many. With
  // tp_size > 1 a sequence not agreed on takes no block from the tier. Returns the agreed hit of
  // each uid, in blocks of the cache group. Errors, on every rank and changing nothing:
  // kInvalidArgument (comm's size or rank differ from the config; a rank with the error names
  // it), kFailedPrecondition (as FetchRemotePrefix on some rank; the ranks passed different
  // uids), kNotFound (an untracked uid), or the communicator's error.
  Result<std::vector<int32_t>> AgreeRemotePrefix(std::span<const SeqId> uids, Communicator& comm);
  // AgreeRemotePrefix in two halves around the engine's own all-reduce (torch.distributed, say):
  // RemotePrefixOffer waits for and verifies the fetches and returns what this rank offers (a
  // local error is carried in `values`, never returned, so every rank still reaches the
  // collective); the engine replaces `values` by their element-wise minimum over the ranks; then
  // AgreeRemotePrefix(vote) on every rank. The same errors and results as above.
  RemotePrefixVote RemotePrefixOffer(std::span<const SeqId> uids);
  Result<std::vector<int32_t>> AgreeRemotePrefix(const RemotePrefixVote& reduced);

  // ---- sequence transfer (state_manager_transfer.cc; StateManagerConfig.transfer) ----
  // docs/transfer.md has the flow, the descriptor's format and what each failure leaves.
  //
  // A descriptor of `uid` (opaque bytes: its seen tokens, its known token ids with prefix
  // caching, the KV layout's fingerprint, this engine's tensor-parallel rank and world size, its
  // blocks and the keys of the registered memory holding them) for ImportSequence on another
  // engine. The sequence stays this manager's, pinned, until the receiver confirms: it cannot be
  // scheduled, flushed, forked, rolled back, partially freed or preempted (kFailedPrecondition),
  // and its blocks are not freed. Once a receiver has confirmed (DONE), the next Schedule,
  // ScheduleBatch, CompleteExports or transfer call flushes it. An export no receiver was granted
  // within TransferConfig::export_timeout_ms is cancelled by those same calls (the sequence stays
  // here, un-pinned). kFailedPrecondition (transfer off, tokens in flight, preempted, exported
  // already), kNotFound; nothing changes on failure.
  Result<std::vector<std::byte>> ExportSequence(SeqId uid);
  // Imports the sequence `descriptor` describes: takes a tracking slot and blocks, reads the
  // sender's blocks into them (UCX gets, all in flight at once), has the sender grant it, and
  // tracks it under its uid with its seen tokens (no tokens in flight; with prefix caching, its
  // known tokens, and its full blocks published to the prefix cache; the leading full blocks this
  // prefix cache holds already are shared, not read, in every full-attention group (a
  // sliding-window group's blocks and a STATE group's slot are always read):
  // cached_prefix_tokens() says how many tokens). All or nothing: on any
  // failure the slot and blocks are given back and the sender still holds the sequence.
  // kInvalidArgument (a truncated or corrupt descriptor, another KV layout: the message names
  // both fingerprints and layouts, another tensor-parallel rank or world size: it names both,
  // more tokens than this engine holds), kAlreadyExists (uid tracked), kResourceExhausted (no
  // slot or too few blocks), kUnavailable (the sender is unreachable or died, a get failed, or
  // TransferConfig::timeout_ms passed), kFailedPrecondition (transfer off, or the sender refused:
  // the export was cancelled or expired, or granted to or imported by another receiver). Blocks
  // whose contents only this call wrote may have evicted unreferenced cached blocks to make
  // room, as a Schedule would.
  Result<Sequence*> ImportSequence(std::span<const std::byte> descriptor);
  // ImportSequence without the wait (docs/transfer.md, "Importing without waiting"): the checks,
  // the tracking slot and the blocks are taken now, as ImportSequence takes them, and the
  // sequence is tracked under its uid at once but pinned while the transfer thread reads its
  // blocks and has the sender grant it: Schedule, ScheduleBatch, PostForward, FlushSequence,
  // Fork, Rollback, FreeLeadingBlocks, PreemptSequence, ExtendSequence, PreForward and
  // ExportSequence refuse it (kFailedPrecondition), and SaveSnapshot and LoadSnapshot refuse
  // while any import is started. CompleteImports commits it once its transfer has finished
  // (ImportTicket::Poll). Errors: ImportSequence's checks; the transfer's own errors come from the
  // ticket and CompleteImports.
  Result<ImportTicket> StartImport(std::span<const std::byte> descriptor);
  // Commits every started import whose transfer has finished: a sequence whose transfer
  // succeeded is schedulable from now on (with prefix caching, its full blocks are published); one
  // whose transfer failed is no longer tracked, its slot and blocks given back, and the sender
  // still holds it. Returns them with their statuses (ImportSequence's errors), in the order
  // they were started. Never waits.
  std::vector<std::pair<SeqId, Status>> CompleteImports();
  // Imports started and not completed yet.
  int32_t pending_imports() const;
  // Takes back an export that no receiver has confirmed: the sequence is schedulable here again
  // and no receiver will be granted it. kUnclaimed: no receiver had been granted it, it is only
  // here. kGranted: a receiver had been granted it but never confirmed, so that receiver may hold
  // it too (CancelledExport says when); this engine keeps its copy. kNotFound (no export of uid),
  // kFailedPrecondition (transfer off, or a receiver confirmed already: the sequence is flushed).
  Result<CancelledExport> CancelExport(SeqId uid);
  // Flushes every exported sequence whose receiver has confirmed and cancels the pending exports
  // that expired (TransferConfig::export_timeout_ms); returns how many it flushed.
  int32_t CompleteExports();
  // Exports neither confirmed, cancelled nor expired (granted ones included).
  int32_t pending_exports() const;

  // One layer's cache, as BlockedKVCache::GetCache.
  Result<TensorView> GetCache(int64_t cache_id, int group = 0) const;
  const BlockedKVCache& kv_cache() const;
  // By cache group; REQUIRES: 0 <= group < num_groups().
  const BlockPool& pool(int group = 0) const;
  // The block table array of `group`: [max_tracked_sequences, max_blocks_per_allocation_group].
  const BlockId* block_tables(int group = 0) const;

  const StateManagerConfig& config() const;
  int num_groups() const;
  int32_t n_tracked_sequences() const;
  // Per cache group: blocks a Schedule can take (free + evictable cached blocks).
  std::vector<int32_t> free_blocks() const;
  int32_t kv_block_size(int group = 0) const;            // REQUIRES: a valid group
  int32_t max_blocks_per_sequence(int group = 0) const;  // REQUIRES: a valid group

  // No block is referenced more than its count says, reference counts equal table occurrences,
  // free + referenced = total, tables hold kNoBlock past each sequence's blocks, slots match.
  Status CheckInvariants() const;

 private:
  class Impl;                            // src/state_manager_impl.h
  friend class internal::SnapshotCodec;  // saves and rebuilds the Impl
  explicit StateManager(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace blockkv
