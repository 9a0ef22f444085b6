// JSON for the blockkv tool: a writer for `--json` output and a reader for JSONL traces, both
// minimal (the tool needs objects, arrays, strings, numbers and booleans; nothing else).
//
//   JsonWriter w;
//   w.BeginObject().Key("blocks").Int(40448).Key("dtype").String("fp16").EndObject();
//   std::puts(w.str().c_str());                       // {"blocks": 40448, "dtype": "fp16"}
//
//   JsonlReader reader;
//   Status s = reader.Open("trace.jsonl");            // kNotFound names the path
//   JsonValue line;
//   while (true) {
//     Result<bool> more = reader.Next(&line);         // kInvalidArgument: "trace.jsonl:3: ..."
//     if (!more.ok() || !*more) break;
//     ... reader.line_number() ...
//   }
//
// The tool depends on nothing beyond blockkv and the standard library (DESIGN.md lists
// nlohmann-json and CLI11 for the CLI; neither is on the machine image, and what the tool needs
// fits in this file and json.cc).
#pragma once

#include <cstdint>
#include <fstream>
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

struct JsonMember;

// A parsed JSON value. Objects keep their members in file order (duplicates are an error).
struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<JsonValue> array;
  std::vector<JsonMember> object;

  // The member `key` of an object, or nullptr (also for a value that is not an object).
  const JsonValue* Find(std::string_view key) const;
  // "null", "boolean", "number", "string", "array", "object": for messages.
  std::string_view TypeName() const;
};

struct JsonMember {
  std::string key;
  JsonValue value;
};

// Parses one JSON document (surrounding whitespace allowed). kInvalidArgument says what was
// expected and at which column (1-based).
Result<JsonValue> ParseJson(std::string_view text);

// Reads a JSONL file one value per line; blank lines are skipped.
class JsonlReader {
 public:
  // kNotFound when the file cannot be opened (the message names the path and why).
  Status Open(const std::string& path);
  // The next line's value into *out: true, or false at the end of the file. A line that is not
  // valid JSON is kInvalidArgument "path:line: ...".
  Result<bool> Next(JsonValue* out);
  // 1-based line number of the value Next returned last.
  int64_t line_number() const { return line_number_; }
  const std::string& path() const { return path_; }

 private:
  std::ifstream in_;
  std::string path_;
  std::string line_;
  int64_t line_number_ = 0;
};

}  // namespace blockkv::tool
