// SPDX-License-Identifier: Apache-2.0
// Offload from Python: blockkv.OffloadTicket (what BlockedKVCache.offload / restore / spill and
// StateManager.preempt_sequence / resume_sequence return), handles packed into one int64, and the
// offload statistics as a dict. The ticket class is bound in kv_cache.cc.
//
// A handle (OffloadHandle: index, generation) travels as one int64: generation << 32 | index,
// the index in the low 32 bits. A handle whose generation has bit 31 set is negative; that is
// still a valid handle. Any int64 unpacks to some (index, generation): one the store does not know
// is kNotFound (ValueError), never another block's data.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/offload.h"
#include "common.h"
#include "object_lock.h"

namespace blockkv::python {

// An OffloadTicket and the lock of the object whose store made it (a BlockedKVCache's or a
// StateManager's): wait() and poll() apply the copies' effects to that store, so they hold the
// lock like every other call on it. The shared_ptr aliases the object, so a ticket keeps its
// store alive.
struct Ticket {
  OffloadTicket ticket;
  std::shared_ptr<ObjectLock> lock;
};

// `lock` is a member of `*owner`.
template <class Owner>
py::object MakeTicket(OffloadTicket ticket, const std::shared_ptr<Owner>& owner, ObjectLock& lock) {
  return py::cast(Ticket{ticket, std::shared_ptr<ObjectLock>(owner, &lock)});
}

inline int64_t PackHandle(OffloadHandle h) {
  return static_cast<int64_t>((uint64_t{h.generation} << 32) | static_cast<uint32_t>(h.index));
}

inline OffloadHandle UnpackHandle(int64_t packed) {
  const auto bits = static_cast<uint64_t>(packed);
  return {static_cast<int32_t>(static_cast<uint32_t>(bits & 0xffffffffu)),
          static_cast<uint32_t>(bits >> 32)};
}

// Handles as an int, a list, a NumPy array or a torch tensor of int64.
inline std::vector<OffloadHandle> ToHandles(py::handle obj) {
  const std::vector<int64_t> packed = ToInt64Vector(obj, "handles");
  std::vector<OffloadHandle> handles(packed.size());
  for (size_t i = 0; i < packed.size(); ++i) handles[i] = UnpackHandle(packed[i]);
  return handles;
}

inline py::array_t<int64_t> HandlesToNumpy(const std::vector<OffloadHandle>& handles) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(handles.size()));
  int64_t* data = out.mutable_data();
  for (size_t i = 0; i < handles.size(); ++i) data[i] = PackHandle(handles[i]);
  return out;
}

// The store's counters and its live handles, copied under the owner's lock; StatsDict makes the
// Python dict after.
struct StoreStats {
  OffloadStats counters;
  int64_t live_handles = 0;
};

inline StoreStats ReadStats(const OffloadStore& store) {
  return {store.stats(), store.live_handles()};
}

inline py::dict StatsDict(const StoreStats& stats) {
  const OffloadStats& s = stats.counters;
  py::dict d;
  d["offloaded_blocks"] = s.offloaded_blocks;
  d["restored_blocks"] = s.restored_blocks;
  d["spilled_blocks"] = s.spilled_blocks;
  d["copied_to_host"] = s.copied_to_host;
  d["copied_to_device"] = s.copied_to_device;
  d["failed_copies"] = s.failed_copies;
  d["bytes_written"] = s.bytes_written;
  d["bytes_read"] = s.bytes_read;
  d["live_handles"] = stats.live_handles;
  return d;
}

// ValueError unless 0 <= group < store.num_groups() (the store's own accessors REQUIRE it).
inline void CheckStoreGroup(const OffloadStore& store, int group) {
  if (group < 0 || group >= store.num_groups()) {
    Throw(PyExc_ValueError, "cache group " + std::to_string(group) + " is outside [0, " +
                                std::to_string(store.num_groups()) + ")");
  }
}

}  // namespace blockkv::python
