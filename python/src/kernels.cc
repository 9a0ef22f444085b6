// blockkv.append_kv and blockkv.paged_attention: the kernels of kernels.h over tensors that come
// in through DLPack (torch tensors, NumPy arrays, blockkv.Tensor views of the cache) and a
// RaggedBatchWrapper. Nothing is copied: q (rotary), the cache and out are written in place.
//
// The C++ kernels check every argument before touching memory, so a ValueError leaves every
// tensor as it was. The GIL is released while they run; the Python arguments keep the tensors
// alive meanwhile.
#include "blockkv/kernels.h"

#include <Python.h>

#include <cstdint>
#include <optional>
#include <string>

#include "batch_wrapper.h"
#include "common.h"
#include "tensor.h"

namespace blockkv::python {
namespace {

// The kernel runs holding the batch's lock (object_lock.h), so no other thread refills the
// batch while it reads it.
const BatchWrapper& ToBatch(py::handle obj) {
  if (!py::isinstance<BatchWrapper>(obj)) {
    Throw(PyExc_TypeError, "batch must be a blockkv.RaggedBatchWrapper, got " +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  return obj.cast<const BatchWrapper&>();
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

void AppendKVPy(py::handle layer_cache, py::handle k, py::handle v, py::handle batch, int group,
                bool rotary, int64_t rotary_dim, double theta, py::handle q, float kv_scale,
                int num_threads, py::handle stream) {
  const OwnedTensor cache = ImportTensor(layer_cache);
  const OwnedTensor keys = ImportTensor(k);
  const OwnedTensor values = ImportTensor(v);
  std::optional<OwnedTensor> queries;
  if (!q.is_none()) queries = ImportTensor(q);
  const BatchWrapper& b = ToBatch(batch);
  AppendKVOptions options;
  options.group = group;
  options.rotary.enabled = rotary;
  options.rotary.rotary_dim = ToInt32(rotary_dim, "rotary_dim");
  options.rotary.theta = theta;
  options.q = queries ? &queries->view : nullptr;
  options.kv_scale = kv_scale;
  options.num_threads = num_threads;
  options.stream = ToStream(stream);
  ThrowIfError(LockedWithoutGil(
      b.lock, [&] { return AppendKV(cache.view, keys.view, values.view, *b.batch, options); }));
}

void PagedAttentionPy(py::handle q, py::handle layer_cache, py::handle batch, py::handle out,
                      float scale, bool causal, int64_t sliding_window, int group, float kv_scale,
                      int num_threads, py::handle stream) {
  const OwnedTensor queries = ImportTensor(q);
  const OwnedTensor cache = ImportTensor(layer_cache);
  const OwnedTensor output = ImportTensor(out);
  const BatchWrapper& b = ToBatch(batch);
  AttentionOptions options;
  options.scale = scale;
  options.causal = causal;
  options.sliding_window = sliding_window;
  options.group = group;
  options.kv_scale = kv_scale;
  options.num_threads = num_threads;
  options.stream = ToStream(stream);
  ThrowIfError(LockedWithoutGil(b.lock, [&] {
    return PagedAttention(queries.view, cache.view, *b.batch, output.view, options);
  }));
}

}  // namespace

void BindKernels(py::module_& m) {
  m.def("append_kv", &AppendKVPy, py::arg("layer_cache"), py::arg("k"), py::arg("v"),
        py::arg("batch"), py::kw_only(), py::arg("group") = 0, py::arg("rotary") = false,
        py::arg("rotary_dim") = 0, py::arg("theta") = 10000.0, py::arg("q") = py::none(),
        py::arg("kv_scale") = 1.0f, py::arg("num_threads") = 0, py::arg("stream") = py::none(),
        R"doc(Writes the batch's new keys and values into their cache slots (AppendKV).

layer_cache: one layer, [num_blocks, block_size, 2, Hkv, D] (manager.get_cache(layer) or a torch
view of it); k, v: [T, Hkv, D] with T = batch.current_tokens or padded_tokens. Token j of batch
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
}

}  // namespace blockkv::python
