// SPDX-License-Identifier: Apache-2.0
// blockkv.append_kv and blockkv.paged_attention: the kernels of kernels.h over tensors that come
// in through DLPack (torch tensors, NumPy arrays, blockkv.Tensor views of the cache) and either a
// RaggedBatchWrapper or a page table of the caller's (blockkv.CsrPageTable,
// blockkv.SlotMappingPageTable over torch / NumPy index arrays). Nothing is copied: q (rotary),
// the cache and out are written in place, and a page table keeps its index arrays alive.
//
// The C++ kernels check every argument before touching memory, so a ValueError leaves every
// tensor as it was. What C++ must take on trust, the lengths of a table's arrays, is checked here
// against the arrays' shapes (host arrays; a device table's lengths are read from its offsets).
// The GIL is released while the kernels run; the Python arguments keep the tensors alive.
#include "blockkv/kernels.h"

#include <Python.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>

#include "batch_wrapper.h"
#include "common.h"
#include "tensor.h"

namespace blockkv::python {
namespace {

// An index array of a page table: 1-D (2-D for block_tables), `dtype`, contiguous.
OwnedTensor IndexArray(py::handle obj, const char* name, DType dtype, int ndim) {
  OwnedTensor t = ImportTensor(obj);
  const TensorView& v = t.view;
  if (v.dtype != dtype) {
    Throw(PyExc_ValueError, std::string(name) + " must be " + std::string(DTypeName(dtype)) +
                                ", got " + std::string(DTypeName(v.dtype)));
  }
  if (v.ndim != ndim || !v.is_contiguous()) {
    Throw(PyExc_ValueError, std::string(name) + " must be a contiguous " + std::to_string(ndim) +
                                "-D array, got " + std::to_string(v.ndim) + " dimensions" +
                                (v.is_contiguous() ? "" : ", not contiguous"));
  }
  return t;
}

template <class T>
const T* Data(const OwnedTensor& t) {
  return static_cast<const T*>(t.view.data);
}

// The last entry of an offsets array on the host (its total), or nullopt on a device.
std::optional<int64_t> HostTotal(const OwnedTensor& indptr) {
  if (indptr.view.device != DeviceKind::kCpu || indptr.view.shape[0] == 0) return std::nullopt;
  return Data<int32_t>(indptr)[indptr.view.shape[0] - 1];
}

void CheckLength(const char* name, const OwnedTensor& t, int64_t want, bool at_least = false) {
  const int64_t got = t.view.shape[0];
  if (at_least ? got < want : got != want) {
    Throw(PyExc_ValueError, std::string(name) + " has " + std::to_string(got) + " entries; " +
                                (at_least ? "at least " : "") + std::to_string(want) + " expected");
  }
}

// blockkv.CsrPageTable: FlashInfer's form over int32 arrays.
struct PyCsrTable {
  OwnedTensor qo_indptr, kv_indptr, kv_indices, kv_last_page_len;
  std::optional<OwnedTensor> positions;
  CsrPageTable table;

  PyCsrTable(py::handle qo, py::handle kv, py::handle indices, py::handle last, py::handle pos)
      : qo_indptr(IndexArray(qo, "qo_indptr", DType::kInt32, 1)),
        kv_indptr(IndexArray(kv, "kv_indptr", DType::kInt32, 1)),
        kv_indices(IndexArray(indices, "kv_indices", DType::kInt32, 1)),
        kv_last_page_len(IndexArray(last, "kv_last_page_len", DType::kInt32, 1)) {
    if (!pos.is_none()) positions = IndexArray(pos, "positions", DType::kInt32, 1);
    const int64_t seqs = qo_indptr.view.shape[0] - 1;
    if (seqs < 0) Throw(PyExc_ValueError, "qo_indptr must hold num_seqs + 1 >= 1 entries");
    CheckLength("kv_indptr", kv_indptr, seqs + 1);
    CheckLength("kv_last_page_len", kv_last_page_len, seqs);
    if (auto total = HostTotal(kv_indptr)) CheckLength("kv_indices", kv_indices, *total, true);
    if (auto total = HostTotal(qo_indptr); total && positions) {
      CheckLength("positions", *positions, *total, true);
    }
    table = CsrPageTable{.qo_indptr = Data<int32_t>(qo_indptr),
                         .kv_indptr = Data<int32_t>(kv_indptr),
                         .kv_indices = Data<int32_t>(kv_indices),
                         .kv_last_page_len = Data<int32_t>(kv_last_page_len),
                         .positions = positions ? Data<int32_t>(*positions) : nullptr,
                         .num_seqs = ToInt32(seqs, "num_seqs")};
  }
};

// blockkv.SlotMappingPageTable: vLLM's form (slot_mapping int64, the others int32).
struct PySlotTable {
  OwnedTensor slot_mapping, block_tables, seq_lens, query_start_loc;
  SlotMappingPageTable table;

  PySlotTable(py::handle slots, py::handle tables, py::handle lens, py::handle starts)
      : slot_mapping(IndexArray(slots, "slot_mapping", DType::kInt64, 1)),
        block_tables(IndexArray(tables, "block_tables", DType::kInt32, 2)),
        seq_lens(IndexArray(lens, "seq_lens", DType::kInt32, 1)),
        query_start_loc(IndexArray(starts, "query_start_loc", DType::kInt32, 1)) {
    const int64_t seqs = query_start_loc.view.shape[0] - 1;
    if (seqs < 0) Throw(PyExc_ValueError, "query_start_loc must hold num_seqs + 1 >= 1 entries");
    CheckLength("seq_lens", seq_lens, seqs);
    CheckLength("block_tables", block_tables, seqs);
    table = SlotMappingPageTable{
        .slot_mapping = Data<int64_t>(slot_mapping),
        .block_tables = Data<int32_t>(block_tables),
        .seq_lens = Data<int32_t>(seq_lens),
        .query_start_loc = Data<int32_t>(query_start_loc),
        .num_seqs = ToInt32(seqs, "num_seqs"),
        .num_tokens = ToInt32(slot_mapping.view.shape[0], "slot_mapping's length"),
        .max_blocks_per_seq = ToInt32(block_tables.view.shape[1], "max_blocks_per_seq")};
  }
};

// What the kernels' `batch` argument may be.
// A RaggedBatchWrapper's kernel runs holding the batch's lock (object_lock.h), so no other
// thread refills the batch while it reads it; a page table is the caller's to keep unchanged.
using AnyTable = std::variant<const BatchWrapper*, CsrPageTable, SlotMappingPageTable>;

// Every index array lives where the cache does (C++ reads them there).
void CheckSameDevice(const TensorView& cache, std::initializer_list<const OwnedTensor*> arrays) {
  for (const OwnedTensor* a : arrays) {
    if (a == nullptr) continue;
    if (a->view.device != cache.device ||
        (cache.device == DeviceKind::kCuda && a->view.device_ordinal != cache.device_ordinal)) {
      Throw(PyExc_ValueError, "the page table's arrays must live where layer_cache does (" +
                                  std::string(DeviceKindName(cache.device)) + ":" +
                                  std::to_string(cache.device_ordinal) + "), got one on " +
                                  std::string(DeviceKindName(a->view.device)) + ":" +
                                  std::to_string(a->view.device_ordinal));
    }
  }
}

AnyTable ToTable(py::handle obj, const TensorView& cache) {
  if (py::isinstance<BatchWrapper>(obj)) return &obj.cast<const BatchWrapper&>();
  if (py::isinstance<PyCsrTable>(obj)) {
    const auto& t = obj.cast<const PyCsrTable&>();
    CheckSameDevice(cache, {&t.qo_indptr, &t.kv_indptr, &t.kv_indices, &t.kv_last_page_len,
                            t.positions ? &*t.positions : nullptr});
    return t.table;
  }
  if (py::isinstance<PySlotTable>(obj)) {
    const auto& t = obj.cast<const PySlotTable&>();
    CheckSameDevice(cache, {&t.slot_mapping, &t.block_tables, &t.seq_lens, &t.query_start_loc});
    return t.table;
  }
  Throw(PyExc_TypeError,
        "batch must be a blockkv.RaggedBatchWrapper, CsrPageTable or SlotMappingPageTable, got " +
            std::string(py::str(py::type::of(obj).attr("__name__"))));
}

// stream: None (CUDA's legacy default stream), an int (a cudaStream_t's address), or an object
// with .cuda_stream (torch.cuda.Stream). Ignored for host tensors.
CUstream_st* ToStream(py::handle obj) {
  if (obj.is_none()) return nullptr;
  py::object handle = py::hasattr(obj, "cuda_stream") ? obj.attr("cuda_stream")
                                                      : py::reinterpret_borrow<py::object>(obj);
  if (PyBool_Check(handle.ptr()) || !PyLong_Check(handle.ptr())) {
    Throw(PyExc_TypeError,
          "stream must be None, an int (a cudaStream_t) or a torch.cuda.Stream, got " +
              std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  // NOLINTNEXTLINE(performance-no-int-to-ptr): Python hands a cudaStream_t over as an int.
  return reinterpret_cast<CUstream_st*>(handle.cast<uintptr_t>());
}

void AppendKVPy(py::handle layer_cache, py::handle k, py::handle v, py::handle batch,
                Int<int32_t, "group"> group, bool rotary, Int<int32_t, "rotary_dim"> rotary_dim,
                double theta, py::handle q, float kv_scale, Int<int32_t, "num_threads"> num_threads,
                py::handle stream) {
  const OwnedTensor cache = ImportTensor(layer_cache);
  const OwnedTensor keys = ImportTensor(k);
  const OwnedTensor values = ImportTensor(v);
  std::optional<OwnedTensor> queries;
  if (!q.is_none()) queries = ImportTensor(q);
  const AnyTable table = ToTable(batch, cache.view);
  AppendKVOptions options;
  options.group = group;
  options.rotary.enabled = rotary;
  options.rotary.rotary_dim = rotary_dim;
  options.rotary.theta = theta;
  options.q = queries ? &queries->view : nullptr;
  options.kv_scale = kv_scale;
  options.num_threads = num_threads;
  options.stream = ToStream(stream);
  std::visit(
      [&](const auto& t) {
        if constexpr (std::is_pointer_v<std::decay_t<decltype(t)>>) {
          ThrowIfError(LockedWithoutGil(t->lock, [&] {
            return AppendKV(cache.view, keys.view, values.view, *t->batch, options);
          }));
        } else {
          CallWithoutGil([&] { return AppendKV(cache.view, keys.view, values.view, t, options); });
        }
      },
      table);
}

void PagedAttentionPy(py::handle q, py::handle layer_cache, py::handle batch, py::handle out,
                      float scale, bool causal, Int<int64_t, "sliding_window"> sliding_window,
                      Int<int32_t, "group"> group, float kv_scale,
                      Int<int32_t, "num_threads"> num_threads, py::handle stream) {
  const OwnedTensor queries = ImportTensor(q);
  const OwnedTensor cache = ImportTensor(layer_cache);
  const OwnedTensor output = ImportTensor(out);
  const AnyTable table = ToTable(batch, cache.view);
  AttentionOptions options;
  options.scale = scale;
  options.causal = causal;
  options.sliding_window = sliding_window;
  options.group = group;
  options.kv_scale = kv_scale;
  options.num_threads = num_threads;
  options.stream = ToStream(stream);
  std::visit(
      [&](const auto& t) {
        if constexpr (std::is_pointer_v<std::decay_t<decltype(t)>>) {
          ThrowIfError(LockedWithoutGil(t->lock, [&] {
            return PagedAttention(queries.view, cache.view, *t->batch, output.view, options);
          }));
        } else {
          CallWithoutGil(
              [&] { return PagedAttention(queries.view, cache.view, t, output.view, options); });
        }
      },
      table);
}

void MlaAppendKVPy(py::handle layer_cache, py::handle c_kv, py::handle k_pe, py::handle batch,
                   int group, int num_threads) {
  const OwnedTensor cache = ImportTensor(layer_cache);
  const OwnedTensor latent = ImportTensor(c_kv);
  const OwnedTensor rope = ImportTensor(k_pe);
  const AnyTable table = ToTable(batch, cache.view);
  const MlaAppendOptions options{.group = group, .num_threads = num_threads};
  std::visit(
      [&](const auto& t) {
        if constexpr (std::is_pointer_v<std::decay_t<decltype(t)>>) {
          ThrowIfError(LockedWithoutGil(t->lock, [&] {
            return MlaAppendKV(cache.view, latent.view, rope.view, *t->batch, options);
          }));
        } else {
          CallWithoutGil(
              [&] { return MlaAppendKV(cache.view, latent.view, rope.view, t, options); });
        }
      },
      table);
}

void MlaPagedAttentionPy(py::handle q_nope, py::handle q_pe, py::handle layer_cache,
                         py::handle batch, py::handle out, float scale, bool causal, int group,
                         int num_threads) {
  const OwnedTensor nope = ImportTensor(q_nope);
  const OwnedTensor pe = ImportTensor(q_pe);
  const OwnedTensor cache = ImportTensor(layer_cache);
  const OwnedTensor output = ImportTensor(out);
  const AnyTable table = ToTable(batch, cache.view);
  const MlaAttentionOptions options{
      .scale = scale, .causal = causal, .group = group, .num_threads = num_threads};
  std::visit(
      [&](const auto& t) {
        if constexpr (std::is_pointer_v<std::decay_t<decltype(t)>>) {
          ThrowIfError(LockedWithoutGil(t->lock, [&] {
            return MlaPagedAttention(nope.view, pe.view, cache.view, *t->batch, output.view,
                                     options);
          }));
        } else {
          CallWithoutGil([&] {
            return MlaPagedAttention(nope.view, pe.view, cache.view, t, output.view, options);
          });
        }
      },
      table);
}

}  // namespace

void BindKernels(py::module_& m) {
  py::class_<PyCsrTable>(m, "CsrPageTable", R"doc(
FlashInfer's CSR page table of a batch, for append_kv / paged_attention over a cache of the
caller's (any [num_blocks, block_size, 2, Hkv, D] tensor, e.g. BlockedKVCache.get_cache with blocks
from reserve). int32 arrays (torch or NumPy, where the cache lives): qo_indptr [S + 1] (sequence
i's new tokens are rows qo_indptr[i]..qo_indptr[i+1]), kv_indptr [S + 1] and kv_indices (its
blocks, in order), kv_last_page_len [S] (tokens in its last block), positions [T] or None (each new
token's position, checked). The table keeps the arrays alive and reads them when a kernel runs;
one table serves every layer. ValueError for a wrong dtype, shape or length.)doc")
      .def(py::init<py::handle, py::handle, py::handle, py::handle, py::handle>(),
           py::arg("qo_indptr"), py::arg("kv_indptr"), py::arg("kv_indices"),
           py::arg("kv_last_page_len"), py::arg("positions") = py::none())
      .def_property_readonly("num_seqs", [](const PyCsrTable& t) { return t.table.num_seqs; });
  py::class_<PySlotTable>(m, "SlotMappingPageTable", R"doc(
vLLM's attention metadata as a page table: slot_mapping int64 [num_tokens] (block * block_size +
offset of each row, -1 for padding rows, checked against the tables), block_tables int32 [S,
max_blocks], seq_lens int32 [S] (tokens in all, the new ones included), query_start_loc int32
[S + 1]. The table keeps the arrays alive and reads them when a kernel runs.)doc")
      .def(py::init<py::handle, py::handle, py::handle, py::handle>(), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"))
      .def_property_readonly("num_seqs", [](const PySlotTable& t) { return t.table.num_seqs; });

  m.def("append_kv", &AppendKVPy, py::arg("layer_cache"), py::arg("k"), py::arg("v"),
        py::arg("batch"), py::kw_only(), py::arg("group") = 0, py::arg("rotary") = false,
        py::arg("rotary_dim") = 0, py::arg("theta") = 10000.0, py::arg("q") = py::none(),
        py::arg("kv_scale") = 1.0f, py::arg("num_threads") = 0, py::arg("stream") = py::none(),
        R"doc(Writes the batch's new keys and values into their cache slots (AppendKV).

layer_cache: one layer, [num_blocks, block_size, 2, Hkv, D] (manager.get_cache(layer) or a torch
view of it); k, v: [T, Hkv, D] with T = batch.current_tokens or padded_tokens. batch: a
RaggedBatchWrapper of the manager owning the cache, or a CsrPageTable / SlotMappingPageTable over
any cache (then T >= its tokens; every index is checked first, and two tokens of one slot refused). Token j of batch
sequence i goes to position seen_tokens_i + j. rotary=True applies rotate-half RoPE (rotary_dim
0: D; theta) to K before storing it and to q, [T, Hq, D], in place. kv_scale: fp8 caches store
value / kv_scale. num_threads 0: all cores. stream (CUDA): None, an int or a torch.cuda.Stream.
ValueError (nothing written) for an unsupported or inconsistent argument or a batch not
finalized.)doc");
  m.def("paged_attention", &PagedAttentionPy, py::arg("q"), py::arg("layer_cache"),
        py::arg("batch"), py::arg("out"), py::kw_only(), py::arg("scale") = 0.0f,
        py::arg("causal") = true, py::arg("sliding_window") = 0, py::arg("group") = 0,
        py::arg("kv_scale") = 1.0f, py::arg("num_threads") = 0, py::arg("stream") = py::none(),
        R"doc(Attention of each query token over its sequence's cached keys (PagedAttention).

out[t, h] = softmax(scale * q[t, h] . K^T) V over the keys token t sees: causal (positions <= its
own), within sliding_window (W > 0: (p - W, p]), or all of the sequence (causal=False). q, out:
[T, Hq, D], the same dtype (fp32, fp16, bf16); query head h reads KV head h // (Hq // Hkv).
scale 0: 1/sqrt(D). Padded rows of out are not written. Append the step's keys first
(append_kv). ValueError (nothing written) for an unsupported or inconsistent argument, a batch not
finalized or a block a query needs that was released.)doc");
  m.def("mla_append_kv", &MlaAppendKVPy, py::arg("layer_cache"), py::arg("c_kv"), py::arg("k_pe"),
        py::arg("batch"), py::kw_only(), py::arg("group") = 0, py::arg("num_threads") = 0,
        R"doc(Writes the batch's new MLA latents into their cache slots (MlaAppendKV).
layer_cache: one layer of an MLA group, [num_blocks, block_size, L + R] (get_cache of a group of
KVCacheType.MLA); c_kv: [T, L] each new token's latent (L = latent_dim), k_pe: [T, R] its rotary
key, already rotated (R = rope_dim; may be 0). One dtype throughout: fp32, fp16 or bf16. batch: a
RaggedBatchWrapper (its group must be MLA with this latent_dim) or a page table of the caller's.
CPU only (NotImplementedError for CUDA tensors). ValueError (nothing written) for an unsupported or
inconsistent argument.)doc");
  m.def("mla_paged_attention", &MlaPagedAttentionPy, py::arg("q_nope"), py::arg("q_pe"),
        py::arg("layer_cache"), py::arg("batch"), py::arg("out"), py::kw_only(), py::arg("scale"),
        py::arg("causal") = true, py::arg("group") = 0, py::arg("num_threads") = 0,
        R"doc(MLA decode/prefill attention in the absorbed form (MlaPagedAttention).
For query token t and head h over the keys s it sees (causal: positions <= its own):
score[s] = (q_nope[t, h] . c_kv[s] + q_pe[t, h] . k_pe[s]) * scale; out[t, h] = softmax(score) .
c_kv. q_nope: [T, H, L] queries already absorbed into the latent space (q_nope @ W_UK^T), q_pe:
[T, H, R] rotated, out: [T, H, L] (apply W_UV and W_O after). scale is required: the model's
softmax scale (DeepSeek-V3: 1/sqrt(192) times YaRN's mscale^2). fp32 arithmetic; CPU only.
ValueError (nothing written) for an unsupported or inconsistent argument.)doc");
}

}  // namespace blockkv::python
