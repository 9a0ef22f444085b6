// SPDX-License-Identifier: Apache-2.0
// KVCacheConfig, MemoryConfig, AllocationMode and StateManagerConfig with DeepSpeed's field names
// and defaults, and PrefixCacheConfig and OffloadConfig (StateManagerConfig.prefix_cache and
// .offload_config; DeepSpeed has neither). Like DeepSpeed's pydantic models (validate_assignment),
// every construction and every field assignment is validated: an invalid value raises ValueError
// and leaves the config as it was. Arguments are keyword-only, as a pydantic model's are.
#include <Python.h>
#include <pybind11/stl.h>

#include <array>
#include <cctype>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "blockkv/config.h"
#include "blockkv/offload.h"
#include "blockkv/prefix_cache.h"
#include "blockkv/remote_tier.h"
#include "blockkv/state_manager.h"
#include "common.h"
#include "kv_events.h"
#include "transfer.h"

namespace blockkv::python {
namespace {

AllocationMode ToMode(py::handle obj) {
  if (py::isinstance<AllocationMode>(obj)) return obj.cast<AllocationMode>();
  if (py::isinstance<py::str>(obj)) {
    auto name = obj.cast<std::string>();
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (name == "reserve") return AllocationMode::kReserve;
    if (name == "allocate") return AllocationMode::kAllocate;
  }
  Throw(PyExc_ValueError, "unknown allocation mode " + std::string(py::repr(obj)) +
                              ": expected AllocationMode.RESERVE / \"reserve\" or "
                              "AllocationMode.ALLOCATE / \"allocate\"");
}

std::array<int64_t, 3> ToCacheShape(py::handle obj) {
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj) || py::len(obj) != 3) {
    Throw(PyExc_ValueError, "cache_shape must be (num_caches, num_kv_heads, head_size), got " +
                                std::string(py::repr(obj)));
  }
  std::array<int64_t, 3> shape{};
  for (size_t i = 0; i < 3; ++i) {
    std::vector<int64_t> v = ToInt64Vector(py::sequence(py::reinterpret_borrow<py::object>(obj))[i],
                                           "cache_shape entries");
    if (v.size() != 1) Throw(PyExc_ValueError, "cache_shape entries must be ints");
    shape[i] = v[0];
  }
  return shape;
}

// KVCacheConfig.type: None (DENSE), a blockkv.KVCacheType or DeepSpeed's (their .value is the
// name), or the name itself: "dense", "local", "state", "mla". DeepSpeed stores the type without
// reading it; blockkv lays out MLA groups by it, and refuses LOCAL and STATE (Validate:
// NotImplementedError) rather than accept a kind it would plan and store as DENSE.
KVCacheType ToCacheType(py::handle type) {
  if (type.is_none()) return KVCacheType::kDense;
  py::object value = py::hasattr(type, "value") && !py::isinstance<py::str>(type)
                         ? type.attr("value")
                         : py::reinterpret_borrow<py::object>(type);
  if (py::isinstance<py::str>(value)) {
    const auto name = value.cast<std::string>();
    for (const KVCacheType t :
         {KVCacheType::kDense, KVCacheType::kLocal, KVCacheType::kState, KVCacheType::kMla}) {
      if (name == KVCacheTypeName(t)) return t;
    }
  }
  Throw(PyExc_ValueError, "unknown KV cache type " + std::string(py::repr(type)) +
                              R"(: expected "dense", "local", "state" or "mla")");
}

// blockkv.KVCacheType(name): the Python enum of __init__.py.
py::object CacheTypeToPython(KVCacheType type) {
  return py::module_::import("blockkv").attr("KVCacheType")(KVCacheTypeName(type));
}

// The C++ PrefixCacheConfig has no Validate (StateManager::Create checks the windows against the
// cache groups); these are the checks that need no cache groups, so that a Python config is
// valid from construction on, as the others are.
Status ValidatePrefixCache(const PrefixCacheConfig& c) {
  for (size_t g = 0; g < c.sliding_windows.size(); ++g) {
    if (c.sliding_windows[g] < 0) {
      return InvalidArgumentError("PrefixCacheConfig.sliding_windows[" + std::to_string(g) +
                                  "] is " + std::to_string(c.sliding_windows[g]) +
                                  "; a window is >= 0 tokens (0: full attention)");
    }
  }
  if (c.state_checkpoint_tokens < 0) {
    return InvalidArgumentError("PrefixCacheConfig.state_checkpoint_tokens is " +
                                std::to_string(c.state_checkpoint_tokens) +
                                "; it is >= 0 tokens (0: the default)");
  }
  return Status::Ok();
}

template <class Config>
Status Validate(const Config& config) {
  if constexpr (std::is_same_v<Config, PrefixCacheConfig>) {
    return ValidatePrefixCache(config);
  } else {
    return config.Validate();
  }
}

// Applies `change` to a copy of `config`, validates it, and only then stores it.
template <class Config, class Change>
void SetValidated(Config& config, Change&& change) {
  Config copy = config;
  change(copy);
  ThrowIfError(Validate(copy));
  config = copy;
}

// A property of an int32 field, validated on assignment (range-checked as common.h says).
template <class Config>
auto Int32Setter(int32_t Config::*field, const char* name) {
  return [field, name](Config& c, py::handle v) {
    const auto value = ToInt<int32_t>(v, name);
    SetValidated(c, [&](Config& copy) { copy.*field = value; });
  };
}

// A property of an int64 field, validated on assignment.
template <class Config>
auto Int64Setter(int64_t Config::*field, const char* name) {
  return [field, name](Config& c, py::handle v) {
    const auto value = ToInt<int64_t>(v, name);
    SetValidated(c, [&](Config& copy) { copy.*field = value; });
  };
}

std::string Repr(const KVCacheConfig& c) {
  return "KVCacheConfig(block_size=" + std::to_string(c.block_size) + ", cache_shape=(" +
         std::to_string(c.cache_shape[0]) + ", " + std::to_string(c.cache_shape[1]) + ", " +
         std::to_string(c.cache_shape[2]) + "), cache_dtype='" +
         std::string(DTypeName(c.cache_dtype)) +
         "', num_allocation_groups=" + std::to_string(c.num_allocation_groups) +
         ", max_blocks_per_allocation_group=" + std::to_string(c.max_blocks_per_allocation_group) +
         (c.type == KVCacheType::kDense ? std::string()
                                        : ", type='" + std::string(KVCacheTypeName(c.type)) + "'") +
         (c.type == KVCacheType::kMla ? ", latent_dim=" + std::to_string(c.latent_dim) +
                                            ", rope_dim=" + std::to_string(c.rope_dim)
                                      : std::string()) +
         (c.state_bytes != 0 ? ", state_bytes=" + std::to_string(c.state_bytes) : std::string()) +
         (c.local_window != 0 ? ", local_window=" + std::to_string(c.local_window)
                              : std::string()) +
         ")";
}

std::string Repr(const MemoryConfig& c) {
  return std::string("MemoryConfig(mode='") + AllocationModeName(c.mode) +
         "', size=" + std::to_string(c.size) + (c.shared_pool ? ", shared_pool=True" : "") +
         (c.state_slots != 0 ? ", state_slots=" + std::to_string(c.state_slots) : "") + ")";
}

std::string Repr(const PrefixCacheConfig& c) {
  std::string windows = "[";
  for (size_t g = 0; g < c.sliding_windows.size(); ++g) {
    windows += (g > 0 ? ", " : "") + std::to_string(c.sliding_windows[g]);
  }
  return std::string("PrefixCacheConfig(enabled=") + (c.enabled ? "True" : "False") +
         ", hash_seed=" + std::to_string(c.hash_seed) +
         ", max_events=" + std::to_string(c.max_events) + ", sliding_windows=" + windows + "]" +
         (c.state_checkpoint_tokens != 0
              ? ", state_checkpoint_tokens=" + std::to_string(c.state_checkpoint_tokens)
              : "") +
         ")";
}

// The C++ default (off, default settings) is what prefix_cache=None stands for.
bool IsDefault(const PrefixCacheConfig& c) {
  const PrefixCacheConfig d;
  return c.enabled == d.enabled && c.hash_seed == d.hash_seed && c.max_events == d.max_events &&
         c.sliding_windows == d.sliding_windows && c.hash_function == d.hash_function &&
         c.state_checkpoint_tokens == d.state_checkpoint_tokens;
}

bool operator==(const PrefixCacheConfig& a, const PrefixCacheConfig& b) {
  return a.enabled == b.enabled && a.hash_seed == b.hash_seed && a.max_events == b.max_events &&
         a.sliding_windows == b.sliding_windows && a.hash_function == b.hash_function &&
         a.state_checkpoint_tokens == b.state_checkpoint_tokens;
}

std::string Repr(const OffloadConfig& c) {
  std::string out = "OffloadConfig(host_blocks=" + std::to_string(c.host_blocks) +
                    ", host_bytes=" + std::to_string(c.host_bytes);
  if (!c.disk_path.empty()) {
    out += ", disk_path=" + std::string(py::repr(py::str(c.disk_path))) +
           ", disk_blocks=" + std::to_string(c.disk_blocks) +
           ", disk_bytes=" + std::to_string(c.disk_bytes);
  }
  return out + ")";
}

// The C++ default (no tiers) is what offload_config=None stands for.
bool IsDefault(const OffloadConfig& c) {
  return c.host_bytes == 0 && c.host_blocks == 0 && c.disk_path.empty() && c.disk_bytes == 0 &&
         c.disk_blocks == 0;
}

bool operator==(const OffloadConfig& a, const OffloadConfig& b) {
  return a.host_bytes == b.host_bytes && a.host_blocks == b.host_blocks &&
         a.disk_path == b.disk_path && a.disk_bytes == b.disk_bytes &&
         a.disk_blocks == b.disk_blocks;
}

std::string Repr(const RemoteTierConfig& c) {
  // The URL may hold a password: show only where it points.
  const size_t at = c.url.rfind('@');
  const size_t scheme = c.url.find("://");
  const std::string url = at == std::string::npos ? c.url
                                                  : (scheme == std::string::npos || scheme > at
                                                         ? std::string("redis://")
                                                         : c.url.substr(0, scheme + 3)) +
                                                        "***@" + c.url.substr(at + 1);
  return "RemoteTierConfig(" + std::string(py::repr(py::str(url))) +
         ", model_id=" + std::string(py::repr(py::str(c.model_id))) +
         ", timeout_ms=" + std::to_string(c.timeout_ms) +
         ", max_pending=" + std::to_string(c.max_pending) +
         ", tp_rank=" + std::to_string(c.tp_rank) + ", tp_size=" + std::to_string(c.tp_size) + ")";
}

Status ValidateRemoteTier(const RemoteTierConfig& c) {
  if (c.url.empty()) return InvalidArgumentError("RemoteTierConfig.url is empty");
  if (c.timeout_ms <= 0) {
    return InvalidArgumentError("RemoteTierConfig.timeout_ms is " + std::to_string(c.timeout_ms) +
                                "; it must be > 0");
  }
  if (c.max_pending < 0) {
    return InvalidArgumentError("RemoteTierConfig.max_pending is " + std::to_string(c.max_pending) +
                                "; it must be >= 0");
  }
  if (c.tp_size < 1 || c.tp_rank < 0 || c.tp_rank >= c.tp_size) {
    return InvalidArgumentError("RemoteTierConfig.tp_rank " + std::to_string(c.tp_rank) +
                                " is outside [0, tp_size=" + std::to_string(c.tp_size) + ")");
  }
  return Status::Ok();
}

py::object RemoteState(const std::optional<RemoteTierConfig>& c) {
  if (!c) return py::none();
  return py::make_tuple(c->url, c->model_id, c->timeout_ms, c->max_pending, c->tp_rank, c->tp_size);
}

std::optional<RemoteTierConfig> RemoteFromState(py::handle state) {
  if (state.is_none()) return std::nullopt;
  const auto t = state.cast<py::tuple>();
  return RemoteTierConfig{.url = t[0].cast<std::string>(),
                          .model_id = t[1].cast<std::string>(),
                          .timeout_ms = t[2].cast<int32_t>(),
                          .max_pending = t[3].cast<int32_t>(),
                          .tp_rank = t[4].cast<int32_t>(),
                          .tp_size = t[5].cast<int32_t>()};
}

// StateManagerConfig.remote_tier: None (no tier) or a RemoteTierConfig.
std::optional<RemoteTierConfig> ToRemoteTier(py::handle obj) {
  return OptionalConfig<RemoteTierConfig>(obj, "remote_tier", "blockkv.RemoteTierConfig");
}

std::string Repr(const StateManagerConfig& c) {
  return "StateManagerConfig(max_tracked_sequences=" + std::to_string(c.max_tracked_sequences) +
         ", max_ragged_batch_size=" + std::to_string(c.max_ragged_batch_size) +
         ", max_ragged_sequence_count=" + std::to_string(c.max_ragged_sequence_count) +
         ", max_context=" + std::to_string(c.max_context) +
         ", memory_config=" + Repr(c.memory_config) +
         ", offload=" + (c.offload ? "True" : "False") +
         ", offload_config=" + (IsDefault(c.offload_config) ? "None" : Repr(c.offload_config)) +
         ", prefix_cache=" + (IsDefault(c.prefix_cache) ? "None" : Repr(c.prefix_cache)) +
         ", kv_events=" + KVEventsRepr(c.kv_events) +
         ", remote_tier=" + (c.remote_tier ? Repr(*c.remote_tier) : std::string("None")) +
         ", transfer=" + TransferRepr(c.transfer) + ")";
}

// copy.copy / copy.deepcopy give an independent config; pickle round-trips through a tuple of
// fields, validated again on the way in.
template <class Config, class GetState, class SetState>
void AddValueMethods(py::class_<Config>& cls, GetState get_state, SetState set_state) {
  cls.def("__copy__", [](const Config& c) { return c; })
      .def(
          "__deepcopy__", [](const Config& c, const py::dict&) { return c; }, py::arg("memo"))
      .def(py::pickle(get_state, [set_state](const py::tuple& state) {
        Config c = set_state(state);
        ThrowIfError(Validate(c));
        return c;
      }));
}

py::tuple MemoryState(const MemoryConfig& c) {
  return py::make_tuple(static_cast<int>(c.mode), c.size, c.shared_pool, c.state_slots);
}

MemoryConfig MemoryFromState(const py::tuple& state) {
  MemoryConfig c;
  c.mode = static_cast<AllocationMode>(state[0].cast<int>());
  c.size = state[1].cast<int64_t>();
  if (state.size() >= 3) c.shared_pool = state[2].cast<bool>();  // older pickles: separate pools
  if (state.size() >= 4) c.state_slots = state[3].cast<int32_t>();
  return c;
}

// hash_seed: any int in [0, 2**64), as XXH3 takes it.
uint64_t ToSeed(py::handle obj) {
  if (PyBool_Check(obj.ptr()) || !PyLong_Check(obj.ptr())) {
    Throw(PyExc_TypeError, "hash_seed must be an int, got " +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  const unsigned long long seed = PyLong_AsUnsignedLongLong(obj.ptr());
  if (PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    Throw(PyExc_ValueError, "hash_seed " + std::string(py::repr(obj)) + " is outside [0, 2**64)");
  }
  return seed;
}

size_t ToMaxEvents(int64_t value) {
  if (value < 0) {
    Throw(PyExc_ValueError, "max_events " + std::to_string(value) + " is negative (0: no events)");
  }
  return static_cast<size_t>(value);
}

py::tuple PrefixState(const PrefixCacheConfig& c) {
  return py::make_tuple(c.enabled, c.hash_seed, static_cast<uint64_t>(c.max_events),
                        c.sliding_windows, c.state_checkpoint_tokens);
}

PrefixCacheConfig PrefixFromState(const py::tuple& state) {
  PrefixCacheConfig c;
  c.enabled = state[0].cast<bool>();
  c.hash_seed = state[1].cast<uint64_t>();
  c.max_events = state[2].cast<uint64_t>();
  c.sliding_windows = state[3].cast<std::vector<int64_t>>();
  if (state.size() > 4) c.state_checkpoint_tokens = state[4].cast<int64_t>();  // since issue 21
  return c;
}

void BindPrefixCacheConfig(py::module_& m) {
  using P = PrefixCacheConfig;
  py::class_<P> cls(m, "PrefixCacheConfig",
                    "Prefix caching of a StateManager (StateManagerConfig(prefix_cache=...)); "
                    "see docs/prefix_cache.md.");
  cls.def(py::init([](bool enabled, py::handle hash_seed, Int<int64_t, "max_events"> max_events,
                      py::handle sliding_windows,
                      Int<int64_t, "state_checkpoint_tokens"> state_checkpoint_tokens) {
            P c;
            c.enabled = enabled;
            c.hash_seed = ToSeed(hash_seed);
            c.max_events = ToMaxEvents(max_events);
            c.sliding_windows = ToInt64Vector(sliding_windows, "sliding_windows");
            c.state_checkpoint_tokens = state_checkpoint_tokens;
            ThrowIfError(ValidatePrefixCache(c));
            return c;
          }),
          py::kw_only(), py::arg("enabled") = true, py::arg("hash_seed") = 0,
          py::arg("max_events") = int64_t{65536}, py::arg("sliding_windows") = py::list(),
          py::arg("state_checkpoint_tokens") = int64_t{0})
      .def_property(
          "enabled", [](const P& c) { return c.enabled; }, [](P& c, bool v) { c.enabled = v; },
          "True by default: passing a PrefixCacheConfig turns prefix caching on")
      .def_property(
          "hash_seed", [](const P& c) { return c.hash_seed; },
          [](P& c, py::handle v) { c.hash_seed = ToSeed(v); },
          "Seed of the block keys: the same on every rank and in every run gives the same keys")
      .def_property(
          "max_events", [](const P& c) { return static_cast<uint64_t>(c.max_events); },
          [](P& c, py::handle v) { c.max_events = ToMaxEvents(ToInt<int64_t>(v, "max_events")); },
          "Events kept until drain_cache_events (the oldest are dropped past it); 0: no events")
      .def_property(
          "sliding_windows", [](const P& c) { return c.sliding_windows; },
          [](P& c, py::handle v) {
            std::vector<int64_t> windows = ToInt64Vector(v, "sliding_windows");
            SetValidated(c, [&](P& copy) { copy.sliding_windows = std::move(windows); });
          },
          "Attention window in tokens per cache group (0, or a group past the end: full "
          "attention); a hit in a windowed group needs only its in-window blocks")
      .def_property(
          "state_checkpoint_tokens", [](const P& c) { return c.state_checkpoint_tokens; },
          [](P& c, py::handle v) {
            const auto every = ToInt<int64_t>(v, "state_checkpoint_tokens");
            SetValidated(c, [&](P& copy) { copy.state_checkpoint_tokens = every; });
          },
          "A STATE group's checkpoint interval: its state is saved when a forward ends at a "
          "multiple of it, and a hit resumes from one (0: whole blocks of every group, 512 tokens "
          "or max_context if less); see docs/prefix_cache.md")
      .def("__eq__", [](const P& a, const P& b) { return a == b; })
      .def("__repr__", py::overload_cast<const P&>(&Repr));
  AddValueMethods(cls, &PrefixState, &PrefixFromState);
}

py::tuple OffloadState(const OffloadConfig& c) {
  return py::make_tuple(c.host_blocks, c.host_bytes, c.disk_path, c.disk_blocks, c.disk_bytes);
}

OffloadConfig OffloadFromState(const py::tuple& state) {
  OffloadConfig c;
  c.host_blocks = state[0].cast<int32_t>();
  c.host_bytes = state[1].cast<int64_t>();
  c.disk_path = state[2].cast<std::string>();
  c.disk_blocks = state[3].cast<int32_t>();
  c.disk_bytes = state[4].cast<int64_t>();
  return c;
}

// disk_path: str, bytes or os.PathLike; None is no disk tier.
std::string ToDiskPath(py::handle obj) {
  if (obj.is_none()) return {};
  return py::module_::import("os").attr("fsdecode")(obj).cast<std::string>();
}

void BindOffloadConfig(py::module_& m) {
  using O = OffloadConfig;
  py::class_<O> cls(m, "OffloadConfig",
                    "The host (and optionally disk) tier of a StateManager's offload store "
                    "(StateManagerConfig(offload=True, offload_config=...)); see docs/offload.md. "
                    "The host tier needs host_blocks or host_bytes: it is allocated up front "
                    "(pinned on a GPU), so it has no default size.");
  cls.def(
         py::init([](Int<int32_t, "host_blocks"> host_blocks, Int<int64_t, "host_bytes"> host_bytes,
                     py::handle disk_path, Int<int32_t, "disk_blocks"> disk_blocks,
                     Int<int64_t, "disk_bytes"> disk_bytes) {
           O c;
           c.host_blocks = host_blocks;
           c.host_bytes = host_bytes;
           c.disk_path = ToDiskPath(disk_path);
           c.disk_blocks = disk_blocks;
           c.disk_bytes = disk_bytes;
           ThrowIfError(c.Validate());
           return c;
         }),
         py::kw_only(), py::arg("host_blocks") = 0, py::arg("host_bytes") = 0,
         py::arg("disk_path") = py::none(), py::arg("disk_blocks") = 0, py::arg("disk_bytes") = 0)
      .def_property(
          "host_blocks", [](const O& c) { return c.host_blocks; },
          Int32Setter(&O::host_blocks, "host_blocks"),
          "Host tier slots per cache group; 0: as many as host_bytes holds")
      .def_property(
          "host_bytes", [](const O& c) { return c.host_bytes; },
          Int64Setter(&O::host_bytes, "host_bytes"),
          "Host tier bytes, a block of every cache group counted together (used when "
          "host_blocks is 0)")
      .def_property(
          "disk_path",
          [](const O& c) -> py::object {
            if (c.disk_path.empty()) return py::none();
            return py::str(c.disk_path);
          },
          [](O& c, py::handle v) {
            std::string path = ToDiskPath(v);
            SetValidated(c, [&](O& copy) { copy.disk_path = std::move(path); });
          },
          "The disk tier's file (created and truncated; removed when the store goes), or None")
      .def_property(
          "disk_blocks", [](const O& c) { return c.disk_blocks; },
          Int32Setter(&O::disk_blocks, "disk_blocks"),
          "Disk tier slots per cache group; 0: as many as disk_bytes holds")
      .def_property(
          "disk_bytes", [](const O& c) { return c.disk_bytes; },
          Int64Setter(&O::disk_bytes, "disk_bytes"))
      .def("__eq__", [](const O& a, const O& b) { return a == b; })
      .def("__repr__", py::overload_cast<const O&>(&Repr));
  AddValueMethods(cls, &OffloadState, &OffloadFromState);
}

// StateManagerConfig.offload_config: None (no tiers) or an OffloadConfig.
OffloadConfig ToOffloadConfig(py::handle obj) {
  if (obj.is_none()) return {};
  if (!py::isinstance<OffloadConfig>(obj)) {
    Throw(PyExc_TypeError, "offload_config must be None or a blockkv.OffloadConfig, got " +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  return obj.cast<OffloadConfig>();
}

// StateManagerConfig.prefix_cache: None (off) or a PrefixCacheConfig.
PrefixCacheConfig ToPrefixCache(py::handle obj) {
  if (obj.is_none()) return {};
  if (!py::isinstance<PrefixCacheConfig>(obj)) {
    Throw(PyExc_TypeError, "prefix_cache must be None or a blockkv.PrefixCacheConfig, got " +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  return obj.cast<PrefixCacheConfig>();
}

void BindKVCacheConfig(py::module_& m) {
  py::class_<KVCacheConfig> cls(m, "KVCacheConfig", "One cache group (DeepSpeed's KVCacheConfig).");
  cls.def(
         py::init(
             [](py::handle cache_shape, Int<int32_t, "block_size"> block_size,
                py::handle cache_dtype, Int<int32_t, "num_allocation_groups"> num_allocation_groups,
                Int<int32_t, "max_blocks_per_allocation_group"> max_blocks_per_allocation_group,
                py::handle type, Int<int64_t, "latent_dim"> latent_dim,
                Int<int64_t, "rope_dim"> rope_dim, Int<int64_t, "state_bytes"> state_bytes,
                Int<int64_t, "local_window"> local_window) {
               KVCacheConfig c;
               c.type = ToCacheType(type);
               c.local_window = local_window;
               c.latent_dim = latent_dim;
               c.rope_dim = rope_dim;
               c.state_bytes = state_bytes;
               c.cache_shape = ToCacheShape(cache_shape);
               c.block_size = block_size;
               c.cache_dtype = ToDType(cache_dtype);
               c.num_allocation_groups = num_allocation_groups;
               c.max_blocks_per_allocation_group = max_blocks_per_allocation_group;
               ThrowIfError(c.Validate());
               return c;
             }),
         py::kw_only(), py::arg("cache_shape"), py::arg("block_size") = 128,
         py::arg("cache_dtype") = "fp16", py::arg("num_allocation_groups") = 1,
         py::arg("max_blocks_per_allocation_group") = 64, py::arg("type") = py::none(),
         py::arg("latent_dim") = 0, py::arg("rope_dim") = 0, py::arg("state_bytes") = 0,
         py::arg("local_window") = 0,
         R"(One cache group. type: KVCacheType.DENSE (K and V per KV head), or MLA: one latent row
per token and layer, cache_shape = (num_layers, 1, latent_dim + rope_dim), e.g. DeepSeek-V3's
KVCacheConfig(type=KVCacheType.MLA, cache_shape=(61, 1, 576), latent_dim=512, rope_dim=64,
cache_dtype="bf16"). LOCAL: sliding-window layers, KVCacheConfig(type=KVCacheType.LOCAL,
cache_shape=..., local_window=4096); a StateManager releases the blocks that leave the window.
STATE raises NotImplementedError (issue 21).)")
      .def_property(
          "block_size", [](const KVCacheConfig& c) { return c.block_size; },
          Int32Setter(&KVCacheConfig::block_size, "block_size"))
      .def_property(
          "cache_shape",
          [](const KVCacheConfig& c) {
            return py::make_tuple(c.cache_shape[0], c.cache_shape[1], c.cache_shape[2]);
          },
          [](KVCacheConfig& c, py::handle v) {
            const std::array<int64_t, 3> shape = ToCacheShape(v);
            SetValidated(c, [&](KVCacheConfig& copy) { copy.cache_shape = shape; });
          })
      .def_property(
          "cache_dtype", [](const KVCacheConfig& c) { return DTypeToPython(c.cache_dtype); },
          [](KVCacheConfig& c, py::handle v) {
            const DType dtype = ToDType(v);
            SetValidated(c, [&](KVCacheConfig& copy) { copy.cache_dtype = dtype; });
          },
          "torch's dtype when torch is importable (as DeepSpeed returns), else blockkv's name")
      .def_property_readonly(
          "dtype_name",
          [](const KVCacheConfig& c) { return std::string(DTypeName(c.cache_dtype)); },
          R"(blockkv's name of cache_dtype: "fp16", "bf16", "fp32", "fp8_e4m3", "int8")")
      .def_property(
          "num_allocation_groups", [](const KVCacheConfig& c) { return c.num_allocation_groups; },
          Int32Setter(&KVCacheConfig::num_allocation_groups, "num_allocation_groups"))
      .def_property(
          "max_blocks_per_allocation_group",
          [](const KVCacheConfig& c) { return c.max_blocks_per_allocation_group; },
          Int32Setter(&KVCacheConfig::max_blocks_per_allocation_group,
                      "max_blocks_per_allocation_group"))
      .def_property(
          "type", [](const KVCacheConfig& c) { return CacheTypeToPython(c.type); },
          [](KVCacheConfig& c, py::handle v) {
            const KVCacheType type = ToCacheType(v);
            SetValidated(c, [&](KVCacheConfig& copy) { copy.type = type; });
          },
          "The group's kind: a blockkv.KVCacheType (DeepSpeed's field)")
      .def_property(
          "latent_dim", [](const KVCacheConfig& c) { return c.latent_dim; },
          Int64Setter(&KVCacheConfig::latent_dim, "latent_dim"),
          "MLA: the latent c_kv's width (DeepSeek-V3: 512); 0 otherwise")
      .def_property(
          "rope_dim", [](const KVCacheConfig& c) { return c.rope_dim; },
          Int64Setter(&KVCacheConfig::rope_dim, "rope_dim"),
          "MLA: the rotary key k_pe's width (DeepSeek-V3: 64); 0 otherwise")
      .def_property(
          "state_bytes", [](const KVCacheConfig& c) { return c.state_bytes; },
          Int64Setter(&KVCacheConfig::state_bytes, "state_bytes"),
          "STATE (not supported yet): bytes per sequence; 0 otherwise")
      .def_property(
          "local_window", [](const KVCacheConfig& c) { return c.local_window; },
          Int64Setter(&KVCacheConfig::local_window, "local_window"),
          "LOCAL: the attention window in tokens (Gemma-2: 4096); 0 otherwise")
      .def_property_readonly(
          "bytes_per_block",
          [](const KVCacheConfig& c) { return ValueOrThrow(c.bytes_per_block()); },
          "Bytes one block takes across all layers of the group")
      .def("__eq__",
           [](const KVCacheConfig& a, const KVCacheConfig& b) {
             return a.block_size == b.block_size && a.cache_shape == b.cache_shape &&
                    a.cache_dtype == b.cache_dtype &&
                    a.num_allocation_groups == b.num_allocation_groups &&
                    a.max_blocks_per_allocation_group == b.max_blocks_per_allocation_group &&
                    a.type == b.type && a.latent_dim == b.latent_dim && a.rope_dim == b.rope_dim &&
                    a.state_bytes == b.state_bytes && a.local_window == b.local_window;
           })
      .def("__repr__", py::overload_cast<const KVCacheConfig&>(&Repr));
  AddValueMethods(
      cls,
      [](const KVCacheConfig& c) {
        return py::make_tuple(c.block_size, c.cache_shape[0], c.cache_shape[1], c.cache_shape[2],
                              std::string(DTypeName(c.cache_dtype)), c.num_allocation_groups,
                              c.max_blocks_per_allocation_group,
                              std::string(KVCacheTypeName(c.type)), c.latent_dim, c.rope_dim,
                              c.state_bytes, c.local_window);
      },
      [](const py::tuple& state) {
        KVCacheConfig c;
        c.block_size = state[0].cast<int32_t>();
        c.cache_shape = {state[1].cast<int64_t>(), state[2].cast<int64_t>(),
                         state[3].cast<int64_t>()};
        c.cache_dtype = ToDType(state[4]);
        c.num_allocation_groups = state[5].cast<int32_t>();
        c.max_blocks_per_allocation_group = state[6].cast<int32_t>();
        if (state.size() >= 11) {
          c.type = ToCacheType(state[7]);
          c.latent_dim = state[8].cast<int64_t>();
          c.rope_dim = state[9].cast<int64_t>();
          c.state_bytes = state[10].cast<int64_t>();
        }
        if (state.size() >= 12) c.local_window = state[11].cast<int64_t>();
        return c;
      });
}

void BindMemoryConfig(py::module_& m) {
  py::enum_<AllocationMode>(m, "AllocationMode", "How MemoryConfig.size is read.")
      .value("RESERVE", AllocationMode::kReserve, "size is the bytes to leave free")
      .value("ALLOCATE", AllocationMode::kAllocate, "size is the number of blocks");

  py::class_<MemoryConfig> cls(m, "MemoryConfig",
                               "How big the cache is (DeepSpeed's MemoryConfig).");
  cls.def(py::init([](py::handle mode, Int<int64_t, "size"> size, bool shared_pool,
                      Int<int32_t, "state_slots"> state_slots) {
            MemoryConfig c;
            c.mode = ToMode(mode);
            c.size = size;
            c.shared_pool = shared_pool;
            c.state_slots = state_slots;
            ThrowIfError(c.Validate());
            return c;
          }),
          py::kw_only(), py::arg("mode") = AllocationMode::kReserve,
          py::arg("size") = int64_t{1'000'000'000}, py::arg("shared_pool") = false,
          py::arg("state_slots") = int32_t{0})
      .def_property(
          "mode", [](const MemoryConfig& c) { return c.mode; },
          [](MemoryConfig& c, py::handle v) {
            const AllocationMode mode = ToMode(v);
            SetValidated(c, [&](MemoryConfig& copy) { copy.mode = mode; });
          })
      .def_property(
          "size", [](const MemoryConfig& c) { return c.size; },
          Int64Setter(&MemoryConfig::size, "size"))
      .def_property(
          "shared_pool", [](const MemoryConfig& c) { return c.shared_pool; },
          [](MemoryConfig& c, bool v) { c.shared_pool = v; },
          "Every cache group draws from one pool of blocks (vLLM's hybrid allocator); the groups "
          "need equal layer counts and bytes per block and layer. False: a pool per group, as "
          "DeepSpeed.")
      .def_property(
          "state_slots", [](const MemoryConfig& c) { return c.state_slots; },
          [](MemoryConfig& c, py::handle v) {
            const auto slots = static_cast<int32_t>(v.cast<int64_t>());
            SetValidated(c, [&](MemoryConfig& copy) { copy.state_slots = slots; });
          },
          "Slots of every STATE cache group (one per sequence holding a state); 0: none (a "
          "StateManager gives max_tracked_sequences).")
      .def("__eq__",
           [](const MemoryConfig& a, const MemoryConfig& b) {
             return a.mode == b.mode && a.size == b.size && a.shared_pool == b.shared_pool &&
                    a.state_slots == b.state_slots;
           })
      .def("__repr__", py::overload_cast<const MemoryConfig&>(&Repr));
  AddValueMethods(cls, &MemoryState, &MemoryFromState);
}
void BindRemoteTierConfig(py::module_& m) {
  using R = RemoteTierConfig;
  py::class_<R> cls(m, "RemoteTierConfig",
                    "A prefix-cache tier in Redis shared by every engine "
                    "(StateManagerConfig(remote_tier=...), prefix caching on); see "
                    "docs/remote_tier.md.");
  cls.def(py::init([](std::string url, std::string model_id, Int<int32_t, "timeout_ms"> timeout_ms,
                      Int<int32_t, "max_pending"> max_pending, Int<int32_t, "tp_rank"> tp_rank,
                      Int<int32_t, "tp_size"> tp_size) {
            R c{.url = std::move(url),
                .model_id = std::move(model_id),
                .timeout_ms = timeout_ms,
                .max_pending = max_pending,
                .tp_rank = tp_rank,
                .tp_size = tp_size};
            ThrowIfError(ValidateRemoteTier(c));
            return c;
          }),
          py::arg("url"), py::kw_only(), py::arg("model_id") = "", py::arg("timeout_ms") = 1000,
          py::arg("max_pending") = 1024, py::arg("tp_rank") = 0, py::arg("tp_size") = 1)
      .def_readonly("url", &R::url,
                    "redis://[user:password@]host:port[/db], or "
                    "redis+cluster://[user:password@]host:port[,host:port...] for a Redis Cluster, "
                    "redis+sentinel://[user:password@]host:port[,host:port...]/master_name[/db] "
                    "for the master sentinels watch, or "
                    "unix://[user:password@]/path/to/redis.sock[?db=N]")
      .def_readonly("model_id", &R::model_id, "The model's identity: part of every key")
      .def_readonly("timeout_ms", &R::timeout_ms, "Connect and command timeout")
      .def_readonly("max_pending", &R::max_pending, "Stores queued at most (more are dropped)")
      .def_readonly("tp_rank", &R::tp_rank, "This engine's tensor-parallel rank: part of keys")
      .def_readonly("tp_size", &R::tp_size, "The tensor-parallel world size: part of keys")
      .def("__eq__", [](const R& a, const R& b) { return a == b; })
      .def("__repr__", py::overload_cast<const R&>(&Repr))
      .def("__copy__", [](const R& c) { return c; })
      .def(
          "__deepcopy__", [](const R& c, const py::dict&) { return c; }, py::arg("memo"))
      .def(py::pickle([](const R& c) { return RemoteState(c).cast<py::tuple>(); },
                      [](const py::tuple& state) { return *RemoteFromState(state); }));
}

void BindStateManagerConfig(py::module_& m) {
  using C = StateManagerConfig;
  py::class_<C> cls(m, "StateManagerConfig",
                    "Limits of a StateManager and its batches (DeepSpeed's DSStateManagerConfig).");
  cls.def(py::init([](Int<int32_t, "max_tracked_sequences"> max_tracked_sequences,
                      Int<int32_t, "max_ragged_batch_size"> max_ragged_batch_size,
                      Int<int32_t, "max_ragged_sequence_count"> max_ragged_sequence_count,
                      Int<int64_t, "max_context"> max_context, const py::object& memory_config,
                      bool offload, const py::object& offload_config,
                      const py::object& prefix_cache, const py::object& kv_events,
                      const py::object& remote_tier, const py::object& transfer) {
            C c;
            c.max_tracked_sequences = max_tracked_sequences;
            c.max_ragged_batch_size = max_ragged_batch_size;
            c.max_ragged_sequence_count = max_ragged_sequence_count;
            c.max_context = max_context;
            if (!memory_config.is_none()) c.memory_config = memory_config.cast<MemoryConfig>();
            c.offload = offload;
            c.offload_config = ToOffloadConfig(offload_config);
            c.prefix_cache = ToPrefixCache(prefix_cache);
            c.kv_events = ToKVEventsConfig(kv_events);
            c.remote_tier = ToRemoteTier(remote_tier);
            c.transfer = ToTransferConfig(transfer);
            ThrowIfError(c.Validate());
            return c;
          }),
          py::kw_only(), py::arg("max_tracked_sequences") = 2048,
          py::arg("max_ragged_batch_size") = 768, py::arg("max_ragged_sequence_count") = 512,
          py::arg("max_context") = 8192, py::arg("memory_config") = py::none(),
          py::arg("offload") = false, py::arg("offload_config") = py::none(),
          py::arg("prefix_cache") = py::none(), py::arg("kv_events") = py::none(),
          py::arg("remote_tier") = py::none(), py::arg("transfer") = py::none())
      .def_property(
          "max_tracked_sequences", [](const C& c) { return c.max_tracked_sequences; },
          Int32Setter(&C::max_tracked_sequences, "max_tracked_sequences"))
      .def_property(
          "max_ragged_batch_size", [](const C& c) { return c.max_ragged_batch_size; },
          Int32Setter(&C::max_ragged_batch_size, "max_ragged_batch_size"))
      .def_property(
          "max_ragged_sequence_count", [](const C& c) { return c.max_ragged_sequence_count; },
          Int32Setter(&C::max_ragged_sequence_count, "max_ragged_sequence_count"))
      .def_property(
          "max_context", [](const C& c) { return c.max_context; },
          Int64Setter(&C::max_context, "max_context"))
      .def_property("memory_config",
                    py::cpp_function([](C& c) -> MemoryConfig& { return c.memory_config; },
                                     py::return_value_policy::reference_internal),
                    py::cpp_function([](C& c, const MemoryConfig& v) {
                      SetValidated(c, [&](C& copy) { copy.memory_config = v; });
                    }))
      .def_property(
          "offload", [](const C& c) { return c.offload; },
          [](C& c, bool v) { SetValidated(c, [&](C& copy) { copy.offload = v; }); },
          "A host (and optionally disk) tier for preempt_sequence / resume_sequence, sized by "
          "offload_config (DeepSpeed's flag, which did nothing there)")
      .def_property(
          "offload_config",
          [](const py::object& self) -> py::object {
            C& c = self.cast<C&>();
            if (IsDefault(c.offload_config)) return py::none();
            return py::cast(&c.offload_config, py::return_value_policy::reference_internal, self);
          },
          [](C& c, py::handle v) {
            const OffloadConfig offload = ToOffloadConfig(v);
            SetValidated(c, [&](C& copy) { copy.offload_config = offload; });
          },
          "None (no tiers, the default) or the OffloadConfig, a view of this config's own (as "
          "memory_config is); StateManager needs one when offload is True")
      .def_property(
          "prefix_cache",
          [](const py::object& self) -> py::object {
            C& c = self.cast<C&>();
            if (IsDefault(c.prefix_cache)) return py::none();
            return py::cast(&c.prefix_cache, py::return_value_policy::reference_internal, self);
          },
          [](C& c, py::handle v) {
            const PrefixCacheConfig prefix = ToPrefixCache(v);
            SetValidated(c, [&](C& copy) { copy.prefix_cache = prefix; });
          },
          "None (prefix caching off, the default) or the PrefixCacheConfig, a view of this "
          "config's own (as memory_config is)")
      .def_property(
          "kv_events",
          [](const C& c) -> py::object {
            if (!c.kv_events) return py::none();
            return py::cast(*c.kv_events);
          },
          [](C& c, py::handle v) {
            const std::optional<KVEventsConfig> events = ToKVEventsConfig(v);
            SetValidated(c, [&](C& copy) { copy.kv_events = events; });
          },
          "None (no KV events on the wire, the default) or a KVEventsConfig: publish the prefix "
          "cache's events over ZeroMQ in vLLM's format (docs/kv_events.md)")
      .def_property(
          "remote_tier",
          [](const C& c) -> py::object {
            return c.remote_tier ? py::cast(*c.remote_tier) : py::none();
          },
          [](C& c, py::handle v) {
            std::optional<RemoteTierConfig> remote = ToRemoteTier(v);
            SetValidated(c, [&](C& copy) { copy.remote_tier = std::move(remote); });
          },
          "None (no remote tier, the default) or a RemoteTierConfig (a copy: assign a new one "
          "to change it); needs prefix_cache")
      .def_property(
          "transfer",
          [](const C& c) -> py::object { return c.transfer ? py::cast(*c.transfer) : py::none(); },
          [](C& c, py::handle v) {
            std::optional<TransferConfig> transfer = ToTransferConfig(v);
            SetValidated(c, [&](C& copy) { copy.transfer = std::move(transfer); });
          },
          "None (no sequence transfer, the default) or a TransferConfig (a copy): where this "
          "engine moves sequences to and from others over UCX (docs/transfer.md)")
      .def("__eq__",
           [](const C& a, const C& b) {
             return a.max_tracked_sequences == b.max_tracked_sequences &&
                    a.max_ragged_batch_size == b.max_ragged_batch_size &&
                    a.max_ragged_sequence_count == b.max_ragged_sequence_count &&
                    a.max_context == b.max_context &&
                    a.memory_config.mode == b.memory_config.mode &&
                    a.memory_config.size == b.memory_config.size && a.offload == b.offload &&
                    a.offload_config == b.offload_config && a.prefix_cache == b.prefix_cache &&
                    a.kv_events == b.kv_events && a.remote_tier == b.remote_tier &&
                    a.transfer == b.transfer;
           })
      .def("__repr__", py::overload_cast<const C&>(&Repr));
  AddValueMethods(
      cls,
      [](const C& c) {
        return py::make_tuple(
            c.max_tracked_sequences, c.max_ragged_batch_size, c.max_ragged_sequence_count,
            c.max_context, MemoryState(c.memory_config), c.offload, PrefixState(c.prefix_cache),
            OffloadState(c.offload_config),
            c.kv_events ? py::object(KVEventsState(*c.kv_events)) : py::object(py::none()),
            RemoteState(c.remote_tier), TransferState(c.transfer));
      },
      [](const py::tuple& state) {
        C c;
        c.max_tracked_sequences = state[0].cast<int32_t>();
        c.max_ragged_batch_size = state[1].cast<int32_t>();
        c.max_ragged_sequence_count = state[2].cast<int32_t>();
        c.max_context = state[3].cast<int64_t>();
        c.memory_config = MemoryFromState(state[4].cast<py::tuple>());
        c.offload = state[5].cast<bool>();
        // Pickles made before prefix caching was bound have six fields.
        if (state.size() > 6) c.prefix_cache = PrefixFromState(state[6].cast<py::tuple>());
        // ... and seven before offload_config was.
        if (state.size() > 7) c.offload_config = OffloadFromState(state[7].cast<py::tuple>());
        // ... and eight before kv_events was.
        if (state.size() > 8 && !state[8].is_none()) {
          c.kv_events = KVEventsFromState(state[8].cast<py::tuple>());
        }
        // ... and nine before remote_tier was.
        if (state.size() > 9) c.remote_tier = RemoteFromState(state[9]);
        // ... and ten before transfer was.
        if (state.size() > 10) c.transfer = TransferFromState(state[10]);
        return c;
      });
}

}  // namespace

void BindConfig(py::module_& m) {
  BindKVCacheConfig(m);
  BindMemoryConfig(m);
  BindPrefixCacheConfig(m);
  BindOffloadConfig(m);
  BindKVEventsConfig(m);
  BindTransferConfig(m);
  BindImportTicket(m);
  BindRemoteTierConfig(m);
  BindStateManagerConfig(m);
}

}  // namespace blockkv::python
