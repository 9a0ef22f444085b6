// SPDX-License-Identifier: Apache-2.0
// A real redis-server for the remote tier's tests: started on 127.0.0.1 on a free port in a
// scratch directory with persistence off, killed (SIGKILL) when the object goes. A test that
// cannot start one fails: it never skips.
#pragma once

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
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
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
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
  int port_;
  std::filesystem::path dir_;
  pid_t pid_ = -1;
};

}  // namespace blockkv::testing
