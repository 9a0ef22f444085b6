// SPDX-License-Identifier: Apache-2.0
// AppendKV and PagedAttention on a CUDA GPU against the CPU tests' double-precision reference
// (tests/unit/kernels_reference.h): the cache, the batch's device mirror and the activations live
// on the GPU; results are copied back and compared with the same bounds (fp32 1e-5, fp16/bf16
// 1e-2, fp8 5e-2). DeepSpeed's shapes, GQA ratios, every head size and dtype, fp8, contexts past
// 256 blocks (which also split the key range), sliding windows, rotary, padded batches. Skips
// without a GPU.
#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "blockkv/device.h"
#include "blockkv/kernels.h"
#include "cuda_test_util.h"
#include "internal/kernels_backend.h"
#include "unit/kernels_reference.h"

#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace blockkv {
namespace {

using ::blockkv_test::AttentionCase;
using ::blockkv_test::BatchSetup;
using ::blockkv_test::HostTensor;
using ::blockkv_test::KernelBatch;
using ::blockkv_test::SeqSpec;

// A device copy of a host tensor.
struct GpuTensor {
  DeviceBuffer buffer;
  TensorView view;

  GpuTensor(Device& gpu, const HostTensor& host) {
    buffer = *gpu.Allocate(static_cast<int64_t>(host.bytes.size()));
    EXPECT_TRUE(
        gpu.CopyFromHost(buffer.data(), host.bytes.data(), static_cast<int64_t>(host.bytes.size()))
            .ok());
    view = host.view;
    view.data = buffer.data();
    view.device = DeviceKind::kCuda;
  }
  void CopyTo(Device& gpu, HostTensor& host) const {
    EXPECT_TRUE(
        gpu.CopyToHost(host.bytes.data(), buffer.data(), static_cast<int64_t>(host.bytes.size()))
            .ok());
  }
};

// A device copy of a host array.
template <class T>
struct GpuArray {
  DeviceBuffer buffer;
  GpuArray(Device& gpu, const std::vector<T>& host) {
    const auto bytes = static_cast<int64_t>(std::max<size_t>(1, host.size()) * sizeof(T));
    buffer = *gpu.Allocate(bytes);
    if (!host.empty()) {
      EXPECT_TRUE(gpu.CopyFromHost(buffer.data(), host.data(), bytes).ok());
    }
  }
  const T* data() const { return static_cast<const T*>(buffer.data()); }
};

// How RunOnGpu hands the kernels the batch: the RaggedBatch (device mirror), or page tables of
// the same blocks in either form, their arrays on the GPU.
enum class Form { kBatch, kCsr, kSlots };

// Both page-table forms of a KernelBatch's sequences, in host arrays.
struct HostTables {
  std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, kv_indices, last_page_len, positions;
  std::vector<int32_t> block_tables, seq_lens;
  std::vector<int64_t> slot_mapping;
  int32_t max_blocks = 1;

  explicit HostTables(const KernelBatch& kb) {
    const int64_t bs = kb.setup().block_size;
    for (size_t i = 0; i < kb.seqs().size(); ++i) {
      max_blocks = std::max(max_blocks, static_cast<int32_t>(kb.Seq(i)->block_table().size()));
    }
    for (size_t i = 0; i < kb.seqs().size(); ++i) {
      const auto table = kb.Seq(i)->block_table();
      const int64_t n = kb.seqs()[i].n;
      const int64_t length = kb.seqs()[i].history + n;
      const auto used = static_cast<int32_t>((length + bs - 1) / bs);
      qo_indptr.push_back(qo_indptr.back() + static_cast<int32_t>(n));
      kv_indptr.push_back(kv_indptr.back() + used);
      kv_indices.insert(kv_indices.end(), table.begin(), table.begin() + used);
      last_page_len.push_back(static_cast<int32_t>((length - 1) % bs + 1));
      seq_lens.push_back(static_cast<int32_t>(length));
      std::vector<int32_t> row(static_cast<size_t>(max_blocks), 0);
      std::copy(table.begin(), table.end(), row.begin());
      block_tables.insert(block_tables.end(), row.begin(), row.end());
      for (int64_t p = length - n; p < length; ++p) {
        positions.push_back(static_cast<int32_t>(p));
        slot_mapping.push_back(int64_t{table[static_cast<size_t>(p / bs)]} * bs + p % bs);
      }
    }
  }
};

// The tables' arrays on the GPU and the views over them.
struct GpuTables {
  GpuArray<int32_t> qo_indptr, kv_indptr, kv_indices, last_page_len, positions, block_tables,
      seq_lens;
  GpuArray<int64_t> slot_mapping;
  CsrPageTable csr;
  SlotMappingPageTable slots;

  GpuTables(Device& gpu, const HostTables& h)
      : qo_indptr(gpu, h.qo_indptr),
        kv_indptr(gpu, h.kv_indptr),
        kv_indices(gpu, h.kv_indices),
        last_page_len(gpu, h.last_page_len),
        positions(gpu, h.positions),
        block_tables(gpu, h.block_tables),
        seq_lens(gpu, h.seq_lens),
        slot_mapping(gpu, h.slot_mapping) {
    const auto s = static_cast<int32_t>(h.seq_lens.size());
    csr = {.qo_indptr = qo_indptr.data(),
           .kv_indptr = kv_indptr.data(),
           .kv_indices = kv_indices.data(),
           .kv_last_page_len = last_page_len.data(),
           .positions = positions.data(),
           .num_seqs = s};
    slots = {.slot_mapping = slot_mapping.data(),
             .block_tables = block_tables.data(),
             .seq_lens = seq_lens.data(),
             .query_start_loc = qo_indptr.data(),
             .num_seqs = s,
             .num_tokens = static_cast<int32_t>(h.slot_mapping.size()),
             .max_blocks_per_seq = h.max_blocks};
  }
};

void RunKernelOnGpu(const AttentionCase& c, Form form) {
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const uint32_t seed = std::random_device{}();
  std::ostringstream trace;
  trace << "seed " << seed << " D " << c.setup.head_size << " Hq " << c.q_heads << " Hkv "
        << c.setup.num_kv_heads << " act " << DTypeName(c.act) << " fp8 "
        << (c.setup.cache_dtype == DType::kFloat8E4M3);
  SCOPED_TRACE(trace.str());
  BatchSetup setup = c.setup;
  if (setup.cache_dtype != DType::kFloat8E4M3) setup.cache_dtype = c.act;
  KernelBatch kb(setup, c.seqs, seed, *gpu);
  const int64_t rows = kb.rows();
  HostTensor q(c.act, rows, c.q_heads, setup.head_size);
  HostTensor k(c.act, rows, setup.num_kv_heads, setup.head_size);
  HostTensor v(c.act, rows, setup.num_kv_heads, setup.head_size);
  HostTensor out(c.act, rows, c.q_heads, setup.head_size);
  q.Fill(kb.rng());
  k.Fill(kb.rng());
  v.Fill(kb.rng());
  out.Poison();
  GpuTensor dq(**gpu, q), dk(**gpu, k), dv(**gpu, v), dout(**gpu, out);
  AppendKVOptions append{.rotary = c.rotary, .q = &dq.view, .kv_scale = c.options.kv_scale};
  const HostTables host_tables(kb);
  const GpuTables tables(**gpu, host_tables);
  Status status;
  switch (form) {
    case Form::kBatch:
      status = AppendKV(kb.cache(), dk.view, dv.view, kb.batch(), append);
      if (status.ok())
        status = PagedAttention(dq.view, kb.cache(), kb.batch(), dout.view, c.options);
      break;
    case Form::kCsr:
      status = AppendKV(kb.cache(), dk.view, dv.view, tables.csr, append);
      if (status.ok())
        status = PagedAttention(dq.view, kb.cache(), tables.csr, dout.view, c.options);
      break;
    case Form::kSlots:
      status = AppendKV(kb.cache(), dk.view, dv.view, tables.slots, append);
      if (status.ok()) {
        status = PagedAttention(dq.view, kb.cache(), tables.slots, dout.view, c.options);
      }
      break;
  }
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dq.CopyTo(**gpu, q);  // rotated on the GPU: the reference uses the rotated q
  dout.CopyTo(**gpu, out);
  kb.SyncToHost();
  // V is stored as given (same dtype: exactly).
  if (setup.cache_dtype == c.act) {
    const TensorView& hc = kb.host_cache();
    const size_t elem = ElementSize(c.act);
    for (size_t i = 0; i < c.seqs.size(); ++i) {
      const int64_t row = kb.Row(i, c.seqs[i].n - 1);
      const int64_t at = kb.CacheIndex(i, c.seqs[i].history + c.seqs[i].n - 1, 1, 0);
      EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(hc.data) + at * static_cast<int64_t>(elem),
                            v.bytes.data() + row * setup.num_kv_heads * setup.head_size * elem,
                            static_cast<size_t>(setup.head_size) * elem),
                0)
          << "sequence " << i << ": V of its last token";
    }
  }
  const std::vector<double> ref = blockkv_test::ReferenceAttention(kb, q, c.options);
  EXPECT_LE(blockkv_test::RelativeError(out, ref, kb.tokens()),
            blockkv_test::Tolerance(c.act, setup.cache_dtype));
}

// Each case with both CUDA attention kernels (internal/kernels_backend.h): the default one warp
// per key, and a key per half-warp, which is to replace it once it has passed here.
void RunOnGpu(const AttentionCase& c, Form form = Form::kBatch) {
  using internal::CudaAttentionKernel;
  const CudaAttentionKernel before = internal::GetCudaAttentionKernel();
  for (CudaAttentionKernel kernel :
       {CudaAttentionKernel::kWarpPerKey, CudaAttentionKernel::kHalfWarpPerKey}) {
    SCOPED_TRACE(kernel == CudaAttentionKernel::kWarpPerKey ? "kernel: a warp per key"
                                                            : "kernel: a key per half-warp");
    internal::SetCudaAttentionKernel(kernel);
    RunKernelOnGpu(c, form);
  }
  internal::SetCudaAttentionKernel(before);
}

TEST(CudaKernels, DeepSpeedShapesEveryHeadSize) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 80, 96, 128, 256}) {
    RunOnGpu({.setup = {.num_kv_heads = 2, .head_size = d}, .seqs = {{17, 0}}, .q_heads = 2});
    RunOnGpu({.setup = {.num_kv_heads = 2, .head_size = d}, .seqs = {{33, 8}}, .q_heads = 4});
  }
  RunOnGpu({.setup = {.num_kv_heads = 2, .head_size = 128},
            .seqs = {{128, 0}, {177, 0}, {169, 8}, {117, 88}, {1, 293}, {1, 733}, {1, 33}},
            .q_heads = 2,
            .act = DType::kBFloat16});
}

TEST(CudaKernels, GroupedQueryAttentionRatios) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{32, 8},
                         {64, 16},
                         {40, 8},
                         {64, 4},
                         {4, 4},
                         {4, 2},
                         {14, 2},
                         {2, 1}}) {
    RunOnGpu({.setup = {.block_size = 16, .num_kv_heads = hkv, .head_size = 128},
              .seqs = {{1, 100}, {9, 30}, {1, 7}},
              .q_heads = hq});
  }
}

// Groups over the 8 query heads a thread block takes (Falcon-7B: 71 query heads on one KV head),
// head sizes whose rows the lanes cover in one or four chunks, and a block size that is not a
// power of two (the kernel's division path).
TEST(CudaKernels, LargeGroupsWideHeadsOddBlockSizes) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  for (int64_t hq : {71, 128}) {
    RunOnGpu({.setup = {.block_size = 16, .num_kv_heads = 1, .head_size = 64},
              .seqs = {{1, 300}, {5, 20}},
              .q_heads = hq,
              .act = DType::kBFloat16});
  }
  for (int64_t hq : {1, 2, 6, 16}) {
    RunOnGpu({.setup = {.block_size = 16, .num_kv_heads = 1, .head_size = 256},
              .seqs = {{1, 600}, {3, 40}},
              .q_heads = hq});
  }
  RunOnGpu({.setup = {.block_size = 24, .num_kv_heads = 2, .head_size = 128},
            .seqs = {{1, 1000}, {7, 50}, {1, 23}},
            .q_heads = 8,
            .act = DType::kFloat16});
  RunOnGpu({.setup = {.block_size = 1, .num_kv_heads = 1, .head_size = 64},
            .seqs = {{1, 90}, {2, 0}},
            .q_heads = 1});
}

TEST(CudaKernels, EveryDTypeAndFp8) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  for (DType act : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (bool fp8 : {false, true}) {
      AttentionCase c{.setup = {.block_size = 16,
                                .num_kv_heads = 2,
                                .head_size = 128,
                                .cache_dtype = fp8 ? DType::kFloat8E4M3 : act},
                      .seqs = {{1, 70}, {20, 5}, {1, 0}},
                      .q_heads = 4,
                      .act = act};
      if (fp8) c.options.kv_scale = 0.01f;
      RunOnGpu(c);
    }
  }
}

TEST(CudaKernels, LongContextsSplitTheKeys) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  RunOnGpu({.setup = {.block_size = 8, .num_kv_heads = 2, .head_size = 64},
            .seqs = {{1, 5000}, {2, 2100}},
            .q_heads = 4,
            .act = DType::kFloat32});
}

TEST(CudaKernels, SlidingWindowNonCausalRotaryPadding) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  AttentionCase window{.setup = {.block_size = 16, .num_kv_heads = 2, .head_size = 96},
                       .seqs = {{40, 90}, {1, 300}},
                       .q_heads = 4,
                       .act = DType::kFloat32};
  window.options.sliding_window = 17;
  RunOnGpu(window);
  AttentionCase full = window;
  full.options = {.causal = false};
  RunOnGpu(full);
  RunOnGpu({.setup = {.block_size = 16, .num_kv_heads = 2, .head_size = 80, .padding = true},
            .seqs = {{17, 15}, {1, 63}},
            .q_heads = 4,
            .act = DType::kFloat32,
            .rotary = {.enabled = true, .rotary_dim = 64}});
}

// Issue 17: groups past 64 query heads per KV head (Falcon-7B: 71), and one token of one
// sequence with one KV head in blocks of one token.
TEST(CudaKernels, GqaGroupsPast64AndSingletonShapes) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  for (int64_t g : {7, 64, 65}) {  // 71 and 128: LargeGroupsWideHeadsOddBlockSizes
    RunOnGpu({.setup = {.block_size = 16, .num_kv_heads = 1, .head_size = 64},
              .seqs = {{1, 300}, {5, 20}},
              .q_heads = g});
  }
  RunOnGpu({.setup = {.block_size = 1, .num_kv_heads = 1, .head_size = 64},
            .seqs = {{1, 9}},
            .q_heads = 1,
            .act = DType::kFloat32});
}

// Issue 18: the same numerics through page tables of the caller's, their arrays on the GPU (the
// kernels copy them to the host to check them first).
TEST(CudaKernels, PageTablesOnTheGpuEitherForm) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  for (Form form : {Form::kCsr, Form::kSlots}) {
    RunOnGpu({.setup = {.block_size = 16, .num_kv_heads = 2, .head_size = 128},
              .seqs = {{128, 0}, {17, 40}, {1, 293}, {1, 0}},
              .q_heads = 8,
              .act = DType::kBFloat16},
             form);
    RunOnGpu({.setup = {.block_size = 8, .num_kv_heads = 2, .head_size = 64},
              .seqs = {{1, 5000}, {2, 2100}},
              .q_heads = 142,
              .act = DType::kFloat32},
             form);
  }
}

TEST(CudaKernels, APageTableBlockOutsideTheCacheWritesNothing) {
  BLOCKKV_SKIP_WITHOUT_GPU();
  Result<std::shared_ptr<Device>> gpu = CudaDevice(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  KernelBatch kb({.block_size = 16, .num_kv_heads = 2, .head_size = 64}, {{3, 20}, {1, 5}}, 1,
                 *gpu);
  HostTables host_tables(kb);
  host_tables.kv_indices.back() = 1000;
  const GpuTables tables(**gpu, host_tables);
  HostTensor k(DType::kFloat16, 4, 2, 64);
  k.Fill(kb.rng());
  GpuTensor dk(**gpu, k);
  kb.SyncToHost();
  const std::vector<uint8_t> before(static_cast<const uint8_t*>(kb.host_cache().data),
                                    static_cast<const uint8_t*>(kb.host_cache().data) + kb.bytes());
  const Status status = AppendKV(kb.cache(), dk.view, dk.view, tables.csr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
  kb.SyncToHost();
  EXPECT_EQ(std::memcmp(before.data(), kb.host_cache().data, before.size()), 0);
}

}  // namespace
}  // namespace blockkv
