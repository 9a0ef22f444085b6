// SPDX-License-Identifier: Apache-2.0
// Logging: library code writes nothing itself; it hands lines to a sink the application can
// replace. The default sink writes them to stderr, from INFO up (BlockedKVCache::Create logs one
// INFO line per cache group): set the level or the sink to silence or redirect them.
//
//   blockkv::SetLogLevel(blockkv::LogLevel::kWarning);          // silence info lines
//   blockkv::SetLogSink([](blockkv::LogLevel, std::string_view line) { MyLogger(line); });
#pragma once

#include <functional>
#include <string_view>

namespace blockkv {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

// Called for each line at or above the current level, from whichever thread logged it; calls
// are serialized under a lock, so a sink must not call Log or SetLogSink itself. The line has no
// trailing newline.
using LogSink = std::function<void(LogLevel level, std::string_view line)>;

// Replaces the sink; an empty function restores the default (stderr, "blockkv [I] ..." lines).
void SetLogSink(LogSink sink);
// Lines below `level` are dropped. Default kInfo.
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();

// "DEBUG", "INFO", "WARNING", "ERROR".
const char* LogLevelName(LogLevel level);

// Sends one line to the sink if `level` is enabled. For blockkv's own components.
void Log(LogLevel level, std::string_view line);

}  // namespace blockkv
