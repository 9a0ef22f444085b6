// The C++ half of blockkv.deepspeed (python/blockkv/deepspeed): DeepSpeed's three-step
// allocation -- DSStateManager.allocate_blocks, DSSequenceDescriptor.extend_kv_cache and
// pre_forward -- over StateManager::AllocateBlocks / ExtendSequence / PreForward, as private
// module functions the Python classes call. Block ids cross as int32 NumPy arrays (a torch
// tensor's .numpy() view, no copy on the Python side).
#include <cstdint>
#include <memory>
#include <vector>

#include "blockkv/state_manager.h"
#include "common.h"

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

}  // namespace

void BindDeepSpeed(py::module_& m) {
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
