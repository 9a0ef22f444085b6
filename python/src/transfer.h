// SPDX-License-Identifier: Apache-2.0
// Sequence transfer from Python (transfer.cc): TransferConfig, what StateManagerConfig needs of
// it (config.cc), and the StateManager's methods (state_manager.cc). docs/transfer.md.
#pragma once

#include <optional>
#include <string>

#include "blockkv/transfer.h"
#include "common.h"
#include "sequence.h"

namespace blockkv::python {

void BindTransferConfig(py::module_& m);
void BindImportTicket(py::module_& m);
void BindTransferMethods(py::class_<PyManager, Manager>& cls);

// StateManagerConfig.transfer: None or a TransferConfig (TypeError otherwise).
std::optional<TransferConfig> ToTransferConfig(py::handle obj);
std::string TransferRepr(const std::optional<TransferConfig>& c);
py::object TransferState(const std::optional<TransferConfig>& c);
std::optional<TransferConfig> TransferFromState(py::handle state);

}  // namespace blockkv::python
