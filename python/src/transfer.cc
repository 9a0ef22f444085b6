// SPDX-License-Identifier: Apache-2.0
// blockkv.TransferConfig and StateManager.export_sequence / import_sequence / cancel_export /
// complete_exports (docs/transfer.md).
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
         ", timeout_ms=" + std::to_string(c->timeout_ms) + ")";
}

py::object TransferState(const std::optional<TransferConfig>& c) {
  if (!c) return py::none();
  return py::make_tuple(c->transports, c->devices, c->timeout_ms);
}

std::optional<TransferConfig> TransferFromState(py::handle state) {
  if (state.is_none()) return std::nullopt;
  const auto t = state.cast<py::tuple>();
  return TransferConfig{.transports = t[0].cast<std::string>(),
                        .devices = t[1].cast<std::string>(),
                        .timeout_ms = t[2].cast<int32_t>()};
}

void BindTransferConfig(py::module_& m) {
  using T = TransferConfig;
  py::class_<T> cls(m, "TransferConfig",
                    "Where and how this engine moves sequences to and from other engines over "
                    "UCX (StateManagerConfig(transfer=...)); see docs/transfer.md.");
  cls.def(py::init([](std::string transports, std::string devices,
                      Int<int32_t, "timeout_ms"> timeout_ms) {
            T c{.transports = std::move(transports),
                .devices = std::move(devices),
                .timeout_ms = timeout_ms};
            ThrowIfError(ValidateTransfer(c));
            return c;
          }),
          py::kw_only(), py::arg("transports") = "", py::arg("devices") = "",
          py::arg("timeout_ms") = 10000)
      .def_readonly("transports", &T::transports,
                    "UCX transports, as UCX_TLS (\"\": UCX chooses; \"tcp\"; "
                    "\"posix,sysv,cma,self\")")
      .def_readonly("devices", &T::devices,
                    "Network devices, as UCX_NET_DEVICES (\"\": all; \"lo\"): where this engine "
                    "can be reached")
      .def_readonly("timeout_ms", &T::timeout_ms, "How long import_sequence waits, in ms")
      .def("__eq__", [](const T& a, const T& b) { return a == b; })
      .def("__repr__", [](const T& c) { return TransferRepr(c); })
      .def("__copy__", [](const T& c) { return c; })
      .def(
          "__deepcopy__", [](const T& c, const py::dict&) { return c; }, py::arg("memo"))
      .def(py::pickle([](const T& c) { return TransferState(c).cast<py::tuple>(); },
                      [](const py::tuple& state) { return *TransferFromState(state); }));
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
         "flushes it) or cancel_export. ValueError (unknown uid, tokens in flight, preempted, "
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
          "another KV layout, uid tracked, refused by the sender), ResourceExhaustedError (no "
          "slot or blocks), RuntimeError (the sender unreachable, dead, or timed out); the "
          "sender then still holds it.")
      .def(
          "cancel_export",
          [](const Manager& self, UidArg uid) {
            ThrowIfError(Locked(self->lock, [&] { return self->manager->CancelExport(uid); }));
          },
          py::arg("uid"),
          "Takes back a pending export: `uid` is schedulable here again and no receiver is "
          "accepted for it. ValueError (no pending export; or a receiver confirmed first, and "
          "the sequence is flushed).")
      .def(
          "complete_exports",
          [](const Manager& self) {
            return Locked(self->lock, [&] { return self->manager->CompleteExports(); });
          },
          "Flushes every exported sequence whose receiver confirmed; returns how many.")
      .def_property_readonly(
          "pending_exports",
          [](const Manager& self) {
            return Locked(self->lock, [&] { return self->manager->pending_exports(); });
          },
          "Exports neither confirmed nor cancelled yet.");
}

}  // namespace blockkv::python
