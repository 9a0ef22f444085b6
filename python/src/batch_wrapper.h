// SPDX-License-Identifier: Apache-2.0
// The Python RaggedBatchWrapper's C++ object, shared by ragged_batch.cc (which binds it),
// state_manager.cc (schedule_batch, post_forward) and kernels.cc (append_kv / paged_attention).
#pragma once

#include <memory>

#include "blockkv/ragged_batch.h"
#include "object_lock.h"
#include "sequence.h"

namespace blockkv::python {

struct BatchWrapper {
  Manager owner;  // outlives the batch, as RaggedBatch requires
  std::unique_ptr<RaggedBatch> batch;
  bool has_mirror = false;  // the cache is on a CUDA device, so on_device has a meaning
  // Every call on the batch holds it; a call that also reads or changes the manager's sequences
  // (insert_sequence, finalize, schedule_batch, post_forward) takes owner->lock first.
  mutable ObjectLock lock;
};

}  // namespace blockkv::python
