// SPDX-License-Identifier: Apache-2.0
// The prefix cache seen from Python: StateManager.add_sequence / append_tokens /
// drain_cache_events / reset_prefix_cache / prefix_cache_stats / cached_blocks, and the values
// they return (PrefixCacheStats, CacheEventBatch, BlockStored, BlockRemoved, AllCleared).
//
// Block keys are 128-bit: Python gets them as an int (`hash`, hi · 2**64 + lo, hashable and what
// vLLM's KV events carry) and as the 32 hex digits C++ prints (`hash_hex`). Events are copied
// into Python objects when drained; the manager keeps nothing of them.
#include <Python.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "blockkv/prefix_cache.h"
#include "blockkv/state_manager.h"
#include "common.h"
#include "object_lock.h"
#include "sequence.h"

namespace blockkv::python {
namespace {

// One drain: the events as Python objects, oldest first, and how many were dropped before them.
struct EventBatch {
  py::list events;
  uint64_t dropped = 0;
};

py::int_ HashToInt(const BlockHash& hash) {
  const std::string hex = ToString(hash);
  PyObject* value = PyLong_FromString(hex.c_str(), nullptr, 16);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::int_>(value);
}

py::object OptionalHash(bool present, const BlockHash& hash) {
  return present ? py::object(HashToInt(hash)) : py::object(py::none());
}

py::object OptionalHex(bool present, const BlockHash& hash) {
  return present ? py::object(py::str(ToString(hash))) : py::object(py::none());
}

std::string QuotedNamespace(const std::string& ns) { return py::repr(py::str(ns)); }

// Token ids as TokenId (int32): a list, a NumPy array, a torch tensor or one int. A negative id
// or one past int32 is a ValueError naming the first (read as int64 first, so the message is the
// same for both).
std::vector<TokenId> ToTokenIds(py::handle obj, const char* what) {
  const std::vector<int64_t> ids = ToInts<int64_t>(obj, what);
  std::vector<TokenId> out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > std::numeric_limits<TokenId>::max()) {
      Throw(PyExc_ValueError, std::string(what) + "[" + std::to_string(i) + "] = " +
                                  std::to_string(ids[i]) + " is not a token id (0 to 2**31 - 1)");
    }
    out[i] = static_cast<TokenId>(ids[i]);
  }
  return out;
}

// block_bytes: None, or a sequence of bytes (or str, taken as UTF-8) per block index.
std::vector<std::string> ToBlockBytes(py::handle obj) {
  std::vector<std::string> out;
  if (obj.is_none()) return out;
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj) ||
      py::isinstance<py::bytes>(obj)) {
    Throw(PyExc_TypeError, "block_bytes must be None or a sequence of bytes, one per block, got " +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  for (py::handle item : obj) {
    if (py::isinstance<py::bytes>(item) || py::isinstance<py::str>(item)) {
      out.push_back(item.cast<std::string>());
    } else if (PyByteArray_Check(item.ptr()) != 0) {
      out.emplace_back(PyByteArray_AsString(item.ptr()),
                       static_cast<size_t>(PyByteArray_Size(item.ptr())));
    } else {
      Throw(PyExc_TypeError, "every block_bytes entry must be bytes or str, got " +
                                 std::string(py::str(py::type::of(item).attr("__name__"))));
    }
  }
  return out;
}

py::object ToPython(const CacheEvent& event) {
  return std::visit([](const auto& e) { return py::cast(e); }, event);
}

std::string Repr(const PrefixCacheStats& s) {
  return "PrefixCacheStats(lookups=" + std::to_string(s.lookups) +
         ", queried_tokens=" + std::to_string(s.queried_tokens) +
         ", hit_tokens=" + std::to_string(s.hit_tokens) +
         ", evictions=" + std::to_string(s.evictions) +
         ", host_hit_tokens=" + std::to_string(s.host_hit_tokens) +
         ", remote_hit_tokens=" + std::to_string(s.remote_hit_tokens) + ")";
}

void BindStats(py::module_& m) {
  using S = PrefixCacheStats;
  py::class_<S>(m, "PrefixCacheStats",
                "Counters of the prefix cache, of one namespace or of all (prefix_cache_stats).")
      .def_readonly("lookups", &S::lookups,
                    "Prompts looked up (the first schedule of a sequence added with a prompt)")
      .def_readonly("queried_tokens", &S::queried_tokens,
                    "Known tokens of the looked-up sequences: what could have hit")
      .def_readonly("hit_tokens", &S::hit_tokens, "Tokens taken from the cache")
      .def_readonly("evictions", &S::evictions,
                    "Cached blocks taken for reuse, counted for the evicted block's namespace")
      .def_readonly("host_hit_tokens", &S::host_hit_tokens,
                    "Of hit_tokens, those copied back from the host level (offload)")
      .def_readonly("remote_hit_tokens", &S::remote_hit_tokens,
                    "Of hit_tokens, those fetched from the remote tier (remote_tier_stats() has "
                    "the tier's own counters)")
      .def_property_readonly(
          "hit_rate",
          [](const S& s) {
            return s.queried_tokens == 0
                       ? 0.0
                       : static_cast<double>(s.hit_tokens) / static_cast<double>(s.queried_tokens);
          },
          "hit_tokens / queried_tokens (0.0 before any lookup)")
      .def("_asdict",
           [](const S& s) {
             py::dict d;
             d["lookups"] = s.lookups;
             d["queried_tokens"] = s.queried_tokens;
             d["hit_tokens"] = s.hit_tokens;
             d["evictions"] = s.evictions;
             d["host_hit_tokens"] = s.host_hit_tokens;
             d["remote_hit_tokens"] = s.remote_hit_tokens;
             return d;
           })
      .def("__eq__",
           [](const S& a, const S& b) {
             return a.lookups == b.lookups && a.queried_tokens == b.queried_tokens &&
                    a.hit_tokens == b.hit_tokens && a.evictions == b.evictions &&
                    a.host_hit_tokens == b.host_hit_tokens &&
                    a.remote_hit_tokens == b.remote_hit_tokens;
           })
      .def("__repr__", &Repr);
}

void BindEvents(py::module_& m) {
  py::class_<BlockStored>(m, "BlockStored",
                          "A block was published to the prefix cache (one per block, parents "
                          "before children).")
      .def_property_readonly(
          "hash", [](const BlockStored& e) { return HashToInt(e.hash); },
          "The block's 128-bit key as an int")
      .def_property_readonly(
          "hash_hex", [](const BlockStored& e) { return ToString(e.hash); }, "32 hex digits")
      .def_property_readonly(
          "parent", [](const BlockStored& e) { return OptionalHash(e.has_parent, e.parent); },
          "The previous block's key, None for block 0")
      .def_property_readonly(
          "parent_hex", [](const BlockStored& e) { return OptionalHex(e.has_parent, e.parent); })
      .def_property_readonly("tokens", [](const BlockStored& e) { return e.tokens; })
      .def_property_readonly("namespace", [](const BlockStored& e) { return e.ns; })
      .def_readonly("adapter_id", &BlockStored::adapter_id)
      .def_readonly("group", &BlockStored::group, "Cache group")
      .def_property_readonly(
          "medium", [](const BlockStored& e) { return CacheMediumName(e.medium); },
          R"(Which level: "GPU" (the device), "CPU" (the host level), "DISK", "REMOTE")")
      .def("__eq__",
           [](const BlockStored& a, const BlockStored& b) {
             return a.hash == b.hash && a.has_parent == b.has_parent &&
                    (!a.has_parent || a.parent == b.parent) && a.tokens == b.tokens &&
                    a.ns == b.ns && a.adapter_id == b.adapter_id && a.group == b.group &&
                    a.medium == b.medium;
           })
      .def("__repr__", [](const BlockStored& e) {
        return "BlockStored(hash=" + ToString(e.hash) +
               ", parent=" + (e.has_parent ? ToString(e.parent) : std::string("None")) +
               ", tokens=<" + std::to_string(e.tokens.size()) +
               ">, namespace=" + QuotedNamespace(e.ns) +
               ", adapter_id=" + std::to_string(e.adapter_id) +
               ", group=" + std::to_string(e.group) + ")";
      });

  py::class_<BlockRemoved>(m, "BlockRemoved",
                           "The last cached copy of `hash` in cache `group` is gone.")
      .def_property_readonly("hash", [](const BlockRemoved& e) { return HashToInt(e.hash); })
      .def_property_readonly("hash_hex", [](const BlockRemoved& e) { return ToString(e.hash); })
      .def_readonly("group", &BlockRemoved::group)
      .def_property_readonly(
          "medium", [](const BlockRemoved& e) { return CacheMediumName(e.medium); },
          R"(Which level: "GPU", "CPU", "DISK", "REMOTE")")
      .def("__eq__",
           [](const BlockRemoved& a, const BlockRemoved& b) {
             return a.hash == b.hash && a.group == b.group && a.medium == b.medium;
           })
      .def("__repr__", [](const BlockRemoved& e) {
        return "BlockRemoved(hash=" + ToString(e.hash) + ", group=" + std::to_string(e.group) + ")";
      });

  py::class_<AllCleared>(m, "AllCleared",
                         "Nothing is cached any more (reset_prefix_cache emptied the cache).")
      .def("__eq__", [](const AllCleared&, const AllCleared&) { return true; })
      .def("__repr__", [](const AllCleared&) { return std::string("AllCleared()"); });

  py::class_<EventBatch>(m, "CacheEventBatch",
                         "What drain_cache_events returns: .events, oldest first, and .dropped, "
                         "how many older events were lost because more than max_events "
                         "accumulated. Iterating it, len() and bool() go over .events.")
      .def_readonly("events", &EventBatch::events)
      .def_readonly("dropped", &EventBatch::dropped)
      .def("__len__", [](const EventBatch& b) { return py::len(b.events); })
      .def("__iter__", [](const EventBatch& b) { return b.events.attr("__iter__")(); })
      .def("__bool__", [](const EventBatch& b) { return !b.events.empty(); })
      .def("__repr__", [](const EventBatch& b) {
        return "CacheEventBatch(events=<" + std::to_string(py::len(b.events)) +
               ">, dropped=" + std::to_string(b.dropped) + ")";
      });
}

}  // namespace

void BindPrefixCacheMethods(py::module_& m, py::class_<PyManager, Manager>& cls) {
  BindStats(m);
  BindEvents(m);
  cls.def(
         "add_sequence",
         [](const Manager& self, UidArg uid, py::handle prompt_tokens, const std::string& ns,
            Int<int64_t, "adapter_id"> adapter_id, py::handle block_bytes,
            Int<int32_t, "priority"> priority) {
           const std::vector<TokenId> prompt = ToTokenIds(prompt_tokens, "prompt_tokens");
           SequenceOptions options;
           options.keys.ns = ns;
           options.keys.adapter_id = adapter_id;
           options.keys.block_bytes = ToBlockBytes(block_bytes);
           options.priority = priority;
           Result<SequenceHandle> handle = Locked(self->lock, [&]() -> Result<SequenceHandle> {
             Result<Sequence*> seq = self->manager->AddSequence(uid, prompt, options);
             if (!seq.ok()) return seq.status();
             return Handle(self, **seq);
           });
           return ValueOrThrow(std::move(handle));
         },
         py::arg("uid"), py::arg("prompt_tokens"), py::arg("namespace") = "",
         py::arg("adapter_id") = 0, py::arg("block_bytes") = py::none(),
         py::arg("priority") = kDefaultRetentionPriority,
         "A new sequence whose first tokens are prompt_tokens (a list, NumPy array or torch "
         "tensor of ids); returns its SequenceDescriptor. With prefix caching on, its first "
         "schedule takes the longest cached prefix of whole blocks (never the last prompt token) "
         "and its blocks are published as they fill. Blocks are keyed by `namespace` (tenant "
         "isolation), `adapter_id` (LoRA) and `block_bytes` (opaque bytes per block index, e.g. "
         "image hashes); `priority` 0..100, lower evicted first. Without prefix caching it is "
         "get_or_create_sequence for a new uid. ValueError for a tracked uid, a negative id, a "
         "priority outside [0, 100] or more tokens than max_context.")
      .def(
          "append_tokens",
          [](const Manager& self, UidArg uid, py::handle tokens) {
            const std::vector<TokenId> ids = ToTokenIds(tokens, "tokens");
            ThrowIfError(Locked(self->lock, [&] { return self->manager->AppendTokens(uid, ids); }));
          },
          py::arg("uid"), py::arg("tokens"),
          "Tokens sampled for `uid` (an int or a sequence of ids), so that the blocks they fill "
          "are published too: call before scheduling them. A no-op without prefix caching. "
          "ValueError for an unknown uid or one not added with add_sequence.")
      .def(
          "drain_cache_events",
          [](const Manager& self) {
            const CacheEventBatch drained =
                Locked(self->lock, [&] { return self->manager->DrainCacheEvents(); });
            EventBatch out;
            out.dropped = drained.dropped;
            for (const CacheEvent& event : drained.events) out.events.append(ToPython(event));
            return out;
          },
          "The events queued since the last drain: a CacheEventBatch with .events (BlockStored, "
          "BlockRemoved, AllCleared; oldest first) and .dropped. Empty without prefix caching.")
      .def(
          "reset_prefix_cache",
          [](const Manager& self) {
            return Locked(self->lock, [&] { return self->manager->ResetPrefixCache(); });
          },
          "Drops every cached block no sequence references; returns how many.")
      .def(
          "prefix_cache_stats",
          [](const Manager& self, const std::optional<std::string>& ns) {
            return Locked(self->lock, [&] {
              const PrefixCache* cache = self->manager->prefix_cache();
              if (cache == nullptr) return PrefixCacheStats{};
              return ns ? cache->stats(*ns) : cache->total_stats();
            });
          },
          py::arg("namespace") = py::none(),
          "PrefixCacheStats of one namespace (\"\" is the default one), or of all together when "
          "None. Zeros without prefix caching.")
      .def(
          "cached_blocks",
          [](const Manager& self, GroupArg cache_group) {
            CheckGroup(*self, cache_group);
            return Locked(self->lock, [&] {
              const PrefixCache* cache = self->manager->prefix_cache();
              return cache == nullptr ? int64_t{0} : cache->cached_blocks(cache_group);
            });
          },
          py::arg("cache_group") = 0,
          "Blocks of the group held in the prefix cache (referenced or evictable)")
      .def_property_readonly(
          "prefix_caching",
          [](const Manager& self) { return self->manager->prefix_cache() != nullptr; },
          "Whether the manager was configured with an enabled PrefixCacheConfig");
}

}  // namespace blockkv::python
