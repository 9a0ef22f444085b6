// SPDX-License-Identifier: Apache-2.0
// How much host memory there is, read from /proc/meminfo and the cgroup. The parsers take the
// files' text so that tests can feed them any content.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace blockkv::internal {

struct HostMemory {
  int64_t total = 0;      // min(MemTotal, cgroup limit)
  int64_t available = 0;  // min(MemAvailable, cgroup limit − cgroup usage), >= 0
};

// A field of /proc/meminfo ("MemAvailable") in bytes; nullopt when absent or malformed.
std::optional<int64_t> ParseMemInfoField(std::string_view meminfo, std::string_view field);

// The content of cgroup v2 memory.max or v1 memory.limit_in_bytes, in bytes. nullopt for "max",
// for v1's "no limit" (a value of 2^62 or more), or malformed text.
std::optional<int64_t> ParseCgroupLimit(std::string_view text);

// This process's cgroup path ("/a/b") from /proc/self/cgroup: the v2 line ("0::/a/b") when v2,
// else the v1 line whose controllers include "memory". nullopt when there is none.
std::optional<std::string> CgroupPathOf(std::string_view proc_self_cgroup, bool v2);

// Combines the parsed values (each may be missing) into HostMemory.
HostMemory CombineHostMemory(std::optional<int64_t> mem_total, std::optional<int64_t> mem_available,
                             std::optional<int64_t> cgroup_limit,
                             std::optional<int64_t> cgroup_usage);

// Reads the files of this machine and process.
HostMemory ReadHostMemory();

}  // namespace blockkv::internal
