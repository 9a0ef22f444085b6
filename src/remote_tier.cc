// SPDX-License-Identifier: Apache-2.0
#include "remote_tier.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <charconv>
#include <cstring>

#include "internal/strings.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace blockkv::internal {
namespace {

constexpr char kMagic[4] = {'B', 'K', 'V', 'R'};

template <typename T>
void Put(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(bytes, sizeof(T));
}

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  template <typename T>
  bool Get(T* v) {
    if (in_.size() - at_ < sizeof(T)) return false;
    std::memcpy(v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool Bytes(size_t n, std::string_view* out) {
    if (in_.size() - at_ < n) return false;
    *out = in_.substr(at_, n);
    at_ += n;
    return true;
  }
  size_t at() const { return at_; }

 private:
  std::string_view in_;
  size_t at_ = 0;
};

std::string Hex64(uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = kDigits[v & 15];
  return s;
}

bool ParseInt(std::string_view s, int lo, int hi, int* out) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

Reply Command(redisContext* ctx, const std::vector<std::string_view>& args) {
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const std::string_view a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  return Reply(static_cast<redisReply*>(
      redisCommandArgv(ctx, static_cast<int>(argv.size()), argv.data(), lens.data())));
}

}  // namespace

Result<RedisUrl> ParseRedisUrl(std::string_view url) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgumentError(StrCat("RemoteTierConfig.url \"", url, "\": ", why,
                                       " (expected redis://[user:password@]host:port[/db])"));
  };
  constexpr std::string_view kScheme = "redis://";
  if (url.substr(0, kScheme.size()) != kScheme) return bad("not a redis:// URL");
  std::string_view rest = url.substr(kScheme.size());
  RedisUrl out;
  if (const size_t at = rest.rfind('@'); at != std::string_view::npos) {
    const std::string_view auth = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = auth.find(':');
    if (colon == std::string_view::npos) {
      out.password = std::string(auth);
    } else {
      out.user = std::string(auth.substr(0, colon));
      out.password = std::string(auth.substr(colon + 1));
    }
    if (out.password.empty()) return bad("an empty password");
  }
  if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    if (!ParseInt(rest.substr(slash + 1), 0, 1 << 20, &out.db)) return bad("a bad database");
    rest = rest.substr(0, slash);
  }
  const size_t colon = rest.rfind(':');
  if (colon != std::string_view::npos) {
    if (!ParseInt(rest.substr(colon + 1), 1, 65535, &out.port)) return bad("a bad port");
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) return bad("no host");
  out.host = std::string(rest);
  return out;
}

std::string EncodeRemoteValue(const RemoteBlockMeta& m, size_t* payload_offset) {
  std::string v;
  v.reserve(96 + m.ns.size() + m.extra.size() + m.tokens.size() * sizeof(TokenId) +
            m.payload_bytes);
  v.append(kMagic, sizeof(kMagic));
  Put<uint32_t>(v, kRemoteValueVersion);
  Put<uint64_t>(v, m.fingerprint);
  Put<uint64_t>(v, m.key.lo);
  Put<uint64_t>(v, m.key.hi);
  Put<uint64_t>(v, m.parent_key.lo);
  Put<uint64_t>(v, m.parent_key.hi);
  Put<uint32_t>(v, m.index);
  Put<int64_t>(v, m.adapter_id);
  Put<uint32_t>(v, static_cast<uint32_t>(m.ns.size()));
  v.append(m.ns);
  Put<uint32_t>(v, static_cast<uint32_t>(m.extra.size()));
  v.append(m.extra);
  Put<uint32_t>(v, static_cast<uint32_t>(m.tokens.size()));
  for (const TokenId t : m.tokens) Put<int32_t>(v, t);
  Put<uint64_t>(v, m.payload_bytes);
  *payload_offset = v.size();
  v.resize(v.size() + m.payload_bytes);
  return v;
}

void SealRemoteValue(std::string& value) {
  Put<uint64_t>(value, XXH3_64bits(value.data(), value.size()));
}

int64_t VerifyRemoteValue(std::string_view value, const RemoteBlockMeta& want) {
  if (value.size() < sizeof(kMagic) + sizeof(uint64_t)) return -1;
  const std::string_view body = value.substr(0, value.size() - sizeof(uint64_t));
  uint64_t sum = 0;
  std::memcpy(&sum, value.data() + body.size(), sizeof(sum));
  if (sum != XXH3_64bits(body.data(), body.size())) return -1;
  Reader r(body);
  std::string_view magic;
  uint32_t version = 0;
  uint32_t index = 0;
  uint32_t n = 0;
  uint64_t fingerprint = 0;
  uint64_t payload = 0;
  int64_t adapter = 0;
  BlockHash key;
  BlockHash parent;
  std::string_view ns;
  std::string_view extra;
  std::string_view tokens;
  if (!r.Bytes(sizeof(kMagic), &magic) || magic != std::string_view(kMagic, sizeof(kMagic)) ||
      !r.Get(&version) || version != kRemoteValueVersion || !r.Get(&fingerprint) ||
      fingerprint != want.fingerprint || !r.Get(&key.lo) || !r.Get(&key.hi) || key != want.key ||
      !r.Get(&parent.lo) || !r.Get(&parent.hi) || parent != want.parent_key || !r.Get(&index) ||
      index != want.index || !r.Get(&adapter) || adapter != want.adapter_id || !r.Get(&n) ||
      !r.Bytes(n, &ns) || ns != want.ns || !r.Get(&n) || !r.Bytes(n, &extra) ||
      extra != want.extra || !r.Get(&n) || n != want.tokens.size() ||
      !r.Bytes(size_t{n} * sizeof(TokenId), &tokens) ||
      std::memcmp(tokens.data(), want.tokens.data(), tokens.size()) != 0 || !r.Get(&payload) ||
      payload != want.payload_bytes || body.size() - r.at() != payload) {
    return -1;
  }
  return static_cast<int64_t>(r.at());
}

std::string RemoteKey(uint64_t fingerprint, std::string_view ns, const BlockHash& key) {
  return StrCat("blockkv:{", Hex64(fingerprint), ":", Hex64(XXH3_64bits(ns.data(), ns.size())), ":",
                ToString(key), "}");
}

// ---- the client ----------------------------------------------------------------------------

Result<redisContext*> RemoteTier::Connect(const RedisUrl& url, int32_t timeout_ms) {
  const timeval tv{.tv_sec = timeout_ms / 1000,
                   .tv_usec = static_cast<suseconds_t>(timeout_ms % 1000) * 1000};
  redisContext* ctx = redisConnectWithTimeout(url.host.c_str(), url.port, tv);
  const std::string where = StrCat("redis at ", url.host, ":", url.port);
  if (ctx == nullptr) return UnavailableError(StrCat(where, ": cannot allocate a connection"));
  const auto fail = [&](StatusCode code, std::string_view why) -> Status {
    Status s(code, StrCat(where, ": ", why));
    redisFree(ctx);
    return s;
  };
  if (ctx->err != 0) return fail(StatusCode::kUnavailable, ctx->errstr);
  if (redisSetTimeout(ctx, tv) != REDIS_OK) return fail(StatusCode::kUnavailable, ctx->errstr);
  if (!url.password.empty()) {
    std::vector<std::string_view> args = {"AUTH"};
    if (!url.user.empty()) args.emplace_back(url.user);
    args.emplace_back(url.password);
    const Reply reply = Command(ctx, args);
    if (!reply) return fail(StatusCode::kUnavailable, StrCat("AUTH: ", ctx->errstr));
    if (reply->type == REDIS_REPLY_ERROR) {
      return fail(StatusCode::kPermissionDenied,
                  StrCat("AUTH as user \"", url.user.empty() ? "default" : url.user,
                         "\" refused: ", std::string_view(reply->str, reply->len)));
    }
  }
  if (url.db != 0) {
    const std::string db = std::to_string(url.db);
    const Reply reply = Command(ctx, {"SELECT", db});
    if (!reply) return fail(StatusCode::kUnavailable, StrCat("SELECT: ", ctx->errstr));
    if (reply->type == REDIS_REPLY_ERROR) {
      return fail(
          StatusCode::kInvalidArgument,
          StrCat("SELECT ", url.db, " refused: ", std::string_view(reply->str, reply->len)));
    }
  }
  return ctx;
}

Result<std::unique_ptr<RemoteTier>> RemoteTier::Open(const RemoteTierConfig& config) {
  if (config.timeout_ms <= 0) {
    return InvalidArgumentError(
        StrCat("RemoteTierConfig.timeout_ms is ", config.timeout_ms, "; it must be > 0"));
  }
  if (config.max_pending < 0) {
    return InvalidArgumentError(
        StrCat("RemoteTierConfig.max_pending is ", config.max_pending, "; it must be >= 0"));
  }
  if (config.tp_size < 1 || config.tp_rank < 0 || config.tp_rank >= config.tp_size) {
    return InvalidArgumentError(StrCat("RemoteTierConfig.tp_rank ", config.tp_rank,
                                       " is outside [0, tp_size=", config.tp_size, ")"));
  }
  BLOCKKV_ASSIGN_OR_RETURN(RedisUrl url, ParseRedisUrl(config.url));
  BLOCKKV_ASSIGN_OR_RETURN(redisContext * ctx, Connect(url, config.timeout_ms));
  return std::unique_ptr<RemoteTier>(new RemoteTier(config, std::move(url), ctx));
}

RemoteTier::RemoteTier(RemoteTierConfig config, RedisUrl url, redisContext* ctx)
    : config_(std::move(config)), url_(std::move(url)), ctx_(ctx) {
  connected_ = true;
  worker_ = std::thread([this] { Run(); });
}

RemoteTier::~RemoteTier() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  worker_.join();
  if (ctx_ != nullptr) redisFree(ctx_);
}

bool RemoteTier::Store(std::string key, std::string value) {
  {
    std::lock_guard lock(mu_);
    if (std::ssize(stores_) >= config_.max_pending) {
      ++dropped_;
      return false;
    }
    stores_.emplace_back(std::move(key), std::move(value));
  }
  work_cv_.notify_one();
  return true;
}

RemoteTier::Fetched RemoteTier::Fetch(std::vector<std::string> keys) {
  const size_t n = keys.size();
  auto job = std::make_shared<FetchJob>();
  job->keys = std::move(keys);
  std::unique_lock lock(mu_);
  fetches_.push_back(job);
  work_cv_.notify_one();
  if (!done_cv_.wait_for(lock, std::chrono::milliseconds(config_.timeout_ms),
                         [&] { return job->done; })) {
    // Late: a miss. The worker still runs it if it started (its result is dropped).
    std::erase(fetches_, job);
    ++errors_;
    return {.reply = nullptr, .values = std::vector<std::string_view>(n)};
  }
  return std::move(job->fetched);
}

void RemoteTier::Drain() {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return stores_.empty() && !storing_; });
}

void RemoteTier::CountLookup(int64_t hits, bool missed, int64_t invalid) {
  hits_ += hits;
  misses_ += missed ? 1 : 0;
  invalid_ += invalid;
}

RemoteTierStats RemoteTier::stats() const {
  return {.hits = hits_,
          .misses = misses_,
          .invalid = invalid_,
          .fetched_bytes = fetched_bytes_,
          .stored = stored_,
          .stored_bytes = stored_bytes_,
          .dropped = dropped_,
          .errors = errors_,
          .reconnects = reconnects_,
          .connected = connected_};
}

void RemoteTier::Run() {
  std::unique_lock lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || !fetches_.empty() || !stores_.empty(); });
    if (!fetches_.empty()) {
      const std::shared_ptr<FetchJob> job = fetches_.front();
      fetches_.pop_front();
      std::vector<std::string> keys = job->keys;
      lock.unlock();
      FetchJob result{.keys = std::move(keys), .fetched = {}};
      DoFetch(result);
      lock.lock();
      job->fetched = std::move(result.fetched);
      job->done = true;
      done_cv_.notify_all();
      continue;
    }
    if (stores_.empty()) {
      if (stop_) break;
      continue;
    }
    std::vector<std::pair<std::string, std::string>> batch;
    while (!stores_.empty() && batch.size() < kStoreBatch) {
      batch.push_back(std::move(stores_.front()));
      stores_.pop_front();
    }
    storing_ = true;
    lock.unlock();
    DoStores(batch);
    lock.lock();
    storing_ = false;
    done_cv_.notify_all();
  }
}

bool RemoteTier::EnsureConnected() {
  if (ctx_ != nullptr) return true;
  const auto now = std::chrono::steady_clock::now();
  if (now < retry_at_) return false;
  Result<redisContext*> ctx = Connect(url_, config_.timeout_ms);
  if (!ctx.ok()) {
    ++errors_;
    retry_at_ = now + backoff_;
    backoff_ = std::min<std::chrono::milliseconds>(backoff_ * 2, std::chrono::seconds(2));
    return false;
  }
  ctx_ = *ctx;
  backoff_ = std::chrono::milliseconds(50);
  ++reconnects_;
  connected_ = true;
  return true;
}

void RemoteTier::Disconnect() {
  ++errors_;
  redisFree(ctx_);
  ctx_ = nullptr;
  connected_ = false;
  retry_at_ = std::chrono::steady_clock::now();  // the next command tries once at once
}

void RemoteTier::DoFetch(FetchJob& job) {
  job.fetched.values.assign(job.keys.size(), std::string_view());
  if (!EnsureConnected()) return;
  std::vector<std::string_view> args = {"MGET"};
  args.insert(args.end(), job.keys.begin(), job.keys.end());
  Reply reply = Command(ctx_, args);
  if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements != job.keys.size()) {
    Disconnect();
    return;
  }
  for (size_t i = 0; i < reply->elements; ++i) {
    const redisReply* e = reply->element[i];
    if (e->type != REDIS_REPLY_STRING) continue;
    job.fetched.values[i] = std::string_view(e->str, e->len);
    fetched_bytes_ += static_cast<int64_t>(e->len);
  }
  job.fetched.reply = std::shared_ptr<const redisReply>(reply.release(), ReplyDeleter());
}

void RemoteTier::DoStores(std::vector<std::pair<std::string, std::string>>& batch) {
  if (!EnsureConnected()) {
    dropped_ += std::ssize(batch);
    return;
  }
  for (const auto& [key, value] : batch) {
    const char* argv[] = {"SET", key.data(), value.data()};
    const size_t lens[] = {3, key.size(), value.size()};
    if (redisAppendCommandArgv(ctx_, 3, argv, lens) != REDIS_OK) {
      dropped_ += std::ssize(batch);
      Disconnect();
      return;
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(ctx_, &raw) != REDIS_OK) {
      dropped_ += static_cast<int64_t>(batch.size() - i);
      Disconnect();
      return;
    }
    const Reply reply(static_cast<redisReply*>(raw));
    if (reply->type == REDIS_REPLY_ERROR) {
      ++errors_;
      ++dropped_;
      continue;
    }
    ++stored_;
    stored_bytes_ += static_cast<int64_t>(batch[i].second.size());
  }
}

}  // namespace blockkv::internal
