// SPDX-License-Identifier: Apache-2.0
// A model-based driver for BlockedAllocator: random programs of operations, valid and invalid,
// run against the real allocator and against a trivially correct reference, compared after every
// operation. block_allocator_model_test.cc runs it on a seeded PRNG; tests/fuzz's
// block_allocator_fuzz.cc runs it on libFuzzer's bytes.
//
//   RandomSource source(/*seed=*/42);
//   ModelStats stats;
//   std::string failure = RunAllocatorModel(source, /*max_ops=*/1'000'000, &stats);
//   // failure is empty, or says which operation disagreed and how
//
// The reference is the contract of DESIGN.md §3 written the obvious way: a used flag per id and a
// std::deque as the free list, Free pushing each id onto the front in the order given, Allocate
// popping from the front. It reproduces the real allocator's order, so returned ids must match
// exactly, not just as sets.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/status.h"

namespace blockkv_test {

// Choices from a seeded PRNG (splitmix64): fast, and the same on every platform.
class RandomSource {
 public:
  explicit RandomSource(uint64_t seed) : state_(seed) {}
  bool exhausted() const { return false; }
  // Uniform-enough in [0, bound); bound >= 1.
  uint32_t Below(uint32_t bound) {
    return static_cast<uint32_t>(((Next() >> 32) * uint64_t{bound}) >> 32);
  }

 private:
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  uint64_t state_;
};

// Choices read from a fuzzer's input: one byte for a small bound, two for a larger one; zeros
// once the input is used up (the driver then stops).
class ByteSource {
 public:
  ByteSource(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool exhausted() const { return pos_ >= size_; }
  uint32_t Below(uint32_t bound) {
    uint32_t raw = NextByte();
    if (bound > 256) raw |= NextByte() << 8;
    if (bound > 65536) raw |= NextByte() << 16;
    return raw % bound;
  }

 private:
  uint32_t NextByte() { return pos_ < size_ ? data_[pos_++] : 0; }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// The allocator contract, written the obvious way.
class ReferenceAllocator {
 public:
  explicit ReferenceAllocator(int32_t num_blocks)
      : used_(static_cast<size_t>(num_blocks), 0),
        seen_in_free_(static_cast<size_t>(num_blocks), 0),
        live_index_(static_cast<size_t>(num_blocks), 0) {
    for (blockkv::BlockId id = 0; id < num_blocks; ++id) free_.push_back(id);
  }

  int32_t num_blocks() const { return static_cast<int32_t>(used_.size()); }
  int32_t free_blocks() const { return static_cast<int32_t>(free_.size()); }
  bool used(blockkv::BlockId id) const { return used_[static_cast<size_t>(id)] != 0; }
  // The allocated ids, in no particular order: for picking random ones.
  const std::vector<blockkv::BlockId>& live() const { return live_; }
  // The free ids, head of the free list first.
  const std::deque<blockkv::BlockId>& free_list() const { return free_; }

  // `out_capacity` is the size of the caller's span (or n for the vector overload).
  blockkv::StatusCode Allocate(int32_t n, size_t out_capacity, std::vector<blockkv::BlockId>* out) {
    out->clear();
    if (n < 0 || out_capacity < static_cast<size_t>(n)) {
      return blockkv::StatusCode::kInvalidArgument;
    }
    if (n > free_blocks()) return blockkv::StatusCode::kResourceExhausted;
    for (int32_t i = 0; i < n; ++i) {
      const blockkv::BlockId id = free_.front();
      free_.pop_front();
      used_[static_cast<size_t>(id)] = 1;
      live_index_[static_cast<size_t>(id)] = live_.size();
      live_.push_back(id);
      out->push_back(id);
    }
    return blockkv::StatusCode::kOk;
  }

  // The first bad id, in order, decides the code.
  blockkv::StatusCode Free(std::span<const blockkv::BlockId> ids) {
    ++free_calls_;  // makes the marks of earlier calls stale
    for (const blockkv::BlockId id : ids) {
      if (id < 0 || id >= num_blocks()) return blockkv::StatusCode::kOutOfRange;
      const size_t i = static_cast<size_t>(id);
      if (seen_in_free_[i] == free_calls_ || used_[i] == 0) {
        return blockkv::StatusCode::kFailedPrecondition;
      }
      seen_in_free_[i] = free_calls_;
    }
    for (const blockkv::BlockId id : ids) {
      const size_t i = static_cast<size_t>(id);
      used_[i] = 0;
      free_.push_front(id);
      const size_t at = live_index_[i];
      live_[at] = live_.back();
      live_index_[static_cast<size_t>(live_[at])] = at;
      live_.pop_back();
    }
    return blockkv::StatusCode::kOk;
  }

 private:
  std::vector<uint8_t> used_;           // [num_blocks]: 1 when allocated
  std::vector<uint64_t> seen_in_free_;  // [num_blocks]: the Free call that last named the id
  uint64_t free_calls_ = 0;
  std::deque<blockkv::BlockId> free_;   // front = head of the free list
  std::vector<blockkv::BlockId> live_;  // allocated ids
  std::vector<size_t> live_index_;      // [num_blocks]: position of an allocated id in live_
};

// What a run exercised, so a test can check it was not vacuous.
struct ModelStats {
  int64_t ops = 0;
  int64_t pools = 0;
  int64_t allocate_ok = 0;
  int64_t allocate_invalid = 0;  // n < 0 or span too small
  int64_t allocate_exhausted = 0;
  int64_t span_allocates = 0;
  int64_t free_ok = 0;
  int64_t free_out_of_range = 0;
  int64_t free_failed_precondition = 0;
  int64_t create_rejected = 0;
  int64_t max_pool = 0;
};

namespace model_internal {

inline std::string Describe(std::span<const blockkv::BlockId> ids) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? ", " : "") << ids[i];
  os << "]";
  return os.str();
}

template <class Source>
int32_t UniformIn(Source& source, int32_t lo, int32_t hi) {  // [lo, hi]
  return lo + static_cast<int32_t>(source.Below(static_cast<uint32_t>(hi - lo + 1)));
}

// How many blocks to ask for: mostly small, often at the free count's edge, sometimes anything
// in [-2, num_blocks + 2].
template <class Source>
int32_t PickCount(Source& source, const ReferenceAllocator& ref) {
  switch (source.Below(4)) {
    case 0:
    case 1:
      return UniformIn(source, 0, std::min(ref.free_blocks(), 8));
    case 2:
      return UniformIn(source, ref.free_blocks() - 1, ref.free_blocks() + 1);
    default:
      return UniformIn(source, -2, ref.num_blocks() + 2);
  }
}

// `count` distinct live ids in random order.
template <class Source>
std::vector<blockkv::BlockId> PickLive(Source& source, const ReferenceAllocator& ref,
                                       size_t count) {
  std::vector<blockkv::BlockId> pool = ref.live();
  count = std::min(count, pool.size());
  for (size_t i = 0; i < count; ++i) {
    const size_t j = i + source.Below(static_cast<uint32_t>(pool.size() - i));
    std::swap(pool[i], pool[j]);
  }
  pool.resize(count);
  return pool;
}

// A free request that must fail: some live ids plus one out-of-range id, already-free id or
// duplicate, at a random position.
template <class Source>
std::vector<blockkv::BlockId> PickInvalidFree(Source& source, const ReferenceAllocator& ref) {
  std::vector<blockkv::BlockId> ids = PickLive(
      source, ref, source.Below(static_cast<uint32_t>(std::min<size_t>(ref.live().size(), 6) + 1)));
  const int32_t n = ref.num_blocks();
  blockkv::BlockId bad = -1;
  uint32_t kind = source.Below(3);
  if (kind == 1 && ref.free_blocks() == 0) kind = 0;
  if (kind == 2 && ids.empty()) kind = 0;
  if (kind == 0) {
    const std::array<blockkv::BlockId, 6> out_of_range{
        -1, -2, n, n + 1, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
    bad = out_of_range[source.Below(static_cast<uint32_t>(out_of_range.size()))];
  } else if (kind == 1) {
    bad = ref.free_list()[source.Below(static_cast<uint32_t>(ref.free_list().size()))];
  } else {
    bad = ids[source.Below(static_cast<uint32_t>(ids.size()))];
  }
  const size_t at = source.Below(static_cast<uint32_t>(ids.size() + 1));
  ids.insert(ids.begin() + static_cast<std::ptrdiff_t>(at), bad);
  return ids;
}

// Every observable of `real` equals the reference's; "" when they agree.
inline std::string Compare(const blockkv::BlockedAllocator& real, const ReferenceAllocator& ref) {
  if (blockkv::Status s = real.CheckInvariants(); !s.ok())
    return "CheckInvariants: " + s.ToString();
  std::ostringstream os;
  if (real.free_blocks() != ref.free_blocks() || real.num_blocks() != ref.num_blocks() ||
      real.used_blocks() != ref.num_blocks() - ref.free_blocks()) {
    os << "counts differ: free " << real.free_blocks() << " vs " << ref.free_blocks() << ", num "
       << real.num_blocks() << " vs " << ref.num_blocks();
    return os.str();
  }
  for (blockkv::BlockId id = 0; id < ref.num_blocks(); ++id) {
    if (real.IsUsed(id) != ref.used(id)) {
      os << "IsUsed(" << id << ") is " << real.IsUsed(id) << ", reference says " << ref.used(id);
      return os.str();
    }
  }
  return "";
}

}  // namespace model_internal

// Runs up to `max_ops` operations (fewer when `source` runs dry) over a sequence of allocators of
// varied sizes (1 to 1024 blocks, most small). Returns "" when the real allocator agreed with the
// reference on every status code, every returned id and every count, and CheckInvariants() held
// after every operation; otherwise a description of the first disagreement.
template <class Source>
std::string RunAllocatorModel(Source& source, int64_t max_ops, ModelStats* stats = nullptr) {
  using blockkv::BlockId;
  using blockkv::StatusCode;
  using namespace model_internal;
  ModelStats local;
  ModelStats& st = stats != nullptr ? *stats : local;
  std::vector<BlockId> expected;
  std::vector<BlockId> span_buffer;

  while (st.ops < max_ops && !source.exhausted()) {
    // An invalid size now and then: Create must refuse it.
    if (source.Below(16) == 0) {
      const int32_t bad = -static_cast<int32_t>(source.Below(3));  // 0, -1, -2
      blockkv::Result<blockkv::BlockedAllocator> rejected = blockkv::BlockedAllocator::Create(bad);
      if (rejected.status().code() != StatusCode::kInvalidArgument) {
        return "Create(" + std::to_string(bad) + ") gave " + rejected.status().ToString();
      }
      ++st.create_rejected;
    }
    const int32_t num_blocks = 1 + static_cast<int32_t>(source.Below(1u << source.Below(11)));
    blockkv::Result<blockkv::BlockedAllocator> created =
        blockkv::BlockedAllocator::Create(num_blocks);
    if (!created.ok()) return "Create(" + std::to_string(num_blocks) + ") failed";
    blockkv::BlockedAllocator real = *std::move(created);
    ReferenceAllocator ref(num_blocks);
    ++st.pools;
    st.max_pool = std::max<int64_t>(st.max_pool, num_blocks);
    if (std::string diff = Compare(real, ref); !diff.empty()) return "fresh allocator: " + diff;
    span_buffer.assign(static_cast<size_t>(num_blocks) + 4, blockkv::kNoBlock);

    const int64_t session = 1 + source.Below(4096);
    for (int64_t i = 0; i < session && st.ops < max_ops && !source.exhausted(); ++i) {
      ++st.ops;
      // What this operation was; formatted only when it is reported.
      const uint32_t kind = source.Below(100);
      int32_t n = 0;
      size_t capacity = 0;
      std::vector<BlockId> free_ids;
      auto what = [&] {
        std::ostringstream os;
        os << "op " << st.ops << " on a " << num_blocks << "-block allocator: ";
        if (kind < 30) os << "Allocate(" << n << ")";
        if (kind >= 30 && kind < 45) os << "Allocate(" << n << ", span of " << capacity << ")";
        if (kind >= 45) os << "Free(" << Describe(free_ids) << ")";
        return os.str();
      };
      StatusCode want;
      StatusCode got;
      if (kind < 45) {
        n = PickCount(source, ref);
        if (kind < 30) {
          want = ref.Allocate(n, n < 0 ? 0 : static_cast<size_t>(n), &expected);
          blockkv::Result<std::vector<BlockId>> ids = real.Allocate(n);
          got = ids.status().code();
          if (ids.ok() && *ids != expected) {
            return what() + " returned " + Describe(*ids) + ", expected " + Describe(expected);
          }
        } else {
          ++st.span_allocates;
          const int32_t wanted_capacity = std::max(0, n) + UniformIn(source, -1, 1);
          capacity = static_cast<size_t>(
              std::clamp<int32_t>(wanted_capacity, 0, static_cast<int32_t>(span_buffer.size())));
          want = ref.Allocate(n, capacity, &expected);
          std::fill(span_buffer.begin(), span_buffer.end(), blockkv::kNoBlock);
          got = real.Allocate(n, std::span<BlockId>(span_buffer.data(), capacity)).code();
          const auto written = static_cast<std::ptrdiff_t>(expected.size());
          if (!std::equal(expected.begin(), expected.end(), span_buffer.begin()) ||
              std::any_of(span_buffer.begin() + written, span_buffer.end(),
                          [](BlockId id) { return id != blockkv::kNoBlock; })) {
            return what() + " wrote " + Describe(span_buffer) + ", expected " + Describe(expected) +
                   " then untouched";
          }
        }
        if (got == StatusCode::kOk) ++st.allocate_ok;
        if (got == StatusCode::kInvalidArgument) ++st.allocate_invalid;
        if (got == StatusCode::kResourceExhausted) ++st.allocate_exhausted;
      } else {
        free_ids = kind < 80 ? PickLive(source, ref,
                                        source.Below(static_cast<uint32_t>(ref.live().size() + 1)))
                             : PickInvalidFree(source, ref);
        want = ref.Free(free_ids);
        got = real.Free(free_ids).code();
        if (got == StatusCode::kOk) ++st.free_ok;
        if (got == StatusCode::kOutOfRange) ++st.free_out_of_range;
        if (got == StatusCode::kFailedPrecondition) ++st.free_failed_precondition;
      }
      if (got != want) {
        std::ostringstream os;
        os << what() << " gave " << got << ", reference gave " << want;
        return os.str();
      }
      if (std::string diff = Compare(real, ref); !diff.empty()) {
        return what() + " left the allocator different: " + diff;
      }
    }
  }
  return "";
}

}  // namespace blockkv_test
