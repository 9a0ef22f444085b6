// The requests `simulate` replays: read from a JSONL trace, or generated (ShareGPT-like, with
// shared system prompts). Token ids of a length-only request are made up deterministically:
// the first prefix_len tokens from its prefix group (so requests of one group share them), the
// rest from the request's line, so nothing else is shared by accident.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

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

constexpr uint64_t kGroupSalt = 0x67726F7570ULL;      // "group"
constexpr uint64_t kOwnSalt = 0x7265717565737473ULL;  // "requests"

// Reads one trace line into `request`. Messages name the field; the caller adds path:line.
class LineReader {
 public:
  explicit LineReader(const JsonValue& value) : value_(value) {}

  Status Read(EngineRequest* request) {
    if (value_.type != JsonValue::Type::kObject) {
      return InvalidArgumentError("expected an object, found " + std::string(value_.TypeName()));
    }
    for (const auto& [key, unused] : value_.object) {
      static constexpr std::string_view kKnown[] = {
          "arrival", "prompt", "prompt_len", "prefix_group", "prefix_len", "output_len", "id"};
      if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown)) {
        return InvalidArgumentError("unknown field \"" + key +
                                    "\" (expected arrival, prompt or prompt_len, prefix_group, "
                                    "prefix_len, output_len, id)");
      }
    }
    if (const JsonValue* arrival = value_.Find("arrival")) {
      if (arrival->type != JsonValue::Type::kNumber || !(arrival->number >= 0) ||
          arrival->number > 1e15) {
        return InvalidArgumentError("\"arrival\" must be a number >= 0 (a step)");
      }
      request->arrival = static_cast<int64_t>(std::floor(arrival->number));
    }
    BLOCKKV_ASSIGN_OR_RETURN(request->output_len, Integer("output_len", 1, true));
    const JsonValue* prompt = value_.Find("prompt");
    if (prompt != nullptr) {
      for (const char* other : {"prompt_len", "prefix_group", "prefix_len"}) {
        if (value_.Find(other) != nullptr) {
          return InvalidArgumentError(R"("prompt" and ")" + std::string(other) +
                                      R"(" cannot both be given)");
        }
      }
      return ReadTokens(*prompt, &request->prompt);
    }
    BLOCKKV_ASSIGN_OR_RETURN(const int64_t length, Integer("prompt_len", 1, true));
    if (length > (int64_t{1} << 24)) return InvalidArgumentError("\"prompt_len\" is too large");
    int64_t shared = 0;
    uint64_t group = 0;
    if (const JsonValue* g = value_.Find("prefix_group")) {
      if (g->type == JsonValue::Type::kString) {
        group = HashText(g->string);
      } else if (g->type == JsonValue::Type::kNumber && g->number == std::floor(g->number)) {
        group = Mix(static_cast<uint64_t>(static_cast<int64_t>(g->number)));
      } else {
        return InvalidArgumentError("\"prefix_group\" must be an integer or a string");
      }
      BLOCKKV_ASSIGN_OR_RETURN(shared, Integer("prefix_len", 0, true));
      if (shared > length) {
        return InvalidArgumentError("\"prefix_len\" " + std::to_string(shared) +
                                    " is longer than \"prompt_len\" " + std::to_string(length));
      }
    } else if (value_.Find("prefix_len") != nullptr) {
      return InvalidArgumentError(R"("prefix_len" needs "prefix_group")");
    }
    request->prompt = MakePrompt(length, shared, group ^ kGroupSalt, own_stream_);
    return Status::Ok();
  }

  void set_own_stream(uint64_t stream) { own_stream_ = stream; }

 private:
  Result<int64_t> Integer(const char* name, int64_t min, bool required) const {
    const JsonValue* v = value_.Find(name);
    if (v == nullptr) {
      if (required) return InvalidArgumentError("missing \"" + std::string(name) + "\"");
      return min;
    }
    if (v->type != JsonValue::Type::kNumber || v->number != std::floor(v->number) ||
        v->number < static_cast<double>(min) || v->number > 1e15) {
      return InvalidArgumentError(std::string(1, '"').append(name).append(
          "\" must be an integer >= " + std::to_string(min)));
    }
    return static_cast<int64_t>(v->number);
  }

  static Status ReadTokens(const JsonValue& prompt, std::vector<TokenId>* out) {
    if (prompt.type != JsonValue::Type::kArray || prompt.array.empty()) {
      return InvalidArgumentError("\"prompt\" must be a non-empty array of token ids");
    }
    out->reserve(prompt.array.size());
    for (size_t i = 0; i < prompt.array.size(); ++i) {
      const JsonValue& t = prompt.array[i];
      if (t.type != JsonValue::Type::kNumber || t.number != std::floor(t.number) || t.number < 0 ||
          t.number > std::numeric_limits<TokenId>::max()) {
        return InvalidArgumentError("\"prompt\"[" + std::to_string(i) +
                                    "] is not a token id (an integer in [0, 2^31))");
      }
      out->push_back(static_cast<TokenId>(t.number));
    }
    return Status::Ok();
  }

  const JsonValue& value_;
  uint64_t own_stream_ = 0;
};

}  // namespace

Result<std::vector<EngineRequest>> ReadTrace(const std::string& path) {
  JsonlReader reader;
  BLOCKKV_RETURN_IF_ERROR(reader.Open(path));
  std::vector<EngineRequest> requests;
  JsonValue value;
  while (true) {
    BLOCKKV_ASSIGN_OR_RETURN(const bool more, reader.Next(&value));
    if (!more) break;
    EngineRequest request;
    request.line = reader.line_number();
    LineReader line(value);
    line.set_own_stream(Mix(static_cast<uint64_t>(request.line)) ^ kOwnSalt);
    Status status = line.Read(&request);
    if (!status.ok()) {
      return InvalidArgumentError(path + ":" + std::to_string(request.line) + ": " +
                                  status.message());
    }
    requests.push_back(std::move(request));
  }
  if (requests.empty()) return InvalidArgumentError(path + ": no requests in the trace");
  return requests;
}

std::vector<EngineRequest> GenerateWorkload(const WorkloadOptions& options) {
  std::mt19937_64 rng(options.seed);
  std::vector<int64_t> system_len(static_cast<size_t>(std::max<int64_t>(options.prefix_groups, 0)));
  for (int64_t& len : system_len) len = std::uniform_int_distribution<int64_t>(128, 1024)(rng);
  std::lognormal_distribution<double> user(std::log(150.0), 1.0);
  std::lognormal_distribution<double> output(std::log(200.0), 0.8);
  std::exponential_distribution<double> gap(options.rate > 0 ? options.rate : 1.0);
  std::bernoulli_distribution shared(options.shared_fraction);
  const auto clip = [](double x, int64_t lo, int64_t hi) {
    return std::clamp(static_cast<int64_t>(std::lround(x)), lo, hi);
  };
  std::vector<EngineRequest> requests(static_cast<size_t>(options.requests));
  double t = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    EngineRequest& r = requests[i];
    r.arrival = static_cast<int64_t>(t);
    t += gap(rng);
    int64_t prefix = 0;
    uint64_t group = 0;
    if (!system_len.empty() && shared(rng)) {
      const auto g = std::uniform_int_distribution<size_t>(0, system_len.size() - 1)(rng);
      prefix = system_len[g];
      group = Mix(g) ^ kGroupSalt;
    }
    const int64_t length = prefix + clip(user(rng), 4, 2048);
    r.output_len = clip(output(rng), 1, 1024);
    r.prompt = MakePrompt(length, prefix, group, Mix(i + 1) ^ kOwnSalt ^ options.seed);
  }
  return requests;
}

}  // namespace blockkv::tool
