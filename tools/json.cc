#include "json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace blockkv::tool {

// ---- writer ----

void JsonWriter::BeforeValue() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (first_.empty()) return;
  if (!first_.back()) out_ += ',';
  first_.back() = false;
  out_ += '\n';
  out_.append(2 * first_.size(), ' ');
}

void JsonWriter::Open(char bracket) {
  BeforeValue();
  out_ += bracket;
  first_.push_back(true);
}

void JsonWriter::Close(char bracket) {
  const bool empty = first_.back();
  first_.pop_back();
  if (!empty) {
    out_ += '\n';
    out_.append(2 * first_.size(), ' ');
  }
  out_ += bracket;
  if (first_.empty()) out_ += '\n';
}

JsonWriter& JsonWriter::BeginObject() {
  Open('{');
  return *this;
}
JsonWriter& JsonWriter::EndObject() {
  Close('}');
  return *this;
}
JsonWriter& JsonWriter::BeginArray() {
  Open('[');
  return *this;
}
JsonWriter& JsonWriter::EndArray() {
  Close(']');
  return *this;
}

JsonWriter& JsonWriter::Key(std::string_view key) {
  BeforeValue();
  out_ += '"';
  out_ += JsonEscape(key);
  out_ += "\": ";
  after_key_ = true;
  return *this;
}

JsonWriter& JsonWriter::String(std::string_view value) {
  BeforeValue();
  out_ += '"';
  out_ += JsonEscape(value);
  out_ += '"';
  return *this;
}

JsonWriter& JsonWriter::Int(int64_t value) {
  BeforeValue();
  out_ += std::to_string(value);
  return *this;
}

JsonWriter& JsonWriter::Double(double value) {
  BeforeValue();
  if (!std::isfinite(value)) {
    out_ += "null";
    return *this;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.6g", value);
  out_ += text;
  return *this;
}

JsonWriter& JsonWriter::Bool(bool value) {
  BeforeValue();
  out_ += value ? "true" : "false";
  return *this;
}

JsonWriter& JsonWriter::Null() {
  BeforeValue();
  out_ += "null";
  return *this;
}

std::string JsonEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char code[8];
          std::snprintf(code, sizeof(code), "\\u%04x", static_cast<unsigned>(c));
          out += code;
        } else {
          out += c;
        }
    }
  }
  return out;
}

// ---- reader ----

const JsonValue* JsonValue::Find(std::string_view key) const {
  for (const auto& [name, value] : object) {
    if (name == key) return &value;
  }
  return nullptr;
}

std::string_view JsonValue::TypeName() const {
  switch (type) {
    case Type::kNull:
      return "null";
    case Type::kBool:
      return "boolean";
    case Type::kNumber:
      return "number";
    case Type::kString:
      return "string";
    case Type::kArray:
      return "array";
    case Type::kObject:
      return "object";
  }
  return "?";
}

namespace {

// Recursive descent over one document. Nesting is limited so that a hostile line cannot
// overflow the stack.
class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Status Document(JsonValue* out) {
    BLOCKKV_RETURN_IF_ERROR(Value(out, 0));
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the value");
    return Status::Ok();
  }

 private:
  static constexpr int kMaxDepth = 64;

  Status Error(std::string_view what) const {
    return InvalidArgumentError(std::string(what) + " at column " + std::to_string(pos_ + 1));
  }
  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\r' || text_[pos_] == '\n')) {
      ++pos_;
    }
  }
  bool Consume(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  Status Value(JsonValue* out, int depth) {
    if (depth > kMaxDepth) return Error("nesting deeper than 64");
    SkipSpace();
    if (pos_ == text_.size()) return Error("expected a value, found the end of the line");
    const char c = text_[pos_];
    if (c == '{') return Object(out, depth);
    if (c == '[') return Array(out, depth);
    if (c == '"') {
      out->type = JsonValue::Type::kString;
      return String(&out->string);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return Number(out);
    if (Consume("true")) {
      out->type = JsonValue::Type::kBool;
      out->boolean = true;
      return Status::Ok();
    }
    if (Consume("false")) {
      out->type = JsonValue::Type::kBool;
      return Status::Ok();
    }
    if (Consume("null")) {
      out->type = JsonValue::Type::kNull;
      return Status::Ok();
    }
    return Error(std::string("unexpected character '") + c + "'");
  }

  Status Object(JsonValue* out, int depth) {
    out->type = JsonValue::Type::kObject;
    ++pos_;  // '{'
    SkipSpace();
    if (Consume("}")) return Status::Ok();
    while (true) {
      SkipSpace();
      if (pos_ == text_.size() || text_[pos_] != '"') return Error("expected a member name");
      std::string key;
      BLOCKKV_RETURN_IF_ERROR(String(&key));
      if (out->Find(key) != nullptr) return Error("duplicate member \"" + key + "\"");
      SkipSpace();
      if (!Consume(":")) return Error("expected ':'");
      JsonValue value;
      BLOCKKV_RETURN_IF_ERROR(Value(&value, depth + 1));
      out->object.push_back({std::move(key), std::move(value)});
      SkipSpace();
      if (Consume("}")) return Status::Ok();
      if (!Consume(",")) return Error("expected ',' or '}'");
    }
  }

  Status Array(JsonValue* out, int depth) {
    out->type = JsonValue::Type::kArray;
    ++pos_;  // '['
    SkipSpace();
    if (Consume("]")) return Status::Ok();
    while (true) {
      JsonValue value;
      BLOCKKV_RETURN_IF_ERROR(Value(&value, depth + 1));
      out->array.push_back(std::move(value));
      SkipSpace();
      if (Consume("]")) return Status::Ok();
      if (!Consume(",")) return Error("expected ',' or ']'");
    }
  }

  Status String(std::string* out) {
    ++pos_;  // '"'
    while (pos_ < text_.size()) {
      const char c = text_[pos_++];
      if (c == '"') return Status::Ok();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        *out += c;
        continue;
      }
      if (pos_ == text_.size()) break;
      const char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          *out += e;
          break;
        case 'b':
          *out += '\b';
          break;
        case 'f':
          *out += '\f';
          break;
        case 'n':
          *out += '\n';
          break;
        case 'r':
          *out += '\r';
          break;
        case 't':
          *out += '\t';
          break;
        case 'u': {
          // Kept as UTF-8 for the basic plane; surrogate pairs are not needed by the tool and
          // are passed through as two 3-byte sequences.
          if (pos_ + 4 > text_.size()) return Error("short \\u escape");
          unsigned code = 0;
          for (int i = 0; i < 4; ++i) {
            const char h = text_[pos_++];
            code <<= 4;
            if (h >= '0' && h <= '9') {
              code |= static_cast<unsigned>(h - '0');
            } else if (h >= 'a' && h <= 'f') {
              code |= static_cast<unsigned>(h - 'a' + 10);
            } else if (h >= 'A' && h <= 'F') {
              code |= static_cast<unsigned>(h - 'A' + 10);
            } else {
              return Error("bad \\u escape");
            }
          }
          if (code < 0x80) {
            *out += static_cast<char>(code);
          } else if (code < 0x800) {
            *out += static_cast<char>(0xC0 | (code >> 6));
            *out += static_cast<char>(0x80 | (code & 0x3F));
          } else {
            *out += static_cast<char>(0xE0 | (code >> 12));
            *out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            *out += static_cast<char>(0x80 | (code & 0x3F));
          }
          break;
        }
        default:
          return Error(std::string("bad escape '\\") + e + "'");
      }
    }
    return Error("unterminated string");
  }

  Status Number(JsonValue* out) {
    const size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ > from;
    };
    if (!digits()) return Error("expected digits");
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      if (!digits()) return Error("expected digits after '.'");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (!digits()) return Error("expected an exponent");
    }
    const std::string number(text_.substr(start, pos_ - start));
    errno = 0;
    out->type = JsonValue::Type::kNumber;
    out->number = std::strtod(number.c_str(), nullptr);
    if (errno == ERANGE && std::isinf(out->number)) return Error("number out of range");
    return Status::Ok();
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

Result<JsonValue> ParseJson(std::string_view text) {
  JsonValue value;
  BLOCKKV_RETURN_IF_ERROR(Parser(text).Document(&value));
  return value;
}

Status JsonlReader::Open(const std::string& path) {
  path_ = path;
  line_number_ = 0;
  in_.open(path);
  if (!in_) return NotFoundError("cannot open " + path + ": " + std::strerror(errno));
  return Status::Ok();
}

Result<bool> JsonlReader::Next(JsonValue* out) {
  while (std::getline(in_, line_)) {
    ++line_number_;
    if (line_.find_first_not_of(" \t\r") == std::string::npos) continue;
    Result<JsonValue> value = ParseJson(line_);
    if (!value.ok()) {
      return InvalidArgumentError(path_ + ":" + std::to_string(line_number_) + ": " +
                                  value.status().message());
    }
    *out = std::move(value).value();
    return true;
  }
  if (in_.bad()) return DataLossError("error reading " + path_);
  return false;
}

}  // namespace blockkv::tool
