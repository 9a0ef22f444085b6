// SPDX-License-Identifier: Apache-2.0
// RaggedBatch::Impl, shared by ragged_batch.cc and StateManager::ScheduleBatch
// (state_manager.cc), which fills a batch in the pass that commits a schedule; the per-sequence
// part is inline here so that pass stays one loop.
//
// The hot functions read every array through a local pointer: a store through an int32_t* may
// alias the Impl's own int32 members, so member reads after one are reloaded, and a decode step
// does a dozen stores per sequence.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <vector>

#include "blockkv/device.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "blockkv/status.h"
#include "blockkv/tensor.h"
#include "internal/block_mover.h"
#include "internal/block_size.h"
#include "internal/upload_queue.h"

namespace blockkv {

inline constexpr int32_t kPadIndex = -1;    // input_ids, tokens_to_seq and slot_mapping of padding
inline constexpr int kDescriptorWidth = 4;  // [start_idx, n_tokens, seen_tokens, 0]

// One array of the batch: its place in the host arena and, when the batch has a device mirror, the
// same place in the device arena (ragged_batch.cc draws the layout).
template <class T>
struct ArenaArray {
  std::span<T> host;    // [capacity] in the host arena
  T* device = nullptr;  // the same offset in the device arena; null without a mirror
  int64_t offset = 0;   // bytes from the start of either arena
  int64_t capacity = 0;

  T* data(bool on_device) const { return on_device ? device : host.data(); }
};

struct RaggedBatch::Impl {
  // One inserted sequence, as it was when inserted.
  struct Entry {
    const Sequence* seq = nullptr;
    SeqId uid = 0;
    int32_t slot = 0;
    int32_t start = 0;     // index of its first token in the batch
    int32_t n_tokens = 0;  // its new tokens
    int32_t seen_tokens = 0;
  };

  struct Group {
    internal::BlockSize block_size;
    int32_t max_blocks = 0;                // max_blocks_per_sequence of this group
    ArenaArray<BlockId> block_tables;      // [max_seqs, max_blocks]
    ArenaArray<int64_t> kv_ptrs;           // [max_seqs]
    ArenaArray<int32_t> kv_indptr;         // [max_seqs + 1]
    ArenaArray<int32_t> kv_indices;        // [max_seqs · max_blocks]
    ArenaArray<int32_t> kv_last_page_len;  // [max_seqs]
    ArenaArray<int64_t> slot_mapping;      // [padded capacity]
    // Per row of block_tables: entries that may not be kNoBlock, and the table_version() of the
    // row's last copy (no sequence has version 0).
    struct Row {
      int32_t len = 0;
      uint64_t version = 0;
    };
    std::vector<Row> rows;  // [max_seqs]
  };

  ~Impl();
  Status Init(const StateManager& manager);
  Status InitGroup(const StateManager& manager, int g, int64_t padded_capacity);
  // Every array, in the order of the arenas' layout, with the value Create fills it with.
  template <class F>
  void ForEachArray(F&& f);
  Status AllocateArenas(int64_t bytes);
  void WriteRowAddresses(bool on_device);
  Status CheckInsertable(const Sequence& seq, int64_t n) const;
  // InsertSequence: records `seq` with its `tokens` as the next entry and marks its slot in
  // in_batch. REQUIRES: CheckInsertable's checks hold.
  void Append(const Sequence& seq, std::span<const TokenId> tokens);
  void Clear();
  // ScheduleBatch's entries leave in_batch unmarked (its duplicates are the manager's to catch,
  // and a finalized batch takes no InsertSequence): marks them after all, when the batch stays
  // open to InsertSequence (its Finish failed).
  void MarkEntries();
  Status Finish(bool padding);  // padding, the mirror, finalized
  static bool Unchanged(const Entry& e);
  [[gnu::cold, gnu::noinline]] static Status ChangedError(const Entry& e);
  class Writer;
  void FillPadding();
  // Queues this step's copy to the device mirror (nothing without one).
  Status Upload();
  // Waits for the last step's copy before the host arena is written again; keeps its error for
  // the next Finish.
  void AwaitCopy();
  Status CheckReadable(bool on_device) const;
  Status CheckGroup(int g) const;
  template <class T>
  Result<TensorView> View(const ArenaArray<T>& array, bool on_device,
                          std::initializer_list<int64_t> shape) const;

  const StateManager* owner = nullptr;  // outlives the batch (RaggedBatch::Create's REQUIRES)
  int32_t max_tokens = 0;               // max_ragged_batch_size
  int32_t max_seqs = 0;                 // max_ragged_sequence_count
  std::shared_ptr<Device> mirror;       // the CUDA device of the cache; null on the host
  ArenaArray<int64_t> input_ids;        // [padded capacity]
  ArenaArray<int32_t> tokens_to_seq;    // [padded capacity]
  ArenaArray<int32_t> descriptors;      // [max_seqs, 4]
  ArenaArray<int32_t> metadata;         // [2]
  std::vector<Group> groups;
  // Every array above, in one block of host memory (pinned for blockkv's CudaDevice) and one of
  // device memory with the same layout. Declared before `uploads`, which is destroyed first and
  // waits for its copies.
  internal::HostBuffer host_arena;
  DeviceBuffer device_arena;                       // empty without a mirror
  std::unique_ptr<internal::UploadQueue> uploads;  // null without a mirror
  bool copy_pending = false;                       // a copy from host_arena may be in flight
  Status copy_error;             // what the last AwaitCopy saw go wrong, for the next Finish
  std::vector<Entry> entry_buf;  // [max_seqs]; the first n_entries are the batch's
  int32_t n_entries = 0;
  std::span<const Entry> entries() const {
    return {entry_buf.data(), static_cast<size_t>(n_entries)};
  }
  std::vector<uint8_t> in_batch;  // [max_tracked_sequences] by tracking slot
  bool marked = false;            // some entries' slots are marked in in_batch
  int32_t n_tokens = 0;
  int32_t padded = 0;
  bool finalized = false;
};

// Writes the batch entry after entry: Finalize fills the entries InsertSequence recorded,
// ScheduleBatch appends and fills each sequence it has just scheduled. Every array is held as a
// raw pointer and the counts as locals, so that the dozen int32 / int64 stores per sequence (which
// may alias the Impl's own members) do not make the compiler reload them; a batch of one cache
// group (almost every model) has that group's arrays hoisted too. Done() writes the counts back.
// Every write of the arrays after Create goes through a Writer (FillPadding comes after one), so
// its constructor is where the last step's copy to the device mirror is waited for (normally long
// done) before the staging is overwritten.
class RaggedBatch::Impl::Writer {
 public:
  explicit Writer(Impl& batch)
      : batch_(batch),
        entries_(batch.entry_buf.data()),
        ids_(batch.input_ids.host.data()),
        to_seq_(batch.tokens_to_seq.host.data()),
        descriptors_(batch.descriptors.host.data()),
        n_entries_(batch.n_entries),
        n_tokens_(batch.n_tokens),
        one_group_(batch.groups.size() == 1),
        first_(batch.groups[0]) {
    if (batch.copy_pending) batch.AwaitCopy();  // the arrays are written next
  }

  // `seq` with its `tokens` as the next entry, which it returns. REQUIRES: CheckInsertable's
  // checks hold (ScheduleBatch: they hold by its own checks).
  [[gnu::always_inline]] Entry Append(const Sequence& seq, std::span<const TokenId> tokens) {
    const auto n = static_cast<int32_t>(tokens.size());
    const int32_t start = n_tokens_;
    const Entry e{.seq = &seq,
                  .uid = seq.uid(),
                  .slot = seq.tracking_slot(),
                  .start = start,
                  .n_tokens = n,
                  .seen_tokens = static_cast<int32_t>(seq.seen_tokens())};
    // Field by field: GCC builds a whole-struct copy on the stack and reloads it in 16-byte loads
    // that wait for the 8-byte stores before them (no store forwarding across them).
    Entry& to = entries_[n_entries_++];
    to.seq = e.seq;
    to.uid = e.uid;
    to.slot = e.slot;
    to.start = e.start;
    to.n_tokens = e.n_tokens;
    to.seen_tokens = e.seen_tokens;
    int64_t* ids = ids_ + start;
    if (n == 1) {  // decode: the vectorized loop's setup costs more than its one token
      ids[0] = tokens[0];
    } else {
      std::copy(tokens.begin(), tokens.end(), ids);
    }
    n_tokens_ = start + n;
    return e;
  }

  // ScheduleBatch: Append, then the entry's rows of every array. The entry is passed on as
  // computed, not read back from where it was just stored (a load right after a store to the
  // same bytes waits on store forwarding).
  [[gnu::always_inline]] void AppendFilled(const Sequence& seq, std::span<const TokenId> tokens) {
    const Entry e = Append(seq, tokens);
    Fill(n_entries_ - 1, e);
  }
  // The same for a batch of one cache group (REQUIRED), whose table `seq` has, entries
  // [0, allocated) at `row`, the caller passes (the manager reads them where the sequence keeps
  // them, in the same cache line as the rest).
  [[gnu::always_inline]] void AppendFilledOneGroup(const Sequence& seq,
                                                   std::span<const TokenId> tokens,
                                                   const BlockId* row, int32_t allocated) {
    const Entry e = Append(seq, tokens);
    const int32_t i = n_entries_ - 1;
    FillSequenceRows(i, e);
    first_.Fill({row, static_cast<size_t>(allocated)}, seq.table_version(), e, i,
                int64_t{e.seen_tokens} + e.n_tokens, e.n_tokens == 1);
  }

  // Entry i's rows of every array: descriptors, token map, and each group's dense row, CSR
  // indices, last page length and slots. REQUIRES: entries [0, i) are filled; `e` is entry i.
  [[gnu::always_inline]] void Fill(int32_t i, const Entry& e) {
    FillSequenceRows(i, e);
    const bool decode = e.n_tokens == 1;
    const int64_t total = int64_t{e.seen_tokens} + e.n_tokens;
    const uint64_t version = e.seq->table_version();
    if (one_group_) [[likely]] {
      first_.Fill(e.seq->block_table(0), version, e, i, total, decode);
      return;
    }
    for (size_t g = 0; g < batch_.groups.size(); ++g) {
      GroupOut(batch_.groups[g])
          .Fill(e.seq->block_table(static_cast<int>(g)), version, e, i, total, decode);
    }
  }

  // Entry i's token map and descriptor.
  [[gnu::always_inline]] void FillSequenceRows(int32_t i, const Entry& e) {
    int32_t* to_seq = to_seq_ + e.start;
    if (e.n_tokens == 1) {  // decode: the vectorized loop's setup costs more than its one token
      to_seq[0] = i;
    } else {
      std::fill_n(to_seq, e.n_tokens, i);
    }
    int32_t* row = descriptors_ + int64_t{i} * kDescriptorWidth;
    row[0] = e.start;
    row[1] = e.n_tokens;
    row[2] = e.seen_tokens;
    row[3] = 0;
  }

  void Done() {
    batch_.n_entries = n_entries_;
    batch_.n_tokens = n_tokens_;
  }

 private:
  // One group's arrays.
  struct GroupOut {
    explicit GroupOut(Group& group)
        : block_size(group.block_size),
          max_blocks(group.max_blocks),
          rows(group.rows.data()),
          tables(group.block_tables.host.data()),
          indptr(group.kv_indptr.host.data()),
          indices(group.kv_indices.host.data()),
          last_page_len(group.kv_last_page_len.host.data()),
          slots(group.slot_mapping.host.data()) {}

    [[gnu::always_inline]] void Fill(std::span<const BlockId> table, uint64_t version,
                                     const Entry& e, int32_t i, int64_t total, bool decode) const {
      const internal::BlockSize bs = block_size;
      const BlockId* from = table.data();
      const auto len = static_cast<int32_t>(table.size());
      // The dense row still holds this table's prefix when it last copied the same table
      // version: copy only what was appended since, and clear what the row held past the table.
      Group::Row& last = rows[i];
      const Group::Row was = last;
      BlockId* row = tables + int64_t{i} * max_blocks;
      if (was.version == version && was.len <= len) [[likely]] {  // the same table, grown
        if (was.len + 1 == len) {  // a decode step that crossed into a new block
          row[was.len] = from[was.len];
          last.len = len;
        } else if (was.len < len) {
          std::copy(from + was.len, from + len, row + was.len);
          last.len = len;
        }
      } else {
        const int32_t kept = was.version == version ? std::min(was.len, len) : 0;
        std::copy(from + kept, from + len, row + kept);
        for (int32_t b = len; b < was.len; ++b) row[b] = kNoBlock;
        last = {.len = len, .version = version};
      }

      // CSR: the blocks holding tokens [0, total), copied from the table (loads of the row just
      // written would wait on store forwarding). All three arrays below come from the last
      // position's block and offset: used = its block + 1, the last page's length = its offset
      // + 1, and in a decode step it is the one new token's slot.
      const int64_t last_pos = total - 1;  // -1 for a sequence with no tokens
      const int64_t last_block = total == 0 ? -1 : bs.Index(last_pos);
      const int64_t last_offset = total == 0 ? -1 : bs.Offset(last_pos);
      const auto used = static_cast<int32_t>(last_block + 1);
      const int32_t first = indptr[i];
      std::memcpy(indices + first, from, static_cast<size_t>(used) * sizeof(BlockId));
      indptr[i + 1] = first + used;
      last_page_len[i] = static_cast<int32_t>(last_offset + 1);

      int64_t* to = slots + e.start;
      if (decode) {
        to[0] = int64_t{from[last_block]} * bs.value() + last_offset;
      } else {
        for (int32_t t = 0; t < e.n_tokens; ++t) {
          const int64_t pos = int64_t{e.seen_tokens} + t;
          to[t] = int64_t{from[bs.Index(pos)]} * bs.value() + bs.Offset(pos);
        }
      }
    }

    internal::BlockSize block_size;
    int32_t max_blocks;
    Group::Row* rows;        // [max_seqs]
    BlockId* tables;         // [max_seqs, max_blocks]
    int32_t* indptr;         // [max_seqs + 1]
    int32_t* indices;        // [max_seqs · max_blocks]
    int32_t* last_page_len;  // [max_seqs]
    int64_t* slots;          // [padded capacity]
  };

  Impl& batch_;
  Entry* entries_;        // [max_seqs]
  int64_t* ids_;          // [padded capacity]
  int32_t* to_seq_;       // [padded capacity]
  int32_t* descriptors_;  // [max_seqs, 4]
  int32_t n_entries_;
  int32_t n_tokens_;
  bool one_group_;
  GroupOut first_;  // group 0's arrays
};

}  // namespace blockkv
