// SPDX-License-Identifier: Apache-2.0
#include "internal/host_memory.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <string>

namespace blockkv::internal {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

std::optional<int64_t> ParseInt(std::string_view s) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end != s.data() + s.size() || value < 0) return std::nullopt;
  return value;
}

std::optional<std::string> ReadFile(const char* path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::optional<int64_t> ReadCgroupValue(const char* path) {
  const auto text = ReadFile(path);
  if (!text) return std::nullopt;
  return ParseCgroupLimit(*text);
}

}  // namespace

std::optional<int64_t> ParseMemInfoField(std::string_view meminfo, std::string_view field) {
  while (!meminfo.empty()) {
    const size_t eol = meminfo.find('\n');
    std::string_view line = meminfo.substr(0, eol);
    meminfo = eol == std::string_view::npos ? std::string_view() : meminfo.substr(eol + 1);
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || line.substr(0, colon) != field) continue;
    std::string_view rest = Trim(line.substr(colon + 1));
    int64_t unit = 1;
    if (rest.size() >= 2 && rest.substr(rest.size() - 2) == "kB") {
      unit = 1024;
      rest = Trim(rest.substr(0, rest.size() - 2));
    }
    const auto value = ParseInt(rest);
    if (!value || *value > INT64_MAX / unit) return std::nullopt;
    return *value * unit;
  }
  return std::nullopt;
}

std::optional<int64_t> ParseCgroupLimit(std::string_view text) {
  text = Trim(text);
  if (text == "max") return std::nullopt;
  const auto value = ParseInt(text);
  // cgroup v1 reports "no limit" as a huge page-aligned number near 2^63.
  if (!value || *value >= (int64_t{1} << 62)) return std::nullopt;
  return value;
}

HostMemory CombineHostMemory(std::optional<int64_t> mem_total, std::optional<int64_t> mem_available,
                             std::optional<int64_t> cgroup_limit,
                             std::optional<int64_t> cgroup_usage) {
  HostMemory m;
  m.total = mem_total.value_or(0);
  m.available = mem_available.value_or(m.total);
  if (cgroup_limit) {
    m.total = mem_total ? std::min(*mem_total, *cgroup_limit) : *cgroup_limit;
    const int64_t headroom = std::max<int64_t>(0, *cgroup_limit - cgroup_usage.value_or(0));
    m.available = mem_available ? std::min(*mem_available, headroom) : headroom;
  }
  m.available = std::clamp<int64_t>(m.available, 0, m.total);
  return m;
}

std::optional<std::string> CgroupPathOf(std::string_view proc_self_cgroup, bool v2) {
  while (!proc_self_cgroup.empty()) {
    const size_t eol = proc_self_cgroup.find('\n');
    const std::string_view line = proc_self_cgroup.substr(0, eol);
    proc_self_cgroup =
        eol == std::string_view::npos ? std::string_view() : proc_self_cgroup.substr(eol + 1);
    // "hierarchy-id:controller-list:path"
    const size_t first = line.find(':');
    const size_t second = first == std::string_view::npos ? first : line.find(':', first + 1);
    if (second == std::string_view::npos) continue;
    const std::string_view controllers = line.substr(first + 1, second - first - 1);
    const std::string_view path = Trim(line.substr(second + 1));
    bool match = v2 ? (line.substr(0, first) == "0" && controllers.empty()) : false;
    if (!v2) {
      for (std::string_view rest = controllers; !rest.empty();) {
        const size_t comma = rest.find(',');
        if (rest.substr(0, comma) == "memory") match = true;
        rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      }
    }
    if (match) return std::string(path);
  }
  return std::nullopt;
}

namespace {

// The limit and usage of this process's memory cgroup: its own directory first (as the kernel
// shows it in /proc/self/cgroup), then the mount's root (a cgroup namespace shows "/" there).
void ReadCgroup(const std::string& proc_self_cgroup, std::optional<int64_t>* limit,
                std::optional<int64_t>* usage) {
  struct Layout {
    bool v2;
    const char* mount;
    const char* limit_file;
    const char* usage_file;
  };
  static constexpr Layout kLayouts[] = {
      {true, "/sys/fs/cgroup", "memory.max", "memory.current"},
      {false, "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"},
  };
  for (const Layout& layout : kLayouts) {
    const std::string own = CgroupPathOf(proc_self_cgroup, layout.v2).value_or("/");
    for (const std::string& dir : {std::string(layout.mount) + own, std::string(layout.mount)}) {
      *limit = ReadCgroupValue((dir + "/" + layout.limit_file).c_str());
      if (*limit) {
        *usage = ReadCgroupValue((dir + "/" + layout.usage_file).c_str());
        return;
      }
    }
  }
}

}  // namespace

HostMemory ReadHostMemory() {
  const std::string meminfo = ReadFile("/proc/meminfo").value_or("");
  std::optional<int64_t> limit;
  std::optional<int64_t> usage;
  ReadCgroup(ReadFile("/proc/self/cgroup").value_or(""), &limit, &usage);
  return CombineHostMemory(ParseMemInfoField(meminfo, "MemTotal"),
                           ParseMemInfoField(meminfo, "MemAvailable"), limit, usage);
}

}  // namespace blockkv::internal
