// SPDX-License-Identifier: Apache-2.0
// RaggedBatchWrapper: DeepSpeed's RaggedBatchWrapper over blockkv's RaggedBatch, plus the
// FlashInfer CSR page table and vLLM slot mapping.
//
// Differences from DeepSpeed, documented in docs/python.md: it is built from the StateManager
// (RaggedBatch::Create reads the manager's limits and cache groups), not from the config; it
// takes descriptors of tracked, scheduled sequences only; the accessors return NumPy arrays
// viewing the batch's host arrays (zero-copy, alive as long as the array; contents valid until
// the next clear/finalize), or a blockkv.Tensor of the device mirror when the cache is on a GPU
// and on_device=True. on_device=True on a host cache returns the host arrays. Arrays are always
// cut to the batch, never the whole untruncated buffer DeepSpeed returns with on_device=False.
#include "blockkv/ragged_batch.h"

#include <Python.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "batch_wrapper.h"
#include "common.h"
#include "object_lock.h"
#include "sequence.h"
#include "tensor.h"

namespace blockkv::python {
namespace {

using Wrapper = std::shared_ptr<BatchWrapper>;

// A batch array: `get(batch, on_device)` returns its view, read under the batch's lock; the
// NumPy array (or blockkv.Tensor) viewing it is made after.
template <class Get>
py::object Array(const Wrapper& w, bool on_device, Get get) {
  const bool device = on_device && w->has_mirror;
  Result<TensorView> view = Locked(w->lock, [&] { return get(*w->batch, device); });
  return HostArrayOrTensor(ValueOrThrow(std::move(view)), w);
}

// A per-cache-group batch array.
template <class Get>
auto GroupAccessor(Get get) {
  return [get](const Wrapper& w, bool on_device, Int<int, "cache_group"> cache_group) {
    return Array(w, on_device,
                 [&](const RaggedBatch& b, bool d) { return (b.*get)(cache_group, d); });
  };
}

Wrapper Create(py::handle state_manager) {
  if (!py::isinstance<PyManager>(state_manager)) {
    Throw(PyExc_TypeError,
          "RaggedBatchWrapper takes the StateManager whose sequences it batches (DeepSpeed's takes "
          "the DSStateManagerConfig); got " +
              std::string(py::str(py::type::of(state_manager).attr("__name__"))));
  }
  auto w = std::make_shared<BatchWrapper>();
  w->owner = state_manager.cast<Manager>();
  const std::shared_ptr<Device>& device = w->owner->manager->kv_cache().device();
  w->has_mirror = device != nullptr && device->kind() == DeviceKind::kCuda;
  // Create reads the manager's configuration only, which never changes; the lock anyway.
  Result<std::unique_ptr<RaggedBatch>> batch =
      LockedWithoutGil(w->owner->lock, [&] { return RaggedBatch::Create(*w->owner->manager); });
  w->batch = ValueOrThrow(std::move(batch));
  return w;
}

void InsertSequence(const Wrapper& w, py::handle seq_descriptor, py::handle tokens,
                    bool /*do_checks*/) {
  if (!py::isinstance<SequenceHandle>(seq_descriptor)) {
    Throw(PyExc_TypeError,
          "insert_sequence needs a SequenceDescriptor from the StateManager "
          "(get_or_create_sequence / get_sequence), scheduled first; got " +
              std::string(py::str(py::type::of(seq_descriptor).attr("__name__"))));
  }
  const auto& handle = seq_descriptor.cast<const SequenceHandle&>();
  if (handle.owner != w->owner) {
    Throw(PyExc_ValueError, "sequence " + std::to_string(handle.uid) +
                                " belongs to another StateManager than this batch's");
  }
  if (py::hasattr(tokens, "device") && !py::isinstance<py::array>(tokens)) {
    const std::string device = py::str(tokens.attr("device"));
    if (device != "cpu") {
      Throw(PyExc_RuntimeError, "Expected tokens to be on host but found device '" + device + "'");
    }
  }
  const std::vector<TokenId> ids = ToInts<TokenId>(tokens, "tokens");
  // The manager's lock (the sequence), then the batch's.
  std::optional<Status> status = Locked(w->owner->lock, w->lock, [&]() -> std::optional<Status> {
    const Sequence* seq = handle.Find();
    if (seq == nullptr) return std::nullopt;
    return w->batch->InsertSequence(*seq, ids);
  });
  if (!status) handle.ThrowFlushed();
  ThrowIfError(*status);
}

}  // namespace

void BindRaggedBatch(py::module_& m) {
  py::class_<BatchWrapper, Wrapper>(
      m, "RaggedBatchWrapper",
      "The metadata of one forward over several sequences (DeepSpeed's RaggedBatchWrapper), "
      "built from the StateManager. Thread-safe: every method holds the batch's lock (and "
      "insert_sequence / finalize the manager's before it). The arrays its accessors return "
      "view the batch: their contents change with the next clear, insert_sequence, finalize or "
      "schedule_batch, from any thread.")
      .def(py::init(&Create), py::arg("state_manager"))
      .def("insert_sequence", &InsertSequence, py::arg("seq_descriptor"), py::arg("tokens"),
           py::arg("do_checks") = true,
           "Appends the sequence's in-flight tokens (an int, a list, a NumPy array or a CPU torch "
           "tensor; as many as schedule() gave it). Checks always run; do_checks is accepted for "
           "DeepSpeed's signature.")
      .def(
          "finalize",
          [](const Wrapper& w, bool padding) {
            // It reads the inserted sequences (the manager's lock first) and may copy to the
            // device mirror.
            ThrowIfError(LockedWithoutGil(w->owner->lock, w->lock,
                                          [&] { return w->batch->Finalize(padding); }));
          },
          py::arg("padding") = false,
          "Writes the batch's arrays (padded to a multiple of 8 tokens with padding=True) and "
          "copies them to the device mirror. ValueError (the batch as it was) when a sequence "
          "changed since insert_sequence; RuntimeError when the copy to the device failed.")
      .def(
          "clear", [](const Wrapper& w) { Locked(w->lock, [&] { w->batch->Clear(); }); },
          "Empties the batch for the next forward.")
      .def(
          "input_ids",
          [](const Wrapper& w, bool on_device) {
            return Array(w, on_device, [](const RaggedBatch& b, bool d) { return b.input_ids(d); });
          },
          py::arg("on_device") = true, "int64 [padded_tokens]; padding -1")
      .def(
          "tokens_to_seq",
          [](const Wrapper& w, bool on_device) {
            return Array(w, on_device,
                         [](const RaggedBatch& b, bool d) { return b.tokens_to_seq(d); });
          },
          py::arg("on_device") = true, "int32 [padded_tokens]; padding -1")
      .def(
          "inflight_seq_descriptors",
          [](const Wrapper& w, bool on_device) {
            return Array(w, on_device, [](const RaggedBatch& b, bool d) {
              return b.inflight_seq_descriptors(d);
            });
          },
          py::arg("on_device") = true,
          "int32 [current_sequences, 4]: start_idx, n_tokens, seen_tokens, 0")
      .def(
          "batch_metadata_buffer",
          [](const Wrapper& w, bool on_device) {
            return Array(w, on_device,
                         [](const RaggedBatch& b, bool d) { return b.batch_metadata(d); });
          },
          py::arg("on_device") = true, "int32 [2]: current_tokens, current_sequences")
      .def("kv_ptrs", GroupAccessor(&RaggedBatch::kv_ptrs), py::arg("on_device") = true,
           py::arg("cache_group") = 0, "int64 [current_sequences]: addresses of block_tables rows")
      .def("block_tables", GroupAccessor(&RaggedBatch::block_tables), py::arg("on_device") = true,
           py::arg("cache_group") = 0, "int32 [current_sequences, max_blocks_per_sequence]")
      .def("kv_indptr", GroupAccessor(&RaggedBatch::kv_indptr), py::arg("on_device") = true,
           py::arg("cache_group") = 0, "int32 [current_sequences + 1] (FlashInfer CSR)")
      .def("kv_indices", GroupAccessor(&RaggedBatch::kv_indices), py::arg("on_device") = true,
           py::arg("cache_group") = 0, "int32 [kv_indptr[-1]] (FlashInfer CSR)")
      .def("kv_last_page_len", GroupAccessor(&RaggedBatch::kv_last_page_len),
           py::arg("on_device") = true, py::arg("cache_group") = 0,
           "int32 [current_sequences]: tokens in each sequence's last block")
      .def("slot_mapping", GroupAccessor(&RaggedBatch::slot_mapping), py::arg("on_device") = true,
           py::arg("cache_group") = 0,
           "int64 [padded_tokens]: block * block_size + offset of each new token (vLLM); pad -1")
      .def(
          "masks", [](const Wrapper&, bool) { return py::none(); }, py::arg("on_device") = true,
          "None, as in DeepSpeed")
      .def_property_readonly("current_tokens",
                             [](const Wrapper& w) {
                               return Locked(w->lock, [&] { return w->batch->current_tokens(); });
                             })
      .def_property_readonly("current_sequences",
                             [](const Wrapper& w) {
                               return Locked(w->lock,
                                             [&] { return w->batch->current_sequences(); });
                             })
      .def_property_readonly("padded_tokens",
                             [](const Wrapper& w) {
                               return Locked(w->lock, [&] { return w->batch->padded_tokens(); });
                             })
      .def_property_readonly(
          "tensor_toks",
          [](const Wrapper& w) {
            return Locked(w->lock, [&] { return w->batch->padded_tokens(); });
          },
          "DeepSpeed's name for padded_tokens")
      .def_property_readonly("finalized", [](const Wrapper& w) {
        return Locked(w->lock, [&] { return w->batch->finalized(); });
      });
}

}  // namespace blockkv::python
