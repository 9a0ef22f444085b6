// SPDX-License-Identifier: Apache-2.0
// One connection to a Redis server, plain TCP, a unix socket or TLS, for the remote tier
// (remote_tier.h). hiredis only parses replies here (its redisReader); the bytes go through this
// class's own socket or OpenSSL reads and writes, because Debian 12's hiredis 0.14 has no TLS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <poll.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "blockkv/status.h"

struct redisReply;
struct redisReader;
struct ssl_ctx_st;
struct ssl_st;

namespace blockkv::internal {

// "host:port", "[host]:port" for an IPv6 address, the path alone for a unix socket (port 0): for
// messages.
std::string HostPortText(std::string_view host, int port);

struct ReplyDeleter {
  void operator()(redisReply* r) const;
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// What rediss:// asks of the server's certificate and what the tier shows of its own: the URL's
// ssl_* query parameters (redis-py's names).
struct TlsOptions {
  std::string ca_file;         // ssl_ca_certs: PEM CAs to trust ("" = the system's)
  std::string cert_file;       // ssl_certfile: a client certificate (tls-auth-clients yes)
  std::string key_file;        // ssl_keyfile: its private key
  bool verify = true;          // ssl_cert_reqs=required (default): the chain checked
  bool check_hostname = true;  // ssl_check_hostname: the certificate names the host (or IP)
  std::string server_name;     // ssl_server_name: the name sent and checked, for every node
};

// An OpenSSL context built once per tier from its TlsOptions; every connection of the tier
// handshakes with it.
class TlsContext {
 public:
  // kInvalidArgument naming the file and OpenSSL's reason when a CA, certificate or key does not
  // load.
  static Result<std::shared_ptr<TlsContext>> Create(const TlsOptions& options);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;
  ssl_ctx_st* get() const { return ctx_; }
  const TlsOptions& options() const { return options_; }

 private:
  TlsContext(ssl_ctx_st* ctx, TlsOptions options) : ctx_(ctx), options_(std::move(options)) {}
  ssl_ctx_st* ctx_;
  TlsOptions options_;
};

class RedisConnection {
 public:
  // Connects to host:port (port 0: `host` is a unix socket's path) within timeout_ms, then, with
  // `tls`, handshakes and checks the server's certificate. Every later read and write waits
  // timeout_ms at most. kUnavailable when the server cannot be reached or answers nothing in
  // time; kPermissionDenied when the TLS handshake fails (a certificate that does not verify, a
  // peer that answers but not with TLS) or the server refuses the client's certificate, which no
  // retry fixes. Messages name host:port.
  static Result<std::unique_ptr<RedisConnection>> Open(const std::string& host, int port,
                                                       int32_t timeout_ms, const TlsContext* tls);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // What the connection's OpenSSL BIO writes to and reads from (redis_connection.cc).
  struct BioSocket {
    int fd = -1;
    bool dontwait = false;  // writes do not wait (WriteNow)
  };

  int fd() const { return fd_; }
  // Why the last read or write failed ("" when none did).
  const std::string& error() const { return error_; }

  // RESP: queues a command (nothing is sent until Flush), sends everything queued, reads the next
  // reply (null when the connection failed, closed or timed out).
  void Append(std::span<const std::string_view> args);
  void Append(std::initializer_list<std::string_view> args) {
    Append(std::span<const std::string_view>(args.begin(), args.size()));
  }
  bool Flush();
  Reply GetReply();
  Reply Command(std::span<const std::string_view> args);
  Reply Command(std::initializer_list<std::string_view> args) {
    return Command(std::span<const std::string_view>(args.begin(), args.size()));
  }
  // Whether the reply parser holds bytes not yet read as replies (Read must not be used then).
  bool Buffered() const;

  // Raw bytes, for callers that parse replies themselves (the parser's buffer empty): reads at
  // most n bytes, waiting timeout_ms at most; > 0 the bytes read, <= 0 failed, closed or timed
  // out.
  ssize_t Read(char* dst, size_t n);
  // Writes what the socket takes now from `iov`, without waiting: the number of its bytes taken
  // (0: none now, poll for Events()), or -1 when the connection failed. With TLS, bytes taken may
  // wait in a buffer of the connection's own until a later call sends them: the writes are done
  // when `iov` was taken whole and WritePending() is false.
  ssize_t WriteNow(std::span<const iovec> iov);
  bool WritePending() const { return tls_at_ < tls_out_.size(); }
  // What to poll for before the next WriteNow (POLLOUT, or POLLIN while TLS needs to read).
  short Events() const { return want_read_ ? POLLIN : POLLOUT; }

 private:
  explicit RedisConnection(int fd);
  bool WriteAll(const char* data, size_t n);
  bool Fail(std::string_view what);

  int fd_;
  BioSocket bio_socket_;  // before ssl_: the SSL's BIO points here until SSL_free
  ssl_st* ssl_ = nullptr;
  redisReader* reader_ = nullptr;
  std::string out_;      // commands queued by Append
  std::string tls_out_;  // TLS: bytes WriteNow took, sent from tls_at_ on
  size_t tls_at_ = 0;
  bool want_read_ = false;
  bool tls_failed_ = false;  // the last read failed at the TLS level (not the socket's)
  std::string error_;
};

}  // namespace blockkv::internal
