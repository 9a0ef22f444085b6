// SPDX-License-Identifier: Apache-2.0
// Page tables of an engine's own: the kernels of kernels.h over any cache tensor in blockkv's
// layout, driven by block tables that blockkv's StateManager never saw (an engine's scheduler,
// BlockedKVCache::Reserve, vLLM's or FlashInfer's metadata). Two forms, each a small, trivially
// copyable struct of pointers and counts (FlashInfer's page.cuh style), passed by value:
//
//   CsrPageTable          FlashInfer's: qo_indptr, kv_indptr, kv_indices, kv_last_page_len, and
//                         optionally each new token's position
//   SlotMappingPageTable  vLLM's: slot_mapping, block_tables, seq_lens, query_start_loc
//
//   std::vector<BlockId> blocks = *cache->Reserve(3);          // the engine's own table
//   int32_t qo[] = {0, 5}, kv_ptr[] = {0, 3}, last[] = {5};    // one sequence: 5 new tokens,
//   CsrPageTable table{.qo_indptr = qo, .kv_indptr = kv_ptr,   // 37 in all, blocks of 16
//                      .kv_indices = blocks.data(), .kv_last_page_len = last, .num_seqs = 1};
//   Status s = AppendKV(*cache->GetCache(layer), k, v, table);
//   s = PagedAttention(q, *cache->GetCache(layer), table, out);
//
// Semantics, both forms: sequence i's new tokens are rows [start_i, start_i + n_i) of q, k, v and
// out; it holds L_i tokens in all (the new ones last: positions L_i − n_i ...), token p in block
// table_i[p / block_size] at offset p % block_size of the cache. A table only describes the
// batch: one table serves every layer of a model.
//
// Where the arrays live: where the cache lives (host memory for a CPU cache, the cache's GPU for a
// CUDA one). Every index a call reads is checked against the cache before anything is written
// (kernels.h lists the checks); for a CUDA cache the call first copies the table to the host for
// that, synchronously on the call's stream.
#pragma once

#include <cstdint>
#include <type_traits>

namespace blockkv {

// FlashInfer's CSR page table (flashinfer/page.cuh, BatchPrefillWithPagedKVCache's arguments).
struct CsrPageTable {
  const int32_t* qo_indptr = nullptr;         // [num_seqs + 1]: sequence i's new tokens are rows
                                              // [qo_indptr[i], qo_indptr[i + 1]); qo_indptr[0] = 0
  const int32_t* kv_indptr = nullptr;         // [num_seqs + 1]: its blocks are kv_indices
                                              // [kv_indptr[i], kv_indptr[i + 1])
  const int32_t* kv_indices = nullptr;        // [kv_indptr[num_seqs]]: block ids, in order
  const int32_t* kv_last_page_len = nullptr;  // [num_seqs]: tokens in its last block, 1..block_size
                                              // (L_i = (blocks − 1) · block_size + last)
  const int32_t* positions = nullptr;         // [qo_indptr[num_seqs]] or null: each new token's
                                              // position, checked to be L_i − n_i + j
  int32_t num_seqs = 0;
};
static_assert(std::is_trivially_copyable_v<CsrPageTable>);

// vLLM's attention metadata (FlashAttentionMetadata: slot_mapping, block_table, seq_lens,
// query_start_loc).
struct SlotMappingPageTable {
  const int64_t* slot_mapping = nullptr;     // [num_tokens]: block · block_size + offset of each
                                             // row; kPaddingSlot (−1) past the real tokens
  const int32_t* block_tables = nullptr;     // [num_seqs, max_blocks_per_seq], row-major
  const int32_t* seq_lens = nullptr;         // [num_seqs]: L_i, the new tokens included
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]: rows of sequence i, as qo_indptr
  int32_t num_seqs = 0;
  int32_t num_tokens = 0;  // rows of slot_mapping, >= query_start_loc[num_seqs]
  int32_t max_blocks_per_seq = 0;
};
static_assert(std::is_trivially_copyable_v<SlotMappingPageTable>);

// slot_mapping's value for a row that is padding (vLLM's PAD_SLOT_ID).
inline constexpr int64_t kPaddingSlot = -1;

}  // namespace blockkv
