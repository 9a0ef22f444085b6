// SPDX-License-Identifier: Apache-2.0
#include "remote_tier.h"

#include <hiredis/hiredis.h>  // redisReply (hiredis parses; RedisConnection reads and writes)

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "blockkv/log.h"
#include "internal/checksum.h"
#include "internal/strings.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace blockkv::internal {
namespace {

constexpr char kMagic[4] = {'B', 'K', 'V', 'R'};
constexpr int kClusterSlots = 16384;
constexpr int kMaxRedirects = 5;

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

void AppendDecimal(std::string& out, size_t v) {
  char digits[24];
  const std::to_chars_result r = std::to_chars(std::begin(digits), std::end(digits), v);
  out.append(digits, r.ptr);
}

template <typename T>
bool ParseInt(std::string_view s, T lo, T hi, T* out) {
  T v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

// One node's SETs written straight from their buffers (RedisConnection::WriteNow: sendmsg, or TLS
// records), where formatting them as commands would first copy every value into an output buffer:
// a store of 2 MiB blocks spends its time copying bytes, so this saves one copy of each. Nothing
// is queued on the connection here (every command before was flushed), so the commands go out
// in order; the replies are read with GetReply as usual. Built in place and never moved (the
// iovecs point into `heads`).
class SetWriter {
 public:
  SetWriter() = default;
  SetWriter(const SetWriter&) = delete;
  SetWriter& operator=(const SetWriter&) = delete;

  void Start(RedisConnection* conn, std::span<const RemoteTier::PendingStore* const> items) {
    static constexpr char kCrlf[] = "\r\n";
    conn_ = conn;
    heads_.reserve(items.size());
    iov_.reserve(items.size() * 3);
    for (const RemoteTier::PendingStore* item : items) {
      std::string& head = heads_.emplace_back("*3\r\n$3\r\nSET\r\n$");
      AppendDecimal(head, item->key.size());
      head.append("\r\n").append(item->key).append("\r\n$");
      AppendDecimal(head, item->size);
      head.append("\r\n");
      iov_.push_back({.iov_base = head.data(), .iov_len = head.size()});
      iov_.push_back({.iov_base = item->value.data.get(), .iov_len = item->size});
      iov_.push_back({.iov_base = const_cast<char*>(kCrlf), .iov_len = 2});
    }
  }
  bool done() const { return at_ == iov_.size() && !conn_->WritePending(); }
  int fd() const { return conn_->fd(); }
  short events() const { return conn_->Events(); }
  // Writes what the connection takes now, without waiting; false when it failed.
  bool WriteSome() {
    while (!done()) {
      const ssize_t n = conn_->WriteNow(std::span<const iovec>(iov_).subspan(at_));
      if (n < 0) return false;
      if (n == 0) return true;  // full: poll
      for (auto left = static_cast<size_t>(n); left > 0;) {
        if (left >= iov_[at_].iov_len) {
          left -= iov_[at_].iov_len;
          ++at_;
        } else {
          iov_[at_].iov_base = static_cast<char*>(iov_[at_].iov_base) + left;
          iov_[at_].iov_len -= left;
          left = 0;
        }
      }
      while (at_ < iov_.size() && iov_[at_].iov_len == 0) ++at_;
    }
    return true;
  }

 private:
  RedisConnection* conn_ = nullptr;
  std::vector<std::string> heads_;
  std::vector<iovec> iov_;
  size_t at_ = 0;
};

// Writes every started writer to its end, feeding whichever sockets have room (a node whose
// buffer is full does not hold the others back: every server receives at once). Sets failed[i]
// for a writer whose socket failed or took nothing for `timeout_ms`; what was written to it then
// is unknown, so the caller disconnects it.
void WriteAllSets(std::span<SetWriter*> writers, int32_t timeout_ms, std::vector<uint8_t>& failed) {
  std::vector<pollfd> fds;
  std::vector<size_t> which;
  while (true) {
    fds.clear();
    which.clear();
    for (size_t i = 0; i < writers.size(); ++i) {
      if (failed[i] != 0 || writers[i]->done()) continue;
      fds.push_back({.fd = writers[i]->fd(), .events = writers[i]->events(), .revents = 0});
      which.push_back(i);
    }
    if (fds.empty()) return;
    const int ready = poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno == EINTR) continue;
    for (size_t f = 0; f < fds.size(); ++f) {
      // ready <= 0: nothing took a byte in timeout_ms (or poll failed).
      const bool ok = ready > 0 && (fds[f].revents == 0 || writers[which[f]]->WriteSome());
      if (!ok) failed[which[f]] = 1;
    }
  }
}

// What a fetch's values point into: parsed replies (redirects followed), and the buffers that
// ReadValue read values into, given back to the tier's ValueBuffers when the last view goes.
struct FetchedBuffers {
  std::vector<Reply> replies;
  std::vector<ValueBuffers::Buffer> values;
  std::shared_ptr<ValueBuffers> pool;
  explicit FetchedBuffers(std::shared_ptr<ValueBuffers> p) : pool(std::move(p)) {}
  FetchedBuffers(const FetchedBuffers&) = delete;
  FetchedBuffers& operator=(const FetchedBuffers&) = delete;
  ~FetchedBuffers() {
    for (ValueBuffers::Buffer& b : values) pool->Give(std::move(b));
  }
};

// Reads a RESP reply from a connection through a staging buffer for its framing; a bulk string's
// bytes go from the connection straight to where they are kept (a reply parser reads everything
// into its buffer and copies each value out of it again: one copy of every fetched byte saved).
// Each read waits the connection's timeout at most.
class SocketReader {
 public:
  explicit SocketReader(RedisConnection& conn) : conn_(conn) {}
  // The next line, without its CRLF; false when the socket fails, closes or times out, or the
  // line runs past the staging buffer.
  bool Line(std::string_view* line) {
    while (true) {
      const std::string_view have(buf_.data() + begin_, end_ - begin_);
      const size_t crlf = have.find("\r\n");
      if (crlf != std::string_view::npos) {
        *line = have.substr(0, crlf);
        begin_ += crlf + 2;
        return true;
      }
      if (!Fill()) return false;
    }
  }
  // Exactly n bytes into dst, then the CRLF that ends a bulk string. With `hash`, the first
  // `hashed` bytes are fed to it as they arrive, a piece at a time while it is still in cache.
  bool Bulk(char* dst, size_t n, Checksum64Stream* hash = nullptr, size_t hashed = 0) {
    const auto feed = [&](size_t from, size_t to) {
      if (hash != nullptr && from < hashed) hash->Update(dst + from, std::min(to, hashed) - from);
    };
    const size_t staged = std::min(n, end_ - begin_);
    std::memcpy(dst, buf_.data() + begin_, staged);
    begin_ += staged;
    feed(0, staged);
    for (size_t at = staged; at < n;) {
      const ssize_t got = conn_.Read(dst + at, std::min(n - at, kPiece));
      if (got <= 0) return false;
      feed(at, at + static_cast<size_t>(got));
      at += static_cast<size_t>(got);
    }
    std::string_view crlf;
    return Line(&crlf) && crlf.empty();
  }
  bool Drained() const { return begin_ == end_; }

 private:
  bool Fill() {
    if (begin_ > 0) {  // keep the unread part at the front
      std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
    }
    while (end_ < buf_.size()) {
      const ssize_t got = conn_.Read(buf_.data() + end_, buf_.size() - end_);
      if (got <= 0) return false;
      end_ += static_cast<size_t>(got);
      return true;
    }
    return false;  // a line longer than the buffer: not a reply of ours
  }
  static constexpr size_t kPiece = size_t{256} << 10;  // the most one recv reads into a value
  RedisConnection& conn_;
  std::vector<char> buf_ = std::vector<char>(size_t{64} << 10);
  size_t begin_ = 0;
  size_t end_ = 0;
};

enum class ReplyRead { kValue, kNil, kError, kBroken };

constexpr int64_t kMaxValueBytes = int64_t{512} << 20;

// One reply to GET (or one element of MGET's): a bulk string, read into a buffer of its own in
// `owned` (*value viewing it, *checksum_ok saying whether its trailing XXH3-64 matches the bytes
// before it, hashed as they arrived), nil, or an error (*error viewing its text until the next
// read). kBroken: the connection failed or the reply is not one of those.
ReplyRead ReadValue(SocketReader& in, FetchedBuffers& owned, std::string_view* value,
                    bool* checksum_ok, std::string_view* error) {
  std::string_view line;
  if (!in.Line(&line) || line.empty()) return ReplyRead::kBroken;
  if (line[0] == '-') {
    *error = line.substr(1);
    return ReplyRead::kError;
  }
  if (line == "$-1") return ReplyRead::kNil;
  int64_t len = 0;
  // At most Redis's own limit on a string (proto-max-bulk-len's default): a longer length is
  // not a value of ours, and allocating it could throw.
  if (line[0] != '$' || !ParseInt(line.substr(1), int64_t{0}, kMaxValueBytes, &len)) {
    return ReplyRead::kBroken;
  }
  const auto n = static_cast<size_t>(len);
  ValueBuffers::Buffer buffer = owned.pool->Take(n);
  Checksum64Stream hash;
  const bool summed = n >= sizeof(uint64_t);
  char* const data = buffer.data.get();
  owned.values.push_back(std::move(buffer));  // given back to the pool even when broken
  if (!in.Bulk(data, n, summed ? &hash : nullptr, summed ? n - sizeof(uint64_t) : 0)) {
    return ReplyRead::kBroken;
  }
  uint64_t sum = 0;
  if (summed) std::memcpy(&sum, data + n - sizeof(uint64_t), sizeof(sum));
  *checksum_ok = summed && sum == hash.Digest();
  *value = std::string_view(data, n);
  return ReplyRead::kValue;
}

// An error reply's text "MOVED <slot> <host>:<port>" or "ASK <slot> <host>:<port>".
bool ParseRedirect(std::string_view err, bool* ask, std::string* host, int* port) {
  if (err.starts_with("MOVED ")) {
    *ask = false;
  } else if (err.starts_with("ASK ")) {
    *ask = true;
  } else {
    return false;
  }
  const std::string_view where = err.substr(err.rfind(' ') + 1);
  const size_t colon = where.rfind(':');
  if (colon == std::string_view::npos || colon == 0 ||
      !ParseInt(where.substr(colon + 1), 1, 65535, port)) {
    return false;
  }
  *host = std::string(where.substr(0, colon));
  return true;
}
bool ParseRedirect(const redisReply& reply, bool* ask, std::string* host, int* port) {
  return reply.type == REDIS_REPLY_ERROR &&
         ParseRedirect(std::string_view(reply.str, reply.len), ask, host, port);
}

// RFC 3986's percent-decoding of a URL's user or password ("p%40ss" is "p@ss"); false on a '%'
// not followed by two hex digits.
bool PercentDecode(std::string_view in, std::string* out) {
  out->clear();
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    const int hi = i + 2 < in.size() ? hex(in[i + 1]) : -1;
    const int lo = i + 2 < in.size() ? hex(in[i + 2]) : -1;
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return true;
}

}  // namespace

Result<RedisUrl> ParseRedisUrl(std::string_view url) {
  // The URL as errors show it: the password, if any, replaced by "***".
  std::string shown(url);
  if (const size_t at = url.rfind('@'); at != std::string_view::npos) {
    const size_t start = url.find("://") == std::string_view::npos ? 0 : url.find("://") + 3;
    const size_t colon = url.find(':', start);
    if (start <= at && colon != std::string_view::npos && colon < at) {
      shown = StrCat(url.substr(0, colon + 1), "***", url.substr(at));
    }
  }
  const auto bad = [&](std::string_view why) {
    return InvalidArgumentError(StrCat("RemoteTierConfig.url \"", shown, "\": ", why,
                                       " (expected redis://[user:password@]host:port[/db], or "
                                       "redis+cluster://[user:password@]host:port[,host:port...] "
                                       "for a Redis Cluster, redis+sentinel://[user:password@]"
                                       "host:port[,host:port...]/master_name[/db] for the master "
                                       "sentinels watch, or unix://[user:password@]/path/to/"
                                       "redis.sock[?db=N] for a server's unix socket; "
                                       "rediss for redis over TLS)"));
  };
  RedisUrl out;
  // The database number, after the path's '/' or a socket's "db=".
  const auto parse_db = [&](std::string_view text) -> Status {
    if (ParseInt(text, 0, 1 << 20, &out.db)) return Status::Ok();
    return bad(StrCat("a bad database \"", text, "\""));
  };
  // "rediss" for "redis": the same form over TLS.
  struct Scheme {
    std::string_view prefix;
    bool tls = false;
    bool cluster = false;
    bool sentinel = false;
    bool unix_socket = false;
  };
  static constexpr Scheme kSchemes[] = {
      {.prefix = "redis://"},
      {.prefix = "rediss://", .tls = true},
      {.prefix = "redis+cluster://", .cluster = true},
      {.prefix = "rediss+cluster://", .tls = true, .cluster = true},
      {.prefix = "redis+sentinel://", .sentinel = true},
      {.prefix = "rediss+sentinel://", .tls = true, .sentinel = true},
      {.prefix = "unix://", .unix_socket = true},
  };
  const auto scheme = std::find_if(std::begin(kSchemes), std::end(kSchemes),
                                   [&](const Scheme& s) { return url.starts_with(s.prefix); });
  if (scheme == std::end(kSchemes)) return bad("not a redis:// URL (nor redis+cluster://)");
  out.tls = scheme->tls;
  out.cluster = scheme->cluster;
  out.unix_socket = scheme->unix_socket;
  const bool sentinel = scheme->sentinel;
  std::string_view rest = url.substr(scheme->prefix.size());
  // rediss: the query of TLS settings, from the first '?' on (as RFC 3986 and redis-py have it: a
  // '?' in a password is written %3F).
  if (const size_t q = out.unix_socket ? std::string_view::npos : rest.find('?');
      q != std::string_view::npos) {
    std::string_view query = rest.substr(q + 1);
    rest = rest.substr(0, q);
    while (!query.empty()) {
      const std::string_view item = query.substr(0, query.find('&'));
      query = item.size() == query.size() ? std::string_view() : query.substr(item.size() + 1);
      const size_t eq = item.find('=');
      const std::string_view name = item.substr(0, eq);
      std::string value;
      if (eq == std::string_view::npos || !PercentDecode(item.substr(eq + 1), &value)) {
        return bad(StrCat("a query item \"", item, "\" that is not name=value"));
      }
      if (!out.tls && name.starts_with("ssl_")) {
        return bad(StrCat("\"", name, "\" is for TLS: a rediss:// URL"));
      }
      const auto flag = [&](std::string_view yes, std::string_view no, bool* v) -> Status {
        if (value == yes || value == no) {
          *v = value == yes;
          return Status::Ok();
        }
        return bad(StrCat(name, "=", value, ": ", yes, " or ", no));
      };
      TlsOptions& tls = out.tls_options;
      if (name == "ssl_ca_certs") {
        tls.ca_file = value;
      } else if (name == "ssl_certfile") {
        tls.cert_file = value;
      } else if (name == "ssl_keyfile") {
        tls.key_file = value;
      } else if (name == "ssl_server_name") {
        tls.server_name = value;
      } else if (name == "ssl_cert_reqs") {
        if (value == "optional") value = "required";  // a client's "optional" checks as required
        BLOCKKV_RETURN_IF_ERROR(flag("required", "none", &tls.verify));
        if (!tls.verify) tls.check_hostname = false;
      } else if (name == "ssl_check_hostname") {
        BLOCKKV_RETURN_IF_ERROR(flag("true", "false", &tls.check_hostname));
      } else {
        return bad(StrCat("an unknown query item \"", name,
                          "\" (rediss:// takes ssl_ca_certs, ssl_certfile, ssl_keyfile, "
                          "ssl_cert_reqs, ssl_check_hostname, ssl_server_name)"));
      }
    }
  }
  // The credentials end at the last '@' (at the first "@/" for a unix socket, whose path may hold
  // an '@' of its own).
  if (const size_t at = out.unix_socket
                            ? (rest.starts_with('/') ? std::string_view::npos : rest.find("@/"))
                            : rest.rfind('@');
      at != std::string_view::npos) {
    const std::string_view auth = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = auth.find(':');
    // Percent-encoded as URLs are (a password with '@', ':' or '/' in it: %40, %3A, %2F).
    if (!PercentDecode(colon == std::string_view::npos ? auth : auth.substr(colon + 1),
                       &out.password)) {
      return bad("a '%' in the password not followed by two hex digits (write '%' as %25)");
    }
    if (colon != std::string_view::npos && !PercentDecode(auth.substr(0, colon), &out.user)) {
      return bad(StrCat("a '%' in the user \"", auth.substr(0, colon),
                        "\" not followed by two hex digits (write '%' as %25)"));
    }
    if (out.password.empty()) return bad("an empty password");
  }
  if (out.unix_socket) {
    const size_t query = rest.find('?');
    const std::string_view path = rest.substr(0, query);
    if (!path.starts_with('/') || path.size() < 2) {
      return bad(StrCat("the socket's path \"", path, "\" is not absolute (unix:///path/to/sock)"));
    }
    if (query != std::string_view::npos) {
      const std::string_view q = rest.substr(query + 1);
      if (!q.starts_with("db=")) {
        return bad(StrCat("a query \"", q, "\": only db=N is understood"));
      }
      BLOCKKV_RETURN_IF_ERROR(parse_db(q.substr(3)));
    }
    out.hosts.push_back({.host = std::string(path), .port = 0});
    return out;
  }
  if (sentinel) {  // host:port[,host:port...]/master_name[/db]
    const size_t slash = rest.find('/');
    if (slash == std::string_view::npos || slash + 1 == rest.size()) {
      return bad("no master name (redis+sentinel://host:port/master_name)");
    }
    std::string_view name = rest.substr(slash + 1);
    if (const size_t db = name.find('/'); db != std::string_view::npos) {
      BLOCKKV_RETURN_IF_ERROR(parse_db(name.substr(db + 1)));
      name = name.substr(0, db);
    }
    if (name.empty()) return bad("no master name (redis+sentinel://host:port/master_name)");
    out.sentinel_master = std::string(name);
    rest = rest.substr(0, slash);
  } else if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    if (out.cluster) {
      return bad(
          StrCat("a database \"", rest.substr(slash), "\": a Redis Cluster has database 0 only"));
    }
    BLOCKKV_RETURN_IF_ERROR(parse_db(rest.substr(slash + 1)));
    rest = rest.substr(0, slash);
  }
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view part = rest.substr(0, comma);
    RedisUrl::HostPort hp{.host = {}, .port = sentinel ? 26379 : 6379};
    std::string_view host = part;
    std::optional<std::string_view> port;  // what follows the host's ':'
    if (part.starts_with('[')) {           // an IPv6 address: [::1] or [::1]:6379
      const size_t close = part.find(']');
      if (close == std::string_view::npos) return bad(StrCat("no ']' in \"", part, "\""));
      host = part.substr(1, close - 1);
      const std::string_view after = part.substr(close + 1);
      if (after.starts_with(':')) {
        port = after.substr(1);
      } else if (!after.empty()) {
        return bad(StrCat("\"", after, "\" after the address in \"", part, "\""));
      }
    } else if (const size_t colon = part.rfind(':'); colon != std::string_view::npos) {
      if (part.find(':') != colon) {
        return bad(StrCat("\"", part, "\": an IPv6 address is written in brackets, [::1]:6379"));
      }
      host = part.substr(0, colon);
      port = part.substr(colon + 1);
    }
    if (port && !ParseInt(*port, 1, 65535, &hp.port)) {
      return bad(StrCat("a bad port \"", *port, "\" in \"", part, "\" (1 to 65535)"));
    }
    if (host.empty()) {
      return bad(part.empty() ? std::string("no host") : StrCat("no host in \"", part, "\""));
    }
    hp.host = std::string(host);
    out.hosts.push_back(std::move(hp));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  if (!out.cluster && !sentinel && out.hosts.size() > 1) {
    return bad(StrCat(out.hosts.size(),
                      " hosts: a Redis Cluster's seed nodes are given as "
                      "redis+cluster://host:port,host:port"));
  }
  return out;
}

int KeySlot(std::string_view key) {
  if (const size_t open = key.find('{'); open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  // CRC16-CCITT (XMODEM): polynomial 0x1021, initial 0, as Redis Cluster has; a byte at a time.
  static constexpr std::array<uint16_t, 256> kTable = [] {
    std::array<uint16_t, 256> table{};
    for (size_t byte = 0; byte < table.size(); ++byte) {
      auto crc = static_cast<uint16_t>(byte << 8);
      for (int bit = 0; bit < 8; ++bit) {
        crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                                  : static_cast<uint16_t>(crc << 1);
      }
      table[byte] = crc;
    }
    return table;
  }();
  uint16_t crc = 0;
  for (const char c : key) {
    crc = static_cast<uint16_t>((crc << 8) ^ kTable[((crc >> 8) ^ static_cast<uint8_t>(c)) & 0xff]);
  }
  return crc & (kClusterSlots - 1);
}

std::string EncodeRemoteHeader(const RemoteBlockMeta& m) {
  std::string v;
  v.reserve(96 + m.ns.size() + m.extra.size() + m.tokens.size() * sizeof(TokenId));
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
  return v;
}

void SealRemoteValue(char* value, size_t size) {
  const uint64_t sum = Checksum64(value, size);
  std::memcpy(value + size, &sum, sizeof(sum));
}

void SealRemoteValue(std::string& value) {
  const size_t size = value.size();
  value.resize(size + kRemoteChecksumBytes);
  SealRemoteValue(value.data(), size);
}

bool RemoteValueChecksumOk(std::string_view value) {
  if (value.size() < sizeof(uint64_t)) return false;
  const std::string_view body = value.substr(0, value.size() - sizeof(uint64_t));
  uint64_t sum = 0;
  std::memcpy(&sum, value.data() + body.size(), sizeof(sum));
  return sum == Checksum64(body.data(), body.size());
}

int64_t VerifyRemoteValue(std::string_view value, const RemoteBlockMeta& want, bool checksum_ok) {
  if (value.size() < sizeof(kMagic) + sizeof(uint64_t)) return -1;
  if (!checksum_ok && !RemoteValueChecksumOk(value)) return -1;
  const std::string_view body = value.substr(0, value.size() - sizeof(uint64_t));
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

// Built in place, not with StrCat: a prompt's lookup and its stores make one per block on the
// scheduling thread, and a string stream costs about a microsecond each.
std::string RemoteKey(uint64_t fingerprint, std::string_view ns, const BlockHash& key) {
  std::string out;
  out.reserve(76);
  out.append("blockkv:{");
  AppendHex64(out, fingerprint);
  out.push_back(':');
  AppendHex64(out, XXH3_64bits(ns.data(), ns.size()));
  out.push_back(':');
  AppendHex64(out, key.hi);
  AppendHex64(out, key.lo);
  out.push_back('}');
  return out;
}

// ---- the client ----------------------------------------------------------------------------

ValueBuffers::Buffer ValueBuffers::Take(size_t n) {
  {
    const std::lock_guard lock(mu_);
    // The smallest kept buffer that holds n bytes, if it is not more than twice as large.
    const auto it = free_.lower_bound(n);
    if (it != free_.end() && it->first / 2 <= n) {
      Buffer b{.data = std::move(it->second), .capacity = it->first};
      free_.erase(it);
      bytes_ -= b.capacity;
      return b;
    }
  }
  return {.data = std::make_unique_for_overwrite<char[]>(n), .capacity = n};
}

void ValueBuffers::Give(Buffer b) {
  const std::lock_guard lock(mu_);
  if (b.data == nullptr || bytes_ + b.capacity > max_bytes_) return;  // freed
  bytes_ += b.capacity;
  free_.emplace(b.capacity, std::move(b.data));
}

Result<std::unique_ptr<RedisConnection>> RemoteTier::Connect(const RedisUrl& url,
                                                             const std::string& host,
                                                             int port) const {
  BLOCKKV_ASSIGN_OR_RETURN(std::unique_ptr<RedisConnection> conn,
                           RedisConnection::Open(host, port, config_.timeout_ms, tls_.get()));
  const std::string where = StrCat("redis at ", HostPortText(host, port));
  if (!url.password.empty()) {
    std::vector<std::string_view> args = {"AUTH"};
    if (!url.user.empty()) args.emplace_back(url.user);
    args.emplace_back(url.password);
    const Reply reply = conn->Command(args);
    if (!reply) return UnavailableError(StrCat(where, ": AUTH: ", conn->error()));
    if (reply->type == REDIS_REPLY_ERROR) {
      return PermissionDeniedError(
          StrCat(where, ": AUTH as user \"", url.user.empty() ? "default" : url.user,
                 "\" refused: ", std::string_view(reply->str, reply->len)));
    }
  }
  if (url.db != 0) {
    const std::string db = std::to_string(url.db);
    const Reply reply = conn->Command({"SELECT", db});
    if (!reply) return UnavailableError(StrCat(where, ": SELECT: ", conn->error()));
    if (reply->type == REDIS_REPLY_ERROR) {
      return InvalidArgumentError(StrCat(where, ": SELECT ", url.db,
                                         " refused: ", std::string_view(reply->str, reply->len)));
    }
  }
  return conn;
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
  std::shared_ptr<TlsContext> tls;
  if (url.tls) {
    BLOCKKV_ASSIGN_OR_RETURN(tls, TlsContext::Create(url.tls_options));
  }
  std::unique_ptr<RemoteTier> tier(new RemoteTier(config, std::move(url)));
  tier->tls_ = std::move(tls);
  // A server that cannot be reached now is connected later by the worker that needs it (after a
  // backoff), as one that went away is; only one that answers and refuses fails here.
  if (const Status s = tier->Start(tier->fetch_lane_, /*connect=*/true); !s.ok()) {
    if (s.code() != StatusCode::kUnavailable) return s;
    tier->unreachable_ = std::string(s.message());
  }
  // The stores' own connections; not tried when the fetches' could not be made (each connect can
  // take timeout_ms), nor an error when they cannot be made now.
  if (const Status s = tier->Start(tier->store_lane_, /*connect=*/tier->unreachable_.empty());
      !s.ok() && s.code() != StatusCode::kUnavailable) {
    return s;
  }
  RemoteTier* t = tier.get();
  tier->fetch_worker_ = std::thread([t] { t->RunFetches(); });
  tier->store_worker_ = std::thread([t] { t->RunStores(); });
  return tier;
}

RemoteTier::RemoteTier(RemoteTierConfig config, RedisUrl url)
    : config_(std::move(config)), url_(std::move(url)) {}

RemoteTier::~RemoteTier() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  fetch_cv_.notify_all();
  store_cv_.notify_all();
  if (fetch_worker_.joinable()) fetch_worker_.join();
  if (store_worker_.joinable()) store_worker_.join();
}

Status RemoteTier::Start(Lane& lane, bool connect) {
  Status last = UnavailableError("no host");
  const bool sentinel = !url_.sentinel_master.empty();
  if (!url_.cluster) {  // the one node, connected now or after its backoff
    // (The sentinels' master: its address is asked of them at each connect.)
    lane.nodes[NodeAt(lane, sentinel ? "" : url_.hosts[0].host, sentinel ? 0 : url_.hosts[0].port)]
        ->slots = kClusterSlots;
    lane.num_nodes = 1;
  } else {
    lane.refresh_needed = true;  // until a slot map is read
  }
  if (!connect) return UnavailableError("left to the worker");
  std::vector<RedisUrl::HostPort> master;  // sentinels: the one they name
  if (sentinel) {
    BLOCKKV_RETURN_IF_ERROR(ResolveMaster(*lane.nodes[0]));
    master.push_back({lane.nodes[0]->host, lane.nodes[0]->port});
  }
  for (const RedisUrl::HostPort& seed : sentinel ? master : url_.hosts) {
    Result<std::unique_ptr<RedisConnection>> conn = Connect(url_, seed.host, seed.port);
    if (!conn.ok()) {
      if (conn.status().code() != StatusCode::kUnavailable) return conn.status();
      last = conn.status();
      continue;
    }
    Node& node = url_.cluster ? *lane.nodes[NodeAt(lane, seed.host, seed.port)] : *lane.nodes[0];
    node.conn = std::move(*conn);
    node.ever_connected = true;
    if (!url_.cluster) {
      lane.connected = true;
      return Status::Ok();
    }
    BLOCKKV_RETURN_IF_ERROR(RefreshSlots(lane));
    lane.refresh_needed = false;
    for (const std::unique_ptr<Node>& n : lane.nodes) {
      if (n->slots > 0) EnsureConnected(lane, *n);  // one that fails is retried after its backoff
    }
    UpdateConnected(lane);
    return Status::Ok();
  }
  if (url_.cluster && url_.hosts.size() > 1) {
    std::string seeds;
    for (const RedisUrl::HostPort& seed : url_.hosts) {
      seeds += StrCat(seeds.empty() ? "" : ", ", HostPortText(seed.host, seed.port));
    }
    return UnavailableError(
        StrCat("no seed of the cluster answered (", seeds, "); the last: ", last.message()));
  }
  return last;
}

size_t RemoteTier::NodeAt(Lane& lane, std::string_view host, int port) {
  std::string name(host);
  name.push_back(':');
  AppendDecimal(name, static_cast<size_t>(static_cast<uint32_t>(port)));
  if (const auto it = lane.node_index.find(name); it != lane.node_index.end()) return it->second;
  if (lane.nodes.size() >= kMaxNodes) return kNoNode;
  auto node = std::make_unique<Node>();
  node->host = std::string(host);
  node->port = port;
  lane.nodes.push_back(std::move(node));
  lane.node_index.emplace(std::move(name), lane.nodes.size() - 1);
  return lane.nodes.size() - 1;
}

int RemoteTier::NodeFor(const Lane& lane, std::string_view key) const {
  if (!url_.cluster) return 0;
  return lane.slots.empty() ? -1 : lane.slots[static_cast<size_t>(KeySlot(key))];
}

Status RemoteTier::RefreshSlots(Lane& lane) {
  // Ask a connected node first, then every other known node and the seeds.
  std::vector<size_t> order;
  for (size_t i = 0; i < lane.nodes.size(); ++i) {
    if (lane.nodes[i]->conn != nullptr) order.push_back(i);
  }
  for (size_t i = 0; i < lane.nodes.size(); ++i) {
    if (lane.nodes[i]->conn == nullptr) order.push_back(i);
  }
  for (const RedisUrl::HostPort& seed : url_.hosts) {
    const size_t i = NodeAt(lane, seed.host, seed.port);
    if (i != kNoNode && std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
  }
  for (const size_t i : order) {
    Node& asked = *lane.nodes[i];
    if (!EnsureConnected(lane, asked)) continue;
    const Reply reply = asked.conn->Command({"CLUSTER", "SLOTS"});
    if (!reply) {
      Disconnect(lane, asked);
      continue;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
      return InvalidArgumentError(StrCat(
          "redis at ", HostPortText(asked.host, asked.port),
          ": CLUSTER SLOTS refused: ", std::string_view(reply->str, reply->len),
          " (a redis+cluster:// URL needs a Redis Cluster; a standalone server is redis://)"));
    }
    Served(asked);
    if (reply->type != REDIS_REPLY_ARRAY) continue;
    // A master or replica entry [host, port, ...]: its node, or kNoNode when malformed (or past
    // kMaxNodes). A node that does not know its address gives "" or "?": the one asked.
    const auto node_of = [&](const redisReply* e) {
      if (e->type != REDIS_REPLY_ARRAY || e->elements < 2 ||
          e->element[0]->type != REDIS_REPLY_STRING || e->element[1]->type != REDIS_REPLY_INTEGER) {
        return kNoNode;
      }
      std::string_view host(e->element[0]->str, e->element[0]->len);
      if (host.empty() || host == "?") host = asked.host;
      return NodeAt(lane, host, static_cast<int>(e->element[1]->integer));
    };
    std::vector<int16_t> slots(kClusterSlots, -1);
    std::vector<std::pair<int16_t, int16_t>> replicas;  // (master, replica)
    for (size_t r = 0; r < reply->elements; ++r) {
      const redisReply* range = reply->element[r];
      if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 ||
          range->element[0]->type != REDIS_REPLY_INTEGER ||
          range->element[1]->type != REDIS_REPLY_INTEGER) {
        continue;
      }
      // [first, last, master, replica...]
      const size_t owner = node_of(range->element[2]);
      if (owner == kNoNode) continue;  // its slots have no owner: their keys miss
      const auto index = static_cast<int16_t>(owner);
      const auto first = std::max<long long>(range->element[0]->integer, 0);
      const auto last = std::min<long long>(range->element[1]->integer, kClusterSlots - 1);
      for (long long slot = first; slot <= last; ++slot) slots[static_cast<size_t>(slot)] = index;
      for (size_t e = 3; e < range->elements; ++e) {
        const size_t at = node_of(range->element[e]);
        if (at != kNoNode) replicas.emplace_back(index, static_cast<int16_t>(at));
      }
    }
    lane.slots = std::move(slots);
    for (const std::unique_ptr<Node>& n : lane.nodes) {
      n->slots = 0;
      n->replica = false;
      n->replicas.clear();
    }
    for (const auto& [master, replica] : replicas) {
      Node& m = *lane.nodes[static_cast<size_t>(master)];
      if (std::find(m.replicas.begin(), m.replicas.end(), replica) == m.replicas.end()) {
        m.replicas.push_back(replica);
      }
      lane.nodes[static_cast<size_t>(replica)]->replica = true;
    }
    for (const int16_t owner : lane.slots) {
      if (owner >= 0) ++lane.nodes[static_cast<size_t>(owner)]->slots;
    }
    lane.num_nodes = static_cast<int32_t>(std::count_if(
        lane.nodes.begin(), lane.nodes.end(), [](const auto& n) { return n->slots > 0; }));
    UpdateConnected(lane);
    return Status::Ok();
  }
  return UnavailableError(StrCat("no node of the redis cluster answered CLUSTER SLOTS (seed ",
                                 HostPortText(url_.hosts[0].host, url_.hosts[0].port), ")"));
}

void RemoteTier::MaybeRefresh(Lane& lane) {
  if (!url_.cluster || !lane.refresh_needed) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < lane.refresh_at) return;
  lane.refresh_needed = false;
  ++refreshes_;
  if (!RefreshSlots(lane).ok()) {
    ++errors_;
    lane.refresh_needed = true;
  }
  // Backoff: a node that stays down (its slots still its own) is not asked about every command.
  lane.refresh_at = now + lane.refresh_backoff;
  lane.refresh_backoff =
      std::min<std::chrono::milliseconds>(lane.refresh_backoff * 2, std::chrono::seconds(2));
  if (lane.connected) lane.refresh_backoff = std::chrono::milliseconds(50);
}

void RemoteTier::UpdateConnected(Lane& lane) {
  bool all = lane.num_nodes > 0;
  for (const std::unique_ptr<Node>& n : lane.nodes) {
    if (n->slots > 0 && n->conn == nullptr) all = false;
  }
  lane.connected = all;
}

RemoteTier::PendingStore RemoteTier::NewStore(std::string key, size_t size) {
  return {.key = std::move(key),
          .value = value_buffers_->Take(size + kRemoteChecksumBytes),
          .size = size};
}

void RemoteTier::Store(std::vector<PendingStore>& stores) {
  {
    std::lock_guard lock(mu_);
    for (PendingStore& s : stores) {
      if (std::ssize(stores_) >= config_.max_pending) {
        ++dropped_;
        value_buffers_->Give(std::move(s.value));
      } else {
        stores_.push_back(std::move(s));
      }
    }
  }
  stores.clear();
  store_cv_.notify_one();
}

void RemoteFetchJob::Finish() {
  {
    std::lock_guard lock(mu);
    done = true;
  }
  cv.notify_all();
}

bool RemoteFetchJob::WaitFor(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu);
  return cv.wait_for(lock, timeout, [&] { return done; });
}

bool RemoteFetchJob::Done() {
  std::lock_guard lock(mu);
  return done;
}

std::shared_ptr<RemoteTier::FetchJob> RemoteTier::FetchAsync(std::vector<std::string> keys) {
  auto job = std::make_shared<FetchJob>();
  job->keys = std::move(keys);
  std::lock_guard lock(mu_);
  fetches_.push_back(job);
  fetch_cv_.notify_one();
  return job;
}

void RemoteTier::Cancel(const std::shared_ptr<FetchJob>& job) {
  {
    std::lock_guard lock(mu_);
    if (std::erase(fetches_, job) == 0) return;  // started (or done): it finishes on its own
  }
  job->fetched.values.assign(job->keys.size(), std::string_view());  // off the queue: ours
  job->fetched.failed.assign(job->keys.size(), 1);
  job->Finish();
}

RemoteTier::Fetched RemoteTier::Fetch(std::vector<std::string> keys) {
  const size_t n = keys.size();
  const std::shared_ptr<FetchJob> job = FetchAsync(std::move(keys));
  if (!job->WaitFor(std::chrono::milliseconds(config_.timeout_ms))) {
    // Late: a miss. The worker still runs it if it started (its result is dropped).
    Cancel(job);
    ++errors_;
    return {.reply = nullptr,
            .values = std::vector<std::string_view>(n),
            .failed = std::vector<uint8_t>(n, 1),
            .checksum_ok = {},
            .late = true};
  }
  return std::move(job->fetched);
}

void RemoteTier::Drain() {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return stores_.empty() && !storing_; });
}

void RemoteTier::CountLookup(int64_t hits, Miss miss) {
  hits_ += hits;
  switch (miss) {
    case Miss::kNone:
      return;
    case Miss::kNotFound:
      ++not_found_;
      break;
    case Miss::kVerifyFailed:
      ++verify_failed_;
      break;
    case Miss::kError:
      ++miss_error_;
      break;
    case Miss::kLate:
      ++late_;
      break;
    case Miss::kOtherRank:
      ++other_rank_;
      break;
  }
  ++misses_;
}

RemoteTierStats RemoteTier::stats() const {
  return {.hits = hits_,
          .misses = misses_,
          .misses_not_found = not_found_,
          .misses_verify_failed = verify_failed_,
          .misses_error = miss_error_,
          .misses_late = late_,
          .misses_other_rank = other_rank_,
          .invalid = verify_failed_,
          .fetched_bytes = fetched_bytes_,
          .stored = stored_,
          .stored_bytes = stored_bytes_,
          .dropped = dropped_,
          .errors = errors_,
          .reconnects = reconnects_,
          .redirects = redirects_,
          .topology_refreshes = refreshes_,
          .replica_reads = replica_reads_,
          .nodes = fetch_lane_.num_nodes,
          .connected = fetch_lane_.connected && store_lane_.connected};
}

void RemoteTier::RunFetches() {
  std::unique_lock lock(mu_);
  while (true) {
    fetch_cv_.wait(lock, [&] { return stop_ || !fetches_.empty(); });
    if (stop_) {  // closing: a fetch still queued (one asked for ahead) fails at once
      for (const std::shared_ptr<FetchJob>& job : fetches_) {
        job->fetched.values.assign(job->keys.size(), std::string_view());
        job->fetched.failed.assign(job->keys.size(), 1);
        job->Finish();
      }
      fetches_.clear();
      break;
    }
    // Every fetch queued meanwhile (engines fetching ahead for several admitted requests) goes
    // in one pipeline: one MGET per node for all their keys, one round trip, not one each.
    std::vector<std::shared_ptr<FetchJob>> jobs;
    size_t keys = 0;
    while (!fetches_.empty() &&
           (jobs.empty() || keys + fetches_.front()->keys.size() <= kFetchBatchKeys)) {
      keys += fetches_.front()->keys.size();
      jobs.push_back(std::move(fetches_.front()));
      fetches_.pop_front();
    }
    lock.unlock();
    // Their keys are fixed once queued; only this thread writes their `fetched`.
    if (jobs.size() == 1) {
      DoFetch(fetch_lane_, *jobs[0]);
    } else {
      FetchJob all;
      all.keys.reserve(keys);
      for (const std::shared_ptr<FetchJob>& job : jobs) {
        all.keys.insert(all.keys.end(), job->keys.begin(), job->keys.end());
      }
      DoFetch(fetch_lane_, all);
      size_t at = 0;
      for (const std::shared_ptr<FetchJob>& job : jobs) {
        const auto first = static_cast<std::ptrdiff_t>(at);
        const auto last = static_cast<std::ptrdiff_t>(at + job->keys.size());
        job->fetched.reply = all.fetched.reply;  // the replies, shared
        job->fetched.values.assign(all.fetched.values.begin() + first,
                                   all.fetched.values.begin() + last);
        job->fetched.failed.assign(all.fetched.failed.begin() + first,
                                   all.fetched.failed.begin() + last);
        job->fetched.checksum_ok.assign(all.fetched.checksum_ok.begin() + first,
                                        all.fetched.checksum_ok.begin() + last);
        at += job->keys.size();
      }
    }
    for (const std::shared_ptr<FetchJob>& job : jobs) job->Finish();
    lock.lock();
  }
}

void RemoteTier::RunStores() {
  std::unique_lock lock(mu_);
  while (true) {
    store_cv_.wait(lock, [&] { return stop_ || !stores_.empty(); });
    if (stores_.empty()) break;  // stopping, every queued store sent
    std::vector<PendingStore> batch;
    while (!stores_.empty() && batch.size() < kStoreBatch) {
      batch.push_back(std::move(stores_.front()));
      stores_.pop_front();
    }
    storing_ = true;
    lock.unlock();
    const bool failed = DoStores(store_lane_, batch);
    for (PendingStore& s : batch) value_buffers_->Give(std::move(s.value));
    lock.lock();
    storing_ = false;
    // Closing, a batch that failed drops what is still queued: a stalled or refusing server
    // would otherwise hold the destructor a timeout for each batch.
    if (stop_ && failed) {
      dropped_ += std::ssize(stores_);
      for (PendingStore& s : stores_) value_buffers_->Give(std::move(s.value));
      stores_.clear();
    }
    done_cv_.notify_all();
  }
}

Status RemoteTier::ResolveMaster(Node& node) {
  ++refreshes_;
  const std::string_view name = url_.sentinel_master;
  Status last = UnavailableError("no sentinel");
  Status unknown = Status::Ok();  // a sentinel that answered and knows no such master
  for (const RedisUrl::HostPort& s : url_.hosts) {
    const std::string where = StrCat("sentinel at ", HostPortText(s.host, s.port));
    // Asked without AUTH (a sentinel's own password is often unset); one that wants it gets the
    // URL's user and password.
    RedisUrl plain;
    Result<std::unique_ptr<RedisConnection>> conn = Connect(plain, s.host, s.port);
    Reply reply;
    if (conn.ok()) {
      reply = (*conn)->Command({"SENTINEL", "get-master-addr-by-name", name});
      if (reply && reply->type == REDIS_REPLY_ERROR &&
          std::string_view(reply->str, reply->len).starts_with("NOAUTH") &&
          !url_.password.empty()) {
        plain.user = url_.user;
        plain.password = url_.password;
        conn = Connect(plain, s.host, s.port);
        if (conn.ok()) reply = (*conn)->Command({"SENTINEL", "get-master-addr-by-name", name});
      }
    }
    if (!conn.ok()) {
      last = conn.status();
      continue;
    }
    int port = 0;
    if (!reply) {
      last = UnavailableError(StrCat(where, ": no answer"));
    } else if (reply->type == REDIS_REPLY_NIL) {
      unknown = InvalidArgumentError(StrCat(where, " knows no master named \"", name,
                                            "\" (redis+sentinel://host:port/master_name)"));
    } else if (reply->type == REDIS_REPLY_ERROR) {
      last = UnavailableError(StrCat(where, ": ", std::string_view(reply->str, reply->len)));
    } else if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 ||
               reply->element[0]->type != REDIS_REPLY_STRING ||
               reply->element[1]->type != REDIS_REPLY_STRING ||
               !ParseInt(std::string_view(reply->element[1]->str, reply->element[1]->len), 1, 65535,
                         &port)) {
      last = UnavailableError(StrCat(where,
                                     ": a malformed answer to SENTINEL "
                                     "get-master-addr-by-name"));
    } else {
      node.host = std::string(reply->element[0]->str, reply->element[0]->len);
      node.port = port;
      return Status::Ok();
    }
  }
  return unknown.ok() ? last : unknown;
}

bool RemoteTier::EnsureConnected(Lane& lane, Node& node) {
  if (node.conn != nullptr) return true;
  const auto now = std::chrono::steady_clock::now();
  if (now < node.retry_at) return false;
  // Sentinels: the master's address asked again (a failover since moves it).
  const Status resolved = url_.sentinel_master.empty() ? Status::Ok() : ResolveMaster(node);
  Result<std::unique_ptr<RedisConnection>> conn =
      resolved.ok() ? Connect(url_, node.host, node.port) : resolved;
  if (conn.ok() && node.replica) {
    // A replica serves reads of its master's slots only on a READONLY connection (otherwise
    // MOVED to the master). One that refuses (an ACL without READONLY) is not read from.
    const Reply reply = (*conn)->Command({"READONLY"});
    if (!reply || reply->type == REDIS_REPLY_ERROR) conn = UnavailableError("READONLY refused");
  }
  if (!conn.ok()) {
    ++errors_;
    Failed(node, now);
    if (url_.cluster) lane.refresh_needed = true;
    return false;
  }
  node.conn = std::move(*conn);  // the backoff stays until a command is answered (Served)
  if (node.ever_connected) ++reconnects_;
  node.ever_connected = true;
  UpdateConnected(lane);
  return true;
}

void RemoteTier::Disconnect(Lane& lane, Node& node) {
  ++errors_;
  node.conn.reset();
  // Not tried again before its backoff, which only an answered command resets: a stalled server
  // (it accepts connections, answers nothing) costs one timeout per backoff, not one per
  // command, and its reads go to a replica meanwhile.
  Failed(node, std::chrono::steady_clock::now());
  if (url_.cluster) lane.refresh_needed = true;
  UpdateConnected(lane);
}

RemoteTier::Node* RemoteTier::ConnectedReplica(Lane& lane, const Node& master) {
  for (const int16_t r : master.replicas) {
    Node& replica = *lane.nodes[static_cast<size_t>(r)];
    if (replica.replica && replica.conn != nullptr) return &replica;
  }
  // None connected: one attempt (a connect can wait timeout_ms), the next replica next time.
  const auto now = std::chrono::steady_clock::now();
  for (const int16_t r : master.replicas) {
    Node& replica = *lane.nodes[static_cast<size_t>(r)];
    if (replica.replica && now >= replica.retry_at) {
      return EnsureConnected(lane, replica) ? &replica : nullptr;
    }
  }
  return nullptr;
}

Reply RemoteTier::FollowRedirect(Lane& lane, Redirect r, std::string_view cmd, std::string_view key,
                                 std::string_view value) {
  for (int hop = 0; hop < kMaxRedirects; ++hop) {
    ++redirects_;
    const size_t index = NodeAt(lane, r.host, r.port);
    if (index == kNoNode) break;  // a redirect to yet another node, past any real cluster's size
    if (!r.ask && !lane.slots.empty()) {
      // The slot moved for good: send its next commands there at once, and read the whole map
      // again before the next command.
      lane.slots[static_cast<size_t>(KeySlot(key))] = static_cast<int16_t>(index);
      lane.refresh_needed = true;
    }
    Node& node = *lane.nodes[index];
    if (!EnsureConnected(lane, node)) return nullptr;
    if (r.ask) node.conn->Append({"ASKING"});
    if (value.empty()) {
      node.conn->Append({cmd, key});
    } else {
      node.conn->Append({cmd, key, value});
    }
    Reply reply;
    if (node.conn->Flush() && (!r.ask || node.conn->GetReply() != nullptr)) {
      reply = node.conn->GetReply();
    }
    if (reply == nullptr) {
      Disconnect(lane, node);
      return nullptr;
    }
    if (!ParseRedirect(*reply, &r.ask, &r.host, &r.port)) return reply;
  }
  ++errors_;
  return nullptr;
}

void RemoteTier::DoFetch(Lane& lane, FetchJob& job) {
  const size_t n = job.keys.size();
  std::vector<std::string_view>& values = job.fetched.values;
  std::vector<uint8_t>& failed = job.fetched.failed;
  std::vector<uint8_t>& checksum_ok = job.fetched.checksum_ok;
  values.assign(n, std::string_view());
  failed.assign(n, 0);
  checksum_ok.assign(n, 0);
  // A value read from the socket, its checksum checked as it arrived (the state manager's thread
  // then checks only its fields).
  const auto keep = [&](size_t item, std::string_view value, bool sum_ok) {
    values[item] = value;
    checksum_ok[item] = sum_ok ? 1 : 0;
    fetched_bytes_ += std::ssize(value);
  };
  MaybeRefresh(lane);
  auto owned = std::make_shared<FetchedBuffers>(value_buffers_);
  // A reply to GET: a value, none, a redirect to follow, or an error.
  std::vector<Redirect> redirects;
  const auto take = [&](size_t item, Reply reply) {
    Redirect r{.item = item};
    if (reply->type == REDIS_REPLY_STRING) {
      values[item] = std::string_view(reply->str, reply->len);
      fetched_bytes_ += static_cast<int64_t>(reply->len);
      owned->replies.push_back(std::move(reply));
    } else if (reply->type == REDIS_REPLY_NIL) {
      // not found
    } else if (url_.cluster && ParseRedirect(*reply, &r.ask, &r.host, &r.port)) {
      redirects.push_back(std::move(r));
    } else {
      ++errors_;
      failed[item] = 1;
      if (reply->type == REDIS_REPLY_ERROR) {
        WarnRefused("GET", nullptr, std::string_view(reply->str, reply->len));
      }
    }
  };
  // Group the keys by node; write every node's commands, then read every node's replies.
  std::vector<std::vector<size_t>> groups(lane.nodes.size());
  for (size_t i = 0; i < n; ++i) {
    const int node = NodeFor(lane, job.keys[i]);
    if (node < 0) {
      failed[i] = 1;  // no node owns its slot
    } else {
      groups[static_cast<size_t>(node)].push_back(i);
    }
  }
  const auto fail = [&](const std::vector<size_t>& items, size_t from) {
    for (size_t j = from; j < items.size(); ++j) failed[items[j]] = 1;
  };
  // What one node is asked: the keys of one master's slots, sent to that master or, while it is
  // down, to one of its replicas (a replica may lag behind its master: a value it lacks is a
  // miss, one it has is verified as any other).
  struct Ask {
    size_t master = 0;     // index in lane.nodes
    Node* node = nullptr;  // asked
    std::vector<size_t> items;
  };
  std::vector<Ask> asks;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].empty()) asks.push_back({.master = g, .items = std::move(groups[g])});
  }
  // Round 0 asks the masters (or the replicas of those down); round 1 (a cluster) asks a replica
  // for what a master's connection lost on the way (it failed when written or read: a master
  // killed since the last fetch), so that the first fetch after a master dies still hits.
  for (int round = 0; round < 2 && !asks.empty(); ++round) {
    std::vector<Ask> sent;
    std::vector<Ask> retry;
    // `node`'s connection failed with ask's items from `from` on unanswered: a master's go to a
    // replica in the next round, a replica's (or a standalone server's) miss.
    const auto lost = [&](const Ask& ask, const Node& node, size_t from) {
      if (url_.cluster && round == 0 && !node.replica) {
        retry.push_back(
            {.master = ask.master, .items = {ask.items.begin() + from, ask.items.end()}});
      } else {
        fail(ask.items, from);
      }
    };
    for (Ask& ask : asks) {
      Node* node = lane.nodes[ask.master].get();
      if (round > 0 || !EnsureConnected(lane, *node)) {
        node = url_.cluster ? ConnectedReplica(lane, *node) : nullptr;
        if (node == nullptr) {
          fail(ask.items, 0);
          continue;
        }
        replica_reads_ += std::ssize(ask.items);
      }
      if (url_.cluster) {
        // MGET across slots is refused by a cluster (and each block has its own slot): GETs.
        for (const size_t i : ask.items) node->conn->Append({"GET", job.keys[i]});
      } else {
        std::vector<std::string_view> args = {"MGET"};
        for (const size_t i : ask.items) args.emplace_back(job.keys[i]);
        node->conn->Append(args);
      }
      if (!node->conn->Flush()) {
        Disconnect(lane, *node);
        lost(ask, *node, 0);
        continue;
      }
      ask.node = node;
      sent.push_back(std::move(ask));
    }
    // The replies are read from the connection by us, each value straight into a buffer of its
    // own (the reply parser would read them into its buffer and copy each out again). The parser
    // holds nothing unread here: every reply before was read whole.
    for (const Ask& ask : sent) {
      const std::vector<size_t>& items = ask.items;
      Node& node = *ask.node;
      SocketReader in(*node.conn);
      const auto broken = [&](size_t from) {
        Disconnect(lane, node);
        for (size_t j = from; j < items.size(); ++j) values[items[j]] = {};
        lost(ask, node, from);
      };
      if (node.conn->Buffered()) {
        broken(0);
        continue;
      }
      std::string_view value;
      bool sum_ok = false;
      std::string_view error;
      if (!url_.cluster) {  // one MGET: "*<n>" then n values or nils, or an error
        std::string_view line;
        int count = 0;
        const bool got = in.Line(&line) && !line.empty();
        if (got && line[0] == '-' && in.Drained()) {
          ++errors_;  // refused (an ACL, say): the reply was read whole, the connection is fine
          fail(items, 0);
          WarnRefused("MGET", &node, line.substr(1));
        } else if (!got || line[0] != '*' ||
                   !ParseInt(line.substr(1), 0, std::numeric_limits<int>::max(), &count) ||
                   static_cast<size_t>(count) != items.size()) {
          broken(0);
        } else {
          bool whole = true;
          for (size_t r = 0; r < items.size() && whole; ++r) {
            const ReplyRead read = ReadValue(in, *owned, &value, &sum_ok, &error);
            if (read == ReplyRead::kValue) keep(items[r], value, sum_ok);
            whole = read == ReplyRead::kValue || read == ReplyRead::kNil;  // never an error here
          }
          if (!whole || !in.Drained()) broken(0);
        }
        if (node.conn != nullptr) Served(node);
        continue;
      }
      for (size_t r = 0; r < items.size(); ++r) {  // GETs: a value, nil, a redirect or an error
        const ReplyRead read = ReadValue(in, *owned, &value, &sum_ok, &error);
        if (read == ReplyRead::kBroken) {
          broken(r);
          break;
        }
        if (read == ReplyRead::kValue) {
          keep(items[r], value, sum_ok);
        } else if (read == ReplyRead::kError) {
          Redirect redirect{.item = items[r]};
          if (ParseRedirect(error, &redirect.ask, &redirect.host, &redirect.port)) {
            redirects.push_back(std::move(redirect));
          } else {
            ++errors_;
            failed[items[r]] = 1;
            WarnRefused("GET", &node, error);
          }
        }
      }
      if (node.conn != nullptr && !in.Drained()) Disconnect(lane, node);  // more than was asked for
      if (node.conn != nullptr) Served(node);
    }
    asks = std::move(retry);
  }
  std::vector<Redirect> pending;
  pending.swap(redirects);
  for (const Redirect& r : pending) {
    Reply reply = FollowRedirect(lane, r, "GET", job.keys[r.item], {});
    if (reply == nullptr) {
      failed[r.item] = 1;
    } else {
      take(r.item, std::move(reply));  // never a redirect: FollowRedirect followed those
    }
  }
  job.fetched.reply = std::move(owned);
}

void RemoteTier::WarnRefused(std::string_view command, const Node* node, std::string_view reply) {
  const std::string_view kind = reply.substr(0, reply.find(' '));
  {
    const std::string once = StrCat(command, " ", kind);
    const std::lock_guard lock(mu_);
    if (std::find(warned_.begin(), warned_.end(), once) != warned_.end()) return;
    warned_.push_back(once);
  }
  std::string_view hint;
  if (kind == "OOM") {
    hint =
        "; a cache server wants a maxmemory-policy that evicts (allkeys-lru or allkeys-lfu), "
        "not noeviction";
  } else if (kind == "NOPERM") {
    hint =
        "; the ACL user needs +get +mget +set on the tier's keys (~blockkv:*), and "
        "+cluster|slots +readonly for a cluster";
  } else if (kind == "MISCONF") {
    hint =
        "; the server stops writes after a failed RDB save: fix its disk or set "
        "stop-writes-on-bgsave-error no (or save \"\" for a cache)";
  }
  Log(LogLevel::kWarning,
      StrCat(
          "remote tier: redis at ",
          node != nullptr ? HostPortText(node->host, node->port) : std::string("a node"),
          " refused ", command, ": ", reply, hint,
          " (logged once; each refused command counts in errors, its blocks missed or dropped)"));
}

bool RemoteTier::DoStores(Lane& lane, std::vector<PendingStore>& batch) {
  bool failed_node = false;
  MaybeRefresh(lane);
  std::vector<Redirect> redirects;
  bool demoted = false;  // a sentinels' master that became a replica since they were asked
  const auto take = [&](size_t item, const redisReply& reply, const Node* node) {
    Redirect r{.item = item};
    if (url_.cluster && ParseRedirect(reply, &r.ask, &r.host, &r.port)) {
      redirects.push_back(std::move(r));
    } else if (reply.type == REDIS_REPLY_ERROR) {
      ++errors_;
      ++dropped_;
      WarnRefused("SET", node, std::string_view(reply.str, reply.len));
      demoted = demoted || (!url_.sentinel_master.empty() &&
                            std::string_view(reply.str, reply.len).starts_with("READONLY"));
    } else {
      ++stored_;
      stored_bytes_ += static_cast<int64_t>(batch[item].size);
    }
  };
  std::vector<std::vector<size_t>> groups(lane.nodes.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const int node = NodeFor(lane, batch[i].key);
    if (node < 0) {
      ++dropped_;
    } else {
      groups[static_cast<size_t>(node)].push_back(i);
    }
  }
  // Each node's values sealed (here, not on the scheduling thread) and its first bytes sent
  // before the next node's are sealed, then every node fed at once.
  std::vector<size_t> sent;
  std::vector<SetWriter> writers(groups.size());
  std::vector<SetWriter*> started;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<size_t>& items = groups[g];
    if (items.empty()) continue;
    Node& node = *lane.nodes[g];
    if (!EnsureConnected(lane, node)) {
      dropped_ += std::ssize(items);
      failed_node = true;
      continue;
    }
    std::vector<const PendingStore*> sets;
    sets.reserve(items.size());
    for (const size_t i : items) {
      PendingStore& store = batch[i];
      SealRemoteValue(store.value.data.get(), store.size);
      store.size += kRemoteChecksumBytes;
      sets.push_back(&store);
    }
    writers[g].Start(node.conn.get(), sets);
    sent.push_back(g);
    started.push_back(&writers[g]);
    writers[g].WriteSome();  // a failure shows again in WriteAllSets
  }
  std::vector<uint8_t> failed(started.size(), 0);
  WriteAllSets(started, config_.timeout_ms, failed);
  for (size_t w = 0; w < started.size(); ++w) {
    if (failed[w] == 0) continue;
    const size_t g = sent[w];
    dropped_ += std::ssize(groups[g]);
    Disconnect(lane, *lane.nodes[g]);
    failed_node = true;
    groups[g].clear();  // no replies to read
  }
  for (const size_t g : sent) {
    if (groups[g].empty()) continue;
    const std::vector<size_t>& items = groups[g];
    Node& node = *lane.nodes[g];
    for (size_t r = 0; r < items.size(); ++r) {
      const Reply reply = node.conn->GetReply();
      if (reply == nullptr) {
        dropped_ += static_cast<int64_t>(items.size() - r);
        Disconnect(lane, node);
        failed_node = true;
        break;
      }
      take(items[r], *reply, &node);
    }
    if (demoted && node.conn != nullptr) {
      Disconnect(lane, node);  // the sentinels are asked for the new master at the reconnect
    } else if (node.conn != nullptr) {
      Served(node);
    }
  }
  std::vector<Redirect> pending;
  pending.swap(redirects);
  for (const Redirect& r : pending) {
    const Reply reply = FollowRedirect(lane, r, "SET", batch[r.item].key, batch[r.item].bytes());
    if (reply == nullptr) {
      ++dropped_;
    } else {
      take(r.item, *reply, nullptr);
    }
  }
  return failed_node;
}

}  // namespace blockkv::internal
