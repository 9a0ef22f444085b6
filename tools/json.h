// SPDX-License-Identifier: Apache-2.0
// JSON for the blockkv tool: a writer for `--json` output, and the line reader of JSONL traces.
// A line's JSON is parsed by nlohmann-json's SAX interface (trace.cc), which checks the grammar,
// numbers and UTF-8; this file only splits the file into lines, bounded in length.
//
//   JsonWriter w;
//   w.BeginObject().Key("blocks").Int(40448).Key("dtype").String("fp16").EndObject();
//   std::puts(w.str().c_str());                       // {"blocks": 40448, "dtype": "fp16"}
//
//   JsonlReader reader;
//   Status s = reader.Open("trace.jsonl");            // kNotFound names the path
//   std::string_view line;
//   while (true) {
//     Result<bool> more = reader.Next(&line);         // kInvalidArgument: "trace.jsonl:3: ..."
//     if (!more.ok() || !*more) break;
//     ... reader.line_number() ...
//   }
//
// The writer stays hand-written: it is a hundred lines with no parsing in it, and its
// member-order, two-space output is what docs/tool.md shows.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "blockkv/status.h"

namespace blockkv::tool {

// Writes one JSON document, indented by two spaces, members in the order written.
// REQUIRES: calls form a valid document (Key only inside an object, before each value).
class JsonWriter {
 public:
  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  JsonWriter& Key(std::string_view key);
  JsonWriter& String(std::string_view value);
  JsonWriter& Int(int64_t value);
  JsonWriter& Double(double value);  // non-finite values are written as null
  JsonWriter& Bool(bool value);
  JsonWriter& Null();

  // The document so far, with a trailing newline once the outermost value is closed.
  const std::string& str() const { return out_; }

 private:
  void BeforeValue();
  void Open(char bracket);
  void Close(char bracket);

  std::string out_;
  std::vector<bool> first_;  // per open container: no member written yet
  bool after_key_ = false;
};

// `text` with JSON string escapes, without the quotes.
std::string JsonEscape(std::string_view text);

// Opens `path` for reading: kNotFound (missing), kInvalidArgument (a directory or not a regular
// file), kPermissionDenied, each
// naming the path and the reason.
Result<std::FILE*> OpenInputFile(const std::string& path);
// The Status of a failed open or write of `path` from its errno, with the same mapping.
Status FileError(std::string_view what, const std::string& path, int error);

// Reads a JSONL file one line at a time, without holding more than the current line; blank
// lines are skipped. A line longer than kMaxLineBytes is an error, not an allocation.
class JsonlReader {
 public:
  static constexpr int64_t kMaxLineBytes = int64_t{64} << 20;

  JsonlReader() = default;
  ~JsonlReader();
  JsonlReader(const JsonlReader&) = delete;
  JsonlReader& operator=(const JsonlReader&) = delete;

  // OpenInputFile's errors.
  Status Open(const std::string& path);
  // Reads from `file` (not closed by the reader), named `path` in messages: for tests and fuzzers
  // that read from memory (fmemopen).
  void Attach(std::FILE* file, const std::string& path);
  // The next non-blank line into *line (valid until the next call): true, or false at the end of
  // the file. kInvalidArgument "path:N: ..." for a line past kMaxLineBytes, kDataLoss for a
  // read error.
  Result<bool> Next(std::string_view* line);
  // 1-based number of the line Next returned last.
  int64_t line_number() const { return line_number_; }
  const std::string& path() const { return path_; }

 private:
  std::FILE* file_ = nullptr;
  bool owned_ = false;
  std::string path_;
  std::string line_;
  std::array<char, 1 << 16> buffer_{};  // read ahead: [pos_, end_) not yet returned
  size_t pos_ = 0;
  size_t end_ = 0;
  int64_t line_number_ = 0;
};

}  // namespace blockkv::tool
