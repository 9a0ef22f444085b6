// SPDX-License-Identifier: Apache-2.0
#include "json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <sys/stat.h>

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

Status FileError(std::string_view what, const std::string& path, int error) {
  std::string message = std::string(what) + " " + path + ": " + std::strerror(error);
  switch (error) {
    case ENOENT:
    case ENOTDIR:
      return NotFoundError(std::move(message));
    case EACCES:
    case EPERM:
    case EROFS:
      return PermissionDeniedError(std::move(message));
    case EISDIR:
      return InvalidArgumentError(std::move(message));
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return ResourceExhaustedError(std::move(message));
    default:
      return UnavailableError(std::move(message));
  }
}

Result<std::FILE*> OpenInputFile(const std::string& path) {
  if (path.empty()) return InvalidArgumentError("an empty file name");
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) return FileError("cannot open", path, errno);
  if (S_ISDIR(info.st_mode)) return FileError("cannot open", path, EISDIR);
  if (!S_ISREG(info.st_mode) && !S_ISFIFO(info.st_mode) && !S_ISCHR(info.st_mode)) {
    return InvalidArgumentError("cannot open " + path + ": not a regular file");
  }
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return FileError("cannot open", path, errno);
  return file;
}

JsonlReader::~JsonlReader() {
  if (owned_ && file_ != nullptr) std::fclose(file_);
}

Status JsonlReader::Open(const std::string& path) {
  BLOCKKV_ASSIGN_OR_RETURN(std::FILE * file, OpenInputFile(path));
  Attach(file, path);
  owned_ = true;
  return Status::Ok();
}

void JsonlReader::Attach(std::FILE* file, const std::string& path) {
  if (owned_ && file_ != nullptr) std::fclose(file_);
  file_ = file;
  owned_ = false;
  path_ = path;
  pos_ = end_ = 0;
  line_number_ = 0;
}

Result<bool> JsonlReader::Next(std::string_view* line) {
  while (true) {
    line_.clear();
    bool read_any = false;
    while (true) {
      if (pos_ == end_) {
        end_ = std::fread(buffer_.data(), 1, buffer_.size(), file_);
        pos_ = 0;
        if (end_ == 0) break;
      }
      read_any = true;
      const char* from = buffer_.data() + pos_;
      const void* newline = std::memchr(from, '\n', end_ - pos_);
      const size_t n = newline == nullptr ? end_ - pos_ : static_cast<const char*>(newline) - from;
      if (static_cast<int64_t>(line_.size() + n) > kMaxLineBytes) {
        return InvalidArgumentError(path_ + ":" + std::to_string(line_number_ + 1) +
                                    ": the line is longer than " +
                                    std::to_string(kMaxLineBytes >> 20) + " MiB");
      }
      line_.append(from, n);
      pos_ += n;
      if (newline != nullptr) {
        ++pos_;
        break;
      }
    }
    if (std::ferror(file_) != 0) return DataLossError("error reading " + path_);
    if (!read_any) return false;
    ++line_number_;
    if (line_.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (line_.back() == '\r') line_.pop_back();
    *line = line_;
    return true;
  }
}

}  // namespace blockkv::tool
