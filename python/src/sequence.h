// SPDX-License-Identifier: Apache-2.0
// The Python StateManager's C++ object, and a tracked sequence seen from Python (DeepSpeed's
// DSSequenceDescriptor).
//
// A descriptor keeps the manager alive and remembers the uid and tracking slot the sequence had
// when it was made. Every read takes the manager's lock and looks the sequence up again, so a
// descriptor of a flushed sequence raises ValueError instead of reading a reused slot.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "blockkv/state_manager.h"
#include "common.h"
#include "object_lock.h"

namespace blockkv::python {

// The Python StateManager. `lock` serializes every call on the manager, on its descriptors and
// on the tickets of its offload store (object_lock.h); a RaggedBatchWrapper built over it takes
// this lock before its own.
struct PyManager {
  std::unique_ptr<StateManager> manager;
  mutable ObjectLock lock;
};
using Manager = std::shared_ptr<PyManager>;

struct SequenceHandle {
  Manager owner;
  SeqId uid = 0;
  int32_t slot = -1;

  // The sequence, or nullptr when it was flushed. REQUIRES: owner->lock is held.
  const Sequence* Find() const {
    const Sequence* seq = owner->manager->GetSequence(uid);
    return seq != nullptr && seq->tracking_slot() == slot ? seq : nullptr;
  }

  // read(sequence), holding the manager's lock; ValueError when the sequence was flushed.
  // `read` runs no Python code (object_lock.h) and returns a value.
  template <class Read>
  auto With(Read read) const {
    std::optional<decltype(read(std::declval<const Sequence&>()))> out;
    Locked(owner->lock, [&] {
      if (const Sequence* seq = Find()) out.emplace(read(*seq));
    });
    if (!out) ThrowFlushed();
    return std::move(*out);
  }

  [[noreturn]] void ThrowFlushed() const {
    Throw(PyExc_ValueError, "sequence " + std::to_string(uid) +
                                " is no longer tracked (it was flushed); get a new descriptor");
  }
};

// REQUIRES: owner->lock is held (it copies nothing but the owner pointer and two ints).
inline SequenceHandle Handle(const Manager& owner, const Sequence& seq) {
  return SequenceHandle{owner, seq.uid(), seq.tracking_slot()};
}

// prefix_cache.cc: StateManager.add_sequence, append_tokens, drain_cache_events,
// reset_prefix_cache, prefix_cache_stats, cached_blocks, and the classes they return.
void BindPrefixCacheMethods(py::module_& m, py::class_<PyManager, Manager>& cls);

// ValueError unless 0 <= group < manager.num_groups(). The group count is fixed at creation, so
// this reads it without the lock.
inline void CheckGroup(const PyManager& self, int group) {
  const int groups = self.manager->num_groups();
  if (group < 0 || group >= groups) {
    Throw(PyExc_ValueError, "cache group " + std::to_string(group) + " is outside [0, " +
                                std::to_string(groups) + ")");
  }
}

// The integer arguments the manager's methods share (common.h: Int).
using UidArg = Int<SeqId, "uid">;
using GroupArg = Int<int, "cache_group">;

}  // namespace blockkv::python
