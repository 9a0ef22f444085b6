// SPDX-License-Identifier: Apache-2.0
// StateManager (DeepSpeed's DSStateManager plus the engine's scheduling queries, and preemption
// through the offload tiers), its sequence descriptors and SchedulingResult / SchedulingError.
//
// Every method holds the manager's lock (object_lock.h) while it touches the manager: arguments
// are converted before, Python results and exceptions made after. Calls that may wait (for a
// resume copy with offload on, for a fork's copy) or that are long (schedule_batch) release the
// GIL for the whole call, waiting for the lock included.
#include "blockkv/state_manager.h"

#include <Python.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "batch_wrapper.h"
#include "common.h"
#include "kv_events.h"
#include "object_lock.h"
#include "offload_ticket.h"
#include "sequence.h"
#include "tensor.h"
#include "transfer.h"

namespace blockkv::python {
namespace {

// Raises blockkv.SchedulingError(result, message) (defined in blockkv/__init__.py).
[[noreturn]] void ThrowSchedulingError(SchedulingResult result, const std::string& message) {
  py::object type = py::module_::import("blockkv").attr("SchedulingError");
  py::object error = type(py::cast(result), message);
  PyErr_SetObject(type.ptr(), error.ptr());
  throw py::error_already_set();
}

// schedule / schedule_batch: SchedulingError when a limit was hit, else the status's exception.
void ThrowScheduleError(const Status& status, SchedulingResult result) {
  if (status.ok()) return;
  // `result` is only written once the arguments passed, so an argument error (another manager's
  // batch, a wrong token count) keeps kSuccess and raises ValueError.
  if (result != SchedulingResult::kSuccess) ThrowSchedulingError(result, status.message());
  ThrowStatus(status);
}

// Runs fn() holding the manager's lock; with offload on the GIL is released for the whole call,
// as fn may wait for a resume copy of the sequences it names.
template <class Fn>
decltype(auto) LockedMayWait(const PyManager& self, Fn&& fn) {
  if (self.manager->offload_store() != nullptr) {
    return LockedWithoutGil(self.lock, std::forward<Fn>(fn));
  }
  return Locked(self.lock, std::forward<Fn>(fn));
}

// The table row of `group` for the sequence's slot, [max_blocks_per_sequence(group)].
// REQUIRES: the manager's lock is held.
const BlockId* TableRow(const SequenceHandle& h, int group) {
  const StateManager& m = *h.owner->manager;
  return m.block_tables(group) + static_cast<int64_t>(h.slot) * m.max_blocks_per_sequence(group);
}

std::vector<BlockId> Copy(std::span<const BlockId> table) { return {table.begin(), table.end()}; }

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
  using H = SequenceHandle;
  py::class_<H>(m, "SequenceDescriptor",
                "A tracked sequence (DeepSpeed's DSSequenceDescriptor). Read-only: the "
                "StateManager changes it through schedule, post_forward, free_leading_blocks and "
                "fork. Thread-safe: every read holds its manager's lock. A read of a flushed "
                "sequence raises ValueError.")
      .def_property_readonly("uid", [](const H& h) { return h.uid; })
      .def_property_readonly(
          "tracking_id", [](const H& h) { return h.slot; }, "The tracking slot (DeepSpeed's name)")
      .def_property_readonly("tracking_slot", [](const H& h) { return h.slot; })
      .def_property_readonly(
          "seen_tokens",
          [](const H& h) { return h.With([](const Sequence& s) { return s.seen_tokens(); }); })
      .def_property_readonly(
          "in_flight_tokens",
          [](const H& h) { return h.With([](const Sequence& s) { return s.in_flight_tokens(); }); })
      .def_property_readonly(
          "cached_prefix_tokens",
          [](const H& h) {
            return h.With([](const Sequence& s) { return s.cached_prefix_tokens(); });
          },
          "Tokens its first schedule took from the prefix cache (0 without a hit)")
      .def_property_readonly(
          "preempted",
          [](const H& h) { return h.With([](const Sequence& s) { return s.preempted(); }); },
          "True between preempt_sequence and resume_sequence: its blocks are in the offload "
          "tiers and its table entries are -1")
      .def_property_readonly(
          "max_context",
          [](const H& h) {
            return Locked(h.owner->lock, [&] { return h.owner->manager->config().max_context; });
          })
      .def_property_readonly(
          "cur_allocated_blocks",
          [](const H& h) {
            return h.With([](const Sequence& s) { return s.cur_allocated_blocks(0); });
          },
          "Blocks of cache group 0 allocated so far (released ones included); "
          "allocated_blocks(cache_group) for another group")
      .def(
          "allocated_blocks",
          [](const H& h, GroupArg cache_group) {
            CheckGroup(*h.owner, cache_group);
            return h.With([&](const Sequence& s) { return s.cur_allocated_blocks(cache_group); });
          },
          py::arg("cache_group") = 0)
      .def(
          "released_blocks",
          [](const H& h, GroupArg cache_group) {
            CheckGroup(*h.owner, cache_group);
            return h.With([&](const Sequence& s) { return s.released_blocks(cache_group); });
          },
          py::arg("cache_group") = 0,
          "Leading table entries released by free_leading_blocks or out of a LOCAL group's "
          "local_window (now -1)")
      .def_property_readonly(
          "kv_blocks_ptr",
          [](const H& h) {
            return h.With(
                [&](const Sequence&) { return reinterpret_cast<uintptr_t>(TableRow(h, 0)); });
          },
          "Host address of the sequence's block-table row of cache group 0")
      .def(
          "kv_cache_ids",
          [](const H& h, GroupArg cache_group, bool /*on_device*/) {
            CheckGroup(*h.owner, cache_group);
            const std::vector<BlockId> row = h.With([&](const Sequence&) {
              const BlockId* begin = TableRow(h, cache_group);
              return std::vector<BlockId>(
                  begin, begin + h.owner->manager->max_blocks_per_sequence(cache_group));
            });
            py::array_t<int32_t> out({py::ssize_t{1}, static_cast<py::ssize_t>(row.size())});
            std::copy(row.begin(), row.end(), out.mutable_data());
            return out;
          },
          py::arg("cache_group") = 0, py::arg("on_device") = false,
          "A copy of the table row, int32 [1, max_blocks_per_allocation_group] "
          "(DeepSpeed's [num_allocation_groups, max_blocks] with one allocation group); -1 past "
          "the allocated blocks. on_device is accepted and ignored: the table is on the host.")
      .def(
          "block_table",
          [](const H& h, GroupArg cache_group) {
            CheckGroup(*h.owner, cache_group);
            return ToNumpy(
                h.With([&](const Sequence& s) { return Copy(s.block_table(cache_group)); }));
          },
          py::arg("cache_group") = 0,
          "A copy of the table, int32 [cur_allocated_blocks]; released entries are -1")
      .def(
          "all_block_ids",
          [](const H& h, GroupArg cache_group) {
            CheckGroup(*h.owner, cache_group);
            return ToNumpy(h.With([&](const Sequence& s) {
              std::vector<BlockId> held;
              for (BlockId b : s.block_table(cache_group)) {
                if (b != kNoBlock) held.push_back(b);
              }
              return held;
            }));
          },
          py::arg("cache_group") = 0, "The blocks the sequence holds, int32, in table order")
      .def(
          "post_forward",
          [](const H& h) {
            const Status status = h.With([&](const Sequence&) {
              const SeqId uid = h.uid;
              return h.owner->manager->PostForward(std::span<const SeqId>(&uid, 1));
            });
            ThrowIfError(status);
          },
          "seen_tokens += in_flight_tokens (the manager's post_forward for this uid)")
      .def("__repr__", [](const H& h) {
        return Locked(h.owner->lock, [&] {
          const Sequence* seq = h.Find();
          if (seq == nullptr) {
            return "<blockkv.SequenceDescriptor uid=" + std::to_string(h.uid) + " (flushed)>";
          }
          return "<blockkv.SequenceDescriptor uid=" + std::to_string(h.uid) +
                 " seen_tokens=" + std::to_string(seq->seen_tokens()) +
                 " in_flight_tokens=" + std::to_string(seq->in_flight_tokens()) +
                 " cur_allocated_blocks=" + std::to_string(seq->cur_allocated_blocks(0)) +
                 (seq->preempted() ? " preempted" : "") + ">";
        });
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
  // A copy: another thread may assign to the Python config while the GIL is released.
  const StateManagerConfig copy = config;
  Result<std::unique_ptr<StateManager>> manager = InternalError("not created");
  {
    py::gil_scoped_release release;
    manager = StateManager::Create(copy, std::move(configs), std::move(dev));
  }
  auto out = std::make_shared<PyManager>();
  out->manager = ValueOrThrow(std::move(manager));
  return out;
}

// The manager's offload store; RuntimeError when offload is off (as BlockedKVCache.offload).
// Whether there is one is fixed at creation, so this needs no lock.
const OffloadStore& Store(const PyManager& self) {
  const OffloadStore* store = self.manager->offload_store();
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
  Result<OffloadTicket> ticket = LockedWithoutGil(self->lock, [&] { return call(*self->manager); });
  return MakeTicket(ValueOrThrow(std::move(ticket)), self, self->lock);
}

void BindManager(py::module_& m) {
  py::class_<PyManager, Manager> cls(
      m, "StateManager",
      "The sequences of an engine and their block tables over one BlockedKVCache (DeepSpeed's "
      "DSStateManager, plus the engine's query / can_schedule and a schedule that reserves the "
      "blocks). Thread-safe: every method holds the manager's lock, so calls from several "
      "threads run one at a time (a call that releases the GIL also waits for the lock without "
      "it). The same lock covers its descriptors, offload store, prefix cache and tickets.");
  cls.def(py::init(&Create), py::arg("config"), py::arg("kv_configs"),
          py::arg("base_mp_group") = py::none(), py::arg("device") = py::none())
      .def(
          "get_or_create_sequence",
          [](const Manager& self, UidArg uid) {
            Result<SequenceHandle> handle = Locked(self->lock, [&]() -> Result<SequenceHandle> {
              Result<Sequence*> seq = self->manager->GetOrCreateSequence(uid);
              if (!seq.ok()) return seq.status();
              return Handle(self, **seq);
            });
            return ValueOrThrow(std::move(handle));
          },
          py::arg("uid"),
          "The descriptor of `uid`, tracking it first if it is new. ResourceExhaustedError when "
          "every tracking slot is taken.")
      .def(
          "get_sequence",
          [](const Manager& self, UidArg uid) -> py::object {
            std::optional<SequenceHandle> handle = Locked(self->lock, [&] {
              const Sequence* seq = self->manager->GetSequence(uid);
              return seq == nullptr ? std::nullopt : std::optional(Handle(self, *seq));
            });
            return handle ? py::cast(*std::move(handle)) : py::none();
          },
          py::arg("uid"), "The descriptor, or None when `uid` is not tracked")
      .def(
          "flush_sequence",
          [](const Manager& self, UidArg uid) {
            // With offload on it may wait for a resume copy.
            const Status status =
                LockedMayWait(*self, [&] { return self->manager->FlushSequence(uid); });
            if (status.code() == StatusCode::kNotFound) {  // DeepSpeed only warns
              const std::string message = "Attempting to flush sequence " +
                                          std::to_string(uid.value) + " which does not exist.";
              if (PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) != 0) {
                throw py::error_already_set();
              }
              return;
            }
            ThrowIfError(status);
          },
          py::arg("uid"),
          "Stops tracking `uid` and frees its blocks (and drops its offload handles). An unknown "
          "uid is a RuntimeWarning, as in DeepSpeed.")
      .def(
          "query",
          [](const Manager& self, UidArg uid, Int<int64_t, "max_request_tokens"> max_request_tokens,
             Int<int32_t, "max_request_blocks"> max_request_blocks, GroupArg cache_group) {
            const KVRequirement r = ValueOrThrow(Locked(self->lock, [&] {
              return self->manager->Query(
                  uid, {.max_new_tokens = max_request_tokens, .max_new_blocks = max_request_blocks},
                  cache_group);
            }));
            return py::make_tuple(r.tokens, r.blocks);
          },
          py::arg("uid"), py::arg("max_request_tokens"), py::arg("max_request_blocks"),
          py::arg("cache_group") = 0,
          "(tokens, blocks): how many of max_request_tokens `uid` may run next and the new "
          "blocks they need (DeepSpeed's engine query)")
      .def(
          "can_schedule",
          [](const Manager& self, py::handle uids, py::handle lengths) {
            const std::vector<SeqId> u = ToInt64Vector(uids, "uids");
            const std::vector<int64_t> l = ToInt64Vector(lengths, "lengths");
            return ValueOrThrow(Locked(
                self->lock, [&] { return self->manager->CanSchedule({.uids = u, .lengths = l}); }));
          },
          py::arg("uids"), py::arg("lengths"))
      .def(
          "schedule",
          [](const Manager& self, py::handle uids, py::handle lengths) {
            const std::vector<SeqId> u = ToInt64Vector(uids, "uids");
            const std::vector<int64_t> l = ToInt64Vector(lengths, "lengths");
            SchedulingResult result = SchedulingResult::kSuccess;
            // With offload on, Schedule waits for the resume copies of the uids it names.
            const Status status = LockedMayWait(
                *self, [&] { return self->manager->Schedule({.uids = u, .lengths = l}, &result); });
            ThrowScheduleError(status, result);
          },
          py::arg("uids"), py::arg("lengths"),
          "All or nothing: creates unknown sequences, reserves their blocks and sets "
          "in_flight_tokens. SchedulingError (with .result) when a limit is hit; ValueError for "
          "a bad argument (a negative length, uids and lengths of different sizes, a preempted "
          "sequence).")
      .def(
          "schedule_batch",
          [](const Manager& self, py::handle uids, py::handle lengths, py::handle tokens,
             const BatchWrapper& batch, bool padding) {
            const std::vector<SeqId> u = ToInt64Vector(uids, "uids");
            const std::vector<int64_t> l = ToInt64Vector(lengths, "lengths");
            const std::vector<TokenId> t = ToInts<TokenId>(tokens, "tokens");
            SchedulingResult result = SchedulingResult::kSuccess;
            // The GIL released always: the arguments are C++ values now, and with offload on it
            // waits for the resume copies of the uids it names, as schedule does. The manager's
            // lock, then the batch's.
            const Status status = LockedWithoutGil(self->lock, batch.lock, [&] {
              return self->manager->ScheduleBatch({.uids = u, .lengths = l}, t, *batch.batch,
                                                  padding, &result);
            });
            ThrowScheduleError(status, result);
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
          [](const Manager& self, py::handle uids, py::handle accepted) {
            std::vector<int64_t> kept;
            if (!accepted.is_none()) kept = ToInt64Vector(accepted, "accepted");
            if (py::isinstance<BatchWrapper>(uids)) {
              const auto& batch = uids.cast<const BatchWrapper&>();
              ThrowIfError(Locked(self->lock, batch.lock, [&] {
                const int32_t n = batch.batch->current_sequences();
                if (!accepted.is_none() && std::ssize(kept) != n) {  // [] is not "keep all"
                  return InvalidArgumentError("post_forward: " + std::to_string(kept.size()) +
                                              " accepted counts for " + std::to_string(n) +
                                              " sequences");
                }
                return self->manager->PostForward(*batch.batch, kept);
              }));
              return;
            }
            const std::vector<SeqId> u = ToInt64Vector(uids, "uids");
            if (!accepted.is_none() && kept.size() != u.size()) {
              // An empty list for no uids is fine; an empty one for some uids is a mismatch, not
              // "keep all" (which is None).
              throw py::value_error("post_forward: " + std::to_string(kept.size()) +
                                    " accepted counts for " + std::to_string(u.size()) +
                                    " sequences");
            }
            ThrowIfError(Locked(self->lock, [&] { return self->manager->PostForward(u, kept); }));
          },
          py::arg("uids"), py::arg("accepted") = py::none(),
          "seen_tokens += in_flight_tokens for each uid; or for every sequence of a "
          "RaggedBatchWrapper, which with prefix caching also records the tokens the batch gave "
          "each sequence (so a decode step needs no append_tokens). Speculative decoding: "
          "`accepted[i]` (a list, a NumPy array, a torch tensor; None keeps all) is how many of "
          "uid i's (or the batch's i-th sequence's) in-flight tokens are kept; a sequence that "
          "rejects some gives back its blocks past ceil(seen_tokens / block_size) and forgets "
          "its known tokens past seen_tokens, and only blocks whose every token is kept are ever "
          "published. All or nothing: ValueError for an unknown or repeated uid, a count outside "
          "[0, in_flight_tokens] or a count per uid missing, or a batch of another manager or "
          "whose sequences changed since.")
      .def(
          "rollback",
          [](const Manager& self, UidArg uid, Int<int64_t, "n"> n) {
            // With offload on it may wait for a resume copy.
            ThrowIfError(LockedMayWait(*self, [&] { return self->manager->Rollback(uid, n); }));
          },
          py::arg("uid"), py::arg("n"),
          "Takes back the last `n` committed tokens of `uid` (seen_tokens -= n): blocks past the "
          "new end go back, and a block it shares (a fork, a prefix hit) or published is copied "
          "before it is written again. ValueError (n < 0 or n > seen_tokens, naming both; an "
          "unknown uid; tokens in flight: reject them with post_forward's accepted; a preempted "
          "sequence; a sliding-window group that would keep no whole block), "
          "ResourceExhaustedError (no block for the copy); nothing changes on failure.")
      .def(
          "fork",
          [](const Manager& self, Int<SeqId, "parent_uid"> parent_uid,
             Int<SeqId, "child_uid"> child_uid) {
            ThrowIfError(LockedWithoutGil(
                self->lock, [&] { return self->manager->Fork(parent_uid, child_uid); }));
          },
          py::arg("parent_uid"), py::arg("child_uid"),
          "A new sequence `child_uid` sharing the parent's full blocks, with a copy of its "
          "partial last block. ValueError (unknown parent, tracked child, tokens in flight), "
          "ResourceExhaustedError (no slot or block); nothing changes on failure.")
      .def(
          "free_leading_blocks",
          [](const Manager& self, UidArg uid, Int<int32_t, "num_blocks"> num_blocks,
             GroupArg cache_group) {
            // With offload on it may wait for a resume copy.
            ThrowIfError(LockedMayWait(*self, [&] {
              return self->manager->FreeLeadingBlocks(uid, num_blocks, cache_group);
            }));
          },
          py::arg("uid"), py::arg("num_blocks"), py::arg("cache_group") = 0,
          "Releases the `num_blocks` oldest still-held blocks of `uid` (sliding-window layers); "
          "their table entries become -1. ValueError (unknown uid, a block not wholly before "
          "seen_tokens, a bad group); nothing changes on failure.")
      .def(
          "get_remaining_block_capacity",
          [](const Manager& self, UidArg uid, GroupArg cache_group) {
            CheckGroup(*self, cache_group);
            return Locked(self->lock,
                          [&] { return self->manager->RemainingBlockCapacity(uid, cache_group); });
          },
          py::arg("uid"), py::arg("cache_group") = 0)
      .def(
          "get_cache",
          [](const Manager& self, Int<int64_t, "cache_id"> cache_id, GroupArg cache_group) {
            const TensorView view = ValueOrThrow(
                Locked(self->lock, [&] { return self->manager->GetCache(cache_id, cache_group); }));
            return MakeTensor(view, self);
          },
          py::arg("cache_id"), py::arg("cache_group") = 0)
      .def_property_readonly("n_tracked_sequences",
                             [](const Manager& self) {
                               return Locked(self->lock,
                                             [&] { return self->manager->n_tracked_sequences(); });
                             })
      .def_property_readonly(
          "free_blocks",
          [](const Manager& self) {
            return Locked(self->lock, [&] { return self->manager->free_blocks(); });
          },
          "A list: one entry per cache group")
      .def_property_readonly("kv_block_size",
                             [](const Manager& self) { return self->manager->kv_block_size(0); })
      .def_property_readonly(
          "num_caches", [](const Manager& self) { return self->manager->num_groups(); },
          "The number of cache groups")
      .def_property_readonly(
          "num_blocks", [](const Manager& self) { return self->manager->kv_cache().num_blocks(); })
      .def(
          "max_blocks_per_sequence",
          [](const Manager& self, GroupArg cache_group) {
            CheckGroup(*self, cache_group);
            return self->manager->max_blocks_per_sequence(cache_group);
          },
          py::arg("cache_group") = 0)
      .def(
          "preempt_sequence",
          [](const Manager& self, UidArg uid) {
            return OffloadCall(self, [&](StateManager& sm) { return sm.PreemptSequence(uid); });
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
          [](const Manager& self, UidArg uid) {
            return OffloadCall(self, [&](StateManager& sm) { return sm.ResumeSequence(uid); });
          },
          py::arg("uid"),
          "Brings a preempted sequence back into new blocks, its table rewritten: an "
          "OffloadTicket. The next schedule (or fork, free_leading_blocks, flush_sequence) naming "
          "it waits for the copy, and raises the copy's error if it failed (the sequence is then "
          "preempted again). ValueError (unknown uid, not preempted), ResourceExhaustedError "
          "(too few free blocks: nothing changed), RuntimeError when offload is off.")
      .def(
          "offload_stats",
          [](const Manager& self) {
            const OffloadStore& store = Store(*self);
            return StatsDict(Locked(self->lock, [&] { return ReadStats(store); }));
          },
          "A dict of the offload store's counters: offloaded_blocks, restored_blocks, "
          "spilled_blocks, copied_to_host, copied_to_device, failed_copies, bytes_written, "
          "bytes_read, live_handles. RuntimeError "
          "when offload is off.")
      .def(
          "free_host_blocks",
          [](const Manager& self, GroupArg cache_group) {
            const OffloadStore& store = Store(*self);
            CheckStoreGroup(store, cache_group);
            return Locked(self->lock, [&] { return store.free_host_blocks(cache_group); });
          },
          py::arg("cache_group") = 0, "Free host tier slots of the group")
      .def(
          "free_disk_blocks",
          [](const Manager& self, GroupArg cache_group) {
            const OffloadStore& store = Store(*self);
            CheckStoreGroup(store, cache_group);
            return Locked(self->lock, [&] { return store.free_disk_blocks(cache_group); });
          },
          py::arg("cache_group") = 0, "Free disk tier slots of the group (0 without one)")
      .def(
          "host_prefix_stats",
          [](const Manager& self) {
            const StateManager::HostPrefixStats s =
                Locked(self->lock, [&] { return self->manager->host_prefix_stats(); });
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
      .def(
          "remote_tier_stats",
          [](const Manager& self) {
            const RemoteTierStats s =
                Locked(self->lock, [&] { return self->manager->remote_tier_stats(); });
            py::dict d;
            d["hits"] = s.hits;
            d["misses"] = s.misses;
            d["misses_not_found"] = s.misses_not_found;
            d["misses_verify_failed"] = s.misses_verify_failed;
            d["misses_error"] = s.misses_error;
            d["misses_late"] = s.misses_late;
            d["misses_other_rank"] = s.misses_other_rank;
            d["invalid"] = s.invalid;
            d["fetched_bytes"] = s.fetched_bytes;
            d["stored"] = s.stored;
            d["stored_bytes"] = s.stored_bytes;
            d["dropped"] = s.dropped;
            d["errors"] = s.errors;
            d["reconnects"] = s.reconnects;
            d["redirects"] = s.redirects;
            d["topology_refreshes"] = s.topology_refreshes;
            d["replica_reads"] = s.replica_reads;
            d["nodes"] = s.nodes;
            d["connected"] = s.connected;
            return d;
          },
          "The remote tier's counters (docs/remote_tier.md): a dict of hits (blocks fetched and "
          "placed), misses (lookups the tier stopped) and misses by cause (misses_not_found, "
          "misses_verify_failed, misses_error, misses_late, misses_other_rank), invalid (values "
          "that did not "
          "verify), fetched_bytes, stored, stored_bytes, dropped, errors, reconnects, redirects "
          "(cluster MOVED / ASK followed), topology_refreshes, replica_reads (keys read from a "
          "cluster replica while their master was down), nodes (servers owning slots), "
          "connected. Zeros without the tier.")
      .def(
          "fetch_remote_prefix",
          [](const Manager& self, SeqId uid) {
            return ValueOrThrow(
                Locked(self->lock, [&] { return self->manager->FetchRemotePrefix(uid); }));
          },
          py::arg("uid"),
          "Fetches ahead, from the remote tier, the blocks of the prompt of `uid` (added with "
          "add_sequence, not yet scheduled) past those the device holds, and returns a "
          "RemoteFetchTicket at once; the first schedule of `uid` takes what has arrived by "
          "then without waiting and recomputes the rest. ValueError: no remote tier, or the "
          "sequence was not added with add_sequence, was scheduled, or is not tracked.")
      .def(
          "agree_remote_prefix",
          [](const Manager& self, py::handle uids, const py::function& all_reduce_min) {
            const std::vector<SeqId> u = ToInt64Vector(uids, "uids");
            RemotePrefixVote vote;
            {
              py::gil_scoped_release release;  // waits for the fetches
              vote = Locked(self->lock, [&] { return self->manager->RemotePrefixOffer(u); });
            }
            // The engine's all-reduce, with no lock held (object_lock.h, rule 1).
            const py::object reduced = all_reduce_min(py::cast(vote.values));
            std::vector<int64_t> values = ToInt64Vector(reduced, "all_reduce_min's result");
            if (values.size() != vote.values.size()) {
              throw py::value_error("agree_remote_prefix: all_reduce_min returned " +
                                    std::to_string(values.size()) + " values for " +
                                    std::to_string(vote.values.size()) +
                                    "; it must return as many as it was given");
            }
            vote.values = std::move(values);
            return ValueOrThrow(
                Locked(self->lock, [&] { return self->manager->AgreeRemotePrefix(vote); }));
          },
          py::arg("uids"), py::arg("all_reduce_min"),
          "Tensor-parallel ranks agree on their remote tier hits (docs/remote_tier.md, "
          "\"Tensor parallelism\"). Every rank calls it with the same uids in the same order, "
          "after fetch_remote_prefix of each; all_reduce_min(list of ints) -> list of ints must "
          "return the element-wise minimum of every rank's list (e.g. torch.distributed.all_reduce "
          "with ReduceOp.MIN on an int64 tensor). Returns each uid's agreed hit in blocks; its "
          "first schedule takes at most that many. ValueError (on every rank): a sequence not "
          "added, scheduled already or untracked on some rank, different uids on different ranks.")
      .def(
          "flush_remote_tier",
          [](const Manager& self) {
            py::gil_scoped_release release;
            Locked(self->lock, [&] { self->manager->FlushRemoteTier(); });
          },
          "Waits until every block queued for the remote tier was stored or failed")
      .def_property_readonly("config", [](const Manager& self) { return self->manager->config(); })
      .def(
          "check_invariants",
          [](const Manager& self) {
            ThrowIfError(Locked(self->lock, [&] { return self->manager->CheckInvariants(); }));
          },
          "RuntimeError naming the first broken invariant of the manager, its pools, offload "
          "store and prefix cache; None when they hold.");
  BindPrefixCacheMethods(m, cls);
  BindKVEventsMethods(cls);
  BindTransferMethods(cls);
}

}  // namespace

void BindRemoteFetchTicket(py::module_& m) {
  py::class_<RemoteFetchTicket>(m, "RemoteFetchTicket",
                                "A fetch from the remote tier in flight "
                                "(StateManager.fetch_remote_prefix). Thread-safe.")
      .def(
          "poll", [](const RemoteFetchTicket& t) { return t.Poll(); },
          "True when the values arrived or the fetch failed")
      .def(
          "wait",
          [](const RemoteFetchTicket& t) {
            py::gil_scoped_release release;
            t.Wait();
          },
          "Blocks (the GIL released) until poll() is true: about the tier's timeout_ms at most")
      .def_property_readonly(
          "blocks", [](const RemoteFetchTicket& t) { return t.blocks(); },
          "Blocks asked for (0: nothing to fetch, or the tier is off)")
      .def("__repr__", [](const RemoteFetchTicket& t) {
        return "<blockkv.RemoteFetchTicket blocks=" + std::to_string(t.blocks()) +
               (t.Poll() ? " done>" : " in flight>");
      });
}

void BindStateManager(py::module_& m) {
  BindRemoteFetchTicket(m);
  BindSchedulingResult(m);
  BindSequence(m);
  BindManager(m);
}

}  // namespace blockkv::python
