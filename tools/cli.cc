// SPDX-License-Identifier: Apache-2.0
// The command line of the `blockkv` tool: parses arguments and maps outcomes to exit codes
//   0 success; 2 bad arguments (the message, then the command's usage, on stderr);
//   1 a runtime failure (the Status, which names a bad file and its line).
//
// The flag parser is this file's own (60 lines) rather than CLI11's: the messages and usage text
// that tests/tool and docs/tool.md hold ("unknown flag --x", "--x needs a value (N)", "--x 'v':
// expected an integer in [1, 2147483647]") would each need mapping back from CLI11's exceptions,
// and CLI11 2.1 takes "--json=yes" for true where the tool refuses a value on a switch
// (docs/benchmarks.md, "blockkv trace reader"). Every flag value is range-checked here before a
// command sizes anything by it.
#include "cli.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>

#include "blockkv/log.h"
#include "commands.h"
#include "json.h"

namespace blockkv::tool {
namespace {

struct FlagSpec {
  const char* name;   // without the dashes
  const char* value;  // what it takes, e.g. "SIZE"; nullptr for a switch
  const char* help;
};

// The command line of one subcommand: --name value, --name=value, or --switch. Getters leave
// their output alone when the flag is absent and keep the first conversion error in error().
class Flags {
 public:
  static Result<Flags> Parse(std::span<const FlagSpec> spec, std::span<char* const> args) {
    Flags flags;
    for (size_t i = 0; i < args.size(); ++i) {
      std::string_view arg = args[i];
      if (!arg.starts_with("--"))
        return InvalidArgumentError("unexpected argument '" + std::string(arg) + "'");
      arg.remove_prefix(2);
      std::string_view name = arg, value;
      const size_t eq = arg.find('=');
      const bool inline_value = eq != std::string_view::npos;
      if (inline_value) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
      }
      const auto it =
          std::find_if(spec.begin(), spec.end(), [&](const FlagSpec& f) { return name == f.name; });
      if (it == spec.end()) return InvalidArgumentError("unknown flag --" + std::string(name));
      if (flags.values_.contains(std::string(name))) {
        return InvalidArgumentError("--" + std::string(name) + " given twice");
      }
      if (it->value == nullptr) {
        if (inline_value) return InvalidArgumentError("--" + std::string(name) + " takes no value");
      } else if (!inline_value) {
        if (i + 1 == args.size()) {
          return InvalidArgumentError("--" + std::string(name) + " needs a value (" + it->value +
                                      ")");
        }
        value = args[++i];
      }
      flags.values_[std::string(name)] = std::string(value);
    }
    return flags;
  }

  bool Has(const char* name) const { return values_.contains(name); }
  const Status& error() const { return error_; }

  void String(const char* name, std::string* out) const {
    if (Has(name)) *out = values_.at(name);
  }
  // An integer in [min, max], and at most what T holds.
  template <class T>
  void Int(const char* name, int64_t min, T* out,
           int64_t max = std::numeric_limits<int64_t>::max()) {
    if (!Has(name)) return;
    max = static_cast<int64_t>(
        std::min<uint64_t>(static_cast<uint64_t>(max), std::numeric_limits<T>::max()));
    Result<int64_t> v = ParseCount(values_.at(name));
    if (!v.ok() || *v < min || *v > max) {
      Fail(name, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
      return;
    }
    *out = static_cast<T>(*v);
  }
  // A file name: not empty.
  void File(const char* name, std::string* out) {
    if (!Has(name)) return;
    if (values_.at(name).empty()) {
      if (error_.ok()) {
        error_ = InvalidArgumentError("--" + std::string(name) + " '': expected a file name");
      }
      return;
    }
    *out = values_.at(name);
  }
  void Double(const char* name, double min, double max, double* out) {
    if (!Has(name)) return;
    const std::string& text = values_.at(name);
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || errno != 0 || !(v >= min && v <= max)) {
      Fail(name, "a number in [" + Short(min) + ", " + Short(max) + "]");
      return;
    }
    *out = v;
  }
  void Size(const char* name, int64_t* out) {
    if (!Has(name)) return;
    Result<int64_t> v = ParseSize(values_.at(name));
    if (!v.ok()) {
      if (error_.ok())
        error_ = InvalidArgumentError("--" + std::string(name) + ": " + v.status().message());
      return;
    }
    *out = *v;
  }

 private:
  static std::string Short(double x) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", x);
    return text;
  }
  void Fail(const char* name, const std::string& expected) {
    if (error_.ok()) {
      error_ = InvalidArgumentError("--" + std::string(name) + " '" + values_.at(name) +
                                    "': expected " + expected);
    }
  }

  std::map<std::string, std::string, std::less<>> values_;
  Status error_;
};

struct Command {
  const char* name;
  const char* summary;
  const char* usage;  // the line after "usage: blockkv"
  std::span<const FlagSpec> flags;
  int (*run)(const Command& command, Flags& flags, const CliOptions& cli);
};

std::string Usage(const Command& c) {
  std::string text = "usage: blockkv " + std::string(c.usage) + "\n" + c.summary + "\n\nflags:\n";
  for (const FlagSpec& f : c.flags) {
    std::string left = "  --" + std::string(f.name);
    if (f.value != nullptr) left.append(" ").append(f.value);
    left.resize(std::max<size_t>(left.size() + 2, 26), ' ');
    text += left + f.help + "\n";
  }
  return text;
}

// The CliOptions of this run: every message goes to its streams.
const CliOptions* g_cli = nullptr;

int BadArguments(const Command& c, const std::string& message) {
  std::fprintf(g_cli->err, "blockkv %s: %s\n\n%s", c.name, message.c_str(), Usage(c).c_str());
  return 2;
}

int Failed(const Command& c, const Status& status) {
  std::fprintf(g_cli->err, "blockkv %s: %s\n", c.name, status.ToString().c_str());
  return 1;
}

// ---- plan ----

constexpr FlagSpec kPlanFlags[] = {
    {"model", "NAME",
     "a preset: Llama-3-8B, Llama-3-70B, Llama-2-13B, Mistral-7B, Qwen2.5-7B, GPT-NeoX-20B, "
     "Phi-3-mini, DeepSeek-V3, Gemma-2-9B, gpt-oss-20b, Jamba-v0.1"},
    {"layers", "N", "layers (instead of, or overriding, --model)"},
    {"kv-heads", "N", "KV heads"},
    {"head-size", "N", "head size"},
    {"latent-dim", "N", "MLA: latent width per token (instead of --kv-heads, --head-size)"},
    {"rope-dim", "N", "MLA: rotary key width per token (default 0)"},
    {"memory", "SIZE|host|cuda:N", "memory for the cache: 80GiB, 40GB, host, cuda:0 (required)"},
    {"slack", "SIZE", "bytes kept free (default 1GiB)"},
    {"block-size", "N", "tokens per block (default 16)"},
    {"dtype", "D", "cache dtype: fp16 (default), bf16, fp32, fp8_e4m3, int8"},
    {"tp", "N", "tensor-parallel ranks; KV heads are split across them (default 1)"},
    {"context", "N", "tokens per sequence (default: the model's maximum, or 4096)"},
    {"json", nullptr, "print JSON"},
    {"help", nullptr, "this text"},
};

int RunPlan(const Command& c, Flags& flags, const CliOptions& cli) {
  PlanOptions options;
  if (flags.Has("model")) {
    std::string name;
    flags.String("model", &name);
    const ModelShape* preset = FindModelPreset(name);
    if (preset == nullptr) return BadArguments(c, "unknown model '" + name + "'");
    options.shape = *preset;
  } else {
    options.shape.name = "custom";
    const bool mla = flags.Has("latent-dim");
    if (!flags.Has("layers") || (!mla && (!flags.Has("kv-heads") || !flags.Has("head-size")))) {
      return BadArguments(
          c, "give --model, or --layers with --kv-heads and --head-size (or MLA's --latent-dim)");
    }
  }
  if (!flags.Has("memory")) return BadArguments(c, "--memory is required");
  std::string memory, dtype = "fp16";
  flags.String("memory", &memory);
  flags.String("dtype", &dtype);
  flags.Int("layers", 1, &options.shape.layers);
  flags.Int("kv-heads", 1, &options.shape.kv_heads);
  flags.Int("head-size", 1, &options.shape.head_size);
  if (flags.Has("latent-dim") || flags.Has("rope-dim")) {
    if (flags.Has("kv-heads") || flags.Has("head-size")) {
      return BadArguments(c,
                          "an MLA shape (--latent-dim, --rope-dim) takes no --kv-heads or "
                          "--head-size");
    }
    flags.Int("latent-dim", 1, &options.shape.latent_dim, 1 << 20);
    flags.Int("rope-dim", 0, &options.shape.rope_dim, 1 << 20);
    options.shape.kv_heads = 1;
    options.shape.head_size = options.shape.latent_dim + options.shape.rope_dim;
  }
  flags.Size("slack", &options.slack);
  flags.Int("block-size", 1, &options.block_size);
  flags.Int("tp", 1, &options.tp);
  flags.Int("context", 1, &options.context);
  if (!flags.error().ok()) return BadArguments(c, flags.error().message());
  Result<MemorySpec> spec = ParseMemory(memory);
  if (!spec.ok()) return BadArguments(c, "--memory: " + spec.status().message());
  options.memory = *spec;
  Result<DType> parsed = ParseDType(dtype);
  if (!parsed.ok()) return BadArguments(c, "--dtype: " + parsed.status().message());
  options.dtype = *parsed;
  if (Status s = CheckPlanOptions(options); !s.ok()) return BadArguments(c, s.message());
  if (cli.dry_run) return 0;
  Result<PlanReport> report = Plan(options);
  if (!report.ok()) return Failed(c, report.status());
  std::fputs(FormatPlan(*report, flags.Has("json")).c_str(), cli.out);
  return 0;
}

// ---- simulate ----

constexpr FlagSpec kSimulateFlags[] = {
    {"trace", "FILE",
     "JSONL requests: {\"arrival\", \"prompt\" or \"prompt_len\" (+ \"prefix_group\", "
     "\"prefix_len\"), \"output_len\"}; default: a generated workload"},
    {"requests", "N", "generated: requests (default 200)"},
    {"prefix-groups", "N", "generated: shared system prompts (default 8)"},
    {"shared-fraction", "F", "generated: share of requests with a system prompt (default 0.8)"},
    {"rate", "F", "generated: mean arrivals per step (default 0.5)"},
    {"seed", "N", "generated: random seed (default 1)"},
    {"blocks", "N", "cache blocks (default 2048)"},
    {"block-size", "N", "tokens per block (default 16)"},
    {"token-budget", "N", "tokens per step, prefill chunks included (default 2048)"},
    {"max-seqs", "N", "sequences per step (default 256)"},
    {"max-context", "N", "tokens per sequence (default 32768)"},
    {"watermark", "F", "fraction of blocks kept free when admitting (default 0.01)"},
    {"host-blocks", "N",
     "host tier for preemption, in blocks (default: as many as --blocks; 0: none, recompute)"},
    {"no-prefix-cache", nullptr, "turn prefix caching off"},
    {"engines", "N",
     "engines (StateManagers) the requests are dealt to, round-robin (default 1, at most 64)"},
    {"remote", "URL",
     "redis://[user:password@]host:port[/db] (or redis+cluster://host:port[,host:port...], "
     "redis+sentinel://host:port[,host:port...]/master_name, unix:///path/to/redis.sock): a "
     "remote prefix tier every engine shares; the report compares the same run without it"},
    {"max-pending", "N",
     "with --remote: stores each engine queues at most, those past it dropped and counted "
     "(default 1024; 0: no write-through)"},
    {"plot", "FILE", "write an SVG of occupancy and hit rate per step"},
    {"no-progress", nullptr, "no progress bar (it is drawn only when stderr is a terminal)"},
    {"json", nullptr, "print JSON"},
    {"help", nullptr, "this text"},
};

// The flags every engine shares.
void EngineFlags(Flags& flags, EngineOptions* e) {
  flags.Int("blocks", 1, &e->num_blocks);
  flags.Int("block-size", 1, &e->block_size);
  flags.Int("token-budget", 1, &e->token_budget);
  flags.Int("max-seqs", 1, &e->max_seqs, Engine::kMaxSequences);
}

int RunSimulate(const Command& c, Flags& flags, const CliOptions& cli) {
  SimulateOptions options;
  WorkloadOptions workload;
  EngineFlags(flags, &options.engine);
  flags.Int("max-context", 1, &options.engine.max_context, std::numeric_limits<int32_t>::max());
  flags.Double("watermark", 0, 0.5, &options.engine.watermark);
  options.engine.host_blocks = options.engine.num_blocks;
  flags.Int("host-blocks", 0, &options.engine.host_blocks);
  flags.Int("requests", 1, &workload.requests, kMaxGeneratedRequests);
  flags.Int("prefix-groups", 0, &workload.prefix_groups, kMaxPrefixGroups);
  flags.Double("shared-fraction", 0, 1, &workload.shared_fraction);
  flags.Double("rate", 1e-6, 1e6, &workload.rate);
  flags.Int("seed", 0, &workload.seed);
  flags.Int("engines", 1, &options.engines, kMaxSimulatedEngines);
  std::string trace, plot;
  flags.File("trace", &trace);
  flags.File("plot", &plot);
  if (!flags.error().ok()) return BadArguments(c, flags.error().message());
  if (flags.Has("trace") &&
      (flags.Has("requests") || flags.Has("prefix-groups") || flags.Has("shared-fraction") ||
       flags.Has("rate") || flags.Has("seed"))) {
    return BadArguments(c, "--trace replays a file: the generator's flags do not apply");
  }
  options.engine.prefix_cache = !flags.Has("no-prefix-cache");
  if (flags.Has("max-pending") && !flags.Has("remote")) {
    return BadArguments(c, "--max-pending sizes the remote tier's store queue: it needs --remote");
  }
  if (flags.Has("remote")) {
    if (!options.engine.prefix_cache) {
      return BadArguments(c, "--remote needs prefix caching: drop --no-prefix-cache");
    }
    RemoteTierConfig remote;
    flags.String("remote", &remote.url);
    flags.Int("max-pending", 0, &remote.max_pending);
    if (!flags.error().ok()) return BadArguments(c, flags.error().message());
    // Part of every key: only another `blockkv simulate` (whose NullRunner writes no KV) shares
    // these blocks; the fingerprint adds the cache's shape, dtype and block size.
    remote.model_id = "blockkv-simulate-null-runner";
    options.remote = remote;
  }
  options.progress = !flags.Has("no-progress") && StderrIsTerminal();
  if (cli.dry_run) return 0;
  // Both sources hand the engine one request at a time: a trace is read as it is replayed.
  TraceReader trace_reader;
  WorkloadGenerator generator(workload);
  RequestSource* requests = &generator;
  std::string source = "generated (seed " + std::to_string(workload.seed) + ")";
  if (flags.Has("trace")) {
    if (Status s = trace_reader.Open(trace, options.engine.max_context); !s.ok()) {
      return Failed(c, s);
    }
    requests = &trace_reader;
    source = trace;
  }
  Result<SimulateReport> report = Simulate(*requests, options);
  if (!report.ok()) {
    // The engine names a request that cannot run by its line: say which file, as the reader does.
    const Status& s = report.status();
    const bool engine_line = flags.Has("trace") && s.message().starts_with("line ");
    return Failed(c, engine_line ? Status(s.code(), trace + ":" + s.message().substr(5)) : s);
  }
  report->source = source;
  if (!plot.empty()) {
    if (Status s = WriteFile(plot, PlotSvg(report->samples, "blockkv simulate: " + source));
        !s.ok()) {
      return Failed(c, s);
    }
  }
  std::fputs(FormatSimulate(*report, options.engine, flags.Has("json")).c_str(), cli.out);
  return 0;
}

// ---- demo ----

constexpr FlagSpec kDemoFlags[] = {
    {"model", "PATH", "a llama2.c checkpoint (float32 model.bin); default: a random tiny Llama"},
    {"seed", "N", "seed of the random weights and prompts (default 7)"},
    {"requests", "N", "requests (default 16)"},
    {"prompt-groups", "N", "shared system prompts (default 4)"},
    {"system-len", "N", "tokens per system prompt (default 64)"},
    {"output-len", "N", "greedy tokens per request (default 32)"},
    {"blocks", "N", "cache blocks (default: a third of what all requests would hold at once)"},
    {"block-size", "N", "tokens per block (default 16)"},
    {"token-budget", "N", "tokens per step (default 128)"},
    {"max-seqs", "N", "sequences per step (default 16)"},
    {"host-blocks", "N", "host tier for preemption (default: as many as --blocks; 0: none)"},
    {"draft-tokens", "N", "speculative decoding: drafts per step, k (default 4; 0: skip it)"},
    {"draft-layers", "N", "layers of the draft model, the first of the full one (default: half)"},
    {"no-check", nullptr, "skip the dense-cache comparison"},
    {"json", nullptr, "print JSON"},
    {"help", nullptr, "this text"},
};

int RunDemo(const Command& c, Flags& flags, const CliOptions& cli) {
  DemoOptions options;
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  flags.File("model", &options.model_path);
  flags.Int("seed", 0, &options.seed);
  flags.Int("requests", 1, &options.requests, kMaxDemoRequests);
  flags.Int("prompt-groups", 1, &options.prompt_groups, kMaxDemoRequests);
  flags.Int("system-len", 1, &options.system_len, kInt32Max);
  flags.Int("output-len", 1, &options.output_len, kInt32Max);
  EngineFlags(flags, &options.engine);
  flags.Int("host-blocks", 0, &options.engine.host_blocks);
  flags.Int("draft-tokens", 0, &options.draft_tokens, kInt32Max);
  flags.Int("draft-layers", 1, &options.draft_layers, kInt32Max);
  if (!flags.error().ok()) return BadArguments(c, flags.error().message());
  options.check = !flags.Has("no-check");
  if (cli.dry_run) return 0;
  Result<DemoReport> report = Demo(options);
  if (!report.ok()) return Failed(c, report.status());
  std::fputs(FormatDemo(*report, options, flags.Has("json")).c_str(), cli.out);
  if (report->checked && !report->identical) {
    return Failed(c, InternalError("the paged run's greedy tokens differ from the dense run's: " +
                                   report->mismatch));
  }
  return 0;
}

constexpr Command kCommands[] = {
    {"plan", "How many KV-cache blocks, tokens and sequences of a model fit in memory.",
     "plan (--model NAME | --layers N (--kv-heads N --head-size N | --latent-dim N "
     "[--rope-dim N])) --memory SIZE [flags]",
     kPlanFlags, RunPlan},
    {"simulate",
     "Replays requests through the state manager, prefix cache and a continuous-batching loop "
     "(bookkeeping only).",
     "simulate [--trace FILE] [flags]", kSimulateFlags, RunSimulate},
    {"demo",
     "A tiny Llama generates through the paged KV cache; its greedy tokens are checked against "
     "a dense cache.",
     "demo [flags]", kDemoFlags, RunDemo},
};

std::string MainUsage() {
  std::string text = "usage: blockkv <command> [flags]\n\ncommands:\n";
  for (const Command& c : kCommands) {
    std::string name = "  " + std::string(c.name);
    name.resize(12, ' ');
    text += name + c.summary + "\n";
  }
  text +=
      "\n`blockkv <command> --help` lists a command's flags. Exit codes: 0 success, 1 runtime "
      "failure, 2 bad arguments.\n";
  return text;
}

int Dispatch(std::span<char* const> args, const CliOptions& cli) {
  if (args.size() < 2) {
    std::fputs(MainUsage().c_str(), cli.err);
    return 2;
  }
  const std::string_view name = args[1];
  if (name == "help" || name == "--help" || name == "-h") {
    std::fputs(MainUsage().c_str(), cli.out);
    return 0;
  }
  for (const Command& c : kCommands) {
    if (name != c.name) continue;
    Result<Flags> flags = Flags::Parse(c.flags, args.subspan(2));
    if (!flags.ok()) return BadArguments(c, flags.status().message());
    if (flags->Has("help")) {
      std::fputs(Usage(c).c_str(), cli.out);
      return 0;
    }
    return c.run(c, *flags, cli);
  }
  std::fprintf(cli.err, "blockkv: unknown command '%s'\n\n%s", std::string(name).c_str(),
               MainUsage().c_str());
  return 2;
}

}  // namespace

int RunCli(std::span<char* const> args, const CliOptions& cli) {
  SetLogLevel(LogLevel::kWarning);  // the cache's creation line is noise here
  g_cli = &cli;
  // No exception's text reaches a user: what escapes a command (an allocation the checks did not
  // foresee) is a runtime failure with a message of ours.
  const char* command = args.size() > 1 ? args[1] : "";
  try {
    return Dispatch(args, cli);
  } catch (const std::bad_alloc&) {
    std::fprintf(cli.err, "blockkv %s: RESOURCE_EXHAUSTED: out of memory\n", command);
  } catch (const std::length_error&) {
    std::fprintf(cli.err, "blockkv %s: RESOURCE_EXHAUSTED: a size past what memory can hold\n",
                 command);
  } catch (...) {
    std::fprintf(cli.err, "blockkv %s: INTERNAL: an unexpected error\n", command);
  }
  return 1;
}

}  // namespace blockkv::tool
