// SPDX-License-Identifier: Apache-2.0
#include "blockkv/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>

namespace blockkv {
namespace {

struct LogState {
  std::mutex mutex;
  LogSink sink;  // empty: the default stderr sink
  std::atomic<LogLevel> level{LogLevel::kInfo};
};

LogState& State() {
  static auto* state = new LogState();  // never destroyed: logging works during exit
  return *state;
}

}  // namespace

const char* LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "?";
}

void SetLogSink(LogSink sink) {
  LogState& state = State();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.sink = std::move(sink);
}

void SetLogLevel(LogLevel level) { State().level.store(level, std::memory_order_relaxed); }

LogLevel GetLogLevel() { return State().level.load(std::memory_order_relaxed); }

void Log(LogLevel level, std::string_view line) {
  LogState& state = State();
  if (level < state.level.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sink) {
    state.sink(level, line);
  } else {
    std::fprintf(stderr, "blockkv [%c] %.*s\n", LogLevelName(level)[0],
                 static_cast<int>(line.size()), line.data());
  }
}

}  // namespace blockkv
