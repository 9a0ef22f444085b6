// SPDX-License-Identifier: Apache-2.0
// blockkv.TransferConfig, blockkv.ImportTicket and StateManager.export_sequence /
// import_sequence / start_import / complete_imports / cancel_export / complete_exports
// (docs/transfer.md).
#include "transfer.h"

#include <pybind11/stl.h>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "blockkv/state_manager.h"
#include "object_lock.h"

namespace blockkv::python {
namespace {

Status ValidateTransfer(const TransferConfig& c) {
  if (c.timeout_ms <= 0) {
    return InvalidArgumentError("TransferConfig.timeout_ms is " + std::to_string(c.timeout_ms) +
                                "; it must be > 0");
  }
  if (c.export_timeout_ms < 0) {
    return InvalidArgumentError("TransferConfig.export_timeout_ms is " +
                                std::to_string(c.export_timeout_ms) +
                                "; it must be >= 0 (0: never)");
  }
  if (c.tp_size < 1 || c.tp_rank < 0 || c.tp_rank >= c.tp_size) {
    return InvalidArgumentError("TransferConfig: tp_rank is " + std::to_string(c.tp_rank) +
                                " and tp_size " + std::to_string(c.tp_size) +
                                "; they must satisfy 0 <= tp_rank < tp_size");
  }
  return Status::Ok();
}

}  // namespace

std::optional<TransferConfig> ToTransferConfig(py::handle obj) {
  return OptionalConfig<TransferConfig>(obj, "transfer", "blockkv.TransferConfig");
}

std::string TransferRepr(const std::optional<TransferConfig>& c) {
  if (!c) return "None";
  return "TransferConfig(transports=" + std::string(py::repr(py::str(c->transports))) +
         ", devices=" + std::string(py::repr(py::str(c->devices))) +
         ", timeout_ms=" + std::to_string(c->timeout_ms) +
         ", export_timeout_ms=" + std::to_string(c->export_timeout_ms) +
         ", tp_rank=" + std::to_string(c->tp_rank) + ", tp_size=" + std::to_string(c->tp_size) +
         ")";
}

py::object TransferState(const std::optional<TransferConfig>& c) {
  if (!c) return py::none();
  return py::make_tuple(c->transports, c->devices, c->timeout_ms, c->export_timeout_ms, c->tp_rank,
                        c->tp_size);
}

std::optional<TransferConfig> TransferFromState(py::handle state) {
  if (state.is_none()) return std::nullopt;
  const auto t = state.cast<py::tuple>();
  TransferConfig c{.transports = t[0].cast<std::string>(),
                   .devices = t[1].cast<std::string>(),
                   .timeout_ms = t[2].cast<int32_t>()};
  if (t.size() >= 6) {  // older pickles have 3 fields: the defaults
    c.export_timeout_ms = t[3].cast<int32_t>();
    c.tp_rank = t[4].cast<int32_t>();
    c.tp_size = t[5].cast<int32_t>();
  }
  return c;
}

void BindTransferConfig(py::module_& m) {
  using T = TransferConfig;
  py::class_<T> cls(m, "TransferConfig",
                    "Where and how this engine moves sequences to and from other engines over "
                    "UCX (StateManagerConfig(transfer=...)); see docs/transfer.md.");
  cls.def(py::init([](std::string transports, std::string devices,
                      Int<int32_t, "timeout_ms"> timeout_ms,
                      Int<int32_t, "export_timeout_ms"> export_timeout_ms,
                      Int<int32_t, "tp_rank"> tp_rank, Int<int32_t, "tp_size"> tp_size) {
            T c{.transports = std::move(transports),
                .devices = std::move(devices),
                .timeout_ms = timeout_ms,
                .export_timeout_ms = export_timeout_ms,
                .tp_rank = tp_rank,
                .tp_size = tp_size};
            ThrowIfError(ValidateTransfer(c));
            return c;
          }),
          py::kw_only(), py::arg("transports") = "", py::arg("devices") = "",
          py::arg("timeout_ms") = 10000, py::arg("export_timeout_ms") = 120000,
          py::arg("tp_rank") = 0, py::arg("tp_size") = 1)
      .def_readonly("transports", &T::transports,
                    "UCX transports, as UCX_TLS (\"\": UCX chooses; \"tcp\"; "
                    "\"posix,sysv,cma,self\")")
      .def_readonly("devices", &T::devices,
                    "Network devices, as UCX_NET_DEVICES (\"\": all; \"lo\"): where this engine "
                    "can be reached")
      .def_readonly("timeout_ms", &T::timeout_ms, "How long import_sequence waits, in ms")
      .def_readonly("export_timeout_ms", &T::export_timeout_ms,
                    "How long an export waits for a receiver before this engine takes it back "
                    "(the sequence stays here, un-pinned), in ms; 0: forever")
      .def_readonly("tp_rank", &T::tp_rank,
                    "This engine's tensor-parallel rank: it imports only its own rank's shard")
      .def_readonly("tp_size", &T::tp_size, "The tensor-parallel world size")
      .def("__eq__", [](const T& a, const T& b) { return a == b; })
      .def("__repr__", [](const T& c) { return TransferRepr(c); })
      .def("__copy__", [](const T& c) { return c; })
      .def(
          "__deepcopy__", [](const T& c, const py::dict&) { return c; }, py::arg("memo"))
      .def(py::pickle([](const T& c) { return TransferState(c).cast<py::tuple>(); },
                      [](const py::tuple& state) { return *TransferFromState(state); }));
}

void BindImportTicket(py::module_& m) {
  py::class_<ImportTicket>(m, "ImportTicket",
                           "A sequence's transfer into this engine, running on the transfer "
                           "thread (StateManager.start_import). Thread-safe.")
      .def_property_readonly("uid", &ImportTicket::uid, "The sequence")
      .def(
          "poll", [](const ImportTicket& t) { return t.Poll(); },
          "True once the transfer has finished (complete_imports then commits it)")
      .def(
          "wait",
          [](const ImportTicket& t) {
            py::gil_scoped_release release;
            (void)t.Wait();
          },
          "Blocks (the GIL released) until poll() is true: TransferConfig.timeout_ms at most, "
          "after the imports started before it")
      .def("__repr__", [](const ImportTicket& t) {
        return "<blockkv.ImportTicket uid=" + std::to_string(t.uid()) +
               (t.Poll() ? " done>" : " in flight>");
      });
}

void BindTransferMethods(py::class_<PyManager, Manager>& cls) {
  cls.def(
         "export_sequence",
         [](const Manager& self, UidArg uid) {
           Result<std::vector<std::byte>> d =
               Locked(self->lock, [&] { return self->manager->ExportSequence(uid); });
           const std::vector<std::byte> bytes = ValueOrThrow(std::move(d));
           return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
         },
         py::arg("uid"),
         "A descriptor of `uid` (bytes, opaque) for import_sequence on another engine. The "
         "sequence stays here, pinned, until the receiver confirms (then the next schedule "
         "flushes it), cancel_export, or TransferConfig.export_timeout_ms passes with no "
         "receiver granted (the next schedule takes it back). ValueError (unknown uid, tokens in "
         "flight, preempted, "
         "exported already, transfer not configured); nothing changes on failure.")
      .def(
          "import_sequence",
          [](const Manager& self, const py::bytes& descriptor) {
            const std::string d = descriptor;
            // The gets and the sender's confirm take a while: the GIL is released meanwhile.
            Result<Sequence*> seq = LockedWithoutGil(self->lock, [&] {
              return self->manager->ImportSequence(std::as_bytes(std::span(d)));
            });
            ThrowIfError(seq.status());
            Result<SequenceHandle> handle =
                Locked(self->lock, [&]() -> Result<SequenceHandle> { return Handle(self, **seq); });
            return ValueOrThrow(std::move(handle));
          },
          py::arg("descriptor"),
          "Imports the sequence another engine's export_sequence described: reads its blocks "
          "from the sender (UCX gets), has the sender confirm, and returns its Sequence (seen "
          "tokens restored, nothing in flight). All or nothing: ValueError (corrupt descriptor, "
          "another KV layout, another tensor-parallel rank or world size, uid tracked, refused "
          "by the sender: cancelled, expired, granted to or imported by another receiver), "
          "ResourceExhaustedError (no "
          "slot or blocks), RuntimeError (the sender unreachable, dead, or timed out); the "
          "sender then still holds it.")
      .def(
          "start_import",
          [](const Manager& self, const py::bytes& descriptor) {
            const std::string d = descriptor;
            Result<ImportTicket> ticket = Locked(self->lock, [&] {
              return self->manager->StartImport(std::as_bytes(std::span(d)));
            });
            return ValueOrThrow(std::move(ticket));
          },
          py::arg("descriptor"),
          "import_sequence without the wait: takes the slot and blocks now and returns an "
          "ImportTicket at once while the transfer thread reads the blocks. The sequence is "
          "tracked but pinned (schedule, post_forward, flush_sequence, fork ... raise "
          "ValueError) until complete_imports commits it. Raises what import_sequence raises "
          "for the descriptor and this engine's room; the transfer's own errors come from "
          "complete_imports.")
      .def(
          "complete_imports",
          [](const Manager& self) {
            std::vector<std::pair<SeqId, Status>> done =
                Locked(self->lock, [&] { return self->manager->CompleteImports(); });
            py::list out;
            for (const auto& [uid, status] : done) {
              out.append(py::make_tuple(uid, StatusException(status)));
            }
            return out;
          },
          "Commits every started import whose transfer has finished; returns [(uid, None)] for "
          "each now schedulable and [(uid, exception)] for each that failed (no longer tracked; "
          "the sender keeps it), in the order started. Never waits.")
      .def_property_readonly(
          "pending_imports",
          [](const Manager& self) {
            return Locked(self->lock, [&] { return self->manager->pending_imports(); });
          },
          "Imports started and not completed yet.")
      .def(
          "cancel_export",
          [](const Manager& self, UidArg uid) {
            Result<CancelledExport> taken =
                Locked(self->lock, [&] { return self->manager->CancelExport(uid); });
            return ValueOrThrow(std::move(taken)) == CancelledExport::kGranted ? "granted"
                                                                               : "unclaimed";
          },
          py::arg("uid"),
          "Takes back an export no receiver confirmed: `uid` is schedulable here again and no "
          "receiver is granted it. Returns \"unclaimed\" (no receiver had been granted it: it "
          "is only here) or \"granted\" (a receiver had been granted it and never confirmed: "
          "it may hold the sequence too; this engine keeps its copy). ValueError (no pending "
          "export; or a receiver confirmed first, and the sequence is flushed).")
      .def(
          "complete_exports",
          [](const Manager& self) {
            return Locked(self->lock, [&] { return self->manager->CompleteExports(); });
          },
          "Flushes every exported sequence whose receiver confirmed, and takes back the "
          "expired exports; returns how many it flushed.")
      .def_property_readonly(
          "pending_exports",
          [](const Manager& self) {
            return Locked(self->lock, [&] { return self->manager->pending_exports(); });
          },
          "Exports neither confirmed, cancelled nor expired yet.");
}

}  // namespace blockkv::python
