// SPDX-License-Identifier: Apache-2.0
#include "engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "blockkv/device.h"

namespace blockkv::tool {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }  // a >= 0, b > 0

std::string Where(const EngineRequest& request, size_t index) {
  return request.line > 0 ? "line " + std::to_string(request.line)
                          : "request " + std::to_string(index);
}

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

Status NullRunner::Run(const RaggedBatch& batch, std::span<const size_t> requests,
                       std::span<const uint8_t> sample, std::span<TokenId> next) {
  for (size_t i = 0; i < requests.size(); ++i) {
    if (sample[i] == 0) continue;
    const RaggedBatch::Inserted entry = batch.inserted(static_cast<int32_t>(i));
    const auto position = static_cast<uint64_t>(entry.seen_tokens) + entry.tokens.size();
    next[i] = static_cast<TokenId>(Mix(requests[i] * 1000003ULL + position) % 32000);
  }
  return Status::Ok();
}

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  if (options.block_size <= 0 || options.num_blocks <= 0 || options.token_budget <= 0 ||
      options.max_seqs <= 0 || options.max_context <= 0) {
    return InvalidArgumentError(
        "block size, blocks, token budget, sequences and context must "
        "all be > 0");
  }
  KVCacheConfig kv;
  kv.block_size = options.block_size;
  kv.cache_shape = options.cache_shape;
  kv.cache_dtype = options.cache_dtype;
  const int64_t table = CeilDiv(options.max_context, options.block_size);
  if (table > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError("--max-context / --block-size is too large");
  }
  kv.max_blocks_per_allocation_group = static_cast<int32_t>(table);
  StateManagerConfig config;
  // Running requests need max_seqs slots; preempted ones keep theirs until resumed (nothing is
  // admitted while any waits), so twice that is enough.
  config.max_ragged_sequence_count = std::min(options.max_seqs, options.token_budget);
  if (config.max_ragged_sequence_count > kMaxSequences) {
    return InvalidArgumentError("--max-seqs " + std::to_string(options.max_seqs) +
                                " (and --token-budget " + std::to_string(options.token_budget) +
                                ") is more than " + std::to_string(kMaxSequences) +
                                " sequences per step");
  }
  config.max_tracked_sequences = 2 * config.max_ragged_sequence_count;
  config.max_ragged_batch_size = options.token_budget;
  config.max_context = options.max_context;
  config.memory_config.mode = AllocationMode::kAllocate;
  config.memory_config.size = options.num_blocks;
  config.prefix_cache.enabled = options.prefix_cache;
  config.remote_tier = options.remote_tier;
  if (options.host_blocks > 0) {
    config.offload = true;
    config.offload_config.host_blocks = options.host_blocks;
  }
  BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<StateManager> manager,
                           StateManager::Create(config, {kv}, CpuDevice()));
  BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<RaggedBatch> batch, RaggedBatch::Create(*manager));
  return std::unique_ptr<Engine>(new Engine(options, std::move(manager), std::move(batch)));
}

Engine::Engine(EngineOptions options, std::unique_ptr<StateManager> manager,
               std::unique_ptr<RaggedBatch> batch)
    : options_(std::move(options)), manager_(std::move(manager)), batch_(std::move(batch)) {
  stats_.num_blocks = manager_->pool().num_blocks();
  watermark_blocks_ =
      std::max<int32_t>(1, static_cast<int32_t>(std::ceil(options_.watermark * stats_.num_blocks)));
}

int32_t Engine::used_blocks() const {
  return manager_->pool().num_blocks() - manager_->pool().free_blocks();
}

Status Engine::CheckRequest(const EngineRequest& request, size_t index) const {
  const std::string where = Where(request, index);
  if (request.prompt.empty()) return InvalidArgumentError(where + ": empty prompt");
  if (request.output_len < 1) return InvalidArgumentError(where + ": output_len must be >= 1");
  // The last generated token is never run: a request holds prompt + output − 1 tokens.
  const int64_t held = std::ssize(request.prompt) + request.output_len - 1;
  if (held > options_.max_context) {
    return InvalidArgumentError(where + ": " + std::to_string(held) +
                                " tokens (prompt + output - 1) exceed the context limit of " +
                                std::to_string(options_.max_context));
  }
  if (CeilDiv(held, options_.block_size) > stats_.num_blocks) {
    return InvalidArgumentError(where + ": " + std::to_string(held) + " tokens need " +
                                std::to_string(CeilDiv(held, options_.block_size)) +
                                " blocks, more than the cache's " +
                                std::to_string(stats_.num_blocks));
  }
  return Status::Ok();
}

Result<bool> SpanSource::Next(EngineRequest* out) {
  if (next_ == requests_.size()) return false;
  *out = requests_[next_++];
  return true;
}

Status Engine::Arrive(RequestSource& source) {
  while (waiting_.size() < kMaxWaiting) {
    if (!has_pending_) {
      if (source_done_) return Status::Ok();
      BLOCKKV_ASSIGN_OR_RETURN(const bool more, source.Next(&pending_));
      if (!more) {
        source_done_ = true;
        return Status::Ok();
      }
      const auto index = static_cast<size_t>(stats_.requests);
      if (pending_.arrival < last_arrival_) {
        return InvalidArgumentError(
            Where(pending_, index) + ": arrival " + std::to_string(pending_.arrival) +
            " is before the previous request's " + std::to_string(last_arrival_) +
            " (requests are replayed in the order given, which must be arrival order)");
      }
      BLOCKKV_RETURN_IF_ERROR(CheckRequest(pending_, index));
      last_arrival_ = pending_.arrival;
      has_pending_ = true;
      ++stats_.requests;
    }
    if (pending_.arrival > stats_.clock) return Status::Ok();
    auto live = std::make_unique<Live>();
    live->index = static_cast<size_t>(stats_.requests - 1);
    live->uid = static_cast<SeqId>(live->index);
    live->tokens = std::move(pending_.prompt);
    live->prompt_len = std::ssize(live->tokens);
    live->output_len = pending_.output_len;
    if (options_.keep_outputs) outputs_.emplace_back();
    waiting_.push_back(std::move(live));
    has_pending_ = false;
  }
  return Status::Ok();
}

Status Engine::Run(RequestSource& source, StepRunner& runner,
                   const std::function<void(const Engine&)>& after_step) {
  Start();
  while (true) {
    BLOCKKV_ASSIGN_OR_RETURN(const Progress progress, Step(source, runner));
    if (progress == Progress::kFinished) return Status::Ok();
    if (progress == Progress::kStepped && after_step) after_step(*this);
  }
}

void Engine::Start() {
  outputs_.clear();
  stats_.requests = 0;
  has_pending_ = source_done_ = false;
  last_arrival_ = 0;
}

Result<Engine::Progress> Engine::Step(RequestSource& source, StepRunner& runner) {
  BLOCKKV_ASSIGN_OR_RETURN(const Progress progress, BeginStep(source));
  if (progress == Progress::kStepped) BLOCKKV_RETURN_IF_ERROR(FinishStep(runner));
  return progress;
}

Result<Engine::Progress> Engine::BeginStep(RequestSource& source) {
  BLOCKKV_RETURN_IF_ERROR(Arrive(source));
  if (running_.empty() && waiting_.empty() && preempted_.empty()) {
    if (!has_pending_) return Progress::kFinished;  // every request finished
    stats_.clock = pending_.arrival;                // idle until the next arrival
    return Progress::kWaited;
  }
  BLOCKKV_RETURN_IF_ERROR(PlanStep(&entries_));
  if (entries_.empty()) {  // a bug in the loop, not in the input: never spin
    return InternalError("engine: nothing could be scheduled at step " +
                         std::to_string(stats_.clock) + " with " + std::to_string(waiting_.size()) +
                         " requests waiting");
  }
  BLOCKKV_RETURN_IF_ERROR(ScheduleStep(&entries_));
  return Progress::kStepped;
}

Status Engine::FinishStep(StepRunner& runner) {
  BLOCKKV_RETURN_IF_ERROR(RunStep(entries_, runner));
  RecordStep();
  return Status::Ok();
}

Status Engine::PlanStep(std::vector<Entry>* entries) {
  entries->clear();
  BLOCKKV_RETURN_IF_ERROR(Resume());
  int64_t budget = options_.token_budget;
  const auto max_seqs = static_cast<size_t>(manager_->config().max_ragged_sequence_count);
  // Decodes first (one token each), then prefill chunks of running requests.
  for (const bool decode : {true, false}) {
    for (const auto& live : running_) {
      const int64_t remaining = std::ssize(live->tokens) - live->computed;
      if ((remaining == 1) != decode || budget == 0 || entries->size() == max_seqs) continue;
      const int64_t n = std::min(remaining, budget);
      entries->push_back({live.get(), n, false});
      budget -= n;
    }
  }
  // Admissions, oldest first, while the cache keeps its reserve (a request's first chunk is cut
  // to the room left; prefix hits make the estimate conservative). CanSchedule has the last word.
  const int32_t bs = options_.block_size;
  while (preempted_.empty() && !waiting_.empty() && budget > 0 && running_.size() < max_seqs &&
         manager_->n_tracked_sequences() < manager_->config().max_tracked_sequences) {
    Live& next = *waiting_.front();
    int64_t n = std::min<int64_t>(std::ssize(next.tokens), budget);
    // With nothing running the reserve is not needed, and the first chunk only has to fit.
    const int32_t reserve = running_.empty() ? 0 : watermark_blocks_;
    const int64_t room = (static_cast<int64_t>(manager_->free_blocks()[0]) - reserve) * bs;
    if (room < std::min<int64_t>(n, bs)) {
      ++stats_.deferred_steps;
      break;
    }
    n = std::min(n, room);
    BLOCKKV_RETURN_IF_ERROR(manager_->AddSequence(next.uid, next.tokens).status());
    entries->push_back({&next, n, true});
    uids_.clear();
    lengths_.clear();
    for (const Entry& e : *entries) {
      uids_.push_back(e.live->uid);
      lengths_.push_back(e.length);
    }
    BLOCKKV_ASSIGN_OR_RETURN(SchedulingResult fits,
                             manager_->CanSchedule({.uids = uids_, .lengths = lengths_}));
    if (fits != SchedulingResult::kSuccess) {
      entries->pop_back();
      BLOCKKV_RETURN_IF_ERROR(manager_->FlushSequence(next.uid));
      ++stats_.deferred_steps;
      break;
    }
    InsertByArrival(running_, std::move(waiting_.front()));
    waiting_.pop_front();
    budget -= n;
  }
  return Status::Ok();
}

Status Engine::ScheduleStep(std::vector<Entry>* entries) {
  while (true) {
    uids_.clear();
    lengths_.clear();
    ids_.clear();
    for (const Entry& e : *entries) {
      uids_.push_back(e.live->uid);
      lengths_.push_back(e.length);
      // Its tokens from the first not computed; a new sequence with a cached prefix runs only
      // those past it, which ScheduleBatch picks out.
      const auto from = e.live->tokens.begin() + e.live->computed;
      ids_.insert(ids_.end(), from, from + e.length);
    }
    SchedulingResult why = SchedulingResult::kSuccess;
    Status status = manager_->ScheduleBatch({.uids = uids_, .lengths = lengths_}, ids_, *batch_,
                                            /*padding=*/false, &why);
    if (status.ok() || why != SchedulingResult::kKVCacheLimitExceeded) return status;
    // Too few blocks: give back this step's admissions (newest first), then preempt the newest
    // running request.
    if (!entries->empty() && entries->back().admitted) {
      Live* last = entries->back().live;
      entries->pop_back();
      BLOCKKV_RETURN_IF_ERROR(manager_->FlushSequence(last->uid));
      auto it = std::find_if(running_.begin(), running_.end(),
                             [&](const std::unique_ptr<Live>& l) { return l.get() == last; });
      waiting_.push_front(std::move(*it));
      running_.erase(it);
      continue;
    }
    if (running_.size() <= 1) {
      return InternalError("a single request does not fit the cache alone: " + status.message());
    }
    Live* victim = running_.back().get();
    std::erase_if(*entries, [&](const Entry& e) { return e.live == victim; });
    BLOCKKV_RETURN_IF_ERROR(Preempt(victim));
  }
}

Status Engine::Preempt(Live* victim) {
  auto it = std::find_if(running_.begin(), running_.end(),
                         [&](const std::unique_ptr<Live>& l) { return l.get() == victim; });
  if (manager_->offload_store() != nullptr) {
    const Sequence& seq = *manager_->GetSequence(victim->uid);
    const int32_t held = seq.cur_allocated_blocks() - seq.released_blocks();
    Result<OffloadTicket> ticket = manager_->PreemptSequence(victim->uid);
    if (ticket.ok()) {
      stats_.preempted_blocks += held;
      // Its device blocks come back to the pool once the copy is done.
      BLOCKKV_RETURN_IF_ERROR(ticket->Wait());
      InsertByArrival(preempted_, std::move(*it));
      running_.erase(it);
      ++stats_.preemptions;
      return Status::Ok();
    }
    if (ticket.status().code() != StatusCode::kResourceExhausted) return ticket.status();
    // The host tier is full: recompute this one.
  }
  // Recompute: drop its blocks (the ones it published stay cached, evictable, and usually come
  // back as prefix hits) and queue it first, with its generated tokens as part of its prompt.
  BLOCKKV_RETURN_IF_ERROR(manager_->FlushSequence(victim->uid));
  victim->computed = 0;
  waiting_.push_front(std::move(*it));
  running_.erase(it);
  ++stats_.recomputations;
  return Status::Ok();
}

void Engine::InsertByArrival(std::vector<std::unique_ptr<Live>>& list, std::unique_ptr<Live> live) {
  const auto at = std::upper_bound(
      list.begin(), list.end(), live->index,
      [](size_t index, const std::unique_ptr<Live>& l) { return index < l->index; });
  list.insert(at, std::move(live));
}

Status Engine::Resume() {
  const auto max_seqs = static_cast<size_t>(manager_->config().max_ragged_sequence_count);
  while (!preempted_.empty() && running_.size() < max_seqs) {
    Live& next = *preempted_.front();
    const Sequence& seq = *manager_->GetSequence(next.uid);
    // Its blocks back, one to grow into, and one for each running request — what the next
    // block_size decode steps need — above the reserve (unless nothing runs). Resuming at the
    // bare reserve preempted the next request a few steps later: 445 preemptions instead of 4
    // on `simulate --requests 2000 --blocks 8192 --rate 2`.
    const int32_t needed = seq.cur_allocated_blocks() - seq.released_blocks() + 1 +
                           static_cast<int32_t>(running_.size());
    if (!running_.empty() && manager_->free_blocks()[0] < needed + watermark_blocks_) break;
    Result<OffloadTicket> ticket = manager_->ResumeSequence(next.uid);
    if (!ticket.ok()) {
      if (ticket.status().code() == StatusCode::kResourceExhausted) break;
      return ticket.status();
    }
    // Not waited for: the next Schedule naming it waits for the copy.
    InsertByArrival(running_, std::move(preempted_.front()));
    preempted_.erase(preempted_.begin());
    ++stats_.resumes;
  }
  return Status::Ok();
}

Status Engine::RunStep(std::vector<Entry>& entries, StepRunner& runner) {
  const size_t n = entries.size();
  entry_requests_.resize(n);
  sample_.resize(n);
  next_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    // Entry i of the batch ScheduleStep built; it ends at the request's last known token when
    // the forward samples the next one.
    const RaggedBatch::Inserted entry = batch_->inserted(static_cast<int32_t>(i));
    entry_requests_[i] = entries[i].live->index;
    const int64_t end = entry.seen_tokens + std::ssize(entry.tokens);
    sample_[i] = end == std::ssize(entries[i].live->tokens) ? 1 : 0;
  }
  BLOCKKV_RETURN_IF_ERROR(runner.Run(*batch_, entry_requests_, sample_, next_));
  BLOCKKV_RETURN_IF_ERROR(manager_->PostForward(*batch_));
  for (size_t i = 0; i < n; ++i) {
    Live& live = *entries[i].live;
    const RaggedBatch::Inserted ran = batch_->inserted(static_cast<int32_t>(i));
    const int64_t end = ran.seen_tokens + std::ssize(ran.tokens);
    const int64_t prompt_part =
        std::max<int64_t>(0, std::min(end, live.prompt_len) - ran.seen_tokens);
    stats_.prompt_tokens += prompt_part;
    stats_.decode_tokens += std::ssize(ran.tokens) - prompt_part;
    live.computed = end;
    if (sample_[i] == 0) continue;
    live.tokens.push_back(next_[i]);
    if (options_.keep_outputs) outputs_[live.index].push_back(next_[i]);
    ++stats_.generated;
    if (++live.generated == live.output_len) {
      BLOCKKV_RETURN_IF_ERROR(manager_->FlushSequence(live.uid));
      ++stats_.finished;
      live.computed = -1;  // marks it for removal below
    }
  }
  std::erase_if(running_, [](const std::unique_ptr<Live>& l) { return l->computed < 0; });
  return Status::Ok();
}

void Engine::RecordStep() {
  ++stats_.steps;
  ++stats_.clock;
  const int32_t used = used_blocks();
  stats_.peak_used_blocks = std::max(stats_.peak_used_blocks, used);
  stats_.occupancy_sum += static_cast<double>(used) / stats_.num_blocks;
  if (const OffloadStore* store = manager_->offload_store()) {
    stats_.offloaded_blocks = store->stats().offloaded_blocks;
    stats_.restored_blocks = store->stats().restored_blocks;
    const StateManager::HostPrefixStats host = manager_->host_prefix_stats();
    stats_.host_demoted = host.demoted;
    stats_.host_promoted = host.promoted;
    stats_.host_dropped = host.dropped;
  }
  if (const PrefixCache* cache = manager_->prefix_cache()) {
    const PrefixCacheStats total = cache->total_stats();
    stats_.queried_tokens = total.queried_tokens;
    stats_.hit_tokens = total.hit_tokens;
    stats_.evictions = total.evictions;
  }
}

}  // namespace blockkv::tool
