// RaggedBatch: the per-step batch metadata, built on the host and mirrored to a CUDA device.
//
// Implementation notes. Every array is allocated once in Create at the manager's limits, so
// InsertSequence, Finalize and Clear allocate nothing:
//   input_ids        int64 [Pmax]            Pmax = PaddedTokenCount(max_ragged_batch_size)
//   tokens_to_seq    int32 [Pmax]
//   descriptors      int32 [max_seqs, 4]
//   metadata         int32 [2]
//   per cache group: block_tables int32 [max_seqs, max_blocks], kv_ptrs int64 [max_seqs],
//                    kv_indptr int32 [max_seqs + 1], kv_indices int32 [max_seqs · max_blocks],
//                    kv_last_page_len int32 [max_seqs], slot_mapping int64 [Pmax]
// InsertSequence validates and records a sequence and copies its tokens; Finalize builds the
// rest from the recorded sequences' tables. Rows of the dense tables hold kNoBlock past each
// table: Create fills them, and Finalize rewrites only the entries that changed since the last
// step: past the table, only what the row held before (row_len); within it, only what was
// appended since the row last copied the same Sequence::table_version(). A decode step thus
// copies about one block id per sequence into the dense tables, not the whole table.
// kv_ptrs never change: they are the addresses of the rows, written once in Create (on a CUDA
// device, the device mirror holds the device rows' addresses).
#include "blockkv/ragged_batch.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <type_traits>

#include "internal/block_size.h"
#include "internal/host_memory.h"
#include "internal/strings.h"

namespace blockkv {

using internal::ColdStrCat;
using internal::StrCat;

namespace {

constexpr int64_t kSmallBatchTokens = 512;  // to_padded: up to here, a multiple of 64
constexpr int64_t kSmallPadMultiple = 64;
constexpr int64_t kLargePadMultiple = 128;
constexpr int32_t kPadIndex = -1;    // input_ids, tokens_to_seq and slot_mapping of padding
constexpr int kDescriptorWidth = 4;  // [start_idx, n_tokens, seen_tokens, 0]
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

template <class T>
constexpr DType DTypeOf() {
  static_assert(std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>);
  return std::is_same_v<T, int32_t> ? DType::kInt32 : DType::kInt64;
}

// A host array and, when the batch mirrors to a CUDA device, a device buffer of the same size.
template <class T>
struct MirroredArray {
  std::vector<T> host;
  DeviceBuffer device;  // empty when there is no mirror

  Status Init(int64_t capacity, T fill, Device* mirror) {
    host.assign(static_cast<size_t>(capacity), fill);
    if (mirror == nullptr) return Status::Ok();
    BLOCKKV_ASSIGN_OR_RETURN(device, mirror->Allocate(capacity * int64_t{sizeof(T)}));
    return Status::Ok();
  }

  // Copies host[0, count) into the mirror.
  Status Upload(Device& mirror, int64_t count) const {
    if (count == 0) return Status::Ok();
    return mirror.CopyFromHost(device.data(), host.data(), count * int64_t{sizeof(T)});
  }

  T* data(bool on_device) const {
    return on_device ? static_cast<T*>(device.data()) : const_cast<T*>(host.data());
  }
};

}  // namespace

int64_t PaddedTokenCount(int64_t n_tokens) {
  if (n_tokens <= 0) return 0;
  if (n_tokens <= kSmallBatchTokens) return RoundUp(n_tokens, kSmallPadMultiple);
  return RoundUp(n_tokens, kLargePadMultiple);
}

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
    int32_t max_blocks = 0;                   // max_blocks_per_sequence of this group
    MirroredArray<BlockId> block_tables;      // [max_seqs, max_blocks]
    MirroredArray<int64_t> kv_ptrs;           // [max_seqs]
    MirroredArray<int32_t> kv_indptr;         // [max_seqs + 1]
    MirroredArray<int32_t> kv_indices;        // [max_seqs · max_blocks]
    MirroredArray<int32_t> kv_last_page_len;  // [max_seqs]
    MirroredArray<int64_t> slot_mapping;      // [padded capacity]
    std::vector<int32_t> row_len;       // [max_seqs] entries of each row that may not be kNoBlock
    std::vector<uint64_t> row_version;  // [max_seqs] table_version() of the row's last copy
  };

  Status Init(const StateManager& manager);
  Status InitGroup(const StateManager& manager, int g, int64_t padded_capacity);
  Status CheckInsertable(const Sequence& seq, int64_t n) const;
  static bool Unchanged(const Entry& e);
  [[gnu::cold, gnu::noinline]] static Status ChangedError(const Entry& e);
  void FillEntry(int32_t i);  // descriptors, token map, and every group's arrays for entry i
  void FillGroupEntry(Group& group, int32_t i);
  void FillPadding();
  Status Upload() const;
  Status CheckReadable(bool on_device) const;
  Status CheckGroup(int g) const;
  template <class T>
  Result<TensorView> View(const MirroredArray<T>& array, bool on_device,
                          std::initializer_list<int64_t> shape) const;

  const StateManager* owner = nullptr;   // outlives the batch (RaggedBatch::Create's REQUIRES)
  int32_t max_tokens = 0;                // max_ragged_batch_size
  int32_t max_seqs = 0;                  // max_ragged_sequence_count
  std::shared_ptr<Device> mirror;        // the CUDA device of the cache; null on the host
  MirroredArray<int64_t> input_ids;      // [padded capacity]
  MirroredArray<int32_t> tokens_to_seq;  // [padded capacity]
  MirroredArray<int32_t> descriptors;    // [max_seqs, 4]
  MirroredArray<int32_t> metadata;       // [2]
  std::vector<Group> groups;
  std::vector<Entry> entries;     // capacity max_seqs
  std::vector<uint8_t> in_batch;  // [max_tracked_sequences] by tracking slot
  int32_t n_tokens = 0;
  int32_t padded = 0;
  bool finalized = false;
};

Status RaggedBatch::Impl::Init(const StateManager& manager) {
  owner = &manager;
  const StateManagerConfig& config = manager.config();
  max_tokens = config.max_ragged_batch_size;
  max_seqs = config.max_ragged_sequence_count;
  const int64_t padded_capacity = PaddedTokenCount(max_tokens);
  if (padded_capacity > kInt32Max) {
    return InvalidArgumentError(
        StrCat("max_ragged_batch_size ", max_tokens, " pads to more tokens than int32 holds"));
  }
  const std::shared_ptr<Device>& device = manager.kv_cache().device();
  if (device != nullptr && device->kind() == DeviceKind::kCuda) mirror = device;
  Device* m = mirror.get();
  BLOCKKV_RETURN_IF_ERROR(input_ids.Init(padded_capacity, kPadIndex, m));
  BLOCKKV_RETURN_IF_ERROR(tokens_to_seq.Init(padded_capacity, kPadIndex, m));
  BLOCKKV_RETURN_IF_ERROR(descriptors.Init(int64_t{max_seqs} * kDescriptorWidth, 0, m));
  BLOCKKV_RETURN_IF_ERROR(metadata.Init(2, 0, m));
  groups.resize(static_cast<size_t>(manager.num_groups()));
  for (int g = 0; g < manager.num_groups(); ++g) {
    BLOCKKV_RETURN_IF_ERROR(InitGroup(manager, g, padded_capacity));
  }
  entries.reserve(static_cast<size_t>(max_seqs));
  in_batch.assign(static_cast<size_t>(config.max_tracked_sequences), 0);
  return Status::Ok();
}

Status RaggedBatch::Impl::InitGroup(const StateManager& manager, int g, int64_t padded_capacity) {
  Group& group = groups[static_cast<size_t>(g)];
  group.block_size = internal::BlockSize(manager.kv_block_size(g));
  group.max_blocks = manager.max_blocks_per_sequence(g);
  const int64_t table_size = int64_t{max_seqs} * group.max_blocks;
  if (table_size > kInt32Max) {
    return InvalidArgumentError(StrCat("cache group ", g, ": max_ragged_sequence_count ", max_seqs,
                                       " x ", group.max_blocks,
                                       " blocks per sequence does not fit the int32 CSR offsets"));
  }
  // The dense table and the CSR indices dominate; refuse what host memory cannot hold instead
  // of throwing bad_alloc.
  const int64_t table_bytes = 2 * table_size * int64_t{sizeof(BlockId)};
  if (const int64_t available = internal::ReadHostMemory().available; table_bytes > available) {
    return ResourceExhaustedError(StrCat("cache group ", g, ": the batch's block tables for ",
                                         max_seqs, " sequences x ", group.max_blocks,
                                         " blocks need ", table_bytes, " bytes of host memory, ",
                                         available, " available"));
  }
  Device* m = mirror.get();
  BLOCKKV_RETURN_IF_ERROR(group.block_tables.Init(table_size, kNoBlock, m));
  BLOCKKV_RETURN_IF_ERROR(group.kv_ptrs.Init(max_seqs, 0, m));
  BLOCKKV_RETURN_IF_ERROR(group.kv_indptr.Init(int64_t{max_seqs} + 1, 0, m));
  BLOCKKV_RETURN_IF_ERROR(group.kv_indices.Init(table_size, kNoBlock, m));
  BLOCKKV_RETURN_IF_ERROR(group.kv_last_page_len.Init(max_seqs, 0, m));
  BLOCKKV_RETURN_IF_ERROR(group.slot_mapping.Init(padded_capacity, kPadIndex, m));
  group.row_len.assign(static_cast<size_t>(max_seqs), 0);
  group.row_version.assign(static_cast<size_t>(max_seqs), 0);  // no sequence has version 0
  auto write_row_addresses = [&](const BlockId* rows) {
    for (int32_t i = 0; i < max_seqs; ++i) {
      group.kv_ptrs.host[static_cast<size_t>(i)] =
          static_cast<int64_t>(reinterpret_cast<uintptr_t>(rows + int64_t{i} * group.max_blocks));
    }
  };
  if (m != nullptr) {  // the mirror holds the device rows' addresses
    write_row_addresses(group.block_tables.data(/*on_device=*/true));
    BLOCKKV_RETURN_IF_ERROR(group.kv_ptrs.Upload(*m, max_seqs));
  }
  write_row_addresses(group.block_tables.host.data());
  return Status::Ok();
}

// Every check of InsertSequence, before anything changes. Messages are built out of line
// (ColdStrCat) and an OK Status is free, so this is also the hot path.
Status RaggedBatch::Impl::CheckInsertable(const Sequence& seq, int64_t n) const {
  if (finalized) [[unlikely]] {
    return FailedPreconditionError(ColdStrCat("cannot insert sequence ", seq.uid(),
                                              ": the batch is finalized; Clear it first"));
  }
  if (!owner->Owns(seq)) [[unlikely]] {
    return InvalidArgumentError(ColdStrCat(
        "sequence ", seq.uid(), " (slot ", seq.tracking_slot(),
        ") is not tracked by this batch's state manager: flushed, or another manager's"));
  }
  const auto slot = static_cast<size_t>(seq.tracking_slot());
  if (in_batch[slot] != 0) [[unlikely]] {
    return AlreadyExistsError(ColdStrCat("sequence ", seq.uid(), " is already in the batch"));
  }
  if (std::ssize(entries) >= max_seqs) [[unlikely]] {
    return ResourceExhaustedError(
        ColdStrCat("Ragged batch is full due to sequence limit: ", max_seqs,
                   " (max_ragged_sequence_count); cannot insert sequence ", seq.uid()));
  }
  if (n > int64_t{max_tokens} - n_tokens) [[unlikely]] {
    return ResourceExhaustedError(
        ColdStrCat("Ragged batch is full due to token limit: ", max_tokens,
                   " (max_ragged_batch_size); it holds ", n_tokens, " tokens and sequence ",
                   seq.uid(), " adds ", n));
  }
  if (n != seq.in_flight_tokens()) [[unlikely]] {
    return FailedPreconditionError(ColdStrCat("sequence ", seq.uid(), " has ",
                                              seq.in_flight_tokens(), " tokens in flight but ", n,
                                              " tokens were given; Schedule it first"));
  }
  if (seq.seen_tokens() > kInt32Max - n) [[unlikely]] {
    return OutOfRangeError(ColdStrCat("sequence ", seq.uid(), ": seen_tokens ", seq.seen_tokens(),
                                      " + ", n, " new tokens do not fit the int32 descriptors"));
  }
  // The table of every group reaches past the new positions [seen, seen + n). The entries there
  // hold blocks by the state manager's invariants (an entry is kNoBlock only when
  // FreeLeadingBlocks released it, and that releases only blocks wholly before seen), which
  // StateManager::CheckInvariants verifies; this O(1) check keeps the batch from ever indexing
  // past a table without reading the table itself.
  const int64_t end = seq.seen_tokens() + n;
  for (int g = 0; g < std::ssize(groups); ++g) {
    const Group& group = groups[static_cast<size_t>(g)];
    const int32_t allocated = seq.cur_allocated_blocks(g);
    const int64_t needed = group.block_size.BlocksFor(end);
    if (allocated < needed) [[unlikely]] {
      return FailedPreconditionError(
          ColdStrCat("sequence ", seq.uid(), " holds ", allocated, " blocks of cache group ", g,
                     " (block size ", group.block_size.value(), ") but tokens [", seq.seen_tokens(),
                     ", ", end, ") need ", needed, "; Schedule it first"));
    }
  }
  return Status::Ok();
}

// The recorded sequence was not flushed, scheduled or advanced since it was inserted. Its
// blocks for the new tokens cannot have changed without one of these: a sequence's table grows
// only through Schedule (which sets in_flight) and loses entries only to Flush or to
// FreeLeadingBlocks (which releases only blocks before seen).
bool RaggedBatch::Impl::Unchanged(const Entry& e) {
  const Sequence& seq = *e.seq;
  return seq.uid() == e.uid && seq.tracking_slot() == e.slot &&
         seq.seen_tokens() == e.seen_tokens && seq.in_flight_tokens() == e.n_tokens;
}

Status RaggedBatch::Impl::ChangedError(const Entry& e) {
  const Sequence& seq = *e.seq;
  return FailedPreconditionError(
      StrCat("sequence ", e.uid, " changed after InsertSequence (inserted with seen ",
             e.seen_tokens, ", ", e.n_tokens, " in flight; now uid ", seq.uid(), ", seen ",
             seq.seen_tokens(), ", ", seq.in_flight_tokens(), " in flight)"));
}

void RaggedBatch::Impl::FillEntry(int32_t i) {
  const Entry& e = entries[static_cast<size_t>(i)];
  std::fill_n(tokens_to_seq.host.begin() + e.start, e.n_tokens, i);
  int32_t* row = descriptors.host.data() + int64_t{i} * kDescriptorWidth;
  row[0] = e.start;
  row[1] = e.n_tokens;
  row[2] = e.seen_tokens;
  row[3] = 0;
  for (Group& group : groups) FillGroupEntry(group, i);
}

void RaggedBatch::Impl::FillGroupEntry(Group& group, int32_t i) {
  const Entry& e = entries[static_cast<size_t>(i)];
  const int g = static_cast<int>(&group - groups.data());
  const internal::BlockSize bs = group.block_size;
  std::span<const BlockId> table = e.seq->block_table(g);
  BlockId* row = group.block_tables.host.data() + int64_t{i} * group.max_blocks;
  const auto len = static_cast<int32_t>(table.size());
  // The row still holds this table's prefix when it last copied the same table version: copy
  // only what was appended since.
  const int32_t kept =
      group.row_version[i] == e.seq->table_version() ? std::min(group.row_len[i], len) : 0;
  std::copy(table.begin() + kept, table.end(), row + kept);
  if (group.row_len[i] > len) std::fill(row + len, row + group.row_len[i], kNoBlock);
  group.row_len[i] = len;
  group.row_version[i] = e.seq->table_version();

  const int64_t total = int64_t{e.seen_tokens} + e.n_tokens;
  const auto used = static_cast<int32_t>(bs.BlocksFor(total));
  int32_t* indptr = group.kv_indptr.host.data();
  std::copy_n(row, used, group.kv_indices.host.begin() + indptr[i]);
  indptr[i + 1] = indptr[i] + used;
  group.kv_last_page_len.host[i] = total == 0 ? 0 : static_cast<int32_t>(bs.Offset(total - 1) + 1);

  int64_t* slots = group.slot_mapping.host.data() + e.start;
  for (int32_t t = 0; t < e.n_tokens; ++t) {
    const int64_t pos = int64_t{e.seen_tokens} + t;
    slots[t] = int64_t{row[bs.Index(pos)]} * bs.value() + bs.Offset(pos);
  }
}

void RaggedBatch::Impl::FillPadding() {
  std::fill(input_ids.host.begin() + n_tokens, input_ids.host.begin() + padded, kPadIndex);
  std::fill(tokens_to_seq.host.begin() + n_tokens, tokens_to_seq.host.begin() + padded, kPadIndex);
  for (Group& group : groups) {
    std::fill(group.slot_mapping.host.begin() + n_tokens, group.slot_mapping.host.begin() + padded,
              int64_t{kPadIndex});
  }
  metadata.host[0] = n_tokens;
  metadata.host[1] = static_cast<int32_t>(entries.size());
}

Status RaggedBatch::Impl::Upload() const {
  if (mirror == nullptr) return Status::Ok();
  Device& m = *mirror;
  const int64_t n_seqs = std::ssize(entries);
  BLOCKKV_RETURN_IF_ERROR(input_ids.Upload(m, padded));
  BLOCKKV_RETURN_IF_ERROR(tokens_to_seq.Upload(m, padded));
  BLOCKKV_RETURN_IF_ERROR(descriptors.Upload(m, n_seqs * kDescriptorWidth));
  BLOCKKV_RETURN_IF_ERROR(metadata.Upload(m, 2));
  for (const Group& group : groups) {
    BLOCKKV_RETURN_IF_ERROR(group.block_tables.Upload(m, n_seqs * group.max_blocks));
    BLOCKKV_RETURN_IF_ERROR(group.kv_indptr.Upload(m, n_seqs + 1));
    BLOCKKV_RETURN_IF_ERROR(
        group.kv_indices.Upload(m, group.kv_indptr.host[static_cast<size_t>(n_seqs)]));
    BLOCKKV_RETURN_IF_ERROR(group.kv_last_page_len.Upload(m, n_seqs));
    BLOCKKV_RETURN_IF_ERROR(group.slot_mapping.Upload(m, padded));
  }
  return Status::Ok();
}

Status RaggedBatch::Impl::CheckReadable(bool on_device) const {
  if (!finalized) {
    return FailedPreconditionError("the batch's arrays are read after Finalize, until Clear");
  }
  if (on_device && mirror == nullptr) {
    return FailedPreconditionError(
        "on_device = true: the cache is on the host, so the batch has no device mirror");
  }
  return Status::Ok();
}

Status RaggedBatch::Impl::CheckGroup(int g) const {
  if (g < 0 || g >= std::ssize(groups)) {
    return OutOfRangeError(
        StrCat("cache group ", g, " is outside [0, ", groups.size(), ") of this batch"));
  }
  return Status::Ok();
}

template <class T>
Result<TensorView> RaggedBatch::Impl::View(const MirroredArray<T>& array, bool on_device,
                                           std::initializer_list<int64_t> shape) const {
  BLOCKKV_RETURN_IF_ERROR(CheckReadable(on_device));
  const DeviceKind kind = on_device ? mirror->kind() : DeviceKind::kCpu;
  const int ordinal = on_device ? mirror->ordinal() : 0;
  return ContiguousView(array.data(on_device), DTypeOf<T>(), kind, ordinal, shape);
}

// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<RaggedBatch>> RaggedBatch::Create(const StateManager& manager) {
  auto impl = std::make_unique<Impl>();
  BLOCKKV_RETURN_IF_ERROR(impl->Init(manager));
  return std::unique_ptr<RaggedBatch>(new RaggedBatch(std::move(impl)));
}

RaggedBatch::RaggedBatch(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RaggedBatch::~RaggedBatch() = default;

Status RaggedBatch::InsertSequence(const Sequence& seq, std::span<const int64_t> tokens) {
  Impl& b = *impl_;
  const int64_t n = std::ssize(tokens);
  BLOCKKV_RETURN_IF_ERROR(b.CheckInsertable(seq, n));
  b.entries.push_back(Impl::Entry{.seq = &seq,
                                  .uid = seq.uid(),
                                  .slot = seq.tracking_slot(),
                                  .start = b.n_tokens,
                                  .n_tokens = static_cast<int32_t>(n),
                                  .seen_tokens = static_cast<int32_t>(seq.seen_tokens())});
  if (n == 1) {  // a decode step: no call into memmove for one token
    b.input_ids.host[static_cast<size_t>(b.n_tokens)] = tokens[0];
  } else {
    std::copy(tokens.begin(), tokens.end(), b.input_ids.host.begin() + b.n_tokens);
  }
  b.in_batch[static_cast<size_t>(seq.tracking_slot())] = 1;
  b.n_tokens += static_cast<int32_t>(n);
  return Status::Ok();
}

Status RaggedBatch::Finalize(bool padding) {
  // Every sequence is checked before any array is written, so a failed Finalize changes nothing
  // (a batch finalized before stays finalized, its arrays intact). A failed upload to the device
  // mirror leaves the batch unfinalized.
  Impl& b = *impl_;
  for (const Impl::Entry& e : b.entries) {
    if (!Impl::Unchanged(e)) [[unlikely]] {
      return Impl::ChangedError(e);
    }
  }
  b.finalized = false;
  b.padded = padding ? static_cast<int32_t>(PaddedTokenCount(b.n_tokens)) : b.n_tokens;
  for (Impl::Group& group : b.groups) group.kv_indptr.host[0] = 0;
  for (int32_t i = 0; i < std::ssize(b.entries); ++i) b.FillEntry(i);
  b.FillPadding();
  BLOCKKV_RETURN_IF_ERROR(b.Upload());
  b.finalized = true;
  return Status::Ok();
}

void RaggedBatch::Clear() {
  Impl& b = *impl_;
  for (const Impl::Entry& e : b.entries) b.in_batch[static_cast<size_t>(e.slot)] = 0;
  b.entries.clear();
  b.n_tokens = 0;
  b.padded = 0;
  b.finalized = false;
}

RaggedBatch::Inserted RaggedBatch::inserted(int32_t i) const {
  const Impl::Entry& e = impl_->entries[static_cast<size_t>(i)];
  return {e.seq, e.seen_tokens,
          std::span<const int64_t>(impl_->input_ids.host.data() + e.start,
                                   static_cast<size_t>(e.n_tokens))};
}

const StateManager& RaggedBatch::manager() const { return *impl_->owner; }
int32_t RaggedBatch::current_tokens() const { return impl_->n_tokens; }
int32_t RaggedBatch::current_sequences() const {
  return static_cast<int32_t>(impl_->entries.size());
}
int32_t RaggedBatch::padded_tokens() const { return impl_->padded; }
bool RaggedBatch::finalized() const { return impl_->finalized; }

Result<TensorView> RaggedBatch::input_ids(bool on_device) const {
  return impl_->View(impl_->input_ids, on_device, {impl_->padded});
}

Result<TensorView> RaggedBatch::tokens_to_seq(bool on_device) const {
  return impl_->View(impl_->tokens_to_seq, on_device, {impl_->padded});
}

Result<TensorView> RaggedBatch::inflight_seq_descriptors(bool on_device) const {
  return impl_->View(impl_->descriptors, on_device, {current_sequences(), kDescriptorWidth});
}

Result<TensorView> RaggedBatch::batch_metadata(bool on_device) const {
  return impl_->View(impl_->metadata, on_device, {2});
}

Result<TensorView> RaggedBatch::block_tables(int group, bool on_device) const {
  BLOCKKV_RETURN_IF_ERROR(impl_->CheckGroup(group));
  const Impl::Group& g = impl_->groups[static_cast<size_t>(group)];
  return impl_->View(g.block_tables, on_device, {current_sequences(), g.max_blocks});
}

Result<TensorView> RaggedBatch::kv_ptrs(int group, bool on_device) const {
  BLOCKKV_RETURN_IF_ERROR(impl_->CheckGroup(group));
  const Impl::Group& g = impl_->groups[static_cast<size_t>(group)];
  return impl_->View(g.kv_ptrs, on_device, {current_sequences()});
}

Result<TensorView> RaggedBatch::kv_indptr(int group, bool on_device) const {
  BLOCKKV_RETURN_IF_ERROR(impl_->CheckGroup(group));
  const Impl::Group& g = impl_->groups[static_cast<size_t>(group)];
  return impl_->View(g.kv_indptr, on_device, {int64_t{current_sequences()} + 1});
}

Result<TensorView> RaggedBatch::kv_indices(int group, bool on_device) const {
  BLOCKKV_RETURN_IF_ERROR(impl_->CheckGroup(group));
  const Impl::Group& g = impl_->groups[static_cast<size_t>(group)];
  const int64_t n_indices = g.kv_indptr.host[static_cast<size_t>(current_sequences())];
  return impl_->View(g.kv_indices, on_device, {n_indices});
}

Result<TensorView> RaggedBatch::kv_last_page_len(int group, bool on_device) const {
  BLOCKKV_RETURN_IF_ERROR(impl_->CheckGroup(group));
  const Impl::Group& g = impl_->groups[static_cast<size_t>(group)];
  return impl_->View(g.kv_last_page_len, on_device, {current_sequences()});
}

Result<TensorView> RaggedBatch::slot_mapping(int group, bool on_device) const {
  BLOCKKV_RETURN_IF_ERROR(impl_->CheckGroup(group));
  const Impl::Group& g = impl_->groups[static_cast<size_t>(group)];
  return impl_->View(g.slot_mapping, on_device, {impl_->padded});
}

}  // namespace blockkv
