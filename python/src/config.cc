// KVCacheConfig, MemoryConfig, AllocationMode and StateManagerConfig with DeepSpeed's field names
// and defaults. Like DeepSpeed's pydantic models (validate_assignment), every construction and
// every field assignment is validated: an invalid value raises ValueError and leaves the config as
// it was. Arguments are keyword-only, as a pydantic model's are.
#include <Python.h>
#include <pybind11/stl.h>

#include <array>
#include <cctype>
#include <string>

#include "blockkv/config.h"
#include "blockkv/state_manager.h"
#include "common.h"

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

// KVCacheType ("dense" / "local") is informational in DeepSpeed: no code path reads it.
void CheckCacheType(py::handle type) {
  if (type.is_none()) return;
  py::object value = py::hasattr(type, "value") && !py::isinstance<py::str>(type)
                         ? type.attr("value")
                         : py::reinterpret_borrow<py::object>(type);
  if (py::isinstance<py::str>(value)) {
    const auto name = value.cast<std::string>();
    if (name == "dense" || name == "local") return;
  }
  Throw(PyExc_ValueError, "unknown KV cache type " + std::string(py::repr(type)) +
                              R"(: expected "dense" or "local")");
}

// Applies `change` to a copy of `config`, validates it, and only then stores it.
template <class Config, class Change>
void SetValidated(Config& config, Change&& change) {
  Config copy = config;
  change(copy);
  ThrowIfError(copy.Validate());
  config = copy;
}

// A property of an int32 field, validated on assignment.
template <class Config>
auto Int32Setter(int32_t Config::*field, const char* name) {
  return [field, name](Config& c, int64_t v) {
    SetValidated(c, [&](Config& copy) { copy.*field = ToInt32(v, name); });
  };
}

std::string Repr(const KVCacheConfig& c) {
  return "KVCacheConfig(block_size=" + std::to_string(c.block_size) + ", cache_shape=(" +
         std::to_string(c.cache_shape[0]) + ", " + std::to_string(c.cache_shape[1]) + ", " +
         std::to_string(c.cache_shape[2]) + "), cache_dtype='" +
         std::string(DTypeName(c.cache_dtype)) +
         "', num_allocation_groups=" + std::to_string(c.num_allocation_groups) +
         ", max_blocks_per_allocation_group=" + std::to_string(c.max_blocks_per_allocation_group) +
         ")";
}

std::string Repr(const MemoryConfig& c) {
  return std::string("MemoryConfig(mode='") + AllocationModeName(c.mode) +
         "', size=" + std::to_string(c.size) + ")";
}

std::string Repr(const StateManagerConfig& c) {
  return "StateManagerConfig(max_tracked_sequences=" + std::to_string(c.max_tracked_sequences) +
         ", max_ragged_batch_size=" + std::to_string(c.max_ragged_batch_size) +
         ", max_ragged_sequence_count=" + std::to_string(c.max_ragged_sequence_count) +
         ", max_context=" + std::to_string(c.max_context) +
         ", memory_config=" + Repr(c.memory_config) +
         ", offload=" + (c.offload ? "True" : "False") + ")";
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
        ThrowIfError(c.Validate());
        return c;
      }));
}

py::tuple MemoryState(const MemoryConfig& c) {
  return py::make_tuple(static_cast<int>(c.mode), c.size);
}

MemoryConfig MemoryFromState(const py::tuple& state) {
  MemoryConfig c;
  c.mode = static_cast<AllocationMode>(state[0].cast<int>());
  c.size = state[1].cast<int64_t>();
  return c;
}

void BindKVCacheConfig(py::module_& m) {
  py::class_<KVCacheConfig> cls(m, "KVCacheConfig", "One cache group (DeepSpeed's KVCacheConfig).");
  cls.def(py::init([](py::handle cache_shape, int64_t block_size, py::handle cache_dtype,
                      int64_t num_allocation_groups, int64_t max_blocks_per_allocation_group,
                      py::handle type) {
            CheckCacheType(type);
            KVCacheConfig c;
            c.cache_shape = ToCacheShape(cache_shape);
            c.block_size = ToInt32(block_size, "block_size");
            c.cache_dtype = ToDType(cache_dtype);
            c.num_allocation_groups = ToInt32(num_allocation_groups, "num_allocation_groups");
            c.max_blocks_per_allocation_group =
                ToInt32(max_blocks_per_allocation_group, "max_blocks_per_allocation_group");
            ThrowIfError(c.Validate());
            return c;
          }),
          py::kw_only(), py::arg("cache_shape"), py::arg("block_size") = 128,
          py::arg("cache_dtype") = "fp16", py::arg("num_allocation_groups") = 1,
          py::arg("max_blocks_per_allocation_group") = 64, py::arg("type") = py::none())
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
      .def_property_readonly(
          "bytes_per_block",
          [](const KVCacheConfig& c) { return ValueOrThrow(c.bytes_per_block()); },
          "Bytes one block takes across all layers of the group")
      .def("__eq__",
           [](const KVCacheConfig& a, const KVCacheConfig& b) {
             return a.block_size == b.block_size && a.cache_shape == b.cache_shape &&
                    a.cache_dtype == b.cache_dtype &&
                    a.num_allocation_groups == b.num_allocation_groups &&
                    a.max_blocks_per_allocation_group == b.max_blocks_per_allocation_group;
           })
      .def("__repr__", py::overload_cast<const KVCacheConfig&>(&Repr));
  AddValueMethods(
      cls,
      [](const KVCacheConfig& c) {
        return py::make_tuple(c.block_size, c.cache_shape[0], c.cache_shape[1], c.cache_shape[2],
                              std::string(DTypeName(c.cache_dtype)), c.num_allocation_groups,
                              c.max_blocks_per_allocation_group);
      },
      [](const py::tuple& state) {
        KVCacheConfig c;
        c.block_size = state[0].cast<int32_t>();
        c.cache_shape = {state[1].cast<int64_t>(), state[2].cast<int64_t>(),
                         state[3].cast<int64_t>()};
        c.cache_dtype = ToDType(state[4]);
        c.num_allocation_groups = state[5].cast<int32_t>();
        c.max_blocks_per_allocation_group = state[6].cast<int32_t>();
        return c;
      });
}

void BindMemoryConfig(py::module_& m) {
  py::enum_<AllocationMode>(m, "AllocationMode", "How MemoryConfig.size is read.")
      .value("RESERVE", AllocationMode::kReserve, "size is the bytes to leave free")
      .value("ALLOCATE", AllocationMode::kAllocate, "size is the number of blocks");

  py::class_<MemoryConfig> cls(m, "MemoryConfig",
                               "How big the cache is (DeepSpeed's MemoryConfig).");
  cls.def(py::init([](py::handle mode, int64_t size) {
            MemoryConfig c;
            c.mode = ToMode(mode);
            c.size = size;
            ThrowIfError(c.Validate());
            return c;
          }),
          py::kw_only(), py::arg("mode") = AllocationMode::kReserve,
          py::arg("size") = int64_t{1'000'000'000})
      .def_property(
          "mode", [](const MemoryConfig& c) { return c.mode; },
          [](MemoryConfig& c, py::handle v) {
            const AllocationMode mode = ToMode(v);
            SetValidated(c, [&](MemoryConfig& copy) { copy.mode = mode; });
          })
      .def_property(
          "size", [](const MemoryConfig& c) { return c.size; },
          [](MemoryConfig& c, int64_t v) {
            SetValidated(c, [&](MemoryConfig& copy) { copy.size = v; });
          })
      .def("__eq__", [](const MemoryConfig& a,
                        const MemoryConfig& b) { return a.mode == b.mode && a.size == b.size; })
      .def("__repr__", py::overload_cast<const MemoryConfig&>(&Repr));
  AddValueMethods(cls, &MemoryState, &MemoryFromState);
}

void BindStateManagerConfig(py::module_& m) {
  using C = StateManagerConfig;
  py::class_<C> cls(m, "StateManagerConfig",
                    "Limits of a StateManager and its batches (DeepSpeed's DSStateManagerConfig).");
  cls.def(py::init([](int64_t max_tracked_sequences, int64_t max_ragged_batch_size,
                      int64_t max_ragged_sequence_count, int64_t max_context,
                      const py::object& memory_config, bool offload) {
            C c;
            c.max_tracked_sequences = ToInt32(max_tracked_sequences, "max_tracked_sequences");
            c.max_ragged_batch_size = ToInt32(max_ragged_batch_size, "max_ragged_batch_size");
            c.max_ragged_sequence_count =
                ToInt32(max_ragged_sequence_count, "max_ragged_sequence_count");
            c.max_context = max_context;
            if (!memory_config.is_none()) c.memory_config = memory_config.cast<MemoryConfig>();
            c.offload = offload;
            ThrowIfError(c.Validate());
            return c;
          }),
          py::kw_only(), py::arg("max_tracked_sequences") = 2048,
          py::arg("max_ragged_batch_size") = 768, py::arg("max_ragged_sequence_count") = 512,
          py::arg("max_context") = 8192, py::arg("memory_config") = py::none(),
          py::arg("offload") = false)
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
          [](C& c, int64_t v) { SetValidated(c, [&](C& copy) { copy.max_context = v; }); })
      .def_property("memory_config",
                    py::cpp_function([](C& c) -> MemoryConfig& { return c.memory_config; },
                                     py::return_value_policy::reference_internal),
                    py::cpp_function([](C& c, const MemoryConfig& v) {
                      SetValidated(c, [&](C& copy) { copy.memory_config = v; });
                    }))
      .def_property(
          "offload", [](const C& c) { return c.offload; },
          [](C& c, bool v) { SetValidated(c, [&](C& copy) { copy.offload = v; }); })
      .def("__repr__", py::overload_cast<const C&>(&Repr));
  AddValueMethods(
      cls,
      [](const C& c) {
        return py::make_tuple(c.max_tracked_sequences, c.max_ragged_batch_size,
                              c.max_ragged_sequence_count, c.max_context,
                              MemoryState(c.memory_config), c.offload);
      },
      [](const py::tuple& state) {
        C c;
        c.max_tracked_sequences = state[0].cast<int32_t>();
        c.max_ragged_batch_size = state[1].cast<int32_t>();
        c.max_ragged_sequence_count = state[2].cast<int32_t>();
        c.max_context = state[3].cast<int64_t>();
        c.memory_config = MemoryFromState(state[4].cast<py::tuple>());
        c.offload = state[5].cast<bool>();
        return c;
      });
}

}  // namespace

void BindConfig(py::module_& m) {
  BindKVCacheConfig(m);
  BindMemoryConfig(m);
  BindStateManagerConfig(m);
}

}  // namespace blockkv::python
