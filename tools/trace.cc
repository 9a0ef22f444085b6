// SPDX-License-Identifier: Apache-2.0
// The requests `simulate` replays: read from a JSONL trace, or generated (ShareGPT-like, with
// shared system prompts). Token ids of a length-only request are made up deterministically:
// the first prefix_len tokens from its prefix group (so requests of one group share them), the
// rest from the request's line, so nothing else is shared by accident.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "json.h"

namespace blockkv::tool {
namespace {

constexpr int64_t kVocab = 32000;  // made-up token ids are below this (Llama-2's vocabulary)

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

uint64_t HashText(std::string_view text) {  // FNV-1a
  uint64_t h = 0xCBF29CE484222325ULL;
  for (const char c : text) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ULL;
  return h;
}

TokenId MadeUpToken(uint64_t stream, int64_t position) {
  return static_cast<TokenId>(Mix(stream ^ Mix(static_cast<uint64_t>(position))) % kVocab);
}

// Prompt of `length` tokens whose first `shared` come from `group_stream`.
std::vector<TokenId> MakePrompt(int64_t length, int64_t shared, uint64_t group_stream,
                                uint64_t own_stream) {
  std::vector<TokenId> prompt(static_cast<size_t>(length));
  for (int64_t i = 0; i < length; ++i) {
    prompt[i] = MadeUpToken(i < shared ? group_stream : own_stream, i);
  }
  return prompt;
}

constexpr uint64_t kGroupSalt = 0x67726F7570ULL;        // "group"
constexpr uint64_t kOwnSalt = 0x7265717565737473ULL;    // "requests"
constexpr uint64_t kIntegerSalt = 0x696E7465676572ULL;  // "integer"

// The fields of a trace line, as bits: a field seen twice is a duplicate (linear in the line).
enum Field : uint32_t {
  kArrival = 1,
  kPrompt = 2,
  kPromptLen = 4,
  kPrefixGroup = 8,
  kPrefixLen = 16,
  kOutputLen = 32,
  kId = 64,
};

constexpr std::pair<std::string_view, Field> kFields[] = {{"arrival", kArrival},
                                                          {"prompt", kPrompt},
                                                          {"prompt_len", kPromptLen},
                                                          {"prefix_group", kPrefixGroup},
                                                          {"prefix_len", kPrefixLen},
                                                          {"output_len", kOutputLen},
                                                          {"id", kId}};

// One JSON number as nlohmann's SAX gives it: exact when it is an integer that fits 64 bits.
struct Number {
  enum class Kind { kSigned, kUnsigned, kFloat } kind = Kind::kSigned;
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
  std::string text;  // as written (floats only)

  // The value as an int64_t when it is an integer that fits (an integral float up to 2^53, where
  // doubles are still exact, counts); nullopt otherwise.
  std::optional<int64_t> Integer() const {
    switch (kind) {
      case Kind::kSigned:
        return i;
      case Kind::kUnsigned:
        if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
        return static_cast<int64_t>(u);
      case Kind::kFloat:
        if (std::isfinite(f) && f == std::floor(f) && std::fabs(f) <= 9007199254740992.0) {
          return static_cast<int64_t>(f);
        }
        return std::nullopt;
    }
    return std::nullopt;
  }
  std::string ToString() const {
    switch (kind) {
      case Kind::kSigned:
        return std::to_string(i);
      case Kind::kUnsigned:
        return std::to_string(u);
      case Kind::kFloat:
        return text.size() <= 32 ? text : text.substr(0, 32) + "...";
    }
    return text;
  }
};

// nlohmann-json SAX events of one trace line into a TraceLine, without building a DOM: a prompt
// of token ids costs 4 bytes a token, and stops growing at max_tokens. A field's error is kept
// (the first one) and the parse goes on, so that a syntax error anywhere in the line wins: "08"
// is reported as the bad JSON it is, not as a prompt_len of 0. Whatever follows a field's error
// is ignored; depth_ still counts every container so that the ends match.
class LineHandler : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit LineHandler(int64_t max_tokens, TraceLine* out) : max_tokens_(max_tokens), out_(out) {}

  const std::string& error() const { return error_; }
  const std::string& syntax_error() const { return syntax_error_; }
  uint32_t seen() const { return seen_; }

  bool null() override { return Scalar("null"); }
  bool boolean(bool) override { return Scalar("a boolean"); }
  bool number_integer(number_integer_t value) override {
    Number n;
    n.i = value;
    return OnNumber(n);
  }
  bool number_unsigned(number_unsigned_t value) override {
    Number n;
    n.kind = Number::Kind::kUnsigned;
    n.u = value;
    return OnNumber(n);
  }
  bool number_float(number_float_t value, const string_t& text) override {
    Number n;
    n.kind = Number::Kind::kFloat;
    n.f = value;
    n.text = text;
    return OnNumber(n);
  }
  bool string(string_t& value) override {
    if (depth_ == 1 && field_ == kPrefixGroup) {
      out_->prefix_group = value;
      out_->group_is_string = true;
      return true;
    }
    return Scalar("a string");
  }
  bool binary(binary_t&) override { return Scalar("binary"); }
  bool start_object(std::size_t) override {
    if (depth_ == 0) {
      depth_ = 1;
      return true;
    }
    nested_keys_.emplace_back();
    return Nested("an object");
  }
  bool end_object() override {
    if (--depth_ > 0) nested_keys_.pop_back();
    return true;
  }
  bool key(string_t& name) override {
    if (depth_ > 1) {  // inside "id": ignored, but still JSON without duplicate members
      if (!nested_keys_.back().insert(name).second) {
        return Fail("duplicate member \"" + Printable(name) + R"(" inside "id")");
      }
      return true;
    }
    const auto* it = std::find_if(std::begin(kFields), std::end(kFields),
                                  [&](const auto& f) { return f.first == name; });
    if (it == std::end(kFields)) {
      field_ = kId;  // its value is ignored
      return Fail("unknown field \"" + Printable(name) +
                  "\" (expected arrival, prompt or prompt_len, prefix_group, prefix_len, "
                  "output_len, id)");
    }
    if ((seen_ & it->second) != 0) {
      field_ = kId;
      return Fail("duplicate field \"" + std::string(name) + "\"");
    }
    seen_ |= it->second;
    field_ = it->second;
    return true;
  }
  bool start_array(std::size_t) override {
    if (depth_ == 0) {
      ++depth_;
      field_ = kId;
      return Fail("expected an object, found an array");
    }
    if (depth_ == 1 && field_ == kPrompt) {
      depth_ = 2;
      return true;
    }
    return Nested("an array");
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& e) override {
    // "[json.exception.parse_error.101] parse error at line 1, column 18: syntax error while
    // parsing object - unexpected string literal; expected '}'": keep what follows the column.
    std::string_view what = e.what();
    const size_t colon = what.find(": ", what.find("column"));
    what = colon == std::string_view::npos ? what : what.substr(colon + 2);
    syntax_error_ = "column " + std::to_string(position) + ": " + Printable(what);
    return false;
  }

 private:
  // Nested values are allowed only under "id" (ignored); depth_ counts them to skip them.
  bool Nested(const char* what) {
    const int depth = depth_++;
    if (depth == 1 && field_ != kId) return Fail(FieldName() + " must not be " + what);
    if (depth == 2 && field_ == kPrompt) return TokenError();
    return true;
  }
  bool Scalar(const char* what) {
    if (depth_ == 0) return Fail(std::string("expected an object, found ") + what);
    if (depth_ > 1 && field_ != kPrompt) return true;  // inside "id"
    if (depth_ == 2) return TokenError();
    if (field_ == kId) return true;
    return Fail(FieldName() + " must be " + Expected() + ", not " + what);
  }
  bool OnNumber(const Number& n) {
    if (depth_ == 0) return Fail("expected an object, found a number");
    if (depth_ == 2 && field_ == kPrompt) {
      const std::optional<int64_t> id = n.Integer();
      if (!id || *id < 0 || *id > std::numeric_limits<TokenId>::max()) return TokenError(&n);
      if (std::ssize(out_->prompt) >= max_tokens_) {
        return Fail("\"prompt\" has more than " + std::to_string(max_tokens_) +
                    " tokens, the context limit (--max-context)");
      }
      out_->prompt.push_back(static_cast<TokenId>(*id));
      return true;
    }
    if (depth_ > 1 || field_ == kId) return true;
    if (field_ == kPrompt) return Fail("\"prompt\" must be a non-empty array of token ids");
    if (field_ == kArrival) {
      // A step: a fraction is rounded down; at most 10^15 so that the clock cannot overflow.
      const double value = n.kind == Number::Kind::kFloat    ? n.f
                           : n.kind == Number::Kind::kSigned ? static_cast<double>(n.i)
                                                             : static_cast<double>(n.u);
      if (!(value >= 0) || value > 1e15) {
        return Fail("\"arrival\" " + n.ToString() + " is not a step in [0, 10^15]");
      }
      out_->arrival =
          n.kind == Number::Kind::kFloat ? static_cast<int64_t>(std::floor(value)) : *n.Integer();
      return true;
    }
    const std::optional<int64_t> value = n.Integer();
    if (field_ == kPrefixGroup) {
      if (!value && n.kind != Number::Kind::kUnsigned) {
        return Fail("\"prefix_group\" " + n.ToString() +
                    " must be an integer in [-2^63, 2^64) or a string");
      }
      out_->prefix_group = n.ToString();
      out_->group_is_string = false;
      return true;
    }
    int64_t* target = field_ == kPromptLen   ? &out_->prompt_len
                      : field_ == kPrefixLen ? &out_->prefix_len
                                             : &out_->output_len;
    const int64_t min = field_ == kPrefixLen ? 0 : 1;
    if (!value || *value < min) {
      return Fail(FieldName() + " " + n.ToString() + " must be an integer >= " +
                  std::to_string(min) + (value ? "" : " that fits 64 bits"));
    }
    *target = *value;
    return true;
  }
  bool TokenError(const Number* n = nullptr) {
    // Appended rather than concatenated: GCC 12 warns (-Wrestrict) on "literal" + std::string.
    std::string message = "\"prompt\"[";
    message += std::to_string(out_->prompt.size());
    message += "]";
    if (n != nullptr) message.append(" ").append(n->ToString());
    message += " is not a token id (an integer in [0, 2^31))";
    return Fail(std::move(message));
  }
  std::string FieldName() const {
    for (const auto& [name, bit] : kFields) {
      if (bit == field_) return std::string(1, '"').append(name).append(1, '"');
    }
    return "?";
  }
  const char* Expected() const {
    switch (field_) {
      case kArrival:
        return "a number >= 0 (a step)";
      case kPrompt:
        return "a non-empty array of token ids";
      case kPrefixGroup:
        return "an integer or a string";
      default:
        return "an integer";
    }
  }
  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return true;  // parse on: a syntax error later in the line is reported instead
  }
  // At most 200 bytes of `text`, with bytes outside printable ASCII as \xNN: a message never
  // carries a hostile line's invalid UTF-8 or control characters to the terminal.
  static std::string Printable(std::string_view text) {
    std::string out;
    for (const char c : text.substr(0, 200)) {
      const auto b = static_cast<unsigned char>(c);
      if (b >= 0x20 && b < 0x7F) {
        out += c;
      } else {
        char escaped[8];
        std::snprintf(escaped, sizeof(escaped), "\\x%02X", b);
        out += escaped;
      }
    }
    if (text.size() > 200) out += "...";
    return out;
  }

  int64_t max_tokens_;
  TraceLine* out_;
  int depth_ = 0;  // 0: outside the line's object; 1: in it; 2+: in a member's value
  Field field_ = kId;
  uint32_t seen_ = 0;
  std::string error_;
  std::string syntax_error_;
  // Per object open below the line's own, its member names so far (a hash set each: linear).
  std::vector<std::unordered_set<std::string>> nested_keys_;
};

}  // namespace

Result<TraceLine> ParseTraceLine(std::string_view text, int64_t max_tokens) {
  // nlohmann-json's lexer takes a NUL byte for the end of its input: what followed would pass.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return InvalidArgumentError("column " + std::to_string(nul + 1) +
                                ": a NUL byte, which JSON text cannot hold");
  }
  TraceLine line;
  LineHandler handler(max_tokens, &line);
  const bool ok = nlohmann::json::sax_parse(text.begin(), text.end(), &handler,
                                            nlohmann::json::input_format_t::json, true);
  if (!ok) {
    return InvalidArgumentError(handler.syntax_error().empty() ? "not JSON"
                                                               : handler.syntax_error());
  }
  if (!handler.error().empty()) return InvalidArgumentError(handler.error());
  const uint32_t seen = handler.seen();
  if ((seen & kOutputLen) == 0) return InvalidArgumentError("missing \"output_len\"");
  if ((seen & kPrompt) != 0) {
    for (const auto& [name, bit] : kFields) {
      if ((bit & (kPromptLen | kPrefixGroup | kPrefixLen) & seen) != 0) {
        return InvalidArgumentError(R"("prompt" and ")" + std::string(name) +
                                    "\" cannot both be given");
      }
    }
    if (line.prompt.empty()) {
      return InvalidArgumentError("\"prompt\" must be a non-empty array of token ids");
    }
    return line;
  }
  if ((seen & kPromptLen) == 0) return InvalidArgumentError("missing \"prompt_len\"");
  if (line.prompt_len > max_tokens) {
    return InvalidArgumentError("\"prompt_len\" " + std::to_string(line.prompt_len) +
                                " exceeds the context limit of " + std::to_string(max_tokens) +
                                " (--max-context)");
  }
  if ((seen & kPrefixGroup) != 0) {
    if ((seen & kPrefixLen) == 0) return InvalidArgumentError("missing \"prefix_len\"");
    if (line.prefix_len > line.prompt_len) {
      return InvalidArgumentError("\"prefix_len\" " + std::to_string(line.prefix_len) +
                                  " is longer than \"prompt_len\" " +
                                  std::to_string(line.prompt_len));
    }
  } else if ((seen & kPrefixLen) != 0) {
    return InvalidArgumentError(R"("prefix_len" needs "prefix_group")");
  }
  return line;
}

Status TraceReader::Open(const std::string& path, int64_t max_tokens) {
  max_tokens_ = max_tokens;
  return reader_.Open(path);
}

void TraceReader::Attach(std::FILE* file, const std::string& path, int64_t max_tokens) {
  max_tokens_ = max_tokens;
  reader_.Attach(file, path);
}

Result<bool> TraceReader::Next(EngineRequest* out) {
  std::string_view text;
  BLOCKKV_ASSIGN_OR_RETURN(const bool more, reader_.Next(&text));
  const std::string where = reader_.path() + ":" + std::to_string(reader_.line_number()) + ": ";
  if (!more) {
    if (requests_ == 0) return InvalidArgumentError(reader_.path() + ": no requests in the trace");
    return false;
  }
  Result<TraceLine> line = ParseTraceLine(text, max_tokens_);
  if (!line.ok()) return InvalidArgumentError(where + line.status().message());
  ++requests_;
  *out = EngineRequest{};
  out->line = reader_.line_number();
  out->arrival = line->arrival;
  out->output_len = line->output_len;
  if (!line->prompt.empty()) {
    out->prompt = std::move(line->prompt);
    return true;
  }
  // Groups named by a string and by an integer never meet: their hashes are salted apart.
  const uint64_t group = line->group_is_string ? HashText(line->prefix_group)
                                               : Mix(HashText(line->prefix_group) ^ kIntegerSalt);
  const uint64_t own = Mix(static_cast<uint64_t>(out->line)) ^ kOwnSalt;
  out->prompt = MakePrompt(line->prompt_len, line->prefix_len, group ^ kGroupSalt, own);
  return true;
}

Result<std::vector<EngineRequest>> ReadTrace(const std::string& path, int64_t max_tokens) {
  TraceReader reader;
  BLOCKKV_RETURN_IF_ERROR(reader.Open(path, max_tokens));
  std::vector<EngineRequest> requests;
  EngineRequest request;
  while (true) {
    BLOCKKV_ASSIGN_OR_RETURN(const bool more, reader.Next(&request));
    if (!more) return requests;
    requests.push_back(std::move(request));
  }
}

WorkloadGenerator::WorkloadGenerator(const WorkloadOptions& options)
    : options_(options),
      rng_(options.seed),
      user_(std::log(150.0), 1.0),
      output_(std::log(200.0), 0.8),
      gap_(options.rate > 0 ? options.rate : 1.0),
      shared_(options.shared_fraction) {
  system_len_.resize(static_cast<size_t>(std::max<int64_t>(options.prefix_groups, 0)));
  for (int64_t& len : system_len_) len = std::uniform_int_distribution<int64_t>(128, 1024)(rng_);
}

Result<bool> WorkloadGenerator::Next(EngineRequest* out) {
  if (next_ >= options_.requests) return false;
  const auto clip = [](double x, int64_t lo, int64_t hi) {
    return std::clamp(static_cast<int64_t>(std::lround(x)), lo, hi);
  };
  const auto i = static_cast<uint64_t>(next_++);
  *out = EngineRequest{};
  out->arrival = static_cast<int64_t>(t_);
  t_ += gap_(rng_);
  int64_t prefix = 0;
  uint64_t group = 0;
  if (!system_len_.empty() && shared_(rng_)) {
    const auto g = std::uniform_int_distribution<size_t>(0, system_len_.size() - 1)(rng_);
    prefix = system_len_[g];
    group = Mix(g) ^ kGroupSalt;
  }
  const int64_t length = prefix + clip(user_(rng_), 4, 2048);
  out->output_len = clip(output_(rng_), 1, 1024);
  out->prompt = MakePrompt(length, prefix, group, Mix(i + 1) ^ kOwnSalt ^ options_.seed);
  return true;
}

std::vector<EngineRequest> GenerateWorkload(const WorkloadOptions& options) {
  WorkloadGenerator generator(options);
  std::vector<EngineRequest> requests;
  EngineRequest request;
  while (*generator.Next(&request)) requests.push_back(std::move(request));
  return requests;
}

}  // namespace blockkv::tool
