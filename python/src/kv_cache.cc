// Device, BlockedAllocator, BlockedKVCache and split_kv's helpers: DeepSpeed's BlockedAllocator
// and BlockedKVCache with the same names, argument names and defaults. Block ids come back as
// int32 NumPy arrays and are accepted as an int, a list, a NumPy array or a torch tensor.
#include "blockkv/kv_cache.h"

#include <Python.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/config.h"
#include "common.h"
#include "tensor.h"

namespace blockkv::python {
namespace {

void BindDevice(py::module_& m) {
  py::class_<Device, std::shared_ptr<Device>>(
      m, "Device", "Where a cache's bytes live. Made by CpuDevice() or CudaDevice().")
      .def_property_readonly("kind",
                             [](const Device& d) { return std::string(DeviceKindName(d.kind())); })
      .def_property_readonly("ordinal", &Device::ordinal)
      .def_property_readonly("name", &Device::name)
      .def_property_readonly("total_memory", &Device::total_memory)
      .def_property_readonly("available_memory", &Device::available_memory)
      .def("__repr__", [](const Device& d) { return "<blockkv.Device " + d.name() + ">"; });

  m.def(
      "CpuDevice",
      [](const py::object& budget_bytes) {
        if (budget_bytes.is_none()) return CpuDevice();
        const auto budget = budget_bytes.cast<int64_t>();
        if (budget < 0) Throw(PyExc_ValueError, "budget_bytes must be >= 0");
        return CpuDevice(budget);
      },
      py::arg("budget_bytes") = py::none(),
      "Host memory: the machine's (cgroup-aware) without a budget, else a fixed budget of "
      "budget_bytes (RESERVE mode then plans against the budget).");
  m.def(
      "CudaDevice",
      [](int64_t ordinal) { return ValueOrThrow(CudaDevice(ToInt32(ordinal, "ordinal"))); },
      py::arg("ordinal") = 0,
      "CUDA GPU `ordinal`. RuntimeError when blockkv was built without CUDA or there is no such "
      "GPU.");
}

void BindAllocator(py::module_& m) {
  py::class_<BlockedAllocator>(m, "BlockedAllocator",
                               "A free list of block ids (DeepSpeed's BlockedAllocator).")
      .def(py::init([](int64_t num_blocks) {
             return ValueOrThrow(BlockedAllocator::Create(ToInt32(num_blocks, "num_blocks")));
           }),
           py::arg("num_blocks"))
      .def(
          "allocate",
          [](BlockedAllocator& a, int64_t num_blocks) {
            return ToNumpy(ValueOrThrow(a.Allocate(ToInt32(num_blocks, "num_blocks"))));
          },
          py::arg("num_blocks"),
          "`num_blocks` ids as an int32 NumPy array; ValueError (nothing taken) when fewer are "
          "free.")
      .def(
          "free",
          [](BlockedAllocator& a, py::handle blocks) { ThrowIfError(a.Free(ToBlockIds(blocks))); },
          py::arg("blocks"),
          "Returns an int, a list, a NumPy array or a torch tensor of ids; all or nothing: an "
          "invalid, free or repeated id is a ValueError and frees none.")
      .def_property_readonly("free_blocks", &BlockedAllocator::free_blocks)
      .def_property_readonly("num_blocks", &BlockedAllocator::num_blocks)
      .def("check_invariants",
           [](const BlockedAllocator& a) { ThrowIfError(a.CheckInvariants()); });
}

void BindBlockedKVCache(py::module_& m) {
  using Cache = BlockedKVCache;
  py::class_<Cache, std::shared_ptr<Cache>>(
      m, "BlockedKVCache",
      "The storage of a paged KV cache and one allocator per cache group (DeepSpeed's "
      "BlockedKVCache). Views from get_cache keep it alive.")
      .def(py::init([](py::handle configs, const MemoryConfig& memory_config, py::handle mp_group,
                       bool offload, py::handle device) {
             if (offload) {
               Throw(PyExc_NotImplementedError, "Offloading of KV-caches is not yet supported.");
             }
             RequireNoGroup(mp_group, "mp_group");
             std::vector<KVCacheConfig> cache_configs = ToConfigs(configs);
             std::shared_ptr<Device> dev = ToDevice(device);
             Result<std::unique_ptr<Cache>> cache = InternalError("not created");
             {
               py::gil_scoped_release release;
               cache = Cache::Create(std::move(cache_configs), memory_config, std::move(dev));
             }
             return std::shared_ptr<Cache>(ValueOrThrow(std::move(cache)));
           }),
           py::arg("configs"), py::arg("memory_config"), py::arg("mp_group") = py::none(),
           py::arg("offload") = false, py::arg("device") = py::none())
      .def(
          "reserve",
          [](Cache& c, int64_t num_blocks, int cache_group) {
            return ToNumpy(ValueOrThrow(c.Reserve(ToInt32(num_blocks, "num_blocks"), cache_group)));
          },
          py::arg("num_blocks"), py::arg("cache_group") = 0,
          "`num_blocks` free blocks of the group, as an int32 NumPy array.")
      .def(
          "free",
          [](Cache& c, py::handle blocks, int cache_group) {
            ThrowIfError(c.Free(ToBlockIds(blocks), cache_group));
          },
          py::arg("blocks"), py::arg("cache_group") = 0)
      .def(
          "copy_blocks",
          [](Cache& c, py::handle src, py::handle dst, int cache_group) {
            const std::vector<BlockId> from = ToBlockIds(src);
            const std::vector<BlockId> to = ToBlockIds(dst);
            CallWithoutGil([&] { return c.CopyBlocks(from, to, cache_group); });
          },
          py::arg("src"), py::arg("dst"), py::arg("cache_group") = 0,
          "Copies block src[i] to dst[i] in every layer of the group.")
      .def(
          "get_cache",
          [](const std::shared_ptr<Cache>& c, int64_t cache_id, int cache_group) {
            return MakeTensor(ValueOrThrow(c->GetCache(cache_id, cache_group)), c);
          },
          py::arg("cache_id"), py::arg("cache_group") = 0,
          "Layer `cache_id` of the group: a blockkv.Tensor [num_blocks, block_size, 2, "
          "num_kv_heads, head_size] to pass to torch.from_dlpack / numpy.from_dlpack.")
      .def(
          "get_group_storage",
          [](const std::shared_ptr<Cache>& c, int cache_group) {
            return MakeTensor(ValueOrThrow(c->GetGroupStorage(cache_group)), c);
          },
          py::arg("cache_group") = 0,
          "The whole group: [num_caches, num_blocks, block_size, 2, num_kv_heads, head_size].")
      .def(
          "offload",
          [](Cache&, py::handle, int) {
            Throw(PyExc_NotImplementedError, "Offloading is not yet supported.");
          },
          py::arg("blocks"), py::arg("cache_group") = 0)
      .def(
          "restore",
          [](Cache&, py::handle, int) {
            Throw(PyExc_NotImplementedError, "Offloading is not yet supported.");
          },
          py::arg("blocks"), py::arg("cache_group") = 0)
      .def_property_readonly("free_blocks", &Cache::free_blocks, "A list: one entry per group.")
      .def_property_readonly("num_caches", &Cache::num_groups,
                             "The number of cache groups (DeepSpeed's meaning).")
      .def_property_readonly("num_blocks", &Cache::num_blocks, "Blocks in every group.")
      .def_property_readonly("bytes_per_block",
                             [](const Cache& c) { return c.plan().bytes_per_block; })
      .def_property_readonly("total_bytes", [](const Cache& c) { return c.plan().total_bytes; })
      .def_property_readonly("device", &Cache::device)
      .def(
          "config",
          [](const Cache& c, int cache_group) {
            if (cache_group < 0 || cache_group >= c.num_groups()) {
              Throw(PyExc_ValueError, "cache group " + std::to_string(cache_group) +
                                          " is outside [0, " + std::to_string(c.num_groups()) +
                                          ")");
            }
            return c.config(cache_group);
          },
          py::arg("cache_group") = 0)
      .def("check_invariants", [](const Cache& c) { ThrowIfError(c.CheckInvariants()); });
}

}  // namespace

void BindKVCache(py::module_& m) {
  BindDevice(m);
  BindAllocator(m);
  BindBlockedKVCache(m);
}

}  // namespace blockkv::python
