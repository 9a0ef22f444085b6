// SPDX-License-Identifier: Apache-2.0
// The C++ half of blockkv.deepspeed (python/blockkv/deepspeed): DeepSpeed's three-step
// allocation -- DSStateManager.allocate_blocks, DSSequenceDescriptor.extend_kv_cache and
// pre_forward -- over StateManager::AllocateBlocks / ExtendSequence / PreForward, as private
// module functions the Python classes call; and _DSSequenceBase, the C++ base of
// DSSequenceDescriptor, so that the reads engine_v2 makes per sequence and step (seen_tokens,
// cur_allocated_blocks, pre_forward, post_forward, the batch insert) are one call each. Block
// ids cross as int32 NumPy arrays (a torch tensor's .numpy() view, no copy on the Python side).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "batch_wrapper.h"
#include "blockkv/ragged_batch.h"
#include "blockkv/state_manager.h"
#include "common.h"
#include "object_lock.h"
#include "sequence.h"

namespace blockkv::python {
namespace {

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using CountArg = Int<int32_t, "num_blocks">;
using TokensArg = Int<int64_t, "num_tokens">;

// The ids of `blocks`, converted before any lock is taken: an int32 C-contiguous array is read in
// place (kept alive by `keep`), anything else goes through ToBlockIds' checks into `storage`.
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
  *storage = ToBlockIds(blocks);
  return *storage;
}

// Runs call(manager, sequence) holding the manager's lock; ValueError when the descriptor's
// sequence was flushed (its uid may be tracked again, in another slot: that is not this one).
template <class Call>
Status WithSequence(const SequenceHandle& h, Call call) {
  std::optional<Status> status = Locked(h.owner->lock, [&]() -> std::optional<Status> {
    const Sequence* seq = h.Find();
    if (seq == nullptr) return std::nullopt;
    return call(*h.owner->manager, *seq);
  });
  if (!status) h.ThrowFlushed();
  return *status;
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
          "seen_tokens",
          [](const DSSequence& s) {
            return s.handle.With([](const Sequence& seq) { return seq.seen_tokens(); });
          },
          "Tokens that completed a forward")
      .def_property_readonly(
          "in_flight_tokens",
          [](const DSSequence& s) {
            return s.handle.With([](const Sequence& seq) { return seq.in_flight_tokens(); });
          },
          "Tokens of the forward under way (set by pre_forward)")
      .def_property_readonly(
          "cur_allocated_blocks",
          [](const DSSequence& s) {
            return s.handle.With([](const Sequence& seq) { return seq.cur_allocated_blocks(0); });
          },
          "Blocks of cache group 0 in the sequence's table")
      .def_property_readonly(
          "kv_blocks_ptr",
          [](const DSSequence& s) {
            const StateManager& manager = *s.handle.owner->manager;
            return s.handle.With([&](const Sequence& seq) {
              return reinterpret_cast<uintptr_t>(manager.block_tables(0) +
                                                 static_cast<int64_t>(seq.tracking_slot()) *
                                                     manager.max_blocks_per_sequence(0));
            });
          },
          "Host address of the sequence's row of the manager's block table (cache group 0)")
      .def_property_readonly(
          "max_context",
          [](const DSSequence& s) {
            return Locked(s.handle.owner->lock,
                          [&] { return s.handle.owner->manager->config().max_context; });
          },
          "The manager's max_context, enforced by pre_forward")
      .def(
          "pre_forward",
          [](const DSSequence& s, TokensArg num_tokens) {
            ThrowIfError(WithSequence(s.handle, [&](StateManager& manager, const Sequence& seq) {
              return manager.PreForward(seq.uid(), num_tokens);
            }));
          },
          py::arg("num_tokens"),
          "in_flight_tokens = num_tokens. Checked: the sequence's blocks must hold "
          "seen_tokens + num_tokens in every cache group and max_context must not be passed "
          "(ValueError otherwise; extend_kv_cache first)")
      .def(
          "post_forward",
          [](const DSSequence& s, py::handle accepted) {
            const bool speculative = !accepted.is_none();
            const int64_t kept = speculative ? ToInt<int64_t>(accepted, "accepted") : 0;
            ThrowIfError(WithSequence(s.handle, [&](StateManager& manager, const Sequence& seq) {
              const SeqId uid = seq.uid();
              return manager.PostForward(
                  std::span<const SeqId>(&uid, 1),
                  speculative ? std::span<const int64_t>(&kept, 1) : std::span<const int64_t>());
            }));
          },
          py::arg("accepted") = py::none(),
          "seen_tokens += in_flight_tokens; in_flight_tokens = 0. Speculative decoding (not in "
          "DeepSpeed): with `accepted`, only the first `accepted` in-flight tokens are kept and "
          "the blocks past ceil(seen_tokens / block_size) go back (ValueError outside "
          "[0, in_flight_tokens])");
}

}  // namespace

void BindDeepSpeed(py::module_& m) {
  BindSequenceBase(m);
  m.def(
      "_ds_insert",
      [](const BatchWrapper& batch, const DSSequence& s, uintptr_t tokens, TokensArg count,
         bool int64) {
        // `tokens` is the address of `count` tokens (int64, else int32) of a contiguous CPU
        // tensor the caller (blockkv.deepspeed.RaggedBatchWrapper) holds for the whole call.
        const SequenceHandle& h = s.handle;
        if (h.owner != batch.owner) {
          Throw(PyExc_ValueError, "sequence " + std::to_string(h.uid) +
                                      " belongs to another StateManager than this batch's");
        }
        if (count < 0 || (count > 0 && tokens == 0)) {
          Throw(PyExc_ValueError, "no tokens at address " + std::to_string(tokens) + " for " +
                                      std::to_string(count.value) + " tokens");
        }
        const auto n = static_cast<size_t>(count.value);
        std::vector<TokenId> narrowed;
        std::span<const TokenId> ids;
        if (int64) {
          // NOLINTNEXTLINE(performance-no-int-to-ptr): Python hands the tensor's address over.
          const std::span<const int64_t> wide(reinterpret_cast<const int64_t*>(tokens), n);
          narrowed.resize(n);
          for (size_t i = 0; i < n; ++i) {
            if (wide[i] < INT32_MIN || wide[i] > INT32_MAX) {
              Throw(PyExc_ValueError, "tokens[" + std::to_string(i) +
                                          "] = " + std::to_string(wide[i]) + " is outside int32");
            }
            narrowed[i] = static_cast<TokenId>(wide[i]);
          }
          ids = narrowed;
        } else {
          // NOLINTNEXTLINE(performance-no-int-to-ptr): Python hands the tensor's address over.
          ids = std::span<const TokenId>(reinterpret_cast<const TokenId*>(tokens), n);
        }
        // The manager's lock (the sequence), then the batch's.
        std::optional<Status> status =
            Locked(h.owner->lock, batch.lock, [&]() -> std::optional<Status> {
              const Sequence* seq = h.Find();
              if (seq == nullptr) return std::nullopt;
              return batch.batch->InsertSequence(*seq, ids);
            });
        if (!status) h.ThrowFlushed();
        ThrowIfError(*status);
      },
      py::arg("batch"), py::arg("seq"), py::arg("tokens"), py::arg("count"), py::arg("int64"),
      "RaggedBatch::InsertSequence of `count` tokens at address `tokens` (int64 or int32)");
  m.def(
      "_ds_allocate_blocks",
      [](const PyManager& self, CountArg num_blocks, GroupArg cache_group) {
        if (num_blocks < 0) {
          Throw(PyExc_ValueError,
                "cannot allocate " + std::to_string(num_blocks.value) + " blocks: negative");
        }
        CheckGroup(self, cache_group);
        Int32Array out(static_cast<py::ssize_t>(num_blocks.value));
        const std::span<BlockId> ids(out.mutable_data(), static_cast<size_t>(num_blocks.value));
        ThrowIfError(
            Locked(self.lock, [&] { return self.manager->AllocateBlocks(ids, cache_group); }));
        return out;
      },
      py::arg("manager"), py::arg("num_blocks"), py::arg("cache_group") = 0,
      "StateManager::AllocateBlocks: int32 ids the engine holds until extend or free");
  m.def(
      "_ds_extend",
      [](const PyManager& self, UidArg uid, py::handle blocks, GroupArg cache_group) {
        std::vector<BlockId> storage;
        Int32Array keep;
        const std::span<const BlockId> ids = BlockSpan(blocks, &storage, &keep);
        ThrowIfError(
            Locked(self.lock, [&] { return self.manager->ExtendSequence(uid, ids, cache_group); }));
      },
      py::arg("manager"), py::arg("uid"), py::arg("blocks"), py::arg("cache_group") = 0,
      "StateManager::ExtendSequence");
  m.def(
      "_ds_free_blocks",
      [](const PyManager& self, py::handle blocks, GroupArg cache_group) {
        std::vector<BlockId> storage;
        Int32Array keep;
        const std::span<const BlockId> ids = BlockSpan(blocks, &storage, &keep);
        ThrowIfError(Locked(self.lock, [&] { return self.manager->FreeBlocks(ids, cache_group); }));
      },
      py::arg("manager"), py::arg("blocks"), py::arg("cache_group") = 0,
      "StateManager::FreeBlocks");
  m.def(
      "_ds_free_block_counts",
      [](const PyManager& self) {
        return ToNumpy(Locked(self.lock, [&] { return self.manager->free_blocks(); }));
      },
      py::arg("manager"), "The free blocks of every cache group, an int32 array");
  m.def(
      "_ds_engine_held_blocks",
      [](const PyManager& self, GroupArg cache_group) {
        CheckGroup(self, cache_group);
        return Locked(self.lock, [&] { return self.manager->engine_held_blocks(cache_group); });
      },
      py::arg("manager"), py::arg("cache_group") = 0,
      "Blocks allocate_blocks handed out that no sequence took yet");
}

}  // namespace blockkv::python
