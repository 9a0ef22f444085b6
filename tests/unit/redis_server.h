// SPDX-License-Identifier: Apache-2.0
// A real redis-server for the remote tier's tests: started on 127.0.0.1 on a free port in a
// scratch directory with persistence off, killed (SIGKILL) when the object goes; and a Redis
// Cluster of such servers (RedisCluster: cluster-enabled, joined with `redis-cli --cluster
// create`). A test that cannot start one fails: it never skips.
#pragma once

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace blockkv::testing {

// A TCP port nothing listens on now (the kernel's pick for port 0).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

class RedisServer {
 public:
  // `extra`: more redis-server arguments (e.g. {"--requirepass", "secret"}).
  explicit RedisServer(std::vector<std::string> extra = {}, int port = 0)
      : extra_(std::move(extra)), port_(port > 0 ? port : FreePort()) {
    dir_ = std::filesystem::temp_directory_path() /
           ("blockkv-redis-" + std::to_string(getpid()) + "-" + std::to_string(port_));
    std::filesystem::create_directories(dir_);
    Start();
  }
  // A sentinel (redis-server --sentinel, its config file in its directory) watching the master
  // at 127.0.0.1:master_port as `name`, quorum 1: it fails the master over to a replica once it
  // has not answered for down_after_ms.
  struct SentinelOf {
    std::string name;
    int master_port = 0;
    int down_after_ms = 1000;
    std::vector<std::string> extra = {};  // more arguments (a TLS port: TlsFiles::ServerArgs)
  };
  explicit RedisServer(const SentinelOf& s) : extra_(s.extra), port_(FreePort()) {
    dir_ = std::filesystem::temp_directory_path() /
           ("blockkv-sentinel-" + std::to_string(getpid()) + "-" + std::to_string(port_));
    std::filesystem::create_directories(dir_);
    const std::string m = std::to_string(s.master_port);
    sentinel_conf_ = "sentinel monitor " + s.name + " 127.0.0.1 " + m + " 1\n" +
                     "sentinel down-after-milliseconds " + s.name + " " +
                     std::to_string(s.down_after_ms) + "\n" + "sentinel failover-timeout " +
                     s.name + " 10000\n";
    Start();
  }
  ~RedisServer() {
    Kill();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  int port() const { return port_; }
  bool running() const { return pid_ > 0; }
  std::string url(const std::string& auth = "") const {
    return "redis://" + (auth.empty() ? "" : auth + "@") + "127.0.0.1:" + std::to_string(port_);
  }

  // Starts it (again, on the same port); fails the test when it does not answer within 10 s.
  void Start() {
    ASSERT_GT(port_, 0) << "no free port";
    std::vector<std::string> args = {"redis-server",
                                     "--port",
                                     std::to_string(port_),
                                     "--bind",
                                     "127.0.0.1",
                                     "--save",
                                     "",
                                     "--appendonly",
                                     "no",
                                     "--dir",
                                     dir_.string(),
                                     "--daemonize",
                                     "no",
                                     "--loglevel",
                                     "warning"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    if (!sentinel_conf_.empty()) {  // the file a sentinel rewrites (kept across restarts)
      const std::filesystem::path conf = dir_ / "sentinel.conf";
      if (!std::filesystem::exists(conf)) {
        std::FILE* f = std::fopen(conf.c_str(), "w");
        ASSERT_NE(f, nullptr) << conf;
        std::fputs(sentinel_conf_.c_str(), f);
        std::fclose(f);
      }
      args = {"redis-server", conf.string(), "--sentinel", "--port",      std::to_string(port_),
              "--bind",       "127.0.0.1",   "--dir",      dir_.string(), "--daemonize",
              "no",           "--loglevel",  "warning"};
      args.insert(args.end(), extra_.begin(), extra_.end());
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    posix_spawn_file_actions_t quiet;  // its log on stdout would bury the test's output
    posix_spawn_file_actions_init(&quiet);
    posix_spawn_file_actions_addopen(&quiet, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    const int spawned = posix_spawnp(&pid, "redis-server", &quiet, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&quiet);
    ASSERT_EQ(spawned, 0) << "cannot start redis-server (apt-get install redis-server; "
                             "scripts/deps.sh does)";
    pid_ = pid;
    for (int i = 0; i < 200; ++i) {
      const timeval tv{.tv_sec = 1, .tv_usec = 0};
      redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
      const bool up = c != nullptr && c->err == 0;
      if (c != nullptr) redisFree(c);
      if (up) return;
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL() << "redis-server exited at start on port " << port_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "redis-server did not answer on port " << port_ << " within 10 s";
  }
  // Stalls it (SIGSTOP: its sockets stay open, nothing answers) and lets it go on (SIGCONT).
  void Stop() const {
    if (pid_ > 0) kill(pid_, SIGSTOP);
  }
  void Continue() const {
    if (pid_ > 0) kill(pid_, SIGCONT);
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  // A command's reply on a fresh connection (null when the server does not answer).
  std::shared_ptr<redisReply> Command(const std::vector<std::string>& args) const {
    redisContext* c = Connect();
    if (c == nullptr || c->err != 0) {
      if (c != nullptr) redisFree(c);
      return nullptr;
    }
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(
        redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
    redisFree(c);
    return std::shared_ptr<redisReply>(r, [](redisReply* p) {
      if (p != nullptr) freeReplyObject(p);
    });
  }
  // A command's reply as text (a string, status or error reply; an integer in decimal).
  std::string Text(const std::vector<std::string>& args) const {
    const std::shared_ptr<redisReply> r = Command(args);
    if (r == nullptr) return "(no reply)";
    if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
    return r->str != nullptr ? std::string(r->str, r->len) : std::string();
  }

  // A connection for a test to read or change what the server holds (AUTH'd with `password`).
  redisContext* Connect(const std::string& password = "") const {
    const timeval tv{.tv_sec = 2, .tv_usec = 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
    if (c != nullptr && c->err == 0 && !password.empty()) {
      freeReplyObject(redisCommand(c, "AUTH %s", password.c_str()));
    }
    return c;
  }

 private:
  std::vector<std::string> extra_;
  std::string sentinel_conf_;  // a sentinel's config file ("" for a server)
  int port_;
  std::filesystem::path dir_;
  pid_t pid_ = -1;
};

// Runs a program to its end, its stdout (and with `quiet`, its stderr) discarded; its exit status
// (-1 when it cannot start).
inline int RunProgram(std::vector<std::string> args, bool quiet_stderr = false) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  posix_spawn_file_actions_t quiet;
  posix_spawn_file_actions_init(&quiet);
  posix_spawn_file_actions_addopen(&quiet, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  if (quiet_stderr) {
    posix_spawn_file_actions_addopen(&quiet, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  }
  const int spawned = posix_spawnp(&pid, argv[0], &quiet, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&quiet);
  if (spawned != 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// Certificates for TLS tests, made with the openssl tool in a scratch directory: a CA, a server
// certificate it signed for 127.0.0.1, ::1 and localhost, a client certificate it signed, and a
// second CA that signed neither. Fails the test when they cannot be made.
class TlsFiles {
 public:
  TlsFiles()
      : dir_(std::filesystem::temp_directory_path() /
             ("blockkv-tls-" + std::to_string(getpid()) + "-" + std::to_string(FreePort()))) {
    std::filesystem::create_directories(dir_);
    Make();
  }
  ~TlsFiles() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TlsFiles(const TlsFiles&) = delete;
  TlsFiles& operator=(const TlsFiles&) = delete;

  // ca.pem, other_ca.pem, server.pem / server.key, client.pem / client.key
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // redis-server arguments adding a TLS port (its plain port stays, for the tests' own checks);
  // with `client_certs`, a TLS client must show a certificate the CA signed.
  std::vector<std::string> ServerArgs(int tls_port, bool client_certs = false) const {
    return {
        "--tls-port",         std::to_string(tls_port),   "--tls-cert-file",    path("server.pem"),
        "--tls-key-file",     path("server.key"),         "--tls-ca-cert-file", path("ca.pem"),
        "--tls-auth-clients", client_certs ? "yes" : "no"};
  }

 private:
  void Make() {
    const auto ec_key = [&](const std::string& name) {
      return std::vector<std::string>{
          "-newkey", "ec",      "-pkeyopt",         "ec_paramgen_curve:prime256v1",
          "-nodes",  "-keyout", path(name + ".key")};
    };
    const auto run = [&](std::vector<std::string> args) {
      ASSERT_EQ(RunProgram(args, /*quiet_stderr=*/true), 0)
          << "openssl " << args[1] << " failed (apt-get install openssl; scripts/deps.sh does)";
    };
    for (const std::string ca : {"ca", "other_ca"}) {
      std::vector<std::string> args = {
          "openssl",        "req", "-x509", "-days", "2", "-subj", "/CN=blockkv test " + ca, "-out",
          path(ca + ".pem")};
      const std::vector<std::string> key = ec_key(ca);
      args.insert(args.end(), key.begin(), key.end());
      run(args);
    }
    for (const auto& [name, ext] :
         {std::pair<std::string, std::string>{"server",
                                              "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost"},
          {"client", "extendedKeyUsage=clientAuth"}}) {
      std::vector<std::string> req = {"openssl",     "req",  "-subj",
                                      "/CN=" + name, "-out", path(name + ".csr")};
      const std::vector<std::string> key = ec_key(name);
      req.insert(req.end(), key.begin(), key.end());
      run(req);
      std::FILE* f = std::fopen(path(name + ".ext").c_str(), "w");
      ASSERT_NE(f, nullptr);
      std::fputs((ext + "\n").c_str(), f);
      std::fclose(f);
      run({"openssl", "x509", "-req", "-in", path(name + ".csr"), "-CA", path("ca.pem"), "-CAkey",
           path("ca.key"), "-CAcreateserial", "-days", "2", "-extfile", path(name + ".ext"), "-out",
           path(name + ".pem")});
    }
  }

  std::filesystem::path dir_;
};

// A Redis Cluster of `masters` redis-servers, each with `replicas` replicas, on 127.0.0.1, each on
// a free port with a free cluster bus port, persistence off, `cluster-require-full-coverage no`
// (a dead node's slots fail, the others keep serving) and no failover during a test unless the
// test asks for one. Created with `redis-cli --cluster create`; ready once every node says
// cluster_state:ok, knows every node and lists every replica, and every replica's link to its
// master is up.
class RedisCluster {
 public:
  // With `tls`, each node also has a TLS port and the cluster bus is TLS (tls-cluster yes): a TLS
  // client is given the nodes' TLS ports (CLUSTER SLOTS, MOVED), a plain one their plain ports.
  explicit RedisCluster(int masters = 3, int replicas = 0, const TlsFiles* tls = nullptr)
      : replicas_(replicas), tls_(tls) {
    Create(masters, replicas);
  }

  size_t size() const { return nodes_.size(); }
  RedisServer& node(size_t i) { return *nodes_[i]; }
  // redis+cluster://[auth@]127.0.0.1:<port of node 0>,127.0.0.1:<port of node 1>
  std::string url(const std::string& auth = "") const {
    return "redis+cluster://" + (auth.empty() ? "" : auth + "@") +
           "127.0.0.1:" + std::to_string(nodes_[0]->port()) +
           ",127.0.0.1:" + std::to_string(nodes_[1]->port());
  }
  // rediss+cluster://127.0.0.1:<TLS port of node 0>,127.0.0.1:<of node 1>?ssl_ca_certs=<the CA>
  std::string tls_url() const {
    return "rediss+cluster://127.0.0.1:" + std::to_string(tls_ports_[0]) +
           ",127.0.0.1:" + std::to_string(tls_ports_[1]) + "?ssl_ca_certs=" + tls_->path("ca.pem");
  }
  std::string id(size_t i) const { return nodes_[i]->Text({"CLUSTER", "MYID"}); }
  int slot(const std::string& key) const {
    return static_cast<int>(nodes_[0]->Command({"CLUSTER", "KEYSLOT", key})->integer);
  }
  // The node that owns `key`'s slot (per node 0's view of the slot map); -1 when none.
  int owner(const std::string& key) const {
    const int s = slot(key);
    const std::shared_ptr<redisReply> slots = nodes_[0]->Command({"CLUSTER", "SLOTS"});
    for (size_t r = 0; slots != nullptr && r < slots->elements; ++r) {
      const redisReply* range = slots->element[r];
      if (range->element[0]->integer <= s && s <= range->element[1]->integer) {
        const long long port = range->element[2]->element[1]->integer;
        for (size_t i = 0; i < nodes_.size(); ++i) {
          if (nodes_[i]->port() == port) return static_cast<int>(i);
        }
      }
    }
    return -1;
  }
  // The port of the master node i replicates (ROLE), or 0 when node i is a master.
  long long master_port(size_t i) const {
    const std::shared_ptr<redisReply> role = nodes_[i]->Command({"ROLE"});
    if (role == nullptr || role->type != REDIS_REPLY_ARRAY || role->elements < 3 ||
        std::string_view(role->element[0]->str, role->element[0]->len) != "slave") {
      return 0;
    }
    return role->element[2]->integer;
  }
  // A replica of node `master`; -1 when it has none.
  int replica_of(size_t master) const {
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (master_port(i) == nodes_[master]->port()) return static_cast<int>(i);
    }
    return -1;
  }

 private:
  void Create(int masters, int replicas) {
    std::vector<std::string> create = {"redis-cli", "--cluster", "create"};
    for (int i = 0; i < masters * (1 + replicas); ++i) {
      const int bus = FreePort();
      ASSERT_GT(bus, 0) << "no free port";
      // With replicas: no failover unless a test asks for one (CLUSTER FAILOVER), and replicas
      // listed by CLUSTER SLOTS within a second or two: their first sync at once (not 5 s later),
      // their offsets moving (a node lists a replica once gossip says its offset is not 0; with
      // no writes, only the master's pings move it: every 10 s by default), and gossip among all
      // nodes every node timeout / 2.
      std::vector<std::string> args = {"--cluster-enabled",
                                       "yes",
                                       "--cluster-config-file",
                                       "nodes.conf",
                                       "--cluster-port",
                                       std::to_string(bus),
                                       "--cluster-require-full-coverage",
                                       "no",
                                       "--cluster-node-timeout",
                                       replicas > 0 ? "3000" : "60000",
                                       "--cluster-replica-no-failover",
                                       replicas > 0 ? "yes" : "no",
                                       "--repl-diskless-sync-delay",
                                       "0",
                                       "--repl-ping-replica-period",
                                       "1"};
      if (tls_ != nullptr) {
        tls_ports_.push_back(FreePort());
        const std::vector<std::string> more = tls_->ServerArgs(tls_ports_.back());
        args.insert(args.end(), more.begin(), more.end());
        args.insert(args.end(), {"--tls-cluster", "yes", "--tls-replication", "yes"});
      }
      nodes_.push_back(std::make_unique<RedisServer>(std::move(args)));
      if (::testing::Test::HasFatalFailure()) return;
      create.push_back("127.0.0.1:" + std::to_string(nodes_.back()->port()));
    }
    create.insert(create.end(), {"--cluster-replicas", std::to_string(replicas), "--cluster-yes"});
    ASSERT_EQ(RunProgram(create), 0) << "redis-cli --cluster create failed (apt-get install "
                                        "redis-tools redis-server; scripts/deps.sh does)";
    WaitReady();
  }

 public:
  // Waits until every node says cluster_state:ok and knows every node (after Create, or after
  // its nodes were restarted); fails the test after 20 s.
  void WaitReady() {
    const std::string known = "cluster_known_nodes:" + std::to_string(nodes_.size());
    for (int i = 0; i < 400; ++i) {
      bool ready = true;
      for (const auto& node : nodes_) {
        const std::string info = node->Text({"CLUSTER", "INFO"});
        ready = ready && info.find("cluster_state:ok") != std::string::npos &&
                info.find(known) != std::string::npos;
        const std::string replication = node->Text({"INFO", "replication"});
        ready = ready && (replication.find("role:slave") == std::string::npos ||
                          replication.find("master_link_status:up") != std::string::npos);
        // Every node lists every range's replicas: CLUSTER SLOTS leaves out a replica until the
        // node asked has heard (gossip) that it holds data.
        const std::shared_ptr<redisReply> slots = node->Command({"CLUSTER", "SLOTS"});
        ready = ready && slots != nullptr && slots->type == REDIS_REPLY_ARRAY;
        for (size_t r = 0; ready && r < slots->elements; ++r) {
          ready = slots->element[r]->elements >= 3 + static_cast<size_t>(replicas_);
        }
      }
      if (ready) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "the redis cluster did not reach cluster_state:ok (and its replicas their "
              "masters) within 20 s";
  }

 private:
  int replicas_;  // per master
  const TlsFiles* tls_;
  std::vector<int> tls_ports_;
  std::vector<std::unique_ptr<RedisServer>> nodes_;
};

}  // namespace blockkv::testing
