// SPDX-License-Identifier: Apache-2.0
// KV events on the wire from Python (docs/kv_events.md): blockkv.KVEventsConfig (vLLM's names:
// endpoint, replay_endpoint, topic, max_queue_size, ...), given as
// StateManagerConfig(kv_events=...), KVEventsStats, and the StateManager's kv_events_stats,
// kv_events_endpoint, kv_events_replay_endpoint, publish_kv_events and cached_block_hashes.
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "blockkv/kv_events.h"
#include "blockkv/state_manager.h"
#include "common.h"
#include "kv_events.h"
#include "object_lock.h"
#include "sequence.h"

namespace blockkv::python {
namespace {

std::string Repr(const KVEventsConfig& c) {
  auto quoted = [](const std::string& s) { return std::string(py::repr(py::str(s))); };
  return "KVEventsConfig(endpoint=" + quoted(c.endpoint) + ", replay_endpoint=" +
         (c.replay_endpoint.empty() ? std::string("None") : quoted(c.replay_endpoint)) +
         ", topic=" + quoted(c.topic) + ", max_queue_size=" + std::to_string(c.max_queue_size) +
         ", buffer_steps=" + std::to_string(c.buffer_steps) + ", hwm=" + std::to_string(c.hwm) +
         ", data_parallel_rank=" + std::to_string(c.data_parallel_rank) +
         ", int_block_hashes=" + (c.int_block_hashes ? "True" : "False") + ")";
}

CacheMedium ToMedium(const std::string& name) {
  for (const CacheMedium m :
       {CacheMedium::kDevice, CacheMedium::kHost, CacheMedium::kDisk, CacheMedium::kRemote}) {
    if (name == CacheMediumName(m)) return m;
  }
  Throw(PyExc_ValueError, "unknown medium " + std::string(py::repr(py::str(name))) +
                              R"(: expected "GPU" (device), "CPU" (host), "DISK" or "REMOTE")");
}

KVEventPublisher& Publisher(const PyManager& self) {
  KVEventPublisher* p = self.manager->kv_event_publisher();
  if (p == nullptr) {
    Throw(PyExc_RuntimeError,
          "this StateManager publishes no KV events: create it with "
          "StateManagerConfig(kv_events=blockkv.KVEventsConfig(...))");
  }
  return *p;
}

}  // namespace

py::tuple KVEventsState(const KVEventsConfig& c) {
  return py::make_tuple(c.endpoint, c.replay_endpoint, c.topic, c.max_queue_size, c.buffer_steps,
                        c.hwm, c.data_parallel_rank, c.int_block_hashes);
}

KVEventsConfig KVEventsFromState(const py::tuple& state) {
  KVEventsConfig c;
  c.endpoint = state[0].cast<std::string>();
  c.replay_endpoint = state[1].cast<std::string>();
  c.topic = state[2].cast<std::string>();
  c.max_queue_size = state[3].cast<size_t>();
  c.buffer_steps = state[4].cast<size_t>();
  c.hwm = state[5].cast<int32_t>();
  c.data_parallel_rank = state[6].cast<int32_t>();
  c.int_block_hashes = state[7].cast<bool>();
  return c;
}

std::optional<KVEventsConfig> ToKVEventsConfig(py::handle obj) {
  return OptionalConfig<KVEventsConfig>(obj, "kv_events", "blockkv.KVEventsConfig");
}

std::string KVEventsRepr(const std::optional<KVEventsConfig>& c) {
  return c ? Repr(*c) : std::string("None");
}

void BindKVEventsConfig(py::module_& m) {
  using C = KVEventsConfig;
  py::class_<C> cls(m, "KVEventsConfig",
                    "Where and how a StateManager publishes its prefix cache's events over "
                    "ZeroMQ in vLLM's wire format (StateManagerConfig(kv_events=...)); "
                    "see docs/kv_events.md. Immutable.");
  cls.def(
         py::init([](std::string endpoint, const std::optional<std::string>& replay_endpoint,
                     std::string topic, Int<int64_t, "max_queue_size"> max_queue_size,
                     Int<int64_t, "buffer_steps"> buffer_steps, Int<int32_t, "hwm"> hwm,
                     Int<int32_t, "data_parallel_rank"> data_parallel_rank, bool int_block_hashes) {
           C c;
           c.endpoint = std::move(endpoint);
           c.replay_endpoint = replay_endpoint.value_or("");
           c.topic = std::move(topic);
           if (max_queue_size < 1) {
             Throw(PyExc_ValueError, "KVEventsConfig.max_queue_size = " +
                                         std::to_string(max_queue_size) + " must be > 0");
           }
           if (buffer_steps < 1) {
             Throw(PyExc_ValueError, "KVEventsConfig.buffer_steps = " +
                                         std::to_string(buffer_steps) + " must be > 0");
           }
           c.max_queue_size = static_cast<size_t>(static_cast<int64_t>(max_queue_size));
           c.buffer_steps = static_cast<size_t>(static_cast<int64_t>(buffer_steps));
           c.hwm = hwm;
           c.data_parallel_rank = data_parallel_rank;
           c.int_block_hashes = int_block_hashes;
           ThrowIfError(c.Validate());
           return c;
         }),
         py::arg("endpoint") = "tcp://*:5557", py::kw_only(),
         py::arg("replay_endpoint") = py::none(), py::arg("topic") = "",
         py::arg("max_queue_size") = 100000, py::arg("buffer_steps") = 10000,
         py::arg("hwm") = 100000, py::arg("data_parallel_rank") = 0,
         py::arg("int_block_hashes") = false)
      .def_property_readonly(
          "endpoint", [](const C& c) { return c.endpoint; },
          "PUB address: bound when it has '*' or is ipc:// / inproc://, "
          "connected otherwise (vLLM's rule)")
      .def_property_readonly(
          "replay_endpoint",
          [](const C& c) -> py::object {
            if (c.replay_endpoint.empty()) return py::none();
            return py::str(c.replay_endpoint);
          },
          "ROUTER address for replay requests (bound), or None")
      .def_property_readonly("topic", [](const C& c) { return c.topic; })
      .def_property_readonly(
          "max_queue_size", [](const C& c) { return c.max_queue_size; },
          "Batches waiting for the publisher thread; more are dropped")
      .def_property_readonly(
          "buffer_steps", [](const C& c) { return c.buffer_steps; }, "Batches kept for replay")
      .def_property_readonly("hwm", [](const C& c) { return c.hwm; })
      .def_property_readonly("data_parallel_rank", [](const C& c) { return c.data_parallel_rank; })
      .def_property_readonly(
          "int_block_hashes", [](const C& c) { return c.int_block_hashes; },
          "Hashes as the key's low 64 bits (an int) instead of 16 bytes")
      .def("__eq__", [](const C& a, const C& b) { return a == b; })
      .def("__repr__", &Repr)
      .def("__copy__", [](const C& c) { return c; })
      .def(
          "__deepcopy__", [](const C& c, const py::dict&) { return c; }, py::arg("memo"))
      .def(py::pickle(&KVEventsState, [](const py::tuple& state) {
        C c = KVEventsFromState(state);
        ThrowIfError(c.Validate());
        return c;
      }));

  using S = KVEventsStats;
  py::class_<S>(m, "KVEventsStats", "Counters of a StateManager's KV event publisher.")
      .def_readonly("batches_queued", &S::batches_queued)
      .def_readonly("batches_published", &S::batches_published)
      .def_readonly("batches_dropped", &S::batches_dropped, "Batches that found the queue full")
      .def_readonly("events_dropped", &S::events_dropped)
      .def_readonly("resyncs", &S::resyncs, "Full-state batches sent after drops")
      .def_readonly("replay_requests", &S::replay_requests)
      .def("__repr__", [](const S& s) {
        return "KVEventsStats(batches_queued=" + std::to_string(s.batches_queued) +
               ", batches_published=" + std::to_string(s.batches_published) +
               ", batches_dropped=" + std::to_string(s.batches_dropped) +
               ", events_dropped=" + std::to_string(s.events_dropped) +
               ", resyncs=" + std::to_string(s.resyncs) +
               ", replay_requests=" + std::to_string(s.replay_requests) + ")";
      });
}

void BindKVEventsMethods(py::class_<PyManager, Manager>& cls) {
  cls.def_property_readonly(
         "kv_events_stats", [](const Manager& self) { return Publisher(*self).stats(); },
         "KVEventsStats; RuntimeError without kv_events")
      .def_property_readonly(
          "kv_events_endpoint", [](const Manager& self) { return Publisher(*self).endpoint(); },
          "The PUB address, its port resolved when it was bound to '*'")
      .def_property_readonly(
          "kv_events_replay_endpoint",
          [](const Manager& self) -> py::object {
            const std::string e = Publisher(*self).replay_endpoint();
            if (e.empty()) return py::none();
            return py::str(e);
          },
          "The ROUTER address, its port resolved, or None")
      .def(
          "publish_kv_events",
          [](const Manager& self, bool wait) {
            Publisher(*self);  // RuntimeError without kv_events
            if (wait) {
              LockedWithoutGil(self->lock, [&] { self->manager->PublishKVEvents(true); });
            } else {
              Locked(self->lock, [&] { self->manager->PublishKVEvents(false); });
            }
          },
          py::arg("wait") = false,
          "Hands the events queued since the last step to the publisher now (every schedule, "
          "post_forward, flush_sequence and reset_prefix_cache does it on its own); wait=True "
          "returns once the publisher thread has sent everything queued")
      .def(
          "_pause_kv_events",
          [](const Manager& self, bool paused) { Publisher(*self).PauseForTesting(paused); },
          py::arg("paused"),
          "Tests only: the publisher thread takes nothing from its queue while paused")
      .def(
          "cached_block_hashes",
          [](const Manager& self, GroupArg cache_group, const std::string& medium) {
            CheckGroup(*self, cache_group);
            const CacheMedium m = ToMedium(medium);
            const std::vector<BlockHash> keys =
                Locked(self->lock, [&] { return self->manager->cached_keys(cache_group, m); });
            py::set out;
            for (const BlockHash& k : keys) {
              out.add(py::reinterpret_steal<py::object>(
                  PyLong_FromString(ToString(k).c_str(), nullptr, 16)));
            }
            return out;
          },
          py::arg("cache_group") = 0, py::arg("medium") = "GPU",
          "The distinct block keys (ints, hi * 2**64 + lo, as the events' `hash`) that `medium` "
          "(\"GPU\": the device, \"CPU\": the host level) holds for the group: what a subscriber "
          "to the KV events should hold");
}

}  // namespace blockkv::python
