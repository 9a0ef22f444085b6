// The C++ half of blockkv.deepspeed (python/blockkv/deepspeed): DeepSpeed's three-step
// allocation -- DSStateManager.allocate_blocks, DSSequenceDescriptor.extend_kv_cache and
// pre_forward -- over StateManager::AllocateBlocks / ExtendSequence / PreForward, as private
// module functions the Python classes call; and _DSSequenceBase, the C++ base of
// DSSequenceDescriptor, so that the reads engine_v2 makes per sequence and step (seen_tokens,
// cur_allocated_blocks, pre_forward, post_forward, the batch insert) are one call each. Block
// ids cross as int32 NumPy arrays (a torch tensor's .numpy() view, no copy on the Python side).
#include <cstdint>
#include <memory>
#include <vector>

#include "batch_wrapper.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "common.h"
#include "sequence.h"

namespace blockkv::python {
namespace {

using Manager = std::shared_ptr<StateManager>;
using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// The ids of `blocks`: an int32 array is read in place, anything else goes through
// ToInt64Vector's checks into `storage`.
std::span<const BlockId> BlockSpan(py::handle blocks, std::vector<BlockId>* storage,
                                   Int32Array* keep) {
  if (py::isinstance<py::array>(blocks)) {
    auto array = py::reinterpret_borrow<py::array>(blocks);
    if (array.ndim() == 1 && array.dtype().is(py::dtype::of<int32_t>()) &&
        (array.flags() & py::array::c_style) != 0) {
      *keep = py::reinterpret_borrow<Int32Array>(array);
      return {keep->data(), static_cast<size_t>(keep->size())};
    }
  }
  const std::vector<int64_t> ids = ToInt64Vector(blocks, "block ids");
  storage->resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < INT32_MIN || ids[i] > INT32_MAX) {
      Throw(PyExc_ValueError, "Invalid block " + std::to_string(ids[i]) + ": outside int32");
    }
    (*storage)[i] = static_cast<BlockId>(ids[i]);
  }
  return *storage;
}

int CacheGroup(int64_t group) {
  if (group < INT32_MIN || group > INT32_MAX) {
    Throw(PyExc_ValueError, "cache group " + std::to_string(group) + " is outside int32");
  }
  return static_cast<int>(group);
}

// A DSSequenceDescriptor's C++ part: the core sequence it views.
struct DSSequence {
  SequenceHandle handle;
};

void BindSequenceBase(py::module_& m) {
  py::class_<DSSequence>(m, "_DSSequenceBase",
                         "The C++ base of blockkv.deepspeed.DSSequenceDescriptor")
      .def(py::init([](const SequenceHandle& seq) { return DSSequence{seq}; }), py::arg("seq"))
      .def_property_readonly("uid", [](const DSSequence& s) { return s.handle.uid; })
      .def_property_readonly(
          "tracking_id", [](const DSSequence& s) { return s.handle.slot; },
          "The sequence's tracking slot")
      .def_property_readonly(
          "seen_tokens", [](const DSSequence& s) { return s.handle.Get().seen_tokens(); },
          "Tokens that completed a forward")
      .def_property_readonly(
          "in_flight_tokens", [](const DSSequence& s) { return s.handle.Get().in_flight_tokens(); },
          "Tokens of the forward under way (set by pre_forward)")
      .def_property_readonly(
          "cur_allocated_blocks",
          [](const DSSequence& s) { return s.handle.Get().cur_allocated_blocks(0); },
          "Blocks of cache group 0 in the sequence's table")
      .def_property_readonly(
          "kv_blocks_ptr",
          [](const DSSequence& s) {
            s.handle.Get();
            const StateManager& manager = *s.handle.manager;
            return reinterpret_cast<uintptr_t>(manager.block_tables(0) +
                                               static_cast<int64_t>(s.handle.slot) *
                                                   manager.max_blocks_per_sequence(0));
          },
          "Host address of the sequence's row of the manager's block table (cache group 0)")
      .def_property_readonly(
          "max_context", [](const DSSequence& s) { return s.handle.manager->config().max_context; },
          "The manager's max_context, enforced by pre_forward")
      .def(
          "pre_forward",
          [](const DSSequence& s, int64_t num_tokens) {
            ThrowIfError(s.handle.manager->PreForward(s.handle.uid, num_tokens));
          },
          py::arg("num_tokens"),
          "in_flight_tokens = num_tokens. Checked: the sequence's blocks must hold "
          "seen_tokens + num_tokens in every cache group and max_context must not be passed "
          "(ValueError otherwise; extend_kv_cache first)")
      .def(
          "post_forward",
          [](const DSSequence& s) {
            const SeqId uid = s.handle.uid;
            ThrowIfError(s.handle.manager->PostForward(std::span<const SeqId>(&uid, 1)));
          },
          "seen_tokens += in_flight_tokens; in_flight_tokens = 0");
}

}  // namespace

void BindDeepSpeed(py::module_& m) {
  BindSequenceBase(m);
  m.def(
      "_ds_insert",
      [](const BatchWrapper& batch, const DSSequence& s, uintptr_t tokens, int64_t count) {
        // `tokens` is the address of `count` int64 tokens of a contiguous CPU tensor the caller
        // (blockkv.deepspeed.RaggedBatchWrapper) holds for the duration of the call.
        if (s.handle.manager != batch.manager) {
          Throw(PyExc_ValueError, "sequence " + std::to_string(s.handle.uid) +
                                      " belongs to another StateManager than this batch's");
        }
        if (count < 0 || (count > 0 && tokens == 0)) {
          Throw(PyExc_ValueError, "no tokens at address " + std::to_string(tokens) + " for " +
                                      std::to_string(count) + " tokens");
        }
        const Sequence& seq = s.handle.Get();
        // NOLINTNEXTLINE(performance-no-int-to-ptr): Python hands the tensor's address over.
        const auto* ids = reinterpret_cast<const int64_t*>(tokens);
        ThrowIfError(batch.batch->InsertSequence(
            seq, std::span<const int64_t>(ids, static_cast<size_t>(count))));
      },
      py::arg("batch"), py::arg("seq"), py::arg("tokens"), py::arg("count"),
      "RaggedBatch::InsertSequence of `count` int64 tokens at address `tokens`");
  m.def(
      "_ds_allocate_blocks",
      [](StateManager& manager, int64_t num_blocks, int64_t cache_group) {
        if (num_blocks < 0 || num_blocks > INT32_MAX) {
          Throw(PyExc_ValueError, "cannot allocate " + std::to_string(num_blocks) +
                                      " blocks: the count is outside [0, 2^31)");
        }
        Int32Array out(static_cast<py::ssize_t>(num_blocks));
        ThrowIfError(manager.AllocateBlocks(
            std::span<BlockId>(out.mutable_data(), static_cast<size_t>(num_blocks)),
            CacheGroup(cache_group)));
        return out;
      },
      py::arg("manager"), py::arg("num_blocks"), py::arg("cache_group") = 0,
      "StateManager::AllocateBlocks: int32 ids the engine holds until extend or free");
  m.def(
      "_ds_extend",
      [](StateManager& manager, SeqId uid, py::handle blocks, int64_t cache_group) {
        std::vector<BlockId> storage;
        Int32Array keep;
        const std::span<const BlockId> ids = BlockSpan(blocks, &storage, &keep);
        ThrowIfError(manager.ExtendSequence(uid, ids, CacheGroup(cache_group)));
      },
      py::arg("manager"), py::arg("uid"), py::arg("blocks"), py::arg("cache_group") = 0,
      "StateManager::ExtendSequence");
  m.def(
      "_ds_free_blocks",
      [](StateManager& manager, py::handle blocks, int64_t cache_group) {
        std::vector<BlockId> storage;
        Int32Array keep;
        const std::span<const BlockId> ids = BlockSpan(blocks, &storage, &keep);
        ThrowIfError(manager.FreeBlocks(ids, CacheGroup(cache_group)));
      },
      py::arg("manager"), py::arg("blocks"), py::arg("cache_group") = 0,
      "StateManager::FreeBlocks");
  m.def(
      "_ds_pre_forward",
      [](StateManager& manager, SeqId uid, int64_t num_tokens) {
        ThrowIfError(manager.PreForward(uid, num_tokens));
      },
      py::arg("manager"), py::arg("uid"), py::arg("num_tokens"), "StateManager::PreForward");
  m.def(
      "_ds_free_blocks", [](const StateManager& manager) { return ToNumpy(manager.free_blocks()); },
      py::arg("manager"), "The free blocks of every cache group, an int32 array");
  m.def(
      "_ds_engine_held_blocks",
      [](const StateManager& manager, int64_t cache_group) {
        const int group = CacheGroup(cache_group);
        if (group < 0 || group >= manager.num_groups()) {
          Throw(PyExc_ValueError, "cache group " + std::to_string(group) + " is outside [0, " +
                                      std::to_string(manager.num_groups()) + ")");
        }
        return manager.engine_held_blocks(group);
      },
      py::arg("manager"), py::arg("cache_group") = 0,
      "Blocks allocate_blocks handed out that no sequence took yet");
}

}  // namespace blockkv::python
