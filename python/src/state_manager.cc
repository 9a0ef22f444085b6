// StateManager (DeepSpeed's DSStateManager plus the engine's scheduling queries, and preemption
// through the offload tiers), its sequence descriptors and SchedulingResult / SchedulingError.
#include "blockkv/state_manager.h"

#include <Python.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "batch_wrapper.h"
#include "common.h"
#include "offload_ticket.h"
#include "sequence.h"
#include "tensor.h"

namespace blockkv::python {
namespace {

using Manager = std::shared_ptr<StateManager>;

// Raises blockkv.SchedulingError(result, message) (defined in blockkv/__init__.py).
[[noreturn]] void ThrowSchedulingError(SchedulingResult result, const std::string& message) {
  py::object type = py::module_::import("blockkv").attr("SchedulingError");
  py::object error = type(py::cast(result), message);
  PyErr_SetObject(type.ptr(), error.ptr());
  throw py::error_already_set();
}

// The table row of `group` for the sequence's slot, [max_blocks_per_sequence(group)].
const BlockId* TableRow(const SequenceHandle& h, int group) {
  return h.manager->block_tables(group) +
         static_cast<int64_t>(h.slot) * h.manager->max_blocks_per_sequence(group);
}

void BindSchedulingResult(py::module_& m) {
  py::enum_<SchedulingResult>(m, "SchedulingResult",
                              "What can_schedule answers; DeepSpeed's names and values.")
      .value("Success", SchedulingResult::kSuccess)
      .value("EngineSequenceLimitExceeded", SchedulingResult::kEngineSequenceLimitExceeded)
      .value("BatchSequenceLimitExceeded", SchedulingResult::kBatchSequenceLimitExceeded)
      .value("BatchTokenLimitExceeded", SchedulingResult::kBatchTokenLimitExceeded)
      .value("KVCacheLimitExceeded", SchedulingResult::kKVCacheLimitExceeded)
      .value("SequenceTokenLimitExceeded", SchedulingResult::kSequenceTokenLimitExceeded);
}

void BindSequence(py::module_& m) {
  py::class_<SequenceHandle>(m, "SequenceDescriptor",
                             "A tracked sequence (DeepSpeed's DSSequenceDescriptor). Read-only: "
                             "the StateManager changes it through schedule, post_forward, "
                             "free_leading_blocks and fork.")
      .def_property_readonly("uid", [](const SequenceHandle& h) { return h.uid; })
      .def_property_readonly(
          "tracking_id", [](const SequenceHandle& h) { return h.slot; },
          "The tracking slot (DeepSpeed's name)")
      .def_property_readonly("tracking_slot", [](const SequenceHandle& h) { return h.slot; })
      .def_property_readonly("seen_tokens",
                             [](const SequenceHandle& h) { return h.Get().seen_tokens(); })
      .def_property_readonly("in_flight_tokens",
                             [](const SequenceHandle& h) { return h.Get().in_flight_tokens(); })
      .def_property_readonly(
          "cached_prefix_tokens",
          [](const SequenceHandle& h) { return h.Get().cached_prefix_tokens(); },
          "Tokens its first schedule took from the prefix cache (0 without a hit)")
      .def_property_readonly(
          "preempted", [](const SequenceHandle& h) { return h.Get().preempted(); },
          "True between preempt_sequence and resume_sequence: its blocks are in the offload "
          "tiers and its table entries are -1")
      .def_property_readonly(
          "max_context", [](const SequenceHandle& h) { return h.manager->config().max_context; })
      .def_property_readonly(
          "cur_allocated_blocks",
          [](const SequenceHandle& h) { return h.Get().cur_allocated_blocks(0); },
          "Blocks of cache group 0 allocated so far (released ones included); "
          "allocated_blocks(cache_group) for another group")
      .def(
          "allocated_blocks",
          [](const SequenceHandle& h, int cache_group) {
            CheckGroup(*h.manager, cache_group);
            return h.Get().cur_allocated_blocks(cache_group);
          },
          py::arg("cache_group") = 0)
      .def(
          "released_blocks",
          [](const SequenceHandle& h, int cache_group) {
            CheckGroup(*h.manager, cache_group);
            return h.Get().released_blocks(cache_group);
          },
          py::arg("cache_group") = 0,
          "Leading table entries released by free_leading_blocks (now -1)")
      .def_property_readonly(
          "kv_blocks_ptr",
          [](const SequenceHandle& h) {
            h.Get();
            return reinterpret_cast<uintptr_t>(TableRow(h, 0));
          },
          "Host address of the sequence's block-table row of cache group 0")
      .def(
          "kv_cache_ids",
          [](const SequenceHandle& h, int cache_group, bool /*on_device*/) {
            CheckGroup(*h.manager, cache_group);
            h.Get();
            const BlockId* row = TableRow(h, cache_group);
            const int32_t width = h.manager->max_blocks_per_sequence(cache_group);
            py::array_t<int32_t> out({py::ssize_t{1}, py::ssize_t{width}});
            std::copy(row, row + width, out.mutable_data());
            return out;
          },
          py::arg("cache_group") = 0, py::arg("on_device") = false,
          "A copy of the table row, int32 [1, max_blocks_per_allocation_group] "
          "(DeepSpeed's [num_allocation_groups, max_blocks] with one allocation group); -1 past "
          "the allocated blocks. on_device is accepted and ignored: the table is on the host.")
      .def(
          "block_table",
          [](const SequenceHandle& h, int cache_group) {
            CheckGroup(*h.manager, cache_group);
            std::span<const BlockId> table = h.Get().block_table(cache_group);
            return ToNumpy(std::vector<BlockId>(table.begin(), table.end()));
          },
          py::arg("cache_group") = 0,
          "A copy of the table, int32 [cur_allocated_blocks]; released entries are -1")
      .def(
          "all_block_ids",
          [](const SequenceHandle& h, int cache_group) {
            CheckGroup(*h.manager, cache_group);
            std::vector<BlockId> held;
            for (BlockId b : h.Get().block_table(cache_group)) {
              if (b != kNoBlock) held.push_back(b);
            }
            return ToNumpy(held);
          },
          py::arg("cache_group") = 0, "The blocks the sequence holds, int32, in table order")
      .def(
          "post_forward",
          [](const SequenceHandle& h) {
            h.Get();
            const SeqId uid = h.uid;
            ThrowIfError(h.manager->PostForward(std::span<const SeqId>(&uid, 1)));
          },
          "seen_tokens += in_flight_tokens (the manager's post_forward for this uid)")
      .def("__repr__", [](const SequenceHandle& h) {
        const Sequence* seq = h.manager->GetSequence(h.uid);
        if (seq == nullptr || seq->tracking_slot() != h.slot) {
          return "<blockkv.SequenceDescriptor uid=" + std::to_string(h.uid) + " (flushed)>";
        }
        return "<blockkv.SequenceDescriptor uid=" + std::to_string(h.uid) +
               " seen_tokens=" + std::to_string(seq->seen_tokens()) +
               " in_flight_tokens=" + std::to_string(seq->in_flight_tokens()) +
               " cur_allocated_blocks=" + std::to_string(seq->cur_allocated_blocks(0)) +
               (seq->preempted() ? " preempted" : "") + ">";
      });
}

Manager Create(const StateManagerConfig& config, py::handle kv_configs, py::handle base_mp_group,
               py::handle device) {
  if (config.offload && config.offload_config.host_blocks == 0 &&
      config.offload_config.host_bytes == 0) {
    Throw(PyExc_ValueError,
          "StateManagerConfig.offload is True but offload_config sizes no host tier: pass "
          "offload_config=blockkv.OffloadConfig(host_blocks=N) (or host_bytes=N)");
  }
  RequireNoGroup(base_mp_group, "base_mp_group");
  std::vector<KVCacheConfig> configs = ToConfigs(kv_configs);
  std::shared_ptr<Device> dev = ToDevice(device);
  Result<std::unique_ptr<StateManager>> manager = InternalError("not created");
  {
    py::gil_scoped_release release;
    manager = StateManager::Create(config, std::move(configs), std::move(dev));
  }
  return {ValueOrThrow(std::move(manager))};
}

// The manager's offload store; RuntimeError when offload is off (as BlockedKVCache.offload).
const OffloadStore& Store(const StateManager& manager) {
  const OffloadStore* store = manager.offload_store();
  if (store == nullptr) {
    Throw(PyExc_RuntimeError,
          "offload is off for this StateManager: create it with StateManagerConfig(offload=True, "
          "offload_config=blockkv.OffloadConfig(host_blocks=N))");
  }
  return *store;
}

// PreemptSequence / ResumeSequence, the GIL released (they may wait for a resume in flight).
template <class Call>
py::object OffloadCall(const Manager& self, Call call) {
  Store(*self);
  Result<OffloadTicket> ticket = ResultWithoutGil([&] { return call(*self); });
  return MakeTicket(ValueOrThrow(std::move(ticket)), self);
}

void BindManager(py::module_& m) {
  py::class_<StateManager, Manager> cls(
      m, "StateManager",
      "The sequences of an engine and their block tables over one BlockedKVCache (DeepSpeed's "
      "DSStateManager, plus the engine's query / can_schedule and a schedule that reserves the "
      "blocks).");
  cls.def(py::init(&Create), py::arg("config"), py::arg("kv_configs"),
          py::arg("base_mp_group") = py::none(), py::arg("device") = py::none())
      .def(
          "get_or_create_sequence",
          [](const Manager& self, SeqId uid) {
            return Handle(self, *ValueOrThrow(self->GetOrCreateSequence(uid)));
          },
          py::arg("uid"))
      .def(
          "get_sequence",
          [](const Manager& self, SeqId uid) -> py::object {
            const Sequence* seq = self->GetSequence(uid);
            if (seq == nullptr) return py::none();
            return py::cast(Handle(self, *seq));
          },
          py::arg("uid"), "The descriptor, or None when `uid` is not tracked")
      .def(
          "flush_sequence",
          [](StateManager& self, SeqId uid) {
            Status status;
            {
              std::optional<py::gil_scoped_release> release;  // it may wait for a resume copy
              if (self.offload_store() != nullptr) release.emplace();
              status = self.FlushSequence(uid);
            }
            if (status.code() == StatusCode::kNotFound) {  // DeepSpeed only warns
              const std::string message =
                  "Attempting to flush sequence " + std::to_string(uid) + " which does not exist.";
              if (PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) != 0) {
                throw py::error_already_set();
              }
              return;
            }
            ThrowIfError(status);
          },
          py::arg("uid"))
      .def(
          "query",
          [](const StateManager& self, SeqId uid, int64_t max_request_tokens,
             int64_t max_request_blocks, int cache_group) {
            const KVRequirement r = ValueOrThrow(
                self.Query(uid, max_request_tokens,
                           ToInt32(max_request_blocks, "max_request_blocks"), cache_group));
            return py::make_tuple(r.tokens, r.blocks);
          },
          py::arg("uid"), py::arg("max_request_tokens"), py::arg("max_request_blocks"),
          py::arg("cache_group") = 0,
          "(tokens, blocks): how many of max_request_tokens `uid` may run next and the new "
          "blocks they need (DeepSpeed's engine query)")
      .def(
          "can_schedule",
          [](const StateManager& self, py::handle uids, py::handle lengths) {
            const std::vector<SeqId> u = ToInt64Vector(uids, "uids");
            const std::vector<int64_t> l = ToInt64Vector(lengths, "lengths");
            return ValueOrThrow(self.CanSchedule(u, l));
          },
          py::arg("uids"), py::arg("lengths"))
      .def(
          "schedule",
          [](StateManager& self, py::handle uids, py::handle lengths) {
            const std::vector<SeqId> u = ToInt64Vector(uids, "uids");
            const std::vector<int64_t> l = ToInt64Vector(lengths, "lengths");
            SchedulingResult result = SchedulingResult::kSuccess;
            Status status;
            {
              // With offload on, Schedule waits for the resume copies of the uids it names.
              std::optional<py::gil_scoped_release> release;
              if (self.offload_store() != nullptr) release.emplace();
              status = self.Schedule(u, l, &result);
            }
            if (status.ok()) return;
            if (result != SchedulingResult::kSuccess) {
              ThrowSchedulingError(result, status.message());
            }
            ThrowStatus(status);
          },
          py::arg("uids"), py::arg("lengths"),
          "All or nothing: creates unknown sequences, reserves their blocks and sets "
          "in_flight_tokens. SchedulingError (with .result) when a limit is hit.")
      .def(
          "schedule_batch",
          [](StateManager& self, py::handle uids, py::handle lengths, py::handle tokens,
             const BatchWrapper& batch, bool padding) {
            const std::vector<SeqId> u = ToInt64Vector(uids, "uids");
            const std::vector<int64_t> l = ToInt64Vector(lengths, "lengths");
            const std::vector<int64_t> t = ToInt64Vector(tokens, "tokens");
            SchedulingResult result = SchedulingResult::kSuccess;
            Status status;
            {
              // Released always: the arguments are C++ values now, and with offload on it waits
              // for the resume copies of the uids it names, as schedule does.
              py::gil_scoped_release release;
              status = self.ScheduleBatch(u, l, t, *batch.batch, padding, &result);
            }
            if (status.ok()) return;
            // `result` is only written once the arguments passed, so an argument error (another
            // manager's batch, a wrong token count) keeps kSuccess and raises ValueError.
            if (result != SchedulingResult::kSuccess) {
              ThrowSchedulingError(result, status.message());
            }
            ThrowStatus(status);
          },
          py::arg("uids"), py::arg("lengths"), py::arg("tokens"), py::arg("batch"),
          py::arg("padding") = false,
          "schedule, and the RaggedBatchWrapper of that forward built in the same pass (the fast "
          "path of a decode step): `batch` is cleared, filled and finalized as insert_sequence + "
          "finalize(padding) would. `tokens` holds each uid's lengths[i] tokens, one uid after "
          "another (a list, a NumPy array, a torch tensor); a first schedule that hits the prefix "
          "cache runs from the end of the cached prefix and gets the prompt's tokens there, "
          "whichever chunk was passed. All or nothing: SchedulingError (with .result) "
          "when a limit is hit, ValueError for bad arguments (a wrong token count, a batch of "
          "another StateManager), and the manager and the batch are as they were. A failed copy "
          "to the batch's device mirror raises with the forward scheduled and the batch not "
          "finalized: finalize() retries the copy.")
      .def(
          "post_forward",
          [](StateManager& self, py::handle uids) {
            if (py::isinstance<BatchWrapper>(uids)) {
              ThrowIfError(self.PostForward(*uids.cast<const BatchWrapper&>().batch));
              return;
            }
            ThrowIfError(self.PostForward(ToInt64Vector(uids, "uids")));
          },
          py::arg("uids"),
          "seen_tokens += in_flight_tokens for each uid; or for every sequence of a "
          "RaggedBatchWrapper, which with prefix caching also records the tokens the batch gave "
          "each sequence (so a decode step needs no append_tokens)")
      .def(
          "fork",
          [](StateManager& self, SeqId parent_uid, SeqId child_uid) {
            CallWithoutGil([&] { return self.Fork(parent_uid, child_uid); });
          },
          py::arg("parent_uid"), py::arg("child_uid"))
      .def(
          "free_leading_blocks",
          [](StateManager& self, SeqId uid, int64_t num_blocks, int cache_group) {
            const int32_t n = ToInt32(num_blocks, "num_blocks");
            Status status;
            {
              std::optional<py::gil_scoped_release> release;  // it may wait for a resume copy
              if (self.offload_store() != nullptr) release.emplace();
              status = self.FreeLeadingBlocks(uid, n, cache_group);
            }
            ThrowIfError(status);
          },
          py::arg("uid"), py::arg("num_blocks"), py::arg("cache_group") = 0)
      .def(
          "get_remaining_block_capacity",
          [](const StateManager& self, SeqId uid, int cache_group) {
            CheckGroup(self, cache_group);
            return self.RemainingBlockCapacity(uid, cache_group);
          },
          py::arg("uid"), py::arg("cache_group") = 0)
      .def(
          "get_cache",
          [](const Manager& self, int64_t cache_id, int cache_group) {
            return MakeTensor(ValueOrThrow(self->GetCache(cache_id, cache_group)), self);
          },
          py::arg("cache_id"), py::arg("cache_group") = 0)
      .def_property_readonly("n_tracked_sequences", &StateManager::n_tracked_sequences)
      .def_property_readonly("free_blocks", &StateManager::free_blocks,
                             "A list: one entry per cache group")
      .def_property_readonly("kv_block_size",
                             [](const StateManager& self) { return self.kv_block_size(0); })
      .def_property_readonly("num_caches", &StateManager::num_groups, "The number of cache groups")
      .def_property_readonly("num_blocks",
                             [](const StateManager& self) { return self.kv_cache().num_blocks(); })
      .def(
          "max_blocks_per_sequence",
          [](const StateManager& self, int cache_group) {
            CheckGroup(self, cache_group);
            return self.max_blocks_per_sequence(cache_group);
          },
          py::arg("cache_group") = 0)
      .def(
          "preempt_sequence",
          [](const Manager& self, SeqId uid) {
            return OffloadCall(self, [uid](StateManager& sm) { return sm.PreemptSequence(uid); });
          },
          py::arg("uid"),
          "Moves the blocks `uid` holds to the host tier (the disk tier for a group whose host "
          "tier is full): an OffloadTicket; its device blocks are free once the copy is done. "
          "It keeps its slot, seen_tokens and tokens; its table entries become -1 and it cannot "
          "be scheduled, forked or partially freed until resumed. ValueError (unknown uid, tokens "
          "in flight, already preempted), ResourceExhaustedError (the tiers are too full: "
          "nothing changed), RuntimeError when offload is off.")
      .def(
          "resume_sequence",
          [](const Manager& self, SeqId uid) {
            return OffloadCall(self, [uid](StateManager& sm) { return sm.ResumeSequence(uid); });
          },
          py::arg("uid"),
          "Brings a preempted sequence back into new blocks, its table rewritten: an "
          "OffloadTicket. The next schedule (or fork, free_leading_blocks, flush_sequence) naming "
          "it waits for the copy, and raises the copy's error if it failed (the sequence is then "
          "preempted again). ValueError (unknown uid, not preempted), ResourceExhaustedError "
          "(too few free blocks: nothing changed), RuntimeError when offload is off.")
      .def(
          "offload_stats", [](const StateManager& self) { return StatsDict(Store(self)); },
          "A dict of the offload store's counters: offloaded_blocks, restored_blocks, "
          "spilled_blocks, copied_to_host, copied_to_device, failed_copies, bytes_written, "
          "bytes_read, live_handles. RuntimeError "
          "when offload is off.")
      .def(
          "free_host_blocks",
          [](const StateManager& self, int cache_group) {
            const OffloadStore& store = Store(self);
            CheckStoreGroup(store, cache_group);
            return store.free_host_blocks(cache_group);
          },
          py::arg("cache_group") = 0, "Free host tier slots of the group")
      .def(
          "free_disk_blocks",
          [](const StateManager& self, int cache_group) {
            const OffloadStore& store = Store(self);
            CheckStoreGroup(store, cache_group);
            return store.free_disk_blocks(cache_group);
          },
          py::arg("cache_group") = 0, "Free disk tier slots of the group (0 without one)")
      .def(
          "host_prefix_stats",
          [](const StateManager& self) {
            const StateManager::HostPrefixStats s = self.host_prefix_stats();
            py::dict d;
            d["entries"] = s.entries;
            d["demoted"] = s.demoted;
            d["promoted"] = s.promoted;
            d["dropped"] = s.dropped;
            return d;
          },
          "The prefix cache's host level (offload and prefix caching both on, one cache group "
          "without a sliding window): a dict of entries (blocks on the host now), demoted, "
          "promoted, dropped. Zeros without that level.")
      .def_property_readonly("config", [](const StateManager& self) { return self.config(); })
      .def("check_invariants",
           [](const StateManager& self) { ThrowIfError(self.CheckInvariants()); });
  BindPrefixCacheMethods(m, cls);
}

}  // namespace

void BindStateManager(py::module_& m) {
  BindSchedulingResult(m);
  BindSequence(m);
  BindManager(m);
}

}  // namespace blockkv::python
