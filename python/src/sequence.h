// A tracked sequence seen from Python (DeepSpeed's DSSequenceDescriptor): the manager, kept alive
// by the descriptor, and the uid and tracking slot the sequence had when the descriptor was made.
// Every read looks the sequence up again, so a descriptor of a flushed sequence raises
// ValueError instead of reading a reused slot.
#pragma once

#include <memory>
#include <string>

#include "blockkv/state_manager.h"
#include "common.h"

namespace blockkv::python {

struct SequenceHandle {
  std::shared_ptr<StateManager> manager;
  SeqId uid = 0;
  int32_t slot = -1;

  const Sequence& Get() const {
    const Sequence* seq = manager->GetSequence(uid);
    if (seq == nullptr || seq->tracking_slot() != slot) {
      Throw(PyExc_ValueError, "sequence " + std::to_string(uid) +
                                  " is no longer tracked (it was flushed); get a new descriptor");
    }
    return *seq;
  }
};

inline SequenceHandle Handle(const std::shared_ptr<StateManager>& manager, const Sequence& seq) {
  return SequenceHandle{manager, seq.uid(), seq.tracking_slot()};
}

// prefix_cache.cc: StateManager.add_sequence, append_tokens, drain_cache_events,
// reset_prefix_cache, prefix_cache_stats, cached_blocks, and the classes they return.
void BindPrefixCacheMethods(py::module_& m,
                            py::class_<StateManager, std::shared_ptr<StateManager>>& cls);

// ValueError unless 0 <= group < manager.num_groups().
inline void CheckGroup(const StateManager& manager, int group) {
  if (group < 0 || group >= manager.num_groups()) {
    Throw(PyExc_ValueError, "cache group " + std::to_string(group) + " is outside [0, " +
                                std::to_string(manager.num_groups()) + ")");
  }
}

}  // namespace blockkv::python
