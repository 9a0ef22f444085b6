// SPDX-License-Identifier: Apache-2.0
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
//
// The device mirror. All arrays live in one host arena and, with a mirror, one device arena of
// the same layout (ForEachArray), each array 256-byte aligned at a fixed offset, so the device
// addresses never change (engines capture CUDA graphs over them):
//   | kv_ptrs (each group) | metadata | descriptors | input_ids | tokens_to_seq |
//   | per group: kv_indptr, kv_last_page_len, slot_mapping | per group: block_tables, kv_indices |
// Create copies the whole arena once (kv_ptrs then hold the device rows' addresses; the host
// ones are written after). Each Finalize copies from metadata to the end of the last group's
// used kv_indices: the used part of every array and the unused capacity between them, except
// that a gap of more than kCopyGapBytes (64 KiB) splits the copy in two rather than being carried.
// With the batch's sequences near max_ragged_sequence_count that is one copy; a batch far below
// it (unused rows of block_tables past 64 KiB) takes one more per such gap. On blockkv's
// CudaDevice the host arena is pinned (cudaHostAlloc) and the copies are cudaMemcpyAsync on the
// legacy default stream, with an event recorded after them that the next step's Writer
// synchronizes before it overwrites the arena (src/internal/upload_queue.h). Any other Device
// that says kCuda gets its own synchronous CopyFromHost of the same ranges.
#include "blockkv/ragged_batch.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "blockkv/cuda_device.h"
#include "internal/block_mover.h"
#include "internal/block_size.h"
#include "internal/check.h"
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

// Unused capacity between two arrays' used parts up to which one copy carries both (and the gap)
// rather than two copies: about a microsecond of PCIe 5 at 50 GB/s, less than what a second
// cudaMemcpyAsync costs to queue and start.
constexpr int64_t kCopyGapBytes = 64 << 10;

void FreeAligned(std::byte* data) { std::free(data); }

// The host arena without a mirror, or for a Device that is not blockkv's CudaDevice.
Result<internal::HostBuffer> AllocateAligned(int64_t bytes) {
  constexpr int64_t kAlign = 4096;
  const int64_t rounded = RoundUp(std::max<int64_t>(bytes, 1), kAlign);
  void* data = std::aligned_alloc(kAlign, static_cast<size_t>(rounded));
  if (data == nullptr) {
    return ResourceExhaustedError(
        StrCat("cannot allocate ", bytes, " bytes of host memory for the batch's arrays"));
  }
  return internal::HostBuffer(static_cast<std::byte*>(data), bytes, FreeAligned);
}

// A Device of kind kCuda that is not blockkv's CudaDevice (an engine's own, or a test's): its
// CopyFromHost, which returns when the copy is done.
class DeviceCopyQueue final : public internal::UploadQueue {
 public:
  explicit DeviceCopyQueue(Device& device) : device_(device) {}
  Status Copy(void* dst, const std::byte* src, int64_t bytes) override {
    return device_.CopyFromHost(dst, src, bytes);
  }
  Status Record() override { return Status::Ok(); }
  Status Wait() override { return Status::Ok(); }

 private:
  Device& device_;
};

// The ranges of one step's copy: the used parts of the arrays, added in arena order, merged
// while the unused capacity between them is at most kCopyGapBytes.
class CopyPlan {
 public:
  CopyPlan(internal::UploadQueue& queue, const std::byte* host, std::byte* device)
      : queue_(queue), host_(host), device_(device) {}

  template <class T>
  Status Add(const ArenaArray<T>& array, int64_t count) {
    if (count == 0) return Status::Ok();
    BLOCKKV_CHECK(array.offset >= end_, "the batch's copy adds arrays out of arena order");
    if (begin_ >= 0 && array.offset - end_ > kCopyGapBytes) BLOCKKV_RETURN_IF_ERROR(Flush());
    if (begin_ < 0) begin_ = array.offset;
    end_ = array.offset + count * int64_t{sizeof(T)};
    return Status::Ok();
  }

  // Queues the range added since the last Flush.
  Status Flush() {
    if (begin_ < 0) return Status::Ok();
    const int64_t begin = std::exchange(begin_, -1);
    return queue_.Copy(device_ + begin, host_ + begin, end_ - begin);
  }

 private:
  internal::UploadQueue& queue_;
  const std::byte* host_;
  std::byte* device_;
  int64_t begin_ = -1;  // of the range being built; -1 when there is none
  int64_t end_ = 0;
};

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
  const int64_t padded_capacity = PaddedTokenCount(max_tokens);  // <= int32 (config validated)
  const std::shared_ptr<Device>& device = manager.kv_cache().device();
  if (device != nullptr && device->kind() == DeviceKind::kCuda) mirror = device;
  input_ids.capacity = padded_capacity;
  tokens_to_seq.capacity = padded_capacity;
  descriptors.capacity = int64_t{max_seqs} * kDescriptorWidth;
  metadata.capacity = 2;
  groups.resize(static_cast<size_t>(manager.num_groups()));
  for (int g = 0; g < manager.num_groups(); ++g) {
    BLOCKKV_RETURN_IF_ERROR(InitGroup(manager, g, padded_capacity));
  }
  int64_t bytes = 0;
  ForEachArray([&bytes]<class T>(ArenaArray<T>& array, T /*fill*/) {
    array.offset = bytes;
    bytes = RoundUp(bytes + array.capacity * int64_t{sizeof(T)}, kDeviceAlignment);
  });
  BLOCKKV_RETURN_IF_ERROR(AllocateArenas(bytes));
  std::byte* const host = host_arena.data();
  auto* const on_device = static_cast<std::byte*>(device_arena.data());
  ForEachArray([&]<class T>(ArenaArray<T>& array, T fill) {
    array.host = {reinterpret_cast<T*>(host + array.offset), static_cast<size_t>(array.capacity)};
    if (on_device != nullptr) array.device = reinterpret_cast<T*>(on_device + array.offset);
    std::fill(array.host.begin(), array.host.end(), fill);
  });
  if (uploads != nullptr) {
    // The whole arena once, kv_ptrs holding the device rows' addresses: the only copy of kv_ptrs,
    // which no step copies again.
    WriteRowAddresses(/*on_device=*/true);
    BLOCKKV_RETURN_IF_ERROR(uploads->Copy(on_device, host, bytes));
    BLOCKKV_RETURN_IF_ERROR(uploads->Record());
    BLOCKKV_RETURN_IF_ERROR(uploads->Wait());
  }
  WriteRowAddresses(/*on_device=*/false);
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
  // of failing to allocate it.
  const int64_t table_bytes = 2 * table_size * int64_t{sizeof(BlockId)};
  if (const int64_t available = internal::ReadHostMemory().available; table_bytes > available) {
    return ResourceExhaustedError(StrCat("cache group ", g, ": the batch's block tables for ",
                                         max_seqs, " sequences x ", group.max_blocks,
                                         " blocks need ", table_bytes, " bytes of host memory, ",
                                         available, " available"));
  }
  group.block_tables.capacity = table_size;
  group.kv_ptrs.capacity = max_seqs;
  group.kv_indptr.capacity = int64_t{max_seqs} + 1;
  group.kv_indices.capacity = table_size;
  group.kv_last_page_len.capacity = max_seqs;
  group.slot_mapping.capacity = padded_capacity;
  group.rows.assign(static_cast<size_t>(max_seqs), Group::Row{});
  return Status::Ok();
}

// The arenas' layout, each array 256-byte aligned. kv_ptrs first: copied once, in Create. Then
// the arrays every step copies a prefix of, so that one copy from the first to the end of the
// last one's used part carries them all: the small ones (whose unused capacity lies between the
// copied parts), and the block tables and CSR indices last (large, and the last one's unused part
// is not copied).
template <class F>
void RaggedBatch::Impl::ForEachArray(F&& f) {
  for (Group& group : groups) f(group.kv_ptrs, int64_t{0});
  f(metadata, 0);
  f(descriptors, 0);
  f(input_ids, int64_t{kPadIndex});
  f(tokens_to_seq, kPadIndex);
  for (Group& group : groups) {
    f(group.kv_indptr, 0);
    f(group.kv_last_page_len, 0);
    f(group.slot_mapping, int64_t{kPadIndex});
  }
  for (Group& group : groups) {
    f(group.block_tables, kNoBlock);
    f(group.kv_indices, kNoBlock);
  }
}

Status RaggedBatch::Impl::AllocateArenas(int64_t bytes) {
  if (const int64_t available = internal::ReadHostMemory().available; bytes > available) {
    return ResourceExhaustedError(StrCat("the batch's arrays need ", bytes,
                                         " bytes of host memory, ", available, " available"));
  }
  if (mirror == nullptr) {
    BLOCKKV_ASSIGN_OR_RETURN(host_arena, AllocateAligned(bytes));
    return Status::Ok();
  }
  // blockkv's CudaDevice: pinned staging and asynchronous copies. Any other Device of kind
  // kCuda: its own (synchronous) CopyFromHost from plain memory.
  if (CudaStream(*mirror).ok()) {
    BLOCKKV_ASSIGN_OR_RETURN(host_arena, internal::AllocateUploadStaging(*mirror, bytes));
    BLOCKKV_ASSIGN_OR_RETURN(uploads, internal::MakeCudaUploadQueue(*mirror));
  } else {
    BLOCKKV_ASSIGN_OR_RETURN(host_arena, AllocateAligned(bytes));
    uploads = std::make_unique<DeviceCopyQueue>(*mirror);
  }
  BLOCKKV_ASSIGN_OR_RETURN(device_arena, mirror->Allocate(bytes));
  return Status::Ok();
}

// kv_ptrs: the addresses of the block tables' rows, host or device ones.
void RaggedBatch::Impl::WriteRowAddresses(bool on_device) {
  for (Group& group : groups) {
    const BlockId* rows = group.block_tables.data(on_device);
    for (int32_t i = 0; i < max_seqs; ++i) {
      group.kv_ptrs.host[static_cast<size_t>(i)] =
          static_cast<int64_t>(reinterpret_cast<uintptr_t>(rows + int64_t{i} * group.max_blocks));
    }
  }
}

RaggedBatch::Impl::~Impl() {
  if (copy_pending) AwaitCopy();
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

// A failed copy leaves copy_pending unset and the batch unfinalized: a range queued before the
// failure may still be in flight while the arrays are written again, which is harmless, since
// nothing reads the mirror of an unfinalized batch and the retry's copy follows it on the stream.
Status RaggedBatch::Impl::Upload() {
  if (uploads == nullptr) return Status::Ok();
  const int64_t n_seqs = n_entries;
  CopyPlan plan(*uploads, host_arena.data(), static_cast<std::byte*>(device_arena.data()));
  // ForEachArray's order, kv_ptrs left out.
  BLOCKKV_RETURN_IF_ERROR(plan.Add(metadata, 2));
  BLOCKKV_RETURN_IF_ERROR(plan.Add(descriptors, n_seqs * kDescriptorWidth));
  BLOCKKV_RETURN_IF_ERROR(plan.Add(input_ids, padded));
  BLOCKKV_RETURN_IF_ERROR(plan.Add(tokens_to_seq, padded));
  for (const Group& group : groups) {
    BLOCKKV_RETURN_IF_ERROR(plan.Add(group.kv_indptr, n_seqs + 1));
    BLOCKKV_RETURN_IF_ERROR(plan.Add(group.kv_last_page_len, n_seqs));
    BLOCKKV_RETURN_IF_ERROR(plan.Add(group.slot_mapping, padded));
  }
  for (const Group& group : groups) {
    BLOCKKV_RETURN_IF_ERROR(plan.Add(group.block_tables, n_seqs * group.max_blocks));
    BLOCKKV_RETURN_IF_ERROR(
        plan.Add(group.kv_indices, group.kv_indptr.host[static_cast<size_t>(n_seqs)]));
  }
  BLOCKKV_RETURN_IF_ERROR(plan.Flush());
  BLOCKKV_RETURN_IF_ERROR(uploads->Record());
  copy_pending = true;
  return Status::Ok();
}

void RaggedBatch::Impl::AwaitCopy() {
  copy_pending = false;
  if (Status waited = uploads->Wait(); !waited.ok() && copy_error.ok()) {
    copy_error = std::move(waited);
  }
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
Result<TensorView> RaggedBatch::Impl::View(const ArenaArray<T>& array, bool on_device,
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

Status RaggedBatch::InsertSequence(const Sequence& seq, std::span<const TokenId> tokens) {
  BLOCKKV_RETURN_IF_ERROR(impl_->CheckInsertable(seq, std::ssize(tokens)));
  impl_->Append(seq, tokens);
  return Status::Ok();
}

void RaggedBatch::Impl::Append(const Sequence& seq, std::span<const TokenId> tokens) {
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

// After every entry's arrays are written. A failed copy to the device mirror leaves the batch
// unfinalized, and so does the last step's copy found failed on the device when waited for.
Status RaggedBatch::Impl::Finish(bool padding) {
  if (copy_pending) AwaitCopy();  // a Writer has waited already, unless it wrote nothing
  padded = padding ? static_cast<int32_t>(PaddedTokenCount(n_tokens)) : n_tokens;
  FillPadding();
  if (!copy_error.ok()) [[unlikely]] {  // the last step's copy failed on the device
    return std::exchange(copy_error, Status::Ok());
  }
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
