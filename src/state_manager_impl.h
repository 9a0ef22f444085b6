// SPDX-License-Identifier: Apache-2.0
// StateManager::Impl: the state manager's state and the code that works on it, behind the
// public StateManager (include/blockkv/state_manager.h), which forwards each call here. Its
// definitions are spread over state_manager.cc (sequences, scheduling, fork),
// state_manager_prefix.cc (prefix caching), state_manager_offload.cc (preemption),
// state_manager_invariants.cc and snapshot*.cc (SnapshotCodec reads and rebuilds it).
//
// Everything is public to the implementation files; nothing here is part of the API. Not
// thread-safe, as StateManager: no method, const or not, may run while another runs. Methods that
// reuse the per-call scratch below (Check, and so CanSchedule) are not const.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "blockkv/block_pool.h"
#include "blockkv/offload.h"
#include "blockkv/prefix_cache.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "remote_tier.h"

namespace blockkv {
namespace internal {
class BlockSize;
class PrefixHostTier;
class TransferEndpoint;
class UidMap;
}  // namespace internal

class StateManager::Impl {
 public:
  Impl(StateManagerConfig config, std::unique_ptr<BlockedKVCache> cache, BlockedAllocator slots);
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();

  // ---- the API, as StateManager forwards it (contracts in state_manager.h) ----
  Result<Sequence*> GetOrCreateSequence(SeqId uid);
  Result<Sequence*> AddSequence(SeqId uid, std::span<const TokenId> prompt,
                                const SequenceOptions& options);
  Status AppendTokens(SeqId uid, std::span<const TokenId> tokens);
  const Sequence* GetSequence(SeqId uid) const;
  bool Owns(const Sequence& seq) const {
    const int32_t slot = seq.slot_;
    // One unsigned comparison for 0 <= slot < max_tracked_sequences.
    return static_cast<uint32_t>(slot) < static_cast<uint32_t>(config_.max_tracked_sequences) &&
           &sequences_[slot] == &seq;
  }
  Status FlushSequence(SeqId uid);
  Result<KVRequirement> Query(SeqId uid, const KVBudget& budget, int group) const;
  Result<SchedulingResult> CanSchedule(const ScheduleRequest& request);
  Status Schedule(const ScheduleRequest& request, SchedulingResult* result);
  Status ScheduleBatch(const ScheduleRequest& request, std::span<const TokenId> tokens,
                       RaggedBatch& batch, bool padding, SchedulingResult* result);
  Status PostForward(std::span<const SeqId> uids);
  Status PostForward(const RaggedBatch& batch, std::span<const int64_t> accepted);
  // PostForward(uids, accepted) with a non-empty `accepted` (state_manager_rollback.cc).
  Status PostForwardAccepted(std::span<const SeqId> uids, std::span<const int64_t> accepted);
  Status Rollback(SeqId uid, int64_t n);
  Status FreeLeadingBlocks(SeqId uid, int32_t num_blocks, int group);
  // DeepSpeed's step in three calls (state_manager_deepspeed.cc).
  Status AllocateBlocks(std::span<BlockId> out, int group);
  Status ExtendSequence(SeqId uid, std::span<const BlockId> blocks, int group);
  Status FreeBlocks(std::span<const BlockId> blocks, int group);
  Status PreForward(SeqId uid, int64_t num_tokens);
  int32_t engine_held_blocks(int group) const {
    return engine_held_.empty() ? 0 : engine_held_[static_cast<size_t>(group)].count;
  }
  Status Fork(SeqId parent, SeqId child);
  int64_t RemainingBlockCapacity(SeqId uid, int group) const;
  const PrefixCache* prefix_cache() const { return prefix_.get(); }
  CacheEventBatch DrainCacheEvents();
  int64_t ResetPrefixCache();
  std::vector<BlockHash> cached_keys(int group, CacheMedium medium) const;
  // KV events on the wire (state_manager_prefix.cc): the publisher, created by Create.
  Status EnableKVEvents();
  void MaybePublishKVEvents() {
    if (kv_publisher_ != nullptr && (kv_resync_ || prefix_->has_pending_events())) {
      PublishKVEvents();
    }
  }
  // Hands the queued events to the publisher as one batch; after a batch was dropped, a resync
  // instead (AllCleared, then every key every level holds).
  void PublishKVEvents();
  std::unique_ptr<KVEventPublisher> kv_publisher_;
  bool kv_resync_ = false;  // a batch was lost: the next one is a resync
  Status SaveSnapshot(const std::string& path) const;
  Result<std::vector<std::byte>> SaveSnapshot() const;
  Status LoadSnapshot(const std::string& path);
  Status LoadSnapshot(std::span<const std::byte> bytes);
  Result<OffloadTicket> PreemptSequence(SeqId uid);
  Result<OffloadTicket> ResumeSequence(SeqId uid);
  const OffloadStore* offload_store() const { return offload_.get(); }
  HostPrefixStats host_prefix_stats() const;
  RemoteTierStats remote_tier_stats() const;
  void FlushRemoteTier();
  Result<std::vector<std::byte>> ExportSequence(SeqId uid);
  Result<Sequence*> ImportSequence(std::span<const std::byte> descriptor);
  Result<ImportTicket> StartImport(std::span<const std::byte> descriptor);
  std::vector<std::pair<SeqId, Status>> CompleteImports();
  int32_t pending_imports() const { return static_cast<int32_t>(imports_.size()); }
  Result<CancelledExport> CancelExport(SeqId uid);
  int32_t CompleteExports();
  int32_t pending_exports() const { return static_cast<int32_t>(exports_.size()); }
  Result<TensorView> GetCache(int64_t cache_id, int group) const;
  const BlockedKVCache& kv_cache() const { return *cache_; }
  const BlockPool& pool(int group) const { return pools_[group]; }
  const BlockId* block_tables(int group) const { return tables_[group].data(); }
  const StateManagerConfig& config() const { return config_; }
  int num_groups() const { return static_cast<int>(pools_.size()); }
  int32_t n_tracked_sequences() const;
  std::vector<int32_t> free_blocks() const;
  int32_t kv_block_size(int group) const;
  int32_t max_blocks_per_sequence(int group) const;
  Status CheckInvariants() const;

  // ---- internals ----
  // The manager this is the state of (ScheduleBatch compares it with a batch's).
  const StateManager* owner_ = nullptr;

  // The largest number of new tokens a sequence at `seen` may add: max_context and every
  // group's table capacity (token_limit_; the static form for loops that keep it in a register).
  int64_t TokenCapacity(int64_t seen) const { return TokenCapacity(token_limit_, seen); }
  static int64_t TokenCapacity(int64_t token_limit, int64_t seen) {
    return token_limit > seen ? token_limit - seen : 0;
  }
  Status CheckGroupArg(int group) const;
  // The tracked sequence of the i-th uid of the call being checked, or nullptr.
  const Sequence* Scheduled(size_t i) const {
    return slot_scratch_[i] < 0 ? nullptr : &sequences_[slot_scratch_[i]];
  }
  // The arguments — mismatched spans, a negative length, a duplicate uid (kInvalidArgument), a
  // preempted one (kFailedPrecondition) — then CanSchedule's verdict. Leaves each uid's slot (-1
  // when new) in slot_scratch_, and what the verdict counted for Schedule; `why` names the limit
  // and the values when the verdict is not kSuccess.
  Result<SchedulingResult> Check(const ScheduleRequest& request, std::string* why);
  // What Check's pass over the uids counted.
  struct CheckTotals {
    SchedulingResult verdict = SchedulingResult::kSuccess;  // the first limit exceeded
    int64_t tracked = 0;                                    // sequences tracked after the call
    int64_t tokens = 0;                                     // tokens the call schedules
  };
  // Check's pass over the uids: their arguments and lookups (an argument error is returned), and
  // the verdict's per-sequence limits. kSimple: one cache group, no prefix caching.
  template <bool kSimple>
  Status CheckEach(const ScheduleRequest& request, std::string* why, CheckTotals& totals);
  // ScheduleBatch's batch: the tokens it takes, where they go, and the padding.
  struct BatchOut {
    std::span<const TokenId> tokens;
    RaggedBatch* batch = nullptr;
    bool padding = false;
  };
  // Schedule, and with `out`, ScheduleBatch.
  Status ScheduleInto(const ScheduleRequest& request, SchedulingResult* result,
                      const BatchOut* out);
  // ScheduleInto's pass after the blocks are taken: each sequence's blocks and tokens in flight,
  // and with kBatch, its entry in out's batch. kSimple: one cache group, no prefix caching.
  template <bool kBatch, bool kSimple>
  void Commit(const ScheduleRequest& request, const BatchOut* out);
  Status CheckSequence(const Sequence& seq, std::vector<int32_t>* owners, int group) const;
  Sequence* Find(SeqId uid);
  const Sequence* Find(SeqId uid) const;
  Sequence* CreateInSlot(SeqId uid);  // REQUIRES: a free slot
  // After a forward: seen_tokens += in_flight_tokens, in_flight = 0, full blocks published.
  void Advance(Sequence& seq);
  // LOCAL groups: releases the blocks lying wholly before seen_tokens - local_window.
  void ReleaseOutOfWindow(Sequence& seq);

  // ---- speculative decoding (state_manager_rollback.cc) ----
  // kInvalidArgument unless accepted.size() == n (the uids or batch entries) or it is empty.
  static Status CheckAcceptedCount(size_t n, std::span<const int64_t> accepted);
  // kInvalidArgument unless 0 <= accepted <= seq's tokens in flight; kFailedPrecondition for
  // accepted < in flight when a STATE group has applied every token (state_group_).
  Status CheckAccepted(const Sequence& seq, int64_t accepted) const;
  // Advance keeping only the first `accepted` tokens in flight (CheckAccepted passed).
  void AdvanceAccepted(Sequence& seq, int64_t accepted);
  // Shrinks `seq` to its first `end` tokens: in every group the entries past BlocksFor(end) are
  // released (last first), its known tokens and published count are cut at `end`. REQUIRES: every
  // entry past BlocksFor(end) is held (not released), and the block holding position `end`
  // (when partial) is private to `seq` and not cached.
  void TrimTo(Sequence& seq, int64_t end);
  // Fork's and Rollback's private copies of one block per group: copies[g] becomes a new block
  // holding sources[g]'s bytes, or kNoBlock where sources[g] is kNoBlock. All or nothing: every
  // group's free block is checked before any is taken (taking one may evict a cached block, which
  // a later group's failure could not undo), and a failed take or copy gives back what was
  // taken. On failure `group` is the group that failed; `no_free_block` says whether it had no
  // free block (status kResourceExhausted without a message: the caller words it) or its take
  // or copy failed (status: that failure). REQUIRES: sources.size() == num_groups().
  struct BlockCopies {
    Status status;
    int group = -1;
    bool no_free_block = false;
  };
  BlockCopies CopyOneBlockPerGroup(std::span<const BlockId> sources, std::vector<BlockId>& copies);
  // A fresh epoch for slot_marks_ / block_marks_ (duplicate checks).
  uint32_t NextMarkEpoch();
  void ReleaseSequenceBlocks(Sequence& seq);

  // ---- offload (state_manager_offload.cc) ----
  class PoolOwner;         // OffloadStore::BlockOwner over pools_
  struct Parked;           // a preempted or resuming sequence's handles, by slot
  Status EnableOffload();  // from Create
  // ---- prefix caching (state_manager_prefix.cc) ----
  struct SequenceKeys;  // a sequence's known tokens and key state, by slot
  // The prefix a first Schedule of the i-th uid takes, decided by Check.
  struct PrefixHit {
    int64_t tokens = 0;     // cached tokens taken (new seen_tokens)
    int64_t in_flight = 0;  // tokens then scheduled
    size_t first = 0;       // its blocks in hit_blocks_, group after group; group g's are
                            // table entries [hit_starts_[hit·groups + g], tokens / bs(g))
    // The last `promoted` of group 0's blocks come from the host level: kNoBlock in
    // hit_blocks_ until Schedule promotes them; their entries at promote_entries_[promote_first].
    int32_t promoted = 0;
    size_t promote_first = 0;
    // The last `remote` of those come from the remote tier: remote_values_[remote_first, ...).
    int32_t remote = 0;
    size_t remote_first = 0;
    // What stopped the remote tier's run: counted once, when a Schedule takes the hit (not by
    // CanSchedule, nor by a Schedule that does not fit).
    internal::RemoteTier::Miss remote_miss = internal::RemoteTier::Miss::kNone;
    // A STATE group's checkpoint of `tokens` tokens, copied into the sequence's fresh slot by
    // ResumeFromCheckpoints (referenced from ShareHitBlocks until then); kNoBlock without one.
    BlockId checkpoint = kNoBlock;
  };
  int64_t SlidingWindow(int group) const;  // 0: full attention
  // The first block a windowed group needs for a hit of `blocks` blocks (0 without a window).
  int32_t WindowStart(int group, int32_t blocks) const;
  // When the i-th uid of the call is a sequence's first schedule with a prompt to look up, its
  // hit (valid until the next lookup), with the evictable blocks it revives marked and taken
  // off free_scratch_; else nullptr.
  const PrefixHit* LookupPrefix(size_t i, const Sequence* seq, int64_t length);
  // The hit Check found for the i-th uid of the call, or nullptr.
  const PrefixHit* HitOf(size_t i) const {
    return prefix_ != nullptr && hit_index_[i] >= 0 ? &hits_[static_cast<size_t>(hit_index_[i])]
                                                    : nullptr;
  }
  void EnablePrefixCache();  // from the constructor
  // One reference to every block of this call's hits, before Schedule takes new blocks (which
  // may evict evictable ones); or, with share = false, drops them again (UndoSchedule).
  void ShareHitBlocks(bool share);
  // Gives back what Schedule took (scratch_) and shared: a failed promotion.
  void UndoSchedule();
  // Copies this call's host-level hits into `blocks` (fresh, taken by Schedule) and indexes
  // them; on a device error nothing is indexed and the error is returned.
  Status PromoteHits(std::span<const BlockId> blocks);
  // Puts the hit of the i-th uid (shared already) in the sequence's tables and moves it to the
  // hit's end.
  void TakePrefix(size_t i, Sequence& seq);
  // Publishes the blocks of `seq` that are full of known, computed tokens, and its state as a
  // checkpoint when it ends at one.
  void PublishFullBlocks(Sequence& seq);
  // ---- a STATE group's checkpoints (state_manager_prefix.cc, docs/prefix_cache.md) ----
  // The STATE group whose checkpoints prefix caching keeps, or -1; its interval in tokens.
  int checkpoint_group_ = -1;
  int32_t checkpoint_tokens_ = 0;
  // The key of the first `chunks` intervals of `keys`' tokens (extending keys' cached chain).
  // REQUIRES: keys.tokens holds chunks intervals.
  BlockHash CheckpointKey(SequenceKeys& keys, int32_t chunks) const;
  // Looks up the checkpoints of keys' first intervals, at most `limit`: match_blocks_ of the group
  // gets each interval's cached checkpoint or kNoBlock.
  void MatchCheckpoints(const SequenceKeys& keys, int32_t limit);
  // After a forward that ended at a checkpoint of known tokens: copies the sequence's state into
  // a free slot and publishes it (skipped, and counted, when no slot is free or the copy fails).
  void SaveCheckpoint(Sequence& seq, SequenceKeys& keys);
  // Schedule: copies each hit's checkpoint into its sequence's fresh slot (the group's blocks this
  // call took); on a device error nothing is copied that matters and the error is returned.
  Status ResumeFromCheckpoints(size_t n_uids);
  // ShareHitBlocks' part for checkpoints: one reference each, or none (share = false).
  void ShareCheckpoints(bool share);
  int64_t checkpoints_skipped_ = 0;  // SaveCheckpoint found no free slot or failed to copy
  // PostForward(batch): the tokens of a batch entry that would extend the sequence's known
  // tokens are valid ids; then appends them.
  Status CheckRecordableTokens(const Sequence& seq, int64_t seen_tokens,
                               std::span<const int64_t> tokens) const;
  void RecordTokens(const Sequence& seq, std::span<const int64_t> tokens);
  void ResetKeys(int32_t slot);
  void ForkKeys(const Sequence& from, const Sequence& to);
  Status CheckKeys(const Sequence& seq) const;

  // ---- the remote tier (state_manager_remote.cc) ----
  // From Create, after EnableOffload: opens the remote tier (state_manager_remote.cc). An
  // unreachable server leaves it off with one log line; other failures are returned.
  Status EnableRemoteTier();
  struct Verified {
    int32_t blocks = 0;                                                   // leading ones verified
    internal::RemoteTier::Miss miss = internal::RemoteTier::Miss::kNone;  // what stopped them
  };
  // Continues a run of `run` matched blocks of group 0 from the remote tier, at most `max`
  // blocks: fetches (or takes what FetchRemotePrefix fetched ahead, without waiting), verifies
  // and appends the values to remote_values_; returns how many, and the miss that stopped them
  // (TakePrefix counts it). With tp_size > 1 only a fetch ahead is taken (the ranks agreed on
  // it: AgreeRemotePrefix), never a fetch of its own.
  Verified MatchRemote(const SequenceKeys& keys, int32_t run, int32_t max);
  // Blocks [first, first + count) of a sequence.
  struct BlockRange {
    int32_t first = 0;
    int32_t count = 0;
  };
  struct RemoteValue {
    std::shared_ptr<const void> reply;  // owns `value` (hiredis's reply)
    std::string_view value;             // as fetched and verified
    size_t payload = 0;                 // offset of the block's bytes in it
  };
  // Verifies values[offset, offset + blocks.count) of `fetched` as the sequence's `blocks`
  // (remote_keys_ holds their keys), appending each verified one to `out` when given.
  Verified VerifyRemote(const SequenceKeys& keys, BlockRange blocks,
                        const internal::RemoteTier::Fetched& fetched, size_t offset,
                        std::vector<RemoteValue>* out);
  // StateManager::RemotePrefixOffer / AgreeRemotePrefix (docs/remote_tier.md, "Tensor
  // parallelism"). `who` names the caller in errors.
  Status CheckAgreeable(std::span<const SeqId> uids, std::string_view who) const;
  RemotePrefixVote RemotePrefixOffer(std::span<const SeqId> uids);
  Result<std::vector<int32_t>> AgreeRemotePrefix(const RemotePrefixVote& reduced);
  // The leading blocks of group 0 the device holds of `keys`' prompt, short of its last token.
  int32_t DeviceRun(const SequenceKeys& keys);
  // StateManager::FetchRemotePrefix: the job, and the blocks it asks for (none: nullptr, 0).
  Result<std::pair<std::shared_ptr<internal::RemoteFetchJob>, int32_t>> FetchRemotePrefix(
      SeqId uid);
  // Forgets a sequence's fetch ahead, taking it off the queue when it has not started.
  void DropPrefetch(SequenceKeys& keys);
  // remote_keys_[0, n): the chain keys of keys' first n blocks of group 0.
  void RemoteKeys(const SequenceKeys& keys, size_t n);
  // Copies remote_values_[first, first + blocks.size()) into `blocks` (fresh) and publishes them
  // chained on `parent` (what the block before them was published as; nullptr for block 0).
  // `run`: the index of blocks[0] in the sequence; `priority`: the sequence's retention priority.
  Status PlaceRemote(const SequenceKeys& keys, size_t first, std::span<const BlockId> blocks,
                     int32_t run, const PrefixCache::Published* parent, int32_t priority);
  // Copies a newly published block of group 0 out for the remote tier, into remote_stores_;
  // SendRemoteStores queues what is there (a dropped store is counted).
  void StoreRemote(const SequenceKeys& keys, int32_t index, const BlockHash& key,
                   const BlockHash* parent_key, BlockId block);
  void SendRemoteStores();
  // Waits for a resume of `seq` in flight; when its copy failed, parks the sequence again and
  // returns the error. OK when nothing is in flight.
  Status SettleRestore(Sequence& seq);
  // SettleRestore, then kFailedPrecondition when `seq` is preempted; `who` names it in the
  // message ("Fork: parent 7").
  Status RequireResident(Sequence& seq, std::string_view who);
  // Without waiting: true when no resume of `seq` is in flight, or it is done and succeeded
  // (then it is settled); false while it runs, or when it failed (left for the next call that
  // settles it to report).
  bool RestoreDone(Sequence& seq);
  // Waits for every resume in flight among `uids` (Schedule, before it checks anything).
  Status SettleRestores(std::span<const SeqId> uids);
  // FlushSequence's part: a preempted sequence's handles are dropped.
  void DropParked(Sequence& seq);
  Status CheckParked(const Sequence& seq, int group) const;

  // ---- sequence transfer (state_manager_transfer.cc) ----
  Status EnableTransfer();  // from Create
  Status RequireTransfer(std::string_view who) const;
  std::string TransferLayout() const;  // what two engines' blocks must agree on
  // Schedule's hook: flushes exports a receiver confirmed and cancels the expired ones (nothing
  // when there are no exports).
  void MaybeCompleteExports() {
    if (transfer_ != nullptr && !exports_.empty()) [[unlikely]]
      CompleteExports();
  }
  struct PendingExport {
    uint64_t id = 0;
    SeqId uid = 0;
    int64_t expires_ns = 0;  // steady_clock; INT64_MAX: never (export_timeout_ms 0)
  };
  std::unique_ptr<internal::TransferEndpoint> transfer_;
  std::vector<PendingExport> exports_;
  // Started imports (StartImport's tickets), their sequences tracked and pinned, in the order
  // started.
  std::vector<ImportTicket> imports_;
  // Commits (or, failed, drops) imports_[i], whose transfer has finished, and forgets it.
  Status FinishImport(size_t i);
  // kFailedPrecondition naming `who` while any import is started (snapshots).
  Status RefuseWhileImporting(std::string_view who) const;
  std::vector<uint32_t> transfer_region_;  // per group: its registered region
  std::string transfer_layout_;
  uint64_t transfer_fingerprint_ = 0;

  // ---- snapshots (snapshot.cc) ----
  // kFailedPrecondition naming the first sequence (by slot) whose state a snapshot cannot hold —
  // tokens in flight (their forward is not recorded), preempted or resuming (its blocks are in
  // the offload tiers, which a snapshot does not hold) — or the offload copies in flight.
  Status CheckSnapshotable() const;

  StateManagerConfig config_;
  std::unique_ptr<BlockedKVCache> cache_;
  std::vector<BlockPool> pools_;  // one per cache group (sharing state when the pool is shared)
  // Per group: the first group of its memory pool (g itself unless MemoryConfig::shared_pool).
  // Counts of free blocks per pool (free_scratch_, Check's, the copy and resume pre-checks)
  // live at the pool's lead group.
  std::vector<int> pool_lead_;
  // True when another group draws from `group`'s memory pool.
  bool SharesPool(int group) const {
    for (int g = 0; g < num_groups(); ++g) {
      if (g != group && pool_lead_[g] == pool_lead_[group]) return true;
    }
    return false;
  }
  // Per group: blocks AllocateBlocks handed out and the engine still holds (a mark per block,
  // sized on the first AllocateBlocks).
  struct EngineHeld {
    std::vector<uint8_t> marks;
    int32_t count = 0;
  };
  std::vector<EngineHeld> engine_held_;
  std::vector<std::vector<BlockId>> tables_;  // per group [max_tracked, max_blocks]
  BlockedAllocator slots_;                    // tracking slots
  std::unique_ptr<Sequence[]> sequences_;     // [max_tracked_sequences], indexed by slot
  // [max_tracked_sequences, num_groups] with several cache groups; empty with one (each
  // Sequence holds its own).
  std::vector<Sequence::GroupState> group_states_;
  std::unique_ptr<internal::UidMap> by_uid_;      // uid -> slot
  std::vector<internal::BlockSize> block_sizes_;  // per group
  // Per group: the attention window (a LOCAL group's local_window, else the prefix cache's
  // sliding_windows entry; 0: full attention).
  std::vector<int64_t> windows_;
  std::vector<int> local_groups_;         // the LOCAL groups, whose blocks Advance releases
  int state_group_ = -1;                  // the first STATE group (no rollback), or -1
  int64_t token_limit_ = 0;               // min(max_context, every table's token capacity)
  int64_t hit_step_ = 1;                  // a prefix hit is a multiple of every group's block size
  std::unique_ptr<PrefixCache> prefix_;   // when enabled
  std::unique_ptr<SequenceKeys[]> keys_;  // [max_tracked_sequences] when prefix_ is set
  // Declared after pools_ and prefix_: destroyed first, it gives back the blocks it holds.
  std::unique_ptr<PoolOwner> pool_owner_;  // when offload is on
  std::unique_ptr<OffloadStore> offload_;  // when offload is on
  std::unique_ptr<Parked[]> parked_;       // [max_tracked_sequences] when offload is on
  int32_t resuming_ = 0;                   // sequences whose resume copy is not yet settled
  // The prefix cache's host level (prefix_host_tier.h): with offload and prefix caching, one
  // cache group, no window. Destroyed before the store.
  std::unique_ptr<internal::PrefixHostTier> host_prefix_;
  std::vector<int32_t> promote_entries_;  // this call's host-level hits
  int32_t promoted_ = 0;                  // blocks of group 0 they need (Check counts them)
  // The remote tier (remote_tier.h) when configured (connected at Create or later).
  std::unique_ptr<internal::RemoteTier> remote_;
  std::vector<internal::RemoteTier::PendingStore> remote_stores_;  // a sequence's, being copied
  uint64_t remote_fingerprint_ = 0;
  std::vector<RemoteValue> remote_values_;  // this call's remote hits
  std::vector<BlockHash> remote_keys_;      // scratch: a lookup's chain keys

  // Scratch reused across calls so a step allocates nothing once warm.
  std::vector<std::vector<BlockId>> scratch_;  // per group: blocks taken in one Schedule
  std::vector<const BlockId*> next_scratch_;
  std::vector<BlockId> tail_scratch_;
  std::vector<int64_t> free_scratch_;  // per group: free blocks Check left uncounted (at the
                                       // pool's lead group, pool_lead_)
  int64_t lengths_sum_ = 0;            // of the lengths Check was given; -1 past int64
  std::vector<SeqId> uid_scratch_;
  std::vector<int32_t> slot_scratch_;  // per uid of the call: its slot, or -1 when new
  std::vector<int32_t> need_scratch_;  // [uids, groups]: new blocks Check counted
  std::vector<uint32_t> slot_marks_;   // [max_tracked]: == mark_epoch_ when seen
  uint32_t mark_epoch_ = 0;
  std::vector<int32_t> hit_index_;  // per uid of the call: index in hits_, or -1
  std::vector<PrefixHit> hits_;
  std::vector<BlockId> hit_blocks_;
  std::vector<int32_t> hit_starts_;                 // [hits, groups]
  std::vector<std::vector<BlockId>> match_blocks_;  // per group: one lookup's matches
  std::vector<BlockHash> match_keys_;
  std::vector<BlockId> checkpoint_from_, checkpoint_into_;  // ResumeFromCheckpoints' copies
  std::vector<std::vector<uint32_t>> block_marks_;          // per group [num_blocks]: epoch
  uint64_t last_table_version_ = 0;
};

}  // namespace blockkv
