// The Python RaggedBatchWrapper's C++ object, shared by ragged_batch.cc (which binds it) and
// kernels.cc (whose append_kv / paged_attention take it).
#pragma once

#include <memory>

#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"

namespace blockkv::python {

struct BatchWrapper {
  std::shared_ptr<StateManager> manager;  // outlives the batch, as RaggedBatch requires
  std::unique_ptr<RaggedBatch> batch;
  bool has_mirror = false;  // the cache is on a CUDA device, so on_device has a meaning
};

}  // namespace blockkv::python
