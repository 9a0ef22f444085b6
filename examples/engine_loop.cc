// SPDX-License-Identifier: Apache-2.0
// engine_loop: the bookkeeping of a continuous-batching engine through StateManager and
// RaggedBatch — prefix caching of shared system prompts, chunked prefill under a token budget,
// decode, parallel sampling by Fork, a sliding window released with FreeLeadingBlocks,
// all-or-nothing admission when the cache is full, and flushing — with no model arithmetic.
// Each step is one StateManager::ScheduleBatch: the forward scheduled and its RaggedBatch built
// in one call (include/blockkv/ragged_batch.h shows the same step as Schedule, InsertSequence
// and Finalize).
// Prints one line per 16 steps and a summary; exits 1 if any blockkv call fails or a block is
// left held at the end.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <random>
#include <vector>

#include "blockkv/blockkv.h"

namespace {

using blockkv::SeqId;
using blockkv::TokenId;

struct Request {
  SeqId uid = 0;
  std::vector<blockkv::TokenId> tokens;  // the prompt, then the generated tokens
  int64_t prompt = 0;                    // prompt tokens
  int64_t output = 0;                    // tokens to generate
  int64_t prefilled = 0;
  int64_t generated = 0;
};

constexpr int64_t kWindow = 256;  // sliding-window attention, in tokens

bool Ok(const blockkv::Status& status, const char* what) {
  if (!status.ok()) std::fprintf(stderr, "engine_loop: %s: %s\n", what, status.ToString().c_str());
  return status.ok();
}

}  // namespace

int main() {
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  blockkv::KVCacheConfig llama;  // Llama-3-8B attention: 32 layers, 8 KV heads of 128, fp16
  llama.block_size = 16;
  llama.cache_shape = {32, 8, 128};
  llama.max_blocks_per_allocation_group = 4096 / 16;
  blockkv::StateManagerConfig config;
  config.max_tracked_sequences = 64;
  config.max_ragged_sequence_count = 64;
  config.max_ragged_batch_size = 512;  // token budget of one forward
  config.max_context = 4096;
  config.memory_config.mode = blockkv::AllocationMode::kAllocate;
  config.memory_config.size = 300;  // 300 blocks of 16 tokens: small enough to fill up
  // Requests share four system prompts: their blocks are computed once and shared. The window
  // below releases old blocks, so a hit needs only the blocks inside it.
  config.prefix_cache.enabled = true;
  config.prefix_cache.sliding_windows = {kWindow};
  auto created = blockkv::StateManager::Create(config, {llama}, blockkv::CpuDevice(1LL << 30));
  if (!Ok(created.status(), "StateManager::Create")) return 1;
  blockkv::StateManager& manager = **created;
  auto batch_or = blockkv::RaggedBatch::Create(manager);
  if (!Ok(batch_or.status(), "RaggedBatch::Create")) return 1;
  blockkv::RaggedBatch& batch = **batch_or;

  std::mt19937_64 rng(7);
  std::uniform_int_distribution<blockkv::TokenId> vocab(0, 32000);
  std::vector<std::vector<blockkv::TokenId>> system_prompts(4);
  for (auto& p : system_prompts) {
    p.resize(std::uniform_int_distribution<size_t>(100, 400)(rng));
    for (auto& t : p) t = vocab(rng);
  }
  std::deque<Request> waiting;
  for (SeqId uid = 0; uid < 40; ++uid) {
    Request r{.uid = uid, .tokens = system_prompts[uid % 4]};
    r.tokens.resize(r.tokens.size() + std::uniform_int_distribution<size_t>(20, 300)(rng));
    for (size_t i = system_prompts[uid % 4].size(); i < r.tokens.size(); ++i)
      r.tokens[i] = vocab(rng);
    r.prompt = std::ssize(r.tokens);
    r.output = std::uniform_int_distribution<int64_t>(16, 96)(rng);
    waiting.push_back(std::move(r));
  }
  std::vector<Request> running;
  int64_t steps = 0, tokens = 0, refused = 0, forks = 0, released = 0, peak_used = 0;
  std::vector<SeqId> uids;
  std::vector<int64_t> lengths;
  std::vector<TokenId> ids;  // the step's new tokens: lengths[i] for uids[i], one after another

  while (!waiting.empty() || !running.empty()) {
    // Decode every running sequence that finished its prompt; chunk the prompts of the rest and
    // of newly admitted requests into what is left of the token budget.
    uids.clear();
    lengths.clear();
    ids.clear();
    int64_t budget = config.max_ragged_batch_size;
    // Puts the next n tokens of `r` in the step: those from the first it has not run.
    auto add = [&](const Request& r, int64_t n) {
      uids.push_back(r.uid);
      lengths.push_back(n);
      const auto from = r.tokens.begin() + r.prefilled + r.generated;
      ids.insert(ids.end(), from, from + n);
      budget -= n;
    };
    for (const Request& r : running) {
      const int64_t n = r.prefilled < r.prompt ? std::min(r.prompt - r.prefilled, budget) : 1;
      if (n == 0 || budget == 0) continue;
      add(r, n);
    }
    // Admit while the cache keeps a reserve for the running sequences' next blocks.
    while (!waiting.empty() && budget > 0 &&
           std::ssize(running) < config.max_ragged_sequence_count &&
           manager.free_blocks()[0] > 64) {
      // Known by its prompt, so that its first Schedule takes the cached prefix.
      if (!Ok(manager.AddSequence(waiting.front().uid, waiting.front().tokens).status(), "Add")) {
        return 1;
      }
      add(waiting.front(), std::min(waiting.front().prompt, budget));
      running.push_back(waiting.front());
      waiting.pop_front();
    }
    // Schedule and build the batch, all or nothing: when the cache is short, give the newest
    // back and try again. A new sequence whose prompt starts with a cached prefix runs only the
    // tokens past it: ScheduleBatch takes those from `ids`.
    while (true) {
      blockkv::SchedulingResult result = blockkv::SchedulingResult::kSuccess;
      const blockkv::Status scheduled = manager.ScheduleBatch(
          {.uids = uids, .lengths = lengths}, ids, batch, /*padding=*/true, &result);
      if (scheduled.ok()) break;
      if (result != blockkv::SchedulingResult::kKVCacheLimitExceeded || uids.size() <= 1) {
        Ok(scheduled, "ScheduleBatch");
        return 1;
      }
      ++refused;
      const SeqId last = uids.back();
      ids.resize(ids.size() - static_cast<size_t>(lengths.back()));  // its tokens are the last
      uids.pop_back();
      lengths.pop_back();
      auto it = std::find_if(running.begin(), running.end(),
                             [&](const Request& r) { return r.uid == last; });
      if (it->prefilled == 0) {  // not started: forget it and requeue
        if (!Ok(manager.FlushSequence(last), "FlushSequence")) return 1;
        waiting.push_front(*it);
        running.erase(it);
      }
    }
    // ... the model's forward reads batch.slot_mapping(), batch.kv_indptr(), ... here ...
    // Advances every sequence of the batch, and gives the prefix cache the tokens it ran.
    if (!Ok(manager.PostForward(batch), "PostForward")) return 1;
    ++steps;
    tokens += batch.current_tokens();
    peak_used =
        std::max<int64_t>(peak_used, manager.pool().num_blocks() - manager.free_blocks()[0]);

    for (const SeqId uid : uids) {
      auto r = std::find_if(running.begin(), running.end(),
                            [&](const Request& q) { return q.uid == uid; });
      const blockkv::Sequence* seq = manager.GetSequence(r->uid);
      if (r->prefilled < r->prompt) {
        r->prefilled = seq->seen_tokens();
        // Parallel sampling: request 3 asks for two more samples of its prompt, each with a
        // first token of its own.
        if (r->uid == 3 && r->prefilled == r->prompt) {
          for (SeqId child : {1003, 2003}) {
            if (!Ok(manager.Fork(3, child), "Fork")) return 1;
            Request sample{child, r->tokens, r->prompt, r->output, r->prompt, 0};
            sample.tokens.push_back(vocab(rng));
            running.push_back(std::move(sample));
            ++forks;
          }
          r = std::find_if(running.begin(), running.end(),
                           [](const Request& q) { return q.uid == 3; });
        }
      } else {
        ++r->generated;
      }
      // The next token, sampled from the logits (here: made up) once the whole prompt has run.
      if (r->prefilled == r->prompt && r->generated < r->output) r->tokens.push_back(vocab(rng));
      // A sliding window of 256 tokens: blocks wholly before it are no longer needed.
      seq = manager.GetSequence(r->uid);
      const int64_t window_start = seq->seen_tokens() - kWindow;
      const int64_t droppable = window_start / llama.block_size - seq->released_blocks();
      if (droppable > 0) {
        if (!Ok(manager.FreeLeadingBlocks(r->uid, static_cast<int32_t>(droppable)), "Free")) {
          return 1;
        }
        released += droppable;
      }
    }
    for (auto it = running.begin(); it != running.end();) {
      if (it->prefilled == it->prompt && it->generated == it->output) {
        if (!Ok(manager.FlushSequence(it->uid), "FlushSequence")) return 1;
        it = running.erase(it);
      } else {
        ++it;
      }
    }
    if (steps % 16 == 0) {
      std::printf(
          "step %4lld: %3zu running, %2zu waiting, %4d tokens this step, %3d of %d "
          "blocks free\n",
          static_cast<long long>(steps), running.size(), waiting.size(), batch.current_tokens(),
          manager.free_blocks()[0], manager.pool().num_blocks());
    }
  }
  const blockkv::PrefixCacheStats hits = manager.prefix_cache()->total_stats();
  std::printf(
      "prefix cache: %lld of %lld prompt tokens taken from the cache (%.0f%%), %lld "
      "cached blocks evicted\n",
      static_cast<long long>(hits.hit_tokens), static_cast<long long>(hits.queried_tokens),
      100.0 * static_cast<double>(hits.hit_tokens) /
          static_cast<double>(std::max<int64_t>(hits.queried_tokens, 1)),
      static_cast<long long>(hits.evictions));
  const bool clean = manager.CheckInvariants().ok() &&
                     manager.free_blocks()[0] == manager.pool().num_blocks() &&
                     manager.n_tracked_sequences() == 0;
  std::printf(
      "done: %lld steps, %lld tokens, %lld admissions deferred (cache full), %lld forks, "
      "%lld blocks released by the window, peak %lld of %d blocks in use; %s\n",
      static_cast<long long>(steps), static_cast<long long>(tokens),
      static_cast<long long>(refused), static_cast<long long>(forks),
      static_cast<long long>(released), static_cast<long long>(peak_used),
      manager.pool().num_blocks(), clean ? "every block is free again" : "BLOCKS LEFT HELD");
  return clean ? 0 : 1;
}
