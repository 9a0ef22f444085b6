// SPDX-License-Identifier: Apache-2.0
// `blockkv plan`: how many blocks, tokens and sequences of a model's KV cache fit in memory —
// PlanKVCache (the library's own arithmetic) over a preset or custom attention shape.
#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>

#include "blockkv/device.h"
#include "blockkv/kv_cache.h"
#include "commands.h"
#include "json.h"

namespace blockkv::tool {
namespace {

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

// From each model's Hugging Face config.json (num_hidden_layers, num_key_value_heads,
// hidden_size / num_attention_heads, max_position_embeddings, sliding_window).
// Phi-3-mini-4k's config lists sliding_window 2047, which its released kernels ignore; it is
// planned as full attention. DeepSeek-V3: 61 layers of MLA, kv_lora_rank 512 + qk_rope_head_dim
// 64, max_position_embeddings 163840. Gemma-2-9B: 42 layers alternating a 4096-token window and
// full attention (21 each), 8 KV heads of 256. gpt-oss-20b: 24 layers alternating a 128-token
// window and full attention (12 each), 8 KV heads of 64, 131072 positions.
constexpr int64_t kNoWindow = 0;
// Jamba-v0.1: 32 layers, 4 of attention (8 KV heads of 128) and 28 Mamba layers whose state per
// sequence is the conv state (d_conv - 1 = 3) x d_inner 8,192 plus the SSM state d_inner x
// d_state 16, in 2-byte elements: 311,296 bytes a layer; 262,144 positions.
const std::array<ModelShape, 11>& Presets() {
  static const std::array<ModelShape, 11> presets = {{
      {"Llama-3-8B", 32, 8, 128, 8192, kNoWindow},
      {"Llama-3-70B", 80, 8, 128, 8192, kNoWindow},
      {"Llama-2-13B", 40, 40, 128, 4096, kNoWindow},
      {"Mistral-7B", 32, 8, 128, 32768, 4096},
      {"Qwen2.5-7B", 28, 4, 128, 32768, kNoWindow},
      {"GPT-NeoX-20B", 44, 64, 96, 2048, kNoWindow},
      {"Phi-3-mini", 32, 32, 96, 4096, kNoWindow},
      {"DeepSeek-V3", 61, 1, 576, 163840, kNoWindow, 0, 512, 64},
      {"Gemma-2-9B", 42, 8, 256, 8192, 4096, 21},
      {"gpt-oss-20b", 24, 8, 64, 131072, 128, 12},
      {"Jamba-v0.1", 32, 8, 128, 262144, kNoWindow, 0, 0, 0, 28, int64_t{3 + 16} * 8192 * 2},
  }};
  return presets;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::span<const ModelShape> ModelPresets() { return Presets(); }

const ModelShape* FindModelPreset(std::string_view name) {
  for (const ModelShape& shape : Presets()) {
    if (EqualsIgnoreCase(shape.name, name)) return &shape;
  }
  return nullptr;
}

Result<int64_t> ParseCount(std::string_view text) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || text[0] < '0' || text[0] > '9' || end != text.data() + text.size() ||
      error != std::errc()) {
    return InvalidArgumentError(std::string(1, '\'').append(text).append(
        "' is not an integer in [0, 9223372036854775807]"));
  }
  return value;
}

Result<int64_t> ParseSize(std::string_view text) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgumentError("bad size '" + std::string(text) + "': " + std::string(why) +
                                " (e.g. 80GiB, 512MiB, 40GB, 4096)");
  };
  size_t i = 0;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  const std::string number(text.substr(0, i));
  if (number.empty() || std::count(number.begin(), number.end(), '.') > 1 || number == ".") {
    return bad("no number");
  }
  std::string_view unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  static constexpr std::array<std::pair<std::string_view, long double>, 10> kUnits = {{
      {"", 1.0L},
      {"b", 1.0L},
      {"kib", 1024.0L},
      {"mib", 1048576.0L},
      {"gib", 1073741824.0L},
      {"tib", 1099511627776.0L},
      {"kb", 1e3L},
      {"mb", 1e6L},
      {"gb", 1e9L},
      {"tb", 1e12L},
  }};
  for (const auto& [name, scale] : kUnits) {
    if (!EqualsIgnoreCase(unit, name)) continue;
    const long double bytes = std::strtold(number.c_str(), nullptr) * scale;
    if (bytes >= static_cast<long double>(std::numeric_limits<int64_t>::max())) {
      return bad("too large");
    }
    return static_cast<int64_t>(std::floor(bytes));
  }
  return bad("unknown unit '" + std::string(unit) + "'");
}

std::string FormatBytes(int64_t bytes) {
  static constexpr std::array<const char*, 5> kNames = {"B", "KiB", "MiB", "GiB", "TiB"};
  auto value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < kNames.size()) {
    value /= 1024;
    ++unit;
  }
  char text[48];
  if (unit == 0) {
    std::snprintf(text, sizeof(text), "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(text, sizeof(text), "%.2f %s", value, kNames[unit]);
  }
  return text;
}

Result<MemorySpec> ParseMemory(std::string_view text) {
  MemorySpec spec;
  spec.text = std::string(text);
  if (text == "host") {
    spec.kind = MemorySpec::Kind::kHost;
    return spec;
  }
  if (text.starts_with("cuda:")) {
    Result<int64_t> ordinal = ParseCount(text.substr(5));
    if (!ordinal.ok() || *ordinal > 1024) {
      return InvalidArgumentError("bad device '" + spec.text + "': expected cuda:N");
    }
    spec.kind = MemorySpec::Kind::kCuda;
    spec.ordinal = static_cast<int>(*ordinal);
    return spec;
  }
  BLOCKKV_ASSIGN_OR_RETURN(spec.bytes, ParseSize(text));
  if (spec.bytes <= 0) return InvalidArgumentError("'" + spec.text + "' is 0 bytes: expected more");
  return spec;
}

Status CheckPlanOptions(const PlanOptions& options) {
  const ModelShape& s = options.shape;
  if (s.latent_dim < 0 || s.rope_dim < 0 || (s.latent_dim == 0 && s.rope_dim > 0)) {
    return InvalidArgumentError("an MLA shape needs --latent-dim > 0 and --rope-dim >= 0");
  }
  if (s.latent_dim > 0 && (s.kv_heads != 1 || s.head_size != s.latent_dim + s.rope_dim)) {
    return InvalidArgumentError(
        "an MLA shape (--latent-dim) has no KV heads of its own: leave out --kv-heads and "
        "--head-size");
  }
  if (s.state_layers < 0 || s.state_layers >= s.layers || s.state_bytes < 0 ||
      (s.state_layers > 0) != (s.state_bytes > 0)) {
    return InvalidArgumentError(
        "state layers need both a count in [1, layers) and their bytes per layer");
  }
  if (s.window_layers < 0 || s.window_layers > s.layers) {
    return InvalidArgumentError("the window layers must be in [0, layers]");
  }
  if (s.layers <= 0 || s.kv_heads <= 0 || s.head_size <= 0) {
    return InvalidArgumentError(
        "the shape needs --layers, --kv-heads and --head-size > 0 (or "
        "--model)");
  }
  if (options.block_size <= 0) return InvalidArgumentError("--block-size must be > 0");
  if (options.tp <= 0) return InvalidArgumentError("--tp must be > 0");
  if (s.kv_heads % options.tp != 0 && options.tp % s.kv_heads != 0) {
    return InvalidArgumentError("--tp " + std::to_string(options.tp) + " cannot split " +
                                std::to_string(s.kv_heads) +
                                " KV heads: tp must divide them or be a multiple of them");
  }
  if (options.slack < 0) return InvalidArgumentError("--slack must be >= 0");
  const DType d = options.dtype;
  if (d == DType::kInt32 || d == DType::kInt64) {
    return InvalidArgumentError("--dtype must be a cache dtype: fp32, fp16, bf16, fp8_e4m3, int8");
  }
  return Status::Ok();
}

namespace {

Result<int64_t> AvailableBytes(const MemorySpec& memory) {
  switch (memory.kind) {
    case MemorySpec::Kind::kBytes:
      return memory.bytes;
    case MemorySpec::Kind::kHost:
      return CpuDevice()->available_memory();
    case MemorySpec::Kind::kCuda: {
      BLOCKKV_ASSIGN_OR_RETURN(std::shared_ptr<Device> gpu, CudaDevice(memory.ordinal));
      return gpu->available_memory();
    }
  }
  return InternalError("unknown memory kind");
}

}  // namespace

namespace {

// A state model: the attention layers a DENSE group, the state layers a STATE group with one
// slot per sequence. `report` holds the one-group plan (every layer as attention) on entry.
Result<PlanReport> PlanState(const PlanOptions& options, KVCacheConfig dense, MemoryConfig memory,
                             int64_t available, PlanReport report) {
  const ModelShape& shape = options.shape;
  report.one_group = {.sequences = report.sequences, .unused = 0};
  const int64_t attention_layers = shape.layers - shape.state_layers;
  dense.cache_shape[0] = attention_layers;
  const auto element = static_cast<int64_t>(ElementSize(options.dtype));
  KVCacheConfig state{.block_size = options.block_size,
                      .cache_shape = {shape.state_layers, 1, shape.state_bytes / element},
                      .cache_dtype = options.dtype,
                      .type = KVCacheType::kState,
                      .state_bytes = shape.state_bytes};
  if (shape.state_bytes % element != 0) {
    return InvalidArgumentError("the state bytes are not a whole number of " +
                                std::string(DTypeName(options.dtype)) + " elements");
  }
  BLOCKKV_ASSIGN_OR_RETURN(const int64_t block_bytes, dense.bytes_per_block());
  BLOCKKV_ASSIGN_OR_RETURN(const int64_t slot_bytes, state.bytes_per_block());
  // The sequences that fit with their blocks and their slot, then the plan for that many slots.
  const int64_t per_sequence = report.blocks_per_sequence * block_bytes + slot_bytes;
  const int64_t usable = available - memory.size;
  const int64_t sequences = std::min<int64_t>(usable / per_sequence, 1 << 30);
  if (sequences < 1) {
    return ResourceExhaustedError("not one sequence of " + std::to_string(report.context) +
                                  " tokens fits: it needs " + std::to_string(per_sequence) +
                                  " bytes");
  }
  memory.state_slots = static_cast<int32_t>(sequences);
  const std::array<KVCacheConfig, 2> configs = {dense, state};
  BLOCKKV_ASSIGN_OR_RETURN(const KVCachePlan plan, PlanKVCache(configs, memory, available));
  report.bytes_per_block = plan.bytes_per_block;
  report.bytes_per_token = plan.bytes_per_block / options.block_size;
  report.num_blocks = plan.num_blocks;
  report.cache_bytes = plan.total_bytes;
  report.tokens = report.num_blocks * options.block_size;
  report.sequences = std::min<int64_t>(sequences, report.num_blocks / report.blocks_per_sequence);
  report.state_bytes_per_sequence = slot_bytes;
  // vLLM's alternative: one page size for both, the attention block raised to hold a state.
  const int64_t token_bytes = block_bytes / options.block_size / attention_layers;
  const int64_t tokens = CeilDiv(shape.state_bytes, token_bytes);
  report.padded_block_size = CeilDiv(tokens, options.block_size) * options.block_size;
  const int64_t page = report.padded_block_size * token_bytes;
  report.state_padding = static_cast<double>(page - shape.state_bytes) / static_cast<double>(page);
  return report;
}

}  // namespace

Result<PlanReport> Plan(const PlanOptions& options) {
  BLOCKKV_RETURN_IF_ERROR(CheckPlanOptions(options));
  PlanReport report;
  report.options = options;
  const ModelShape& shape = options.shape;
  report.kv_heads_per_rank = std::max<int64_t>(1, shape.kv_heads / options.tp);
  report.context = options.context > 0 ? options.context : shape.max_context;
  BLOCKKV_ASSIGN_OR_RETURN(report.available_bytes, AvailableBytes(options.memory));

  KVCacheConfig config;
  config.block_size = options.block_size;
  config.cache_shape = {shape.layers, report.kv_heads_per_rank, shape.head_size};
  config.cache_dtype = options.dtype;
  if (shape.latent_dim > 0) {  // one latent row per token, on every rank
    config.type = KVCacheType::kMla;
    config.latent_dim = shape.latent_dim;
    config.rope_dim = shape.rope_dim;
  }
  // RESERVE keeps MemoryConfig::size bytes free and must be > 0; with --slack 0 the same
  // quotient comes from one more available byte kept free.
  MemoryConfig memory;
  memory.size = std::max<int64_t>(options.slack, 1);
  int64_t available = report.available_bytes;
  if (options.slack == 0) {
    if (available == std::numeric_limits<int64_t>::max()) {
      return OutOfRangeError("--memory is too large");
    }
    ++available;
  }
  const std::array<KVCacheConfig, 1> configs = {config};
  BLOCKKV_ASSIGN_OR_RETURN(KVCachePlan plan, PlanKVCache(configs, memory, available));

  report.bytes_per_block = plan.bytes_per_block;
  report.bytes_per_token = plan.bytes_per_block / options.block_size;
  report.num_blocks = plan.num_blocks;
  report.cache_bytes = plan.total_bytes;
  report.tokens = report.num_blocks * options.block_size;
  // A sliding-window sequence holds only the blocks its window touches: ceil(W / bs), plus one
  // when the window straddles a block boundary.
  report.blocks_per_sequence = CeilDiv(report.context, options.block_size);
  const int64_t window_blocks =
      std::min(report.blocks_per_sequence, CeilDiv(shape.sliding_window, options.block_size) + 1);
  const bool hybrid = shape.window_layers > 0 && shape.window_layers < shape.layers;
  if (shape.sliding_window > 0 && report.context > shape.sliding_window) {
    if (hybrid) {
      // As one group, one block table: a block holds every layer, so the window layers keep the
      // whole context too. What they hold past their window is the waste.
      report.window_waste = static_cast<double>(shape.window_layers) *
                            static_cast<double>(report.blocks_per_sequence - window_blocks) /
                            static_cast<double>(shape.layers * report.blocks_per_sequence);
    } else {
      report.blocks_per_sequence = window_blocks;
    }
  }
  report.sequences = report.num_blocks / report.blocks_per_sequence;
  if (shape.state_layers > 0) return PlanState(options, config, memory, available, report);
  if (!hybrid) return report;

  // Hybrid: a DENSE group of the full-attention layers and a LOCAL group of the window layers.
  report.hybrid = true;
  const int64_t full_layers = shape.layers - shape.window_layers;
  const int64_t context_blocks = report.blocks_per_sequence;
  const int64_t local_blocks = shape.sliding_window > 0 && report.context > shape.sliding_window
                                   ? window_blocks
                                   : context_blocks;
  // Layer-blocks the sequences of a layout truly hold, over the layer-blocks of its cache.
  const auto unused = [&](int64_t sequences, int64_t num_blocks, int64_t layers_per_block) {
    const long double held =
        static_cast<long double>(sequences) *
        static_cast<long double>(full_layers * context_blocks + shape.window_layers * local_blocks);
    return static_cast<double>(1.0L -
                               held / (static_cast<long double>(num_blocks) * layers_per_block));
  };
  report.one_group = {.sequences = report.sequences,
                      .unused = unused(report.sequences, report.num_blocks, shape.layers)};
  KVCacheConfig dense = config;
  dense.cache_shape[0] = full_layers;
  KVCacheConfig local = config;
  local.cache_shape[0] = shape.window_layers;
  local.type = KVCacheType::kLocal;
  local.local_window = shape.sliding_window;
  const std::array<KVCacheConfig, 2> separate = {dense, local};
  BLOCKKV_ASSIGN_OR_RETURN(const KVCachePlan split, PlanKVCache(separate, memory, available));
  // Every group has split.num_blocks; the DENSE pool runs out first.
  const int64_t split_sequences =
      std::min(split.num_blocks / context_blocks, split.num_blocks / local_blocks);
  report.separate_pools = {.sequences = split_sequences,
                           .unused = unused(split_sequences, split.num_blocks, shape.layers)};
  // One pool: both groups padded to the larger layer count (vLLM pads the same way).
  report.pool_layers = std::max(full_layers, shape.window_layers);
  dense.cache_shape[0] = local.cache_shape[0] = report.pool_layers;
  const std::array<KVCacheConfig, 2> pooled = {dense, local};
  MemoryConfig shared = memory;
  shared.shared_pool = true;
  BLOCKKV_ASSIGN_OR_RETURN(const KVCachePlan pool, PlanKVCache(pooled, shared, available));
  report.dense_blocks = context_blocks;
  report.local_blocks = local_blocks;
  report.bytes_per_block = pool.bytes_per_block;
  report.bytes_per_token = pool.bytes_per_block * shape.layers / report.pool_layers /
                           options.block_size;  // every layer's K and V of one token
  report.num_blocks = pool.num_blocks;
  report.cache_bytes = pool.total_bytes;
  report.tokens = report.num_blocks * options.block_size;
  report.blocks_per_sequence = context_blocks + local_blocks;
  report.sequences = report.num_blocks / report.blocks_per_sequence;
  // A token takes a block entry in each group (the LOCAL one only while in the window): what the
  // blocks hold in tokens depends on the sequences' lengths, so "tokens" is those of the
  // sequences of the context that fit.
  report.tokens = report.sequences * report.context;
  report.shared_pool = {.sequences = report.sequences,
                        .unused = unused(report.sequences, report.num_blocks, report.pool_layers)};
  return report;
}

std::string FormatPlan(const PlanReport& r, bool json) {
  const PlanOptions& o = r.options;
  const ModelShape& s = o.shape;
  const std::string dtype(DTypeName(o.dtype));
  if (json) {
    JsonWriter w;
    w.BeginObject()
        .Key("model")
        .String(s.name)
        .Key("layers")
        .Int(s.layers)
        .Key("kv_heads")
        .Int(s.kv_heads)
        .Key("kv_heads_per_rank")
        .Int(r.kv_heads_per_rank)
        .Key("head_size")
        .Int(s.head_size)
        .Key("sliding_window")
        .Int(s.sliding_window)
        .Key("window_layers")
        .Int(s.sliding_window > 0 && s.window_layers == 0 ? s.layers : s.window_layers)
        .Key("window_waste")
        .Double(r.window_waste)
        .Key("latent_dim")
        .Int(s.latent_dim)
        .Key("rope_dim")
        .Int(s.rope_dim)
        .Key("dtype")
        .String(dtype)
        .Key("block_size")
        .Int(o.block_size)
        .Key("tp")
        .Int(o.tp)
        .Key("memory")
        .String(o.memory.text)
        .Key("available_bytes")
        .Int(r.available_bytes)
        .Key("slack_bytes")
        .Int(o.slack)
        .Key("bytes_per_token")
        .Int(r.bytes_per_token)
        .Key("bytes_per_block")
        .Int(r.bytes_per_block)
        .Key("num_blocks")
        .Int(r.num_blocks)
        .Key("cache_bytes")
        .Int(r.cache_bytes)
        .Key("tokens")
        .Int(r.tokens)
        .Key("block_tokens")
        .Int(r.num_blocks * o.block_size)
        .Key("context")
        .Int(r.context)
        .Key("blocks_per_sequence")
        .Int(r.blocks_per_sequence)
        .Key("sequences")
        .Int(r.sequences);
    if (r.state_bytes_per_sequence > 0) {
      w.Key("state_layers").Int(s.state_layers).Key("state_bytes").Int(s.state_bytes);
      w.Key("state_bytes_per_sequence").Int(r.state_bytes_per_sequence);
      w.Key("sequences_as_attention").Int(r.one_group.sequences);
      w.Key("padded_block_size").Int(r.padded_block_size);
      w.Key("state_padding").Double(r.state_padding);
    }
    if (r.hybrid) {
      const auto layout = [&](const char* name, const PlanReport::Layout& l) {
        w.Key(name).BeginObject().Key("sequences").Int(l.sequences).Key("unused");
        w.Double(l.unused).EndObject();
      };
      w.Key("pool_layers").Int(r.pool_layers).Key("layouts").BeginObject();
      layout("one_group", r.one_group);
      layout("separate_pools", r.separate_pools);
      layout("shared_pool", r.shared_pool);
      w.EndObject();
    }
    w.EndObject();
    return w.str();
  }
  char text[2048];
  std::string window;
  const bool hybrid = s.window_layers > 0 && s.window_layers < s.layers;
  if (s.sliding_window > 0) {
    window = ", sliding window " + std::to_string(s.sliding_window);
    if (hybrid) {
      window = ", " + std::to_string(s.window_layers) + " of them with a sliding window of " +
               std::to_string(s.sliding_window);
    }
  }
  std::string heads = std::to_string(s.kv_heads) + " KV heads x " + std::to_string(s.head_size);
  if (s.latent_dim > 0) {
    heads = "MLA latent " + std::to_string(s.latent_dim) + " + rope " + std::to_string(s.rope_dim) +
            " per token (no K/V split, shared by every head)";
  }
  std::string ranks;
  if (o.tp > 1) {
    ranks = "; tp " + std::to_string(o.tp) + ": " + std::to_string(r.kv_heads_per_rank) +
            " KV head" + (r.kv_heads_per_rank == 1 ? "" : "s") + " per rank, numbers per rank";
    if (s.latent_dim > 0) {
      ranks = "; tp " + std::to_string(o.tp) +
              ": the latent is replicated on every rank, "
              "numbers per rank";
    }
  }
  // Hybrid: a block holds its tokens of one group only.
  const std::string tokens_note =
      r.hybrid ? " in the sequences below (a token takes a block entry in each group; blocks x "
                 "block size = " +
                     std::to_string(r.num_blocks * o.block_size) + ")"
               : "";
  std::snprintf(text, sizeof(text),
                "model      %s: %lld layers, %s, %s, block %d tokens%s%s\n"
                "memory     %s available (%s), %s kept free\n"
                "per token  %s\n"
                "per block  %s (%lld bytes)\n"
                "blocks     %lld (%s)\n"
                "tokens     %lld%s\n"
                "sequences  %lld of %lld tokens (%lld blocks each)\n",
                s.name.c_str(), static_cast<long long>(s.layers), heads.c_str(), dtype.c_str(),
                o.block_size, window.c_str(), ranks.c_str(), FormatBytes(r.available_bytes).c_str(),
                o.memory.text.c_str(), FormatBytes(o.slack).c_str(),
                FormatBytes(r.bytes_per_token).c_str(), FormatBytes(r.bytes_per_block).c_str(),
                static_cast<long long>(r.bytes_per_block), static_cast<long long>(r.num_blocks),
                FormatBytes(r.cache_bytes).c_str(), static_cast<long long>(r.tokens),
                tokens_note.c_str(), static_cast<long long>(r.sequences),
                static_cast<long long>(r.context), static_cast<long long>(r.blocks_per_sequence));
  std::string out = text;
  if (r.state_bytes_per_sequence > 0) {
    char note[1024];
    std::snprintf(
        note, sizeof(note),
        "groups     DENSE %lld attention layers + STATE %lld layers of %s each a sequence: one "
        "slot per sequence (%s), in its own pool (MemoryConfig.state_slots = %lld), planned "
        "before the blocks\n"
        "layouts    as attention in every layer: %lld sequences; DENSE + STATE: %lld (%.2fx)\n"
        "vLLM       pads instead: attention blocks of %lld tokens so one page holds a layer's "
        "state, %.1f%% of each state page padding\n",
        static_cast<long long>(s.layers - s.state_layers), static_cast<long long>(s.state_layers),
        FormatBytes(s.state_bytes).c_str(), FormatBytes(r.state_bytes_per_sequence).c_str(),
        static_cast<long long>(r.sequences), static_cast<long long>(r.one_group.sequences),
        static_cast<long long>(r.sequences),
        r.one_group.sequences > 0
            ? static_cast<double>(r.sequences) / static_cast<double>(r.one_group.sequences)
            : 0.0,
        static_cast<long long>(r.padded_block_size), 100.0 * r.state_padding);
    out += note;
  }
  if (r.hybrid) {
    const int64_t full = s.layers - s.window_layers;
    char note[1024];
    std::snprintf(
        note, sizeof(note),
        "groups     DENSE %lld layers + LOCAL %lld layers (window %lld) in one shared pool "
        "(MemoryConfig.shared_pool)%s: a block is %lld layers, a sequence holds %lld DENSE + "
        "%lld LOCAL blocks\n"
        "layouts    sequences of %lld tokens, and the cache they leave unused:\n"
        "  one group, every layer full attention   %6lld  %5.1f%%\n"
        "  DENSE + LOCAL, a pool per group         %6lld  %5.1f%%\n"
        "  DENSE + LOCAL, one shared pool          %6lld  %5.1f%%  (%.2fx a pool per group)\n",
        static_cast<long long>(full), static_cast<long long>(s.window_layers),
        static_cast<long long>(s.sliding_window),
        full == s.window_layers ? "" : ", the smaller group padded",
        static_cast<long long>(r.pool_layers), static_cast<long long>(r.dense_blocks),
        static_cast<long long>(r.local_blocks), static_cast<long long>(r.context),
        static_cast<long long>(r.one_group.sequences), 100.0 * r.one_group.unused,
        static_cast<long long>(r.separate_pools.sequences), 100.0 * r.separate_pools.unused,
        static_cast<long long>(r.shared_pool.sequences), 100.0 * r.shared_pool.unused,
        r.separate_pools.sequences > 0 ? static_cast<double>(r.shared_pool.sequences) /
                                             static_cast<double>(r.separate_pools.sequences)
                                       : 0.0);
    out += note;
  }
  return out;
}

}  // namespace blockkv::tool
