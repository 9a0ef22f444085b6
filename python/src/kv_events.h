// SPDX-License-Identifier: Apache-2.0
// KV events from Python (kv_events.cc): KVEventsConfig and KVEventsStats, what
// StateManagerConfig needs of them (config.cc), and the StateManager's methods (state_manager.cc).
#pragma once

#include <optional>
#include <string>

#include "blockkv/kv_events.h"
#include "common.h"
#include "sequence.h"

namespace blockkv::python {

void BindKVEventsConfig(py::module_& m);
void BindKVEventsMethods(py::class_<PyManager, Manager>& cls);

// StateManagerConfig.kv_events: None or a KVEventsConfig (TypeError otherwise).
std::optional<KVEventsConfig> ToKVEventsConfig(py::handle obj);
std::string KVEventsRepr(const std::optional<KVEventsConfig>& c);
py::tuple KVEventsState(const KVEventsConfig& c);
KVEventsConfig KVEventsFromState(const py::tuple& state);

}  // namespace blockkv::python
