// SPDX-License-Identifier: Apache-2.0
// Kernels over the blocked KV cache: AppendKV writes one step's keys and values into their slots
// (DeepSpeed's linear_blocked_kv_copy / kv_rotary_embeddings, vLLM's reshape_and_cache), and
// PagedAttention attends each query token over its sequence's cached keys (DeepSpeed's
// blocked_flash, vLLM's paged attention), for a ragged batch that mixes prefill and decode.
//
//   auto layer = manager->GetCache(/*cache_id=*/l);        // [N, block_size, 2, Hkv, D]
//   Status s = AppendKV(*layer, k, v, *batch, {.rotary = {.enabled = true}, .q = &q});
//   s = PagedAttention(q, *layer, *batch, out);            // causal, scale 1/sqrt(D)
//   // or, with block tables of the engine's own (page_table.h):
//   s = PagedAttention(q, *cache->GetCache(l), csr_table, out);  // a CsrPageTable
//
// Both run on the CPU (Highway SIMD, chosen at run time, and threads over (sequence, KV head,
// query chunk) work items) or, in a CUDA build, on the GPU that holds the tensors; the batch's
// host arrays serve the CPU, its device mirror the GPU. Every argument is checked before any
// memory is touched: a failed call writes nothing.
//
// What is supported (anything else is kInvalidArgument naming the value):
//   activations (q, k, v, out)  fp32, fp16 or bf16, all the same dtype, [T, heads, D], last
//                               stride 1; T = batch.current_tokens() or padded_tokens() (rows of
//                               padding are neither read nor written)
//   cache                       the activations' dtype, or fp8 e4m3 (stored = value / kv_scale,
//                               saturating at ±448, rounded to nearest even)
//   head size D                 64, 80, 96, 128, 256
//   heads                       Hq % Hkv == 0 (grouped-query attention, any group size),
//                               Hq <= 65535
//   strides                     in elements; those of extent-1 dimensions are ignored (torch
//                               exports them as 1), the others as checked below
// The batch comes as a RaggedBatch of the StateManager that owns the cache, or as a page table of
// the caller's own (page_table.h: FlashInfer's CSR form or vLLM's slot mapping) over any cache
// tensor in blockkv's layout.
// Arithmetic is fp32 (rotary angles in fp64). Attention uses an online softmax over tiles of
// keys, never a [T, context] matrix, and has no limit on blocks per sequence.
#pragma once

#include <cstdint>

#include "blockkv/page_table.h"
#include "blockkv/status.h"
#include "blockkv/tensor.h"

struct CUstream_st;  // cudaStream_t is CUstream_st* (see cuda_device.h)

namespace blockkv {

class RaggedBatch;  // ragged_batch.h: include it to call the RaggedBatch overloads

// Rotary position embedding, rotate-half form (GPT-NeoX, Hugging Face Llama): for i < r / 2,
// with r = rotary_dim and angle = pos · theta^(−2i / r),
//   x'[i]         = x[i] · cos(angle) − x[i + r/2] · sin(angle)
//   x'[i + r/2]   = x[i + r/2] · cos(angle) + x[i] · sin(angle)
// and x[r..D) unchanged.
struct RotaryOptions {
  bool enabled = false;
  int32_t rotary_dim = 0;  // 0: head_size; else even and <= head_size (partial rotary)
  double theta = 10000.0;  // > 0
};

struct AppendKVOptions {
  int group = 0;                  // cache group: which of the batch's block tables (RaggedBatch)
  RotaryOptions rotary;           // applied to K, and to *q when given
  const TensorView* q = nullptr;  // [T, Hq, D], rotated in place when rotary.enabled
  float kv_scale = 1.0f;          // fp8 e4m3 caches: stored = value / kv_scale (> 0)
  int num_threads = 0;            // CPU: 0 = hardware concurrency; at most 256 are used
  CUstream_st* stream = nullptr;  // CUDA: stream to launch on; nullptr = legacy default stream
};

// Writes token j of batch sequence i (position seen_tokens_i + j) to block
// table[pos / block_size], offset pos % block_size of `layer_cache`: K to plane 0, V to plane 1.
//   layer_cache: [num_blocks, block_size, 2, Hkv, D], one layer of the batch's cache group
//                (BlockedKVCache::GetCache); its block size must be the group's
//   k, v:        [T, Hkv, D]
// kFailedPrecondition when the batch is not finalized or a slot's block was released
// (FreeLeadingBlocks); kUnavailable for CUDA tensors in a build without CUDA.
Status AppendKV(const TensorView& layer_cache, const TensorView& k, const TensorView& v,
                const RaggedBatch& batch, const AppendKVOptions& options = {});

// The same over a page table of the caller's: token j of sequence i (row start_i + j, position
// L_i − n_i + j) goes to its table's block. `layer_cache` is any [num_blocks, block_size, 2, Hkv,
// D] tensor; k, v: [rows, Hkv, D] with rows >= the table's tokens (rows past them untouched).
// Checked before anything is written, each a kInvalidArgument naming the values: the table's
// offsets (qo_indptr / query_start_loc from 0 and non-decreasing, kv_indptr likewise), lengths
// that disagree (a sequence holding fewer tokens than its new ones, kv_last_page_len outside
// [1, block_size], more blocks than max_blocks_per_seq, a position or slot_mapping entry that is
// not the one its table gives, a padding slot that is not kPaddingSlot), every block id it writes
// outside [0, num_blocks), and two tokens written to one slot (blocks shared between sequences).
Status AppendKV(const TensorView& layer_cache, const TensorView& k, const TensorView& v,
                const CsrPageTable& table, const AppendKVOptions& options = {});
Status AppendKV(const TensorView& layer_cache, const TensorView& k, const TensorView& v,
                const SlotMappingPageTable& table, const AppendKVOptions& options = {});

struct AttentionOptions {
  float scale = 0.0f;          // softmax scale; 0: 1 / sqrt(head_size)
  bool causal = true;          // query at position p sees keys [0, p]; false: all seen + new keys
  int64_t sliding_window = 0;  // 0: none; W > 0: query at p sees keys (p − W, p] (causal only)
  int group = 0;               // cache group (RaggedBatch)
  float kv_scale = 1.0f;       // fp8 caches: value = stored · kv_scale (> 0)
  int num_threads = 0;         // CPU: 0 = hardware concurrency; at most 256 are used
  CUstream_st* stream = nullptr;  // CUDA: stream to launch on; nullptr = legacy default stream
};

// out[t, h] = softmax(scale · q[t, h] · Kᵀ) · V over the keys query token t sees, read from its
// sequence's blocks (head h reads KV head h / (Hq / Hkv)). REQUIRES: the step's keys and values
// were appended (AppendKV) before.
//   q, out:      [T, Hq, D]; out is written for every real token, padded rows untouched
//   layer_cache: [num_blocks, block_size, 2, Hkv, D]
// kFailedPrecondition when the batch is not finalized or a block a query needs was released
// (FreeLeadingBlocks outside the window); kUnavailable for CUDA tensors without CUDA.
Status PagedAttention(const TensorView& q, const TensorView& layer_cache, const RaggedBatch& batch,
                      const TensorView& out, const AttentionOptions& options = {});

// The same over a page table of the caller's (blocks may be shared between sequences, and one
// table serves every layer). The table checks of AppendKV apply, block ids to those each query
// reads; q, out: [rows, Hq, D] with rows >= the table's tokens.
Status PagedAttention(const TensorView& q, const TensorView& layer_cache, const CsrPageTable& table,
                      const TensorView& out, const AttentionOptions& options = {});
Status PagedAttention(const TensorView& q, const TensorView& layer_cache,
                      const SlotMappingPageTable& table, const TensorView& out,
                      const AttentionOptions& options = {});

// ---- MLA: multi-head latent attention (DeepSeek-V2/V3, Kimi K2) ------------------------------
//
// One layer of an MLA cache group (KVCacheType::kMla) is [num_blocks, block_size, L + R]: per
// token the latent c_kv (L = latent_dim, 512 for DeepSeek-V3) followed by the rotary key k_pe
// (R = rope_dim, 64), shared by every head. Attention runs in the absorbed form: the caller has
// folded W_UK into the queries (q_nope_absorbed = q_nope · W_UKᵀ, per head, in the latent space)
// and applies W_UV · W_O to the output. For query token t (position p) and head h, over the keys
// s it sees (causal: positions 0..p of its sequence; else all of them):
//   score[s]   = (q_nope[t, h] · c_kv[s] + q_pe[t, h] · k_pe[s]) · scale
//   out[t, h]  = Σ_s softmax(score)[s] · c_kv[s]            (the values are the latent vectors)
//
//   auto layer = manager->GetCache(l, /*group=*/0);             // [N, block_size, 576]
//   Status s = MlaAppendKV(*layer, c_kv, k_pe, *batch);         // [T, 512], [T, 64]
//   s = MlaPagedAttention(q_nope, q_pe, *layer, *batch, out, {.scale = softmax_scale});
//
// Supported: fp32, fp16 or bf16, the cache and every activation of one dtype (no fp8 yet);
// L + R <= kMlaMaxRowDim; heads <= 65535; fp32 arithmetic. The batch is a RaggedBatch whose
// cache group `group` is an MLA group with these latent_dim and rope_dim, or a page table of the
// caller's (page_table.h, the table checks of AppendKV) over any [N, block_size, L + R] tensor.
// Strides of extent-1 dimensions are ignored; the last dimension of each tensor must be
// contiguous. Every argument is checked before anything is written (kInvalidArgument naming the
// value and the limit); CUDA tensors are kUnimplemented (the CUDA kernel is a later issue).
inline constexpr int64_t kMlaMaxRowDim = 4096;

struct MlaAppendOptions {
  int group = 0;        // cache group (RaggedBatch)
  int num_threads = 0;  // CPU: 0 = hardware concurrency; at most 256 are used
};

// Writes token j of batch sequence i (position seen_i + j) into its slot:
// layer_cache[block, offset, 0:L] = c_kv[row], layer_cache[block, offset, L:L+R] = k_pe[row].
//   layer_cache: [num_blocks, block_size, L + R]
//   c_kv:        [T, L]    the compressed latent of each new token (after its norm)
//   k_pe:        [T, R]    its rotary key, already rotated (R may be 0: a [T, 0] tensor)
// kFailedPrecondition when the batch is not finalized or a slot's block was released.
Status MlaAppendKV(const TensorView& layer_cache, const TensorView& c_kv, const TensorView& k_pe,
                   const RaggedBatch& batch, const MlaAppendOptions& options = {});
Status MlaAppendKV(const TensorView& layer_cache, const TensorView& c_kv, const TensorView& k_pe,
                   const CsrPageTable& table, const MlaAppendOptions& options = {});
Status MlaAppendKV(const TensorView& layer_cache, const TensorView& c_kv, const TensorView& k_pe,
                   const SlotMappingPageTable& table, const MlaAppendOptions& options = {});

struct MlaAttentionOptions {
  // The model's softmax scale, required (> 0): it depends on the heads' qk dimensions before
  // absorption (DeepSeek-V3: 1 / sqrt(128 + 64), times YaRN's mscale²), not on L + R.
  float scale = 0.0f;
  bool causal = true;   // query at position p sees keys [0, p]; false: every key of its sequence
  int group = 0;        // cache group (RaggedBatch)
  int num_threads = 0;  // CPU: 0 = hardware concurrency; at most 256 are used
};

// out[t, h] as above, for every real token; rows of padding untouched. REQUIRES: the step's
// latents were appended (MlaAppendKV) before.
//   q_nope: [T, H, L]   queries absorbed into the latent space
//   q_pe:   [T, H, R]   their rotary part, already rotated
//   out:    [T, H, L]   must not overlap q_nope or q_pe
Status MlaPagedAttention(const TensorView& q_nope, const TensorView& q_pe,
                         const TensorView& layer_cache, const RaggedBatch& batch,
                         const TensorView& out, const MlaAttentionOptions& options);
Status MlaPagedAttention(const TensorView& q_nope, const TensorView& q_pe,
                         const TensorView& layer_cache, const CsrPageTable& table,
                         const TensorView& out, const MlaAttentionOptions& options);
Status MlaPagedAttention(const TensorView& q_nope, const TensorView& q_pe,
                         const TensorView& layer_cache, const SlotMappingPageTable& table,
                         const TensorView& out, const MlaAttentionOptions& options);

}  // namespace blockkv
