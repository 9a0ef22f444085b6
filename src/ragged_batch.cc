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
// step: past the table, only what the row held before (Group::Row::len); within it, only what was
// appended since the row last copied the same Sequence::table_version(). A decode step thus
// copies about one block id per sequence into the dense tables, not the whole table.
// kv_ptrs never change: they are the addresses of the rows, written once in Create (on a CUDA
// device, the device mirror holds the device rows' addresses).
#include "blockkv/ragged_batch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>

#include "internal/block_size.h"
#include "internal/host_memory.h"
#include "internal/strings.h"
#include "ragged_batch_impl.h"

namespace blockkv {

using internal::ColdStrCat;
using internal::StrCat;

namespace {

constexpr int64_t kSmallBatchTokens = 512;  // to_padded: up to here, a multiple of 64
constexpr int64_t kSmallPadMultiple = 64;
constexpr int64_t kLargePadMultiple = 128;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

template <class T>
constexpr DType DTypeOf() {
  static_assert(std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>);
  return std::is_same_v<T, int32_t> ? DType::kInt32 : DType::kInt64;
}

}  // namespace

int64_t PaddedTokenCount(int64_t n_tokens) {
  if (n_tokens <= 0) return 0;
  if (n_tokens <= kSmallBatchTokens) return RoundUp(n_tokens, kSmallPadMultiple);
  return RoundUp(n_tokens, kLargePadMultiple);
}

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
  entry_buf.resize(static_cast<size_t>(max_seqs));
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
  group.rows.assign(static_cast<size_t>(max_seqs), Group::Row{});
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
  if (n_entries >= max_seqs) [[unlikely]] {
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

void RaggedBatch::Impl::FillPadding() {
  std::fill(input_ids.host.begin() + n_tokens, input_ids.host.begin() + padded, kPadIndex);
  std::fill(tokens_to_seq.host.begin() + n_tokens, tokens_to_seq.host.begin() + padded, kPadIndex);
  for (Group& group : groups) {
    std::fill(group.slot_mapping.host.begin() + n_tokens, group.slot_mapping.host.begin() + padded,
              int64_t{kPadIndex});
  }
  metadata.host[0] = n_tokens;
  metadata.host[1] = n_entries;
}

Status RaggedBatch::Impl::Upload() const {
  if (mirror == nullptr) return Status::Ok();
  Device& m = *mirror;
  const int64_t n_seqs = n_entries;
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
  BLOCKKV_RETURN_IF_ERROR(impl_->CheckInsertable(seq, std::ssize(tokens)));
  impl_->Append(seq, tokens);
  return Status::Ok();
}

void RaggedBatch::Impl::Append(const Sequence& seq, std::span<const int64_t> tokens) {
  Writer writer(*this);
  writer.Append(seq, tokens);
  writer.Done();
  in_batch[static_cast<size_t>(seq.tracking_slot())] = 1;
  marked = true;
}

void RaggedBatch::Impl::MarkEntries() {
  for (const Entry& e : entries()) in_batch[static_cast<size_t>(e.slot)] = 1;
  marked = true;
}

void RaggedBatch::Impl::Clear() {
  if (marked) {
    for (const Entry& e : entries()) in_batch[static_cast<size_t>(e.slot)] = 0;
    marked = false;
  }
  n_entries = 0;
  n_tokens = 0;
  padded = 0;
  finalized = false;
}

// After every entry's arrays are written. A failed upload to the device mirror leaves the batch
// unfinalized.
Status RaggedBatch::Impl::Finish(bool padding) {
  padded = padding ? static_cast<int32_t>(PaddedTokenCount(n_tokens)) : n_tokens;
  FillPadding();
  BLOCKKV_RETURN_IF_ERROR(Upload());
  finalized = true;
  return Status::Ok();
}

Status RaggedBatch::Finalize(bool padding) {
  // Every sequence is checked before any array is written, so a failed Finalize changes nothing
  // (a batch finalized before stays finalized, its arrays intact).
  Impl& b = *impl_;
  for (const Impl::Entry& e : b.entries()) {
    if (!Impl::Unchanged(e)) [[unlikely]] {
      return Impl::ChangedError(e);
    }
  }
  b.finalized = false;  // kv_indptr[0] is 0 from Create on: only [1, S] are ever written
  Impl::Writer writer(b);
  for (int32_t i = 0; i < b.n_entries; ++i) writer.Fill(i, b.entry_buf[static_cast<size_t>(i)]);
  return b.Finish(padding);
}

void RaggedBatch::Clear() { impl_->Clear(); }

RaggedBatch::Inserted RaggedBatch::inserted(int32_t i) const {
  const Impl::Entry& e = impl_->entry_buf[static_cast<size_t>(i)];
  return {e.seq, e.seen_tokens,
          std::span<const int64_t>(impl_->input_ids.host.data() + e.start,
                                   static_cast<size_t>(e.n_tokens))};
}

const StateManager& RaggedBatch::manager() const { return *impl_->owner; }
int32_t RaggedBatch::current_tokens() const { return impl_->n_tokens; }
int32_t RaggedBatch::current_sequences() const { return impl_->n_entries; }
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
