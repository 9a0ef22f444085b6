// SPDX-License-Identifier: Apache-2.0
// Device, BlockedAllocator, BlockedKVCache and OffloadTicket: DeepSpeed's BlockedAllocator and
// BlockedKVCache with the same names, argument names and defaults, and the offload / restore that
// DeepSpeed leaves unimplemented (an OffloadStore over the cache, with offload=True). Block ids
// come back as int32 NumPy arrays and are accepted as an int, a list, a NumPy array or a torch
// tensor; offload handles are int64 (offload_ticket.h).
#include "blockkv/kv_cache.h"

#include <Python.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "blockkv/block_allocator.h"
#include "blockkv/config.h"
#include "blockkv/offload.h"
#include "common.h"
#include "object_lock.h"
#include "offload_ticket.h"
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
        const auto budget = ToInt<int64_t>(budget_bytes, "budget_bytes");
        if (budget < 0) Throw(PyExc_ValueError, "budget_bytes must be >= 0");
        return CpuDevice(budget);
      },
      py::arg("budget_bytes") = py::none(),
      "Host memory: the machine's (cgroup-aware) without a budget, else a fixed budget of "
      "budget_bytes (RESERVE mode then plans against the budget).");
  m.def(
      "CudaDevice",
      [](Int<int32_t, "ordinal"> ordinal) { return ValueOrThrow(CudaDevice(ordinal)); },
      py::arg("ordinal") = 0,
      "CUDA GPU `ordinal`. RuntimeError when blockkv was built without CUDA or there is no such "
      "GPU.");
}

// The Python BlockedAllocator: the free list and the lock every call holds.
struct PyAllocator {
  explicit PyAllocator(BlockedAllocator a) : allocator(std::move(a)) {}
  BlockedAllocator allocator;
  ObjectLock lock;
};

void BindAllocator(py::module_& m) {
  py::class_<PyAllocator>(m, "BlockedAllocator",
                          "A free list of block ids (DeepSpeed's BlockedAllocator). Thread-safe: "
                          "every method holds the allocator's lock.")
      .def(py::init([](Int<int32_t, "num_blocks"> num_blocks) {
             return std::make_unique<PyAllocator>(
                 ValueOrThrow(BlockedAllocator::Create(num_blocks)));
           }),
           py::arg("num_blocks"))
      .def(
          "allocate",
          [](PyAllocator& a, Int<int32_t, "num_blocks"> num_blocks) {
            return ToNumpy(
                ValueOrThrow(Locked(a.lock, [&] { return a.allocator.Allocate(num_blocks); })));
          },
          py::arg("num_blocks"),
          "`num_blocks` ids as an int32 NumPy array; ValueError (nothing taken) when fewer are "
          "free or num_blocks is negative.")
      .def(
          "free",
          [](PyAllocator& a, py::handle blocks) {
            const std::vector<BlockId> ids = ToBlockIds(blocks);
            ThrowIfError(Locked(a.lock, [&] { return a.allocator.Free(ids); }));
          },
          py::arg("blocks"),
          "Returns an int, a list, a NumPy array or a torch tensor of ids; all or nothing: an "
          "invalid, free or repeated id is a ValueError and frees none.")
      .def_property_readonly(
          "free_blocks",
          [](PyAllocator& a) { return Locked(a.lock, [&] { return a.allocator.free_blocks(); }); })
      .def_property_readonly("num_blocks",
                             [](const PyAllocator& a) { return a.allocator.num_blocks(); })
      .def("check_invariants", [](PyAllocator& a) {
        ThrowIfError(Locked(a.lock, [&] { return a.allocator.CheckInvariants(); }));
      });
}

// The Python BlockedKVCache: the cache (what views from get_cache keep alive), with offload=True
// its offload store, and the lock every call on either holds (the store frees device blocks into
// the cache's allocators). Tickets alias this object, so a ticket keeps its store alive.
struct PyCache {
  std::shared_ptr<BlockedKVCache> cache;
  std::unique_ptr<OffloadStore> store;  // nullptr with offload=False; destroyed before the cache
  ObjectLock lock;

  // Whether there is a store is fixed at creation, so this needs no lock.
  OffloadStore& Store() const {
    if (store == nullptr) {
      Throw(PyExc_RuntimeError,
            "offload is off for this BlockedKVCache: create it with offload=True and "
            "host_blocks= or host_bytes= to offload and restore blocks");
    }
    return *store;
  }
};
using Cache = std::shared_ptr<PyCache>;

Tier ToTier(py::handle obj) {
  if (!py::isinstance<py::str>(obj)) {
    Throw(PyExc_TypeError, R"(tier must be "host" or "disk", got )" +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  const auto name = obj.cast<std::string>();
  if (name == "host") return Tier::kHost;
  if (name == "disk") return Tier::kDisk;
  Throw(PyExc_ValueError, R"(tier must be "host" or "disk", got )" + std::string(py::repr(obj)));
}

// A path: str, bytes or os.PathLike; None is no disk tier.
std::string ToPath(py::handle obj) {
  if (obj.is_none()) return {};
  py::object path = py::module_::import("os").attr("fsdecode")(obj);
  return path.cast<std::string>();
}

// The offload keywords of BlockedKVCache, checked against `offload`.
struct OffloadArgs {
  bool offload = false;
  int64_t host_blocks = 0;
  int64_t host_bytes = 0;
  std::string disk_path;
  int64_t disk_blocks = 0;
  int64_t disk_bytes = 0;

  OffloadConfig ToConfig() const {
    if (!offload) {
      if (host_blocks != 0 || host_bytes != 0 || !disk_path.empty() || disk_blocks != 0 ||
          disk_bytes != 0) {
        Throw(PyExc_ValueError,
              "host_blocks, host_bytes, disk_path, disk_blocks and disk_bytes size the offload "
              "store: pass offload=True with them");
      }
      return {};
    }
    // No default size: the host tier is allocated up front (pinned on a GPU), so any default
    // would either take host memory nobody asked for or be too small to preempt anything.
    if (host_blocks == 0 && host_bytes == 0) {
      Throw(PyExc_ValueError,
            "offload=True needs the host tier's size: host_blocks=N (blocks of every cache "
            "group) or host_bytes=N");
    }
    OffloadConfig config;
    config.host_blocks = ToInt32(host_blocks, "host_blocks");
    config.host_bytes = host_bytes;
    config.disk_path = disk_path;
    config.disk_blocks = ToInt32(disk_blocks, "disk_blocks");
    config.disk_bytes = disk_bytes;
    ThrowIfError(config.Validate());
    return config;
  }
};

Cache CreateCache(py::handle configs, const MemoryConfig& memory_config, py::handle mp_group,
                  const OffloadArgs& args, py::handle device) {
  RequireNoGroup(mp_group, "mp_group");
  const OffloadConfig offload_config = args.ToConfig();
  std::vector<KVCacheConfig> cache_configs = ToConfigs(configs);
  std::shared_ptr<Device> dev = ToDevice(device);
  // A copy: another thread may assign to the Python config while the GIL is released.
  const MemoryConfig memory = memory_config;
  Result<std::unique_ptr<BlockedKVCache>> cache = InternalError("not created");
  Result<std::unique_ptr<OffloadStore>> store = InternalError("not created");
  {
    py::gil_scoped_release release;
    cache = BlockedKVCache::Create(std::move(cache_configs), memory, std::move(dev));
    if (cache.ok() && args.offload) store = OffloadStore::Create(cache->get(), offload_config);
  }
  auto out = std::make_shared<PyCache>();
  out->cache = std::shared_ptr<BlockedKVCache>(ValueOrThrow(std::move(cache)));
  if (args.offload) out->store = ValueOrThrow(std::move(store));
  return out;
}

void BindTicket(py::module_& m) {
  py::class_<Ticket>(m, "OffloadTicket",
                     "The completion of an offload, restore or spill (and of preempt_sequence / "
                     "resume_sequence). Keeps its store alive. Thread-safe: wait and poll hold "
                     "the lock of the object whose store made it.")
      .def(
          "wait",
          [](Ticket& t) {
            ThrowIfError(LockedWithoutGil(*t.lock, [&] { return t.ticket.Wait(); }));
          },
          "Blocks until the copies are done (the GIL released). Raises their first failure, the "
          "same on every call: ResourceExhaustedError (the disk full), RuntimeError (an I/O or "
          "device error, a corrupt disk slot); returns None when they succeeded. It holds its "
          "store's lock (the BlockedKVCache's or the StateManager's) meanwhile, so other calls "
          "on that object wait for the copies too.")
      .def(
          "poll", [](Ticket& t) { return Locked(*t.lock, [&] { return t.ticket.Poll(); }); },
          "True when the copies are done (never raises; wait() then returns at once).")
      .def("__repr__", [](const Ticket&) { return std::string("<blockkv.OffloadTicket>"); });
}

// ValueError unless 0 <= group < the cache's group count (fixed at creation: no lock needed).
void CheckCacheGroup(const PyCache& c, int group) {
  const int groups = c.cache->num_groups();
  if (group < 0 || group >= groups) {
    Throw(PyExc_ValueError, "cache group " + std::to_string(group) + " is outside [0, " +
                                std::to_string(groups) + ")");
  }
}

using CacheGroupArg = Int<int, "cache_group">;

void BindBlockedKVCache(py::module_& m) {
  py::class_<PyCache, Cache>(
      m, "BlockedKVCache",
      "The storage of a paged KV cache and one allocator per cache group (DeepSpeed's "
      "BlockedKVCache), with offload=True a host (and optionally disk) tier to offload blocks "
      "to. Views from get_cache keep it alive. Thread-safe: every method (and every method of "
      "its tickets) holds the cache's lock; the bytes of the views are the caller's to "
      "synchronize, as any tensor's.")
      .def(py::init([](py::handle configs, const MemoryConfig& memory_config, py::handle mp_group,
                       bool offload, py::handle device, Int<int32_t, "host_blocks"> host_blocks,
                       Int<int64_t, "host_bytes"> host_bytes, py::handle disk_path,
                       Int<int32_t, "disk_blocks"> disk_blocks,
                       Int<int64_t, "disk_bytes"> disk_bytes) {
             OffloadArgs args{offload,           host_blocks, host_bytes,
                              ToPath(disk_path), disk_blocks, disk_bytes};
             return CreateCache(configs, memory_config, mp_group, args, device);
           }),
           py::arg("configs"), py::arg("memory_config"), py::arg("mp_group") = py::none(),
           py::arg("offload") = false, py::arg("device") = py::none(), py::kw_only(),
           py::arg("host_blocks") = 0, py::arg("host_bytes") = 0, py::arg("disk_path") = py::none(),
           py::arg("disk_blocks") = 0, py::arg("disk_bytes") = 0)
      .def(
          "reserve",
          [](PyCache& c, Int<int32_t, "num_blocks"> num_blocks, CacheGroupArg cache_group) {
            return ToNumpy(ValueOrThrow(
                Locked(c.lock, [&] { return c.cache->Reserve(num_blocks, cache_group); })));
          },
          py::arg("num_blocks"), py::arg("cache_group") = 0,
          "`num_blocks` free blocks of the group, as an int32 NumPy array. All or nothing: "
          "ResourceExhaustedError when fewer are free, ValueError for a negative count or a bad "
          "group.")
      .def(
          "free",
          [](PyCache& c, py::handle blocks, CacheGroupArg cache_group) {
            const std::vector<BlockId> ids = ToBlockIds(blocks);
            ThrowIfError(Locked(c.lock, [&] { return c.cache->Free(ids, cache_group); }));
          },
          py::arg("blocks"), py::arg("cache_group") = 0,
          "Returns blocks to the group's free list. All or nothing: ValueError for an id out of "
          "range, free, repeated or held by the offload store.")
      .def(
          "copy_blocks",
          [](PyCache& c, py::handle src, py::handle dst, CacheGroupArg cache_group) {
            const std::vector<BlockId> from = ToBlockIds(src);
            const std::vector<BlockId> to = ToBlockIds(dst);
            ThrowIfError(LockedWithoutGil(
                c.lock, [&] { return c.cache->CopyBlocks(from, to, cache_group); }));
          },
          py::arg("src"), py::arg("dst"), py::arg("cache_group") = 0,
          "Copies block src[i] to dst[i] in every layer of the group. ValueError (nothing "
          "copied) for an id out of range or lists of different lengths.")
      .def(
          "get_cache",
          [](const Cache& c, Int<int64_t, "cache_id"> cache_id, CacheGroupArg cache_group) {
            const TensorView view = ValueOrThrow(
                Locked(c->lock, [&] { return c->cache->GetCache(cache_id, cache_group); }));
            return MakeTensor(view, c->cache);
          },
          py::arg("cache_id"), py::arg("cache_group") = 0,
          "Layer `cache_id` of the group: a blockkv.Tensor [num_blocks, block_size, 2, "
          "num_kv_heads, head_size] (an MLA group's: [num_blocks, block_size, latent_dim + "
          "rope_dim]) to pass to torch.from_dlpack / numpy.from_dlpack.")
      .def(
          "get_group_storage",
          [](const Cache& c, CacheGroupArg cache_group) {
            const TensorView view = ValueOrThrow(
                Locked(c->lock, [&] { return c->cache->GetGroupStorage(cache_group); }));
            return MakeTensor(view, c->cache);
          },
          py::arg("cache_group") = 0,
          "The whole group: [num_caches, num_blocks, block_size, 2, num_kv_heads, head_size] "
          "(MLA: [num_caches, num_blocks, block_size, latent_dim + rope_dim]).")
      .def(
          "offload",
          [](const Cache& c, py::handle blocks, CacheGroupArg cache_group, py::handle tier) {
            OffloadStore& store = c->Store();
            const std::vector<BlockId> ids = ToBlockIds(blocks);
            const Tier to = ToTier(tier);
            std::vector<OffloadHandle> handles(ids.size());
            Result<OffloadTicket> ticket = LockedWithoutGil(
                c->lock, [&] { return store.Offload(ids, cache_group, handles, to); });
            return py::make_tuple(HandlesToNumpy(handles),
                                  MakeTicket(ValueOrThrow(std::move(ticket)), c, c->lock));
          },
          py::arg("blocks"), py::arg("cache_group") = 0, py::arg("tier") = "host",
          "Copies `blocks` of the group to the host (or disk) tier: (handles, ticket), handles an "
          "int64 NumPy array, one per block. The blocks are the store's from now on and go back "
          "to the free list once the copy is done. All or nothing: ValueError (a bad group or id, "
          "a repeated id, tier=\"disk\" without a disk tier), ResourceExhaustedError (too few "
          "free slots in the tier).")
      .def(
          "restore",
          [](const Cache& c, py::handle handles, CacheGroupArg cache_group) {
            OffloadStore& store = c->Store();
            CheckStoreGroup(store, cache_group);  // -1 would be the store's kAnyGroup
            const std::vector<OffloadHandle> from = ToHandles(handles);
            std::vector<BlockId> blocks(from.size());
            Result<OffloadTicket> ticket =
                LockedWithoutGil(c->lock, [&] { return store.Restore(from, cache_group, blocks); });
            return py::make_tuple(ToNumpy(blocks),
                                  MakeTicket(ValueOrThrow(std::move(ticket)), c, c->lock));
          },
          py::arg("handles"), py::arg("cache_group") = 0,
          "New blocks of the group for `handles`, copied from wherever each is: (blocks, ticket), "
          "blocks an int32 NumPy array. They hold their contents once ticket.wait() returns; the "
          "handles are released then. All or nothing: ValueError (a stale or unknown handle, one "
          "of another group, a repeated one), ResourceExhaustedError (too few free blocks).")
      .def(
          "spill",
          [](const Cache& c, py::handle handles) {
            OffloadStore& store = c->Store();
            const std::vector<OffloadHandle> from = ToHandles(handles);
            Result<OffloadTicket> ticket =
                LockedWithoutGil(c->lock, [&] { return store.Spill(from); });
            return MakeTicket(ValueOrThrow(std::move(ticket)), c, c->lock);
          },
          py::arg("handles"),
          "Moves host handles to the disk tier, unchanged (others stay where they are): a ticket. "
          "ValueError without a disk tier or for a stale handle, ResourceExhaustedError when the "
          "disk tier is too full.")
      .def(
          "drop",
          [](PyCache& c, py::handle handles) {
            OffloadStore& store = c.Store();
            const std::vector<OffloadHandle> from = ToHandles(handles);
            ThrowIfError(LockedWithoutGil(c.lock, [&] { return store.Drop(from); }));
          },
          py::arg("handles"),
          "Forgets handles without restoring them; ValueError (nothing dropped) for a stale one.")
      .def(
          "handle_tier",
          [](PyCache& c, Int<int64_t, "handle"> handle) {
            const OffloadStore& store = c.Store();
            const Tier tier =
                ValueOrThrow(Locked(c.lock, [&] { return store.tier(UnpackHandle(handle)); }));
            return std::string(TierName(tier));
          },
          py::arg("handle"),
          "Where a handle's bytes are: \"host\", \"disk\", or \"device\" (its offload failed and "
          "kept the device block). ValueError for a stale handle.")
      .def(
          "free_host_blocks",
          [](PyCache& c, CacheGroupArg cache_group) {
            const OffloadStore& store = c.Store();
            CheckStoreGroup(store, cache_group);
            return Locked(c.lock, [&] { return store.free_host_blocks(cache_group); });
          },
          py::arg("cache_group") = 0)
      .def(
          "free_disk_blocks",
          [](PyCache& c, CacheGroupArg cache_group) {
            const OffloadStore& store = c.Store();
            CheckStoreGroup(store, cache_group);
            return Locked(c.lock, [&] { return store.free_disk_blocks(cache_group); });
          },
          py::arg("cache_group") = 0)
      .def_property_readonly(
          "host_blocks", [](const PyCache& c) { return c.Store().host_blocks(); },
          "Host tier slots per cache group")
      .def_property_readonly(
          "disk_blocks", [](const PyCache& c) { return c.Store().disk_blocks(); },
          "Disk tier slots per cache group (0 without a disk tier)")
      .def(
          "offload_stats",
          [](PyCache& c) {
            const OffloadStore& store = c.Store();
            return StatsDict(Locked(c.lock, [&] { return ReadStats(store); }));
          },
          "A dict: offloaded_blocks, restored_blocks, spilled_blocks, copied_to_host, "
          "copied_to_device, failed_copies, "
          "bytes_written, bytes_read, live_handles")
      .def_property_readonly(
          "offload_enabled", [](const PyCache& c) { return c.store != nullptr; },
          "Whether the cache was created with offload=True")
      .def(
          "wait_all",
          [](PyCache& c) {
            OffloadStore& store = c.Store();
            LockedWithoutGil(c.lock, [&] { store.WaitAll(); });
          },
          "Waits for every copy submitted so far (the GIL released) and applies their effects.")
      .def_property_readonly(
          "free_blocks",
          [](PyCache& c) { return Locked(c.lock, [&] { return c.cache->free_blocks(); }); },
          "A list: one entry per group.")
      .def_property_readonly(
          "num_caches", [](const PyCache& c) { return c.cache->num_groups(); },
          "The number of cache groups (DeepSpeed's meaning).")
      .def_property_readonly(
          "num_blocks", [](const PyCache& c) { return c.cache->num_blocks(); },
          "Blocks in every group.")
      .def_property_readonly("bytes_per_block",
                             [](const PyCache& c) { return c.cache->plan().bytes_per_block; })
      .def_property_readonly("total_bytes",
                             [](const PyCache& c) { return c.cache->plan().total_bytes; })
      .def_property_readonly("device", [](const PyCache& c) { return c.cache->device(); })
      .def(
          "config",
          [](const PyCache& c, CacheGroupArg cache_group) {
            CheckCacheGroup(c, cache_group);
            return c.cache->config(cache_group);
          },
          py::arg("cache_group") = 0)
      .def(
          "check_invariants",
          [](PyCache& c) {
            ThrowIfError(Locked(c.lock, [&] {
              Status status = c.cache->CheckInvariants();
              if (status.ok() && c.store != nullptr) status = c.store->CheckInvariants();
              return status;
            }));
          },
          "RuntimeError naming the first broken invariant of the allocators or the offload "
          "store; None when they hold.");
}

}  // namespace

void BindKVCache(py::module_& m) {
  BindDevice(m);
  BindAllocator(m);
  BindTicket(m);
  BindBlockedKVCache(m);
}

}  // namespace blockkv::python
