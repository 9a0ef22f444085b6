// SPDX-License-Identifier: Apache-2.0
// UidMap: sequence uid → tracking slot, an open-addressing hash table with linear probing and
// backward-shift deletion. The state manager looks a uid up several times per sequence per step;
// a flat table of (key, value) pairs costs one cache miss where std::unordered_map costs a chain
// of them. Capacity is fixed at construction (twice the most entries, rounded up to a power of
// two), so it never rehashes and never allocates after construction.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "internal/check.h"

namespace blockkv::internal {

class UidMap {
  struct Entry;

 public:
  static constexpr int32_t kAbsent = -1;

  explicit UidMap(int32_t max_entries)
      : entries_(std::bit_ceil(static_cast<size_t>(max_entries) * 2 + 2)),
        mask_(entries_.size() - 1),
        shift_(64 - std::countr_zero(entries_.size())),
        max_entries_(max_entries) {}

  // The value stored for `key`, or kAbsent.
  int32_t Find(int64_t key) const { return reader().Find(key); }

  // Starts loading the slot where a Find(key) begins, so that a later Find overlaps its cache
  // miss with other work.
  void Prefetch(int64_t key) const { reader().Prefetch(key); }

  // REQUIRES: `key` is absent, size() < max_entries, value >= 0.
  void Insert(int64_t key, int32_t value) {
    BLOCKKV_CHECK(size_ < max_entries_ && value >= 0, "UidMap::Insert past capacity");
    size_t i = Home(key);
    while (entries_[i].value != kAbsent) {
      BLOCKKV_CHECK(entries_[i].key != key, "UidMap::Insert of a present key");
      i = (i + 1) & mask_;
    }
    entries_[i] = {key, value};
    ++size_;
  }

  // REQUIRES: `key` is present.
  void Erase(int64_t key) {
    size_t hole = Home(key);
    while (entries_[hole].key != key || entries_[hole].value == kAbsent) {
      BLOCKKV_CHECK(entries_[hole].value != kAbsent, "UidMap::Erase of an absent key");
      hole = (hole + 1) & mask_;
    }
    // Shift back every later entry of the run whose home is not in (hole, j].
    for (size_t j = (hole + 1) & mask_; entries_[j].value != kAbsent; j = (j + 1) & mask_) {
      const size_t home = Home(entries_[j].key);
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!stays) {
        entries_[hole] = entries_[j];
        hole = j;
      }
    }
    entries_[hole].value = kAbsent;
    --size_;
  }

  int32_t size() const { return size_; }

  // Find and Prefetch over a copy of the table's shape (UidMap's own Find and Prefetch go through
  // one): a loop that also stores through int32 pointers (which may alias the map's own members)
  // keeps these in registers.
  class Reader {
   public:
    int32_t Find(int64_t key) const {
      for (size_t i = Home(key);; i = (i + 1) & mask_) {
        const Entry& e = entries_[i];
        if (e.value == kAbsent) return kAbsent;
        if (e.key == key) return e.value;
      }
    }
    void Prefetch(int64_t key) const { __builtin_prefetch(&entries_[Home(key)]); }

   private:
    friend class UidMap;
    explicit Reader(const UidMap& map)
        : entries_(map.entries_.data()), mask_(map.mask_), shift_(map.shift_) {}
    size_t Home(int64_t key) const { return UidMap::Home(key, shift_); }
    const Entry* entries_;
    size_t mask_;
    int shift_;
  };
  Reader reader() const { return Reader(*this); }

  // Calls f(key, value) for every entry, in table order.
  template <class F>
  void ForEach(F&& f) const {
    for (const Entry& e : entries_) {
      if (e.value != kAbsent) f(e.key, e.value);
    }
  }

 private:
  struct Entry {
    int64_t key = 0;
    int32_t value = kAbsent;
  };

  // Fibonacci hashing: the top bits of key · 2^64/φ. Engines often number sequences 0, 1, 2, ...,
  // which a plain mask would cluster; the multiplication spreads consecutive keys evenly over the
  // table, and costs two instructions where a mixing finalizer (splitmix64's) costs eleven — a
  // step hashes every uid twice (its prefetch and its lookup).
  static size_t Home(int64_t key, int shift) {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9e3779b97f4a7c15ULL) >> shift);
  }
  size_t Home(int64_t key) const { return Home(key, shift_); }

  std::vector<Entry> entries_;
  size_t mask_;
  int shift_;  // 64 - log2(entries_.size())
  int32_t max_entries_;
  int32_t size_ = 0;
};

}  // namespace blockkv::internal
