// libFuzzer target: the JSON reader of trace lines (ParseTraceLine in tools/trace.cc, nlohmann-
// json's SAX parser under a handler of ours) on arbitrary bytes, checked against nlohmann-json's
// own validator and by a round trip. It aborts when
//   - a line is accepted that nlohmann::json::accept refuses (or that holds a NUL byte),
//   - an accepted line breaks the TraceLine contract (a prompt past the limit, output_len < 1,
//     prefix_len > prompt_len),
//   - an accepted line, written back as JSON (JsonWriter), does not parse to the same TraceLine.
// Keep each crash found as a named regression test in tests/tool/tool_simulate_test.cc.
//
//   trace_line_fuzz -max_total_time=60 tests/fuzz/corpus/trace_line_fuzz/
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "json.h"

namespace {

constexpr int64_t kMaxTokens = 512;

[[noreturn]] void Fail(const char* what, std::string_view line) {
  std::fprintf(stderr, "trace_line_fuzz: %s: %.*s\n", what, static_cast<int>(line.size()),
               line.data());
  std::abort();
}

std::string Write(const blockkv::tool::TraceLine& t) {
  blockkv::tool::JsonWriter w;
  w.BeginObject().Key("arrival").Int(t.arrival).Key("output_len").Int(t.output_len);
  if (!t.prompt.empty()) {
    w.Key("prompt").BeginArray();
    for (const int32_t id : t.prompt) w.Int(id);
    w.EndArray();
  } else {
    w.Key("prompt_len").Int(t.prompt_len);
    if (t.group_is_string || !t.prefix_group.empty()) {  // an integer group has digits
      w.Key("prefix_group");
      if (t.group_is_string) {
        w.String(t.prefix_group);
      } else {
        w.Null();  // replaced below: an integer's digits go in as they are
      }
      w.Key("prefix_len").Int(t.prefix_len);
    }
  }
  w.EndObject();
  std::string text = w.str();
  if (!t.prefix_group.empty() && !t.group_is_string) {
    text.replace(text.find("null"), 4, t.prefix_group);
  }
  return text;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  blockkv::Result<blockkv::tool::TraceLine> parsed =
      blockkv::tool::ParseTraceLine(line, kMaxTokens);
  if (!parsed.ok()) {
    if (parsed.status().code() != blockkv::StatusCode::kInvalidArgument) {
      Fail("a code other than INVALID_ARGUMENT", line);
    }
    return 0;
  }
  if (line.find('\0') != std::string_view::npos || !nlohmann::json::accept(line)) {
    Fail("accepted what is not JSON", line);
  }
  const blockkv::tool::TraceLine& t = *parsed;
  if (std::ssize(t.prompt) > kMaxTokens || t.prompt_len > kMaxTokens || t.output_len < 1 ||
      t.arrival < 0 || t.prefix_len > t.prompt_len || (t.prompt.empty() && t.prompt_len < 1)) {
    Fail("a line outside the contract", line);
  }
  const std::string again = Write(t);
  blockkv::Result<blockkv::tool::TraceLine> reparsed =
      blockkv::tool::ParseTraceLine(again, kMaxTokens);
  if (!reparsed.ok()) Fail("its own output does not parse", again);
  const blockkv::tool::TraceLine& u = *reparsed;
  if (u.arrival != t.arrival || u.prompt != t.prompt || u.prompt_len != t.prompt_len ||
      u.prefix_group != t.prefix_group || u.group_is_string != t.group_is_string ||
      u.prefix_len != t.prefix_len || u.output_len != t.output_len) {
    Fail("the round trip changed the line", again);
  }
  return 0;
}
