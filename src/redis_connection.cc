// SPDX-License-Identifier: Apache-2.0
#include "redis_connection.h"

#include <hiredis/hiredis.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <iterator>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal/strings.h"

namespace blockkv::internal {

std::string HostPortText(std::string_view host, int port) {
  if (port == 0) return std::string(host);  // a unix socket's path
  // An IPv6 address in brackets, as URLs write it: [::1]:6379.
  return host.find(':') != std::string_view::npos ? StrCat("[", host, "]:", port)
                                                  : StrCat(host, ":", port);
}

void ReplyDeleter::operator()(redisReply* r) const { freeReplyObject(r); }

namespace {

// OpenSSL's queued errors as one line (and the queue cleared), or `fallback` when there is none.
std::string TlsErrors(std::string_view fallback) {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    char text[256];
    ERR_error_string_n(e, text, sizeof(text));
    if (!out.empty()) out += "; ";
    out += text;
  }
  return out.empty() ? std::string(fallback) : out;
}

std::string Errno(int e) { return std::strerror(e); }

bool IsIpAddress(const std::string& host) {
  in6_addr a6{};
  in_addr a4{};
  return inet_pton(AF_INET, host.c_str(), &a4) == 1 || inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

// A connected stream socket to host:port (port 0: a unix socket's path), blocking, or -1 and
// *why. The connect waits timeout_ms at most per address.
int ConnectSocket(const std::string& host, int port, int32_t timeout_ms, std::string* why) {
  const auto finish = [&](int fd, const sockaddr* addr, socklen_t len) -> bool {
    if (connect(fd, addr, len) != 0) {
      if (errno != EINPROGRESS) {
        *why = Errno(errno);
        return false;
      }
      pollfd p{.fd = fd, .events = POLLOUT, .revents = 0};
      int ready = 0;
      do {
        ready = poll(&p, 1, timeout_ms);
      } while (ready < 0 && errno == EINTR);
      if (ready == 0) {
        *why = "connection timed out";
        return false;
      }
      int err = 0;
      socklen_t err_len = sizeof(err);
      if (ready < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len) != 0) err = errno;
      if (err != 0) {
        *why = Errno(err);
        return false;
      }
    }
    return fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0;
  };
  if (port == 0) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (host.size() >= sizeof(addr.sun_path)) {
      *why = StrCat("the path is longer than ", sizeof(addr.sun_path) - 1, " bytes");
      return -1;
    }
    std::memcpy(addr.sun_path, host.c_str(), host.size() + 1);
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      *why = Errno(errno);
      return -1;
    }
    if (finish(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr))) return fd;
    close(fd);
    return -1;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    *why = StrCat("cannot resolve \"", host, "\": ", gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      *why = Errno(errno);
      continue;
    }
    if (finish(fd, a->ai_addr, a->ai_addrlen)) break;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  if (fd >= 0) {
    const int one = 1;  // commands are small and pipelined: send each flush at once
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

// OpenSSL's own socket BIO writes with write(), which raises SIGPIPE (killing a process that has
// not ignored it) when the server has closed the connection. This one sends with MSG_NOSIGNAL,
// and with MSG_DONTWAIT while the connection's `dontwait` is set (WriteNow); reads are recv's.
int BioWrite(BIO* bio, const char* data, int n) {
  const auto* socket = static_cast<const RedisConnection::BioSocket*>(BIO_get_data(bio));
  BIO_clear_retry_flags(bio);
  const ssize_t put = send(socket->fd, data, static_cast<size_t>(n),
                           MSG_NOSIGNAL | (socket->dontwait ? MSG_DONTWAIT : 0));
  if (put < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    BIO_set_retry_write(bio);
  }
  return static_cast<int>(put);
}

int BioRead(BIO* bio, char* data, int n) {
  const auto* socket = static_cast<const RedisConnection::BioSocket*>(BIO_get_data(bio));
  BIO_clear_retry_flags(bio);
  const ssize_t got = recv(socket->fd, data, static_cast<size_t>(n), 0);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    BIO_set_retry_read(bio);
  }
  return static_cast<int>(got);
}

long BioCtrl(BIO* /*bio*/, int cmd, long /*num*/, void* /*ptr*/) {
  return cmd == BIO_CTRL_FLUSH ? 1 : 0;  // nothing buffered here
}

const BIO_METHOD* SocketBio() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "blockkv socket");
    if (m != nullptr) {
      BIO_meth_set_write(m, BioWrite);
      BIO_meth_set_read(m, BioRead);
      BIO_meth_set_ctrl(m, BioCtrl);
    }
    return m;
  }();
  return method;
}

}  // namespace

// ---- TLS -------------------------------------------------------------------------------------

Result<std::shared_ptr<TlsContext>> TlsContext::Create(const TlsOptions& options) {
  ERR_clear_error();
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (ctx == nullptr) return InternalError(StrCat("TLS: ", TlsErrors("SSL_CTX_new failed")));
  std::shared_ptr<TlsContext> out(new TlsContext(ctx, options));
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  // WriteNow's writes: a record at a time, a write that could not finish retried from tls_out_ or
  // from the value itself (the same bytes at another address).
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Records read many at a time (read-ahead into a 256 KiB buffer): without it each 16 KiB record
  // is two read calls, its header and its body (2,048 for a fetch of 8 × 2 MiB).
  SSL_CTX_set_read_ahead(ctx, 1);
  SSL_CTX_set_default_read_buffer_len(ctx, size_t{256} << 10);
  const auto bad = [](std::string_view what, const std::string& file) {
    return InvalidArgumentError(StrCat("RemoteTierConfig.url: ", what, " \"", file,
                                       "\" does not load: ", TlsErrors("unknown reason")));
  };
  if (options.verify) {
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
    if (!options.ca_file.empty()) {
      if (SSL_CTX_load_verify_locations(ctx, options.ca_file.c_str(), nullptr) != 1) {
        return bad("ssl_ca_certs", options.ca_file);
      }
    } else if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
      return InternalError(StrCat("TLS: the system's CAs: ", TlsErrors("do not load")));
    }
  } else {
    SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, nullptr);
  }
  if (options.cert_file.empty() != options.key_file.empty()) {
    return InvalidArgumentError(
        "RemoteTierConfig.url: ssl_certfile and ssl_keyfile go together (a client certificate and "
        "its key)");
  }
  if (!options.cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, options.cert_file.c_str()) != 1) {
      return bad("ssl_certfile", options.cert_file);
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, options.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
      return bad("ssl_keyfile", options.key_file);
    }
    if (SSL_CTX_check_private_key(ctx) != 1) {
      return bad("ssl_keyfile (not the key of ssl_certfile)", options.key_file);
    }
  }
  return out;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

// ---- the connection --------------------------------------------------------------------------

RedisConnection::RedisConnection(int fd) : fd_(fd), reader_(redisReaderCreate()) {
  // Keep the parser's buffer between replies: by default hiredis frees it whenever it is empty
  // with over 16 KiB spare, so every MB-sized reply grows a new one again.
  if (reader_ != nullptr) reader_->maxbuf = 0;
}

RedisConnection::~RedisConnection() {
  if (ssl_ != nullptr) SSL_free(ssl_);  // no close_notify: the socket just closes
  if (reader_ != nullptr) redisReaderFree(reader_);
  close(fd_);
}

Result<std::unique_ptr<RedisConnection>> RedisConnection::Open(const std::string& host, int port,
                                                               int32_t timeout_ms,
                                                               const TlsContext* tls) {
  const std::string where = StrCat("redis at ", HostPortText(host, port));
  std::string why;
  const int fd = ConnectSocket(host, port, timeout_ms, &why);
  if (fd < 0) return UnavailableError(StrCat(where, ": ", why));
  std::unique_ptr<RedisConnection> conn(new RedisConnection(fd));
  if (conn->reader_ == nullptr) return InternalError(StrCat(where, ": cannot allocate a parser"));
  const timeval tv{.tv_sec = timeout_ms / 1000,
                   .tv_usec = static_cast<suseconds_t>(timeout_ms % 1000) * 1000};
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return UnavailableError(StrCat(where, ": ", Errno(errno)));
  }
  if (tls == nullptr) return conn;

  ERR_clear_error();
  SSL* ssl = SSL_new(tls->get());
  if (ssl == nullptr) return InternalError(StrCat(where, ": ", TlsErrors("SSL_new failed")));
  conn->ssl_ = ssl;
  conn->bio_socket_.fd = fd;
  BIO* bio = SocketBio() != nullptr ? BIO_new(SocketBio()) : nullptr;
  if (bio == nullptr) return InternalError(StrCat(where, ": ", TlsErrors("BIO_new failed")));
  BIO_set_data(bio, &conn->bio_socket_);
  BIO_set_init(bio, 1);
  SSL_set_bio(ssl, bio, bio);  // the SSL owns it
  const TlsOptions& options = tls->options();
  const std::string& name = options.server_name.empty() ? host : options.server_name;
  const bool ip = IsIpAddress(name);
  if (!ip) SSL_set_tlsext_host_name(ssl, name.c_str());  // SNI: names only
  if (options.verify && options.check_hostname) {
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    const int set = ip ? X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str())
                       : X509_VERIFY_PARAM_set1_host(param, name.c_str(), 0);
    if (set != 1) return InternalError(StrCat(where, ": ", TlsErrors("cannot set the host name")));
  }
  // The socket's timeouts bound each read and write of the handshake.
  if (SSL_connect(ssl) != 1) {
    const long verified = SSL_get_verify_result(ssl);
    if (verified != X509_V_OK) {
      ERR_clear_error();
      return PermissionDeniedError(StrCat(
          where, ": the server's TLS certificate does not verify: ",
          X509_verify_cert_error_string(verified),
          " (ssl_ca_certs=PATH names the CA that signed it; ssl_server_name=NAME the name it is "
          "for; ssl_cert_reqs=none skips the check)"));
    }
    const int e = errno;
    const std::string reason = TlsErrors("");
    if (reason.empty()) {  // the socket failed or timed out: nothing of TLS was wrong
      return UnavailableError(StrCat(where, ": the TLS handshake failed: ",
                                     e == EAGAIN || e == EWOULDBLOCK
                                         ? "timed out (is it the server's tls-port?)"
                                     : e != 0 ? Errno(e)
                                              : "the server closed"));
    }
    return PermissionDeniedError(
        StrCat(where, ": the TLS handshake failed: ", reason,
               " (is it the server's tls-port? does it want a client certificate: "
               "ssl_certfile and ssl_keyfile?)"));
  }
  // One command answered (any reply: PING may be refused before AUTH): under TLS 1.3 a server
  // that refuses the client's certificate (or the lack of one) says so only after the handshake.
  if (!conn->Command({"PING"})) {
    // A write that failed (the server reset the connection after its alert) leaves the alert
    // unread: read it for its reason.
    char alert = 0;
    if (!conn->tls_failed_) conn->Read(&alert, 1);
    if (conn->tls_failed_) {
      return PermissionDeniedError(StrCat(where,
                                          ": the server refused the TLS session: ", conn->error(),
                                          " (does it want a client certificate: ssl_certfile and "
                                          "ssl_keyfile?)"));
    }
    return UnavailableError(StrCat(where, ": ", conn->error()));
  }
  return conn;
}

bool RedisConnection::Fail(std::string_view what) {
  error_ = std::string(what);
  return false;
}

void RedisConnection::Append(std::span<const std::string_view> args) {
  char digits[24];
  const auto number = [&](char lead, size_t v) {
    out_.push_back(lead);
    out_.append(digits, std::to_chars(std::begin(digits), std::end(digits), v).ptr);
    out_.append("\r\n");
  };
  number('*', args.size());
  for (const std::string_view a : args) {
    number('$', a.size());
    out_.append(a).append("\r\n");
  }
}

bool RedisConnection::Flush() {
  const bool ok = WriteAll(out_.data(), out_.size());
  out_.clear();
  return ok;
}

bool RedisConnection::WriteAll(const char* data, size_t n) {
  while (n > 0) {
    ssize_t put = 0;
    if (ssl_ != nullptr) {
      ERR_clear_error();
      put = SSL_write(ssl_, data, static_cast<int>(std::min<size_t>(n, 1 << 30)));
      if (put <= 0) return Fail(StrCat("TLS write: ", TlsErrors(Errno(errno))));
    } else {
      put = send(fd_, data, n, MSG_NOSIGNAL);  // a server gone is an error, never a SIGPIPE
      if (put < 0 && errno == EINTR) continue;
      if (put < 0) return Fail(errno == EAGAIN ? "write timed out" : Errno(errno));
    }
    data += put;
    n -= static_cast<size_t>(put);
  }
  return true;
}

ssize_t RedisConnection::Read(char* dst, size_t n) {
  if (ssl_ != nullptr) {
    ERR_clear_error();
    const int got = SSL_read(ssl_, dst, static_cast<int>(std::min<size_t>(n, 1 << 30)));
    if (got <= 0) {
      const int e = errno;
      const std::string reason = TlsErrors("");
      tls_failed_ = !reason.empty();  // an alert or a record that does not decrypt
      Fail(StrCat("TLS read: ", !reason.empty()                   ? reason
                                : e == EAGAIN || e == EWOULDBLOCK ? "timed out"
                                                                  : "the server closed"));
    }
    return got;
  }
  while (true) {
    const ssize_t got = recv(fd_, dst, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) Fail(errno == EAGAIN ? "read timed out" : Errno(errno));
    if (got == 0) Fail("the server closed the connection");
    return got;
  }
}

Reply RedisConnection::GetReply() {
  while (true) {
    void* reply = nullptr;
    if (redisReaderGetReply(reader_, &reply) != REDIS_OK) {
      Fail(StrCat("a reply that does not parse: ", reader_->errstr));
      return nullptr;
    }
    if (reply != nullptr) return Reply(static_cast<redisReply*>(reply));
    char buf[16 << 10];
    const ssize_t got = Read(buf, sizeof(buf));
    if (got <= 0) return nullptr;
    if (redisReaderFeed(reader_, buf, static_cast<size_t>(got)) != REDIS_OK) {
      Fail("out of memory");
      return nullptr;
    }
  }
}

Reply RedisConnection::Command(std::span<const std::string_view> args) {
  Append(args);
  return Flush() ? GetReply() : nullptr;
}

bool RedisConnection::Buffered() const { return reader_->pos != reader_->len; }

ssize_t RedisConnection::WriteNow(std::span<const iovec> iov) {
  if (ssl_ == nullptr) {
    msghdr msg{};
    msg.msg_iov = const_cast<iovec*>(iov.data());
    msg.msg_iovlen = std::min<size_t>(iov.size(), 1024);  // IOV_MAX on Linux
    while (true) {
      // MSG_NOSIGNAL: a server gone is an error here, never a SIGPIPE.
      const ssize_t n = sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      Fail(Errno(errno));
      return -1;
    }
  }
  // TLS. A piece of a record's size or more (a value's bytes) is written from where it is; smaller
  // ones (a SET's head, the CRLFs, a value's first bytes after them) are gathered into one record
  // in tls_out_ (each would otherwise be a record and a write call of its own), counted as taken
  // once gathered. A write OpenSSL could not finish is offered again first with the same bytes, as
  // it requires: tls_out_'s rest, or (taken 0) the same piece, which the caller offers again.
  static constexpr size_t kRecord = size_t{16} << 10;
  bio_socket_.dontwait = true;
  // > 0: written; 0: the socket is full (or TLS wants to read); -1: failed.
  const auto write = [&](const char* data, size_t n) -> int {
    ERR_clear_error();
    const int put = SSL_write(ssl_, data, static_cast<int>(std::min<size_t>(n, 1 << 30)));
    want_read_ = false;
    if (put > 0) return put;
    const int err = SSL_get_error(ssl_, put);
    want_read_ = err == SSL_ERROR_WANT_READ;
    if (err == SSL_ERROR_WANT_WRITE || err == SSL_ERROR_WANT_READ) return 0;
    Fail(StrCat("TLS write: ", TlsErrors(Errno(errno))));
    return -1;
  };
  // 1: tls_out_ written whole (and cleared); 0: full; -1: failed.
  const auto flush = [&]() -> int {
    while (tls_at_ < tls_out_.size()) {
      const int put = write(tls_out_.data() + tls_at_, tls_out_.size() - tls_at_);
      if (put <= 0) return put;
      tls_at_ += static_cast<size_t>(put);
    }
    tls_out_.clear();
    tls_at_ = 0;
    return 1;
  };
  ssize_t taken = 0;
  int state = flush();
  if (state == 1 && !iov.empty() && iov[0].iov_len >= kRecord) {
    state = write(static_cast<const char*>(iov[0].iov_base), iov[0].iov_len);
    taken = std::max(state, 0);
  } else if (state == 1) {
    for (const iovec& v : iov) {
      const size_t take = std::min(v.iov_len, kRecord - tls_out_.size());
      tls_out_.append(static_cast<const char*>(v.iov_base), take);
      if (tls_out_.size() == kRecord) break;
    }
    taken = std::ssize(tls_out_);
    state = flush();
  }
  bio_socket_.dontwait = false;
  return state < 0 ? -1 : taken;
}

}  // namespace blockkv::internal
