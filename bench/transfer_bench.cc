// SPDX-License-Identifier: Apache-2.0
// Sequence transfer (docs/transfer.md): ImportSequence of a 4,096-token Llama-3-8B sequence (32
// layers, 8 KV heads, head 128, fp16, blocks of 16: 512 MiB) from a sender process, against a
// plain ucp_get_nbx of the same bytes (the same runs, from the same sender memory, over the same
// transport) in the same run. The sender is this binary run again with --peer.
//   ./build/default/bench/transfer_bench
// Counters: bytes_per_second (GB/s = 1e9 bytes/s) for each; the import's is the whole call
// (connect, gets, confirm, close). BM_StartImport times StartImport alone (what the scheduling
// thread waits for); its counter whole_ms is the whole import.
#include <benchmark/benchmark.h>
#include <signal.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "blockkv/log.h"
#include "blockkv/state_manager.h"

namespace {

using blockkv::SeqId;

constexpr int64_t kTokens = 4096;
constexpr int64_t kLayers = 32;
constexpr int32_t kBlockSize = 16;
constexpr int32_t kNumBlocks = 260;  // one sequence (256 blocks) and a little room
constexpr uint64_t kLayerBlockBytes = kBlockSize * 2 * 8 * 128 * 2;
constexpr uint64_t kBytes = kLayers * (kTokens / kBlockSize) * kLayerBlockBytes;

blockkv::Result<std::unique_ptr<blockkv::StateManager>> MakeManager(const std::string& tls) {
  blockkv::StateManagerConfig config;
  config.max_tracked_sequences = 4;
  config.max_ragged_sequence_count = 4;
  config.max_ragged_batch_size = kTokens;
  config.max_context = kTokens;
  config.memory_config = {.mode = blockkv::AllocationMode::kAllocate, .size = kNumBlocks};
  config.transfer = blockkv::TransferConfig{.transports = tls};
  blockkv::KVCacheConfig llama{.block_size = kBlockSize,
                               .cache_shape = {kLayers, 8, 128},
                               .max_blocks_per_allocation_group = kTokens / kBlockSize};
  return blockkv::StateManager::Create(config, {llama}, blockkv::CpuDevice());
}

std::string ToHex(std::span<const std::byte> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (const std::byte b : bytes) {
    s += kDigits[static_cast<unsigned>(b) >> 4];
    s += kDigits[static_cast<unsigned>(b) & 15];
  }
  return s;
}

std::vector<std::byte> FromHex(const std::string& s) {
  const auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::vector<std::byte> out(s.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = std::byte(static_cast<uint8_t>(nibble(s[2 * i]) << 4 | nibble(s[2 * i + 1])));
  }
  return out;
}

// The sender: "export" makes a new 4,096-token sequence and prints its descriptor in hex.
int RunPeer(const std::string& tls) {
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  auto m = MakeManager(tls);
  if (!m.ok()) {
    std::cout << "error " << m.status() << std::endl;
    return 1;
  }
  // The KV a prefill wrote: every page of the cache touched, as in a running engine.
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    const blockkv::TensorView view = *(*m)->GetCache(layer);
    std::memset(view.data, 0x5a, static_cast<size_t>(view.numel()) * 2);
  }
  std::cout << "ready" << std::endl;
  std::string line;
  SeqId uid = 0;
  while (std::getline(std::cin, line)) {
    if (line != "export") break;
    ++uid;
    const std::vector<SeqId> uids = {uid};
    const std::vector<int64_t> lengths = {kTokens};
    blockkv::Status s = (*m)->Schedule({.uids = uids, .lengths = lengths});
    if (s.ok()) s = (*m)->PostForward(uids);
    auto d = s.ok() ? (*m)->ExportSequence(uid) : blockkv::Result<std::vector<std::byte>>(s);
    if (!d.ok()) {
      std::cout << "error " << d.status() << std::endl;
    } else {
      std::cout << ToHex(*d) << std::endl;
    }
  }
  return 0;
}

class Peer {
 public:
  explicit Peer(const std::string& tls) {
    int to_child[2];
    int from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) std::abort();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[1]);  // or the peer's stdin never ends
      close(from_child[0]);
      setenv("UCX_LOG_FILE", "/dev/stderr", 1);
      execl("/proc/self/exe", "transfer_bench", "--peer", tls.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    in_ = fdopen(to_child[1], "w");
    out_ = fdopen(from_child[0], "r");
    ready_ = ReadLine() == "ready";
  }
  ~Peer() {
    fclose(in_);  // the peer's stdin ends: it exits
    fclose(out_);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  bool ready() const { return ready_; }
  std::vector<std::byte> Export() {
    fprintf(in_, "export\n");
    fflush(in_);
    const std::string line = ReadLine();
    if (line.rfind("error", 0) == 0) {
      std::cerr << "transfer_bench peer: " << line << "\n";
      return {};
    }
    return FromHex(line);
  }

 private:
  std::string ReadLine() {
    std::string line;
    for (int c = fgetc(out_); c != EOF && c != '\n'; c = fgetc(out_)) line += static_cast<char>(c);
    return line;
  }
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
  bool ready_ = false;
};

// With `start`: StartImport alone is timed (what the scheduling thread waits for), the transfer
// and CompleteImports after it are not (their time is the counter whole_ms).
void BM_ImportSequence(benchmark::State& state, const std::string& tls, bool start) {
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  Peer peer(tls);
  auto m = MakeManager(tls);
  if (!peer.ready() || !m.ok()) {
    state.SkipWithError("the sender or the receiver could not start");
    return;
  }
  // One import first, untimed: the receiver's cache pages are touched, as in a running engine
  // (the plain gets' buffer is touched when it is allocated).
  {
    auto warm = (*m)->ImportSequence(peer.Export());
    if (!warm.ok() || !(*m)->FlushSequence((*warm)->uid()).ok()) {
      state.SkipWithError("the warm-up import failed");
      return;
    }
  }
  double whole_ms = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const std::vector<std::byte> d = peer.Export();
    const auto t0 = std::chrono::steady_clock::now();
    state.ResumeTiming();
    blockkv::Status status;
    SeqId uid = 0;
    if (start) {
      auto ticket = (*m)->StartImport(d);
      state.PauseTiming();
      status = ticket.status();
      if (ticket.ok()) {
        uid = ticket->uid();
        (void)ticket->Wait();
        const auto done = (*m)->CompleteImports();
        status = done.size() == 1
                     ? done[0].second
                     : blockkv::Status(blockkv::StatusCode::kInternal, "CompleteImports: not one");
      }
    } else {
      auto seq = (*m)->ImportSequence(d);
      state.PauseTiming();
      status = seq.status();
      if (seq.ok()) uid = (*seq)->uid();
    }
    whole_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      break;
    }
    if (!(*m)->FlushSequence(uid).ok()) std::abort();
    state.ResumeTiming();
  }
  if (!start) state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["whole_ms"] =
      whole_ms / static_cast<double>(std::max<int64_t>(state.iterations(), 1));
}

// The descriptor's fields the raw gets need (docs/transfer.md, "Descriptor format").
struct Parsed {
  std::string address;
  std::string rkey;
  uint64_t base = 0;
  int32_t num_blocks = 0;
  std::vector<int32_t> ids;
};

Parsed Parse(const std::vector<std::byte>& d) {
  Parsed p;
  size_t at = 12;
  const auto get = [&](void* out, size_t n) {
    std::memcpy(out, d.data() + at, n);
    at += n;
  };
  const auto str = [&] {
    uint64_t n = 0;
    get(&n, 8);
    std::string s(reinterpret_cast<const char*>(d.data() + at), n);
    at += n;
    return s;
  };
  uint64_t u64 = 0;
  str();  // layout
  get(&u64, 8);
  at += 8;  // tp_rank, tp_size
  p.address = str();
  at += 8 + 8 + 8;  // transfer id, uid, seen
  get(&u64, 8);
  at += u64 * 4;  // tokens
  str();          // namespace
  at += 8 + 4;    // adapter id, priority
  uint32_t extras = 0;
  get(&extras, 4);
  for (uint32_t i = 0; i < extras; ++i) str();  // block bytes
  uint32_t regions = 0;
  get(&regions, 4);
  at += 16;
  p.rkey = str();
  uint32_t groups = 0;
  get(&groups, 4);
  uint32_t region = 0;
  get(&region, 4);
  get(&p.base, 8);
  get(&p.num_blocks, 4);
  int32_t released = 0;
  get(&released, 4);
  uint32_t n = 0;
  get(&n, 4);
  p.ids.resize(n);
  get(p.ids.data(), n * 4);
  return p;
}

void Progress(ucp_worker_h w, size_t* outstanding) {
  while (*outstanding > 0) ucp_worker_progress(w);
}

void OnDone(void* request, ucs_status_t status, void* user_data) {
  if (status != UCS_OK) std::abort();
  --*static_cast<size_t*>(user_data);
  ucp_request_free(request);
}

// The same gets with bare ucp: one context and worker of this process, one endpoint, the
// sender's rkey, a registered local buffer, every get in flight at once.
void BM_PlainUcpGet(benchmark::State& state, const std::string& tls) {
  blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
  Peer peer(tls);
  const std::vector<std::byte> d = peer.ready() ? peer.Export() : std::vector<std::byte>{};
  if (d.empty()) {
    state.SkipWithError("the sender could not start");
    return;
  }
  const Parsed p = Parse(d);
  ucp_config_t* config = nullptr;
  ucp_config_read(nullptr, nullptr, &config);
  ucp_config_modify(config, "TLS", tls.c_str());
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  if (ucp_init(&params, config, &context) != UCS_OK) std::abort();
  ucp_config_release(config);
  ucp_worker_params_t wp{};
  ucp_worker_h worker = nullptr;
  if (ucp_worker_create(context, &wp, &worker) != UCS_OK) std::abort();
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(p.address.data());
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) std::abort();
  ucp_rkey_h rkey = nullptr;
  if (ucp_ep_rkey_unpack(ep, p.rkey.data(), &rkey) != UCS_OK) std::abort();
  std::vector<std::byte> local(kBytes);
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = local.data();
  mp.length = local.size();
  ucp_mem_h memh = nullptr;
  if (ucp_mem_map(context, &mp, &memh) != UCS_OK) std::abort();
  const uint64_t per_layer = p.ids.size() * kLayerBlockBytes;
  for (auto _ : state) {
    size_t outstanding = 0;
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      const auto l = static_cast<uint64_t>(layer);
      for (size_t i = 0; i < p.ids.size();) {
        size_t n = 1;
        while (i + n < p.ids.size() && p.ids[i + n] == p.ids[i] + static_cast<int32_t>(n)) ++n;
        ucp_request_param_t rp{};
        rp.op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
        rp.cb.send = &OnDone;
        rp.user_data = &outstanding;
        rp.memh = memh;
        const uint64_t remote =
            p.base + (l * static_cast<uint64_t>(p.num_blocks) + static_cast<uint64_t>(p.ids[i])) *
                         kLayerBlockBytes;
        const ucs_status_ptr_t req =
            ucp_get_nbx(ep, local.data() + l * per_layer + i * kLayerBlockBytes,
                        n * kLayerBlockBytes, remote, rkey, &rp);
        if (UCS_PTR_IS_ERR(req)) std::abort();
        if (req != nullptr) ++outstanding;
        i += n;
      }
    }
    Progress(worker, &outstanding);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  ucp_rkey_destroy(rkey);
  ucp_request_param_t cp{};
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t close = ucp_ep_close_nbx(ep, &cp);
  if (UCS_PTR_IS_PTR(close)) {
    while (ucp_request_check_status(close) == UCS_INPROGRESS) ucp_worker_progress(worker);
    ucp_request_free(close);
  }
  ucp_mem_unmap(context, memh);
  ucp_worker_destroy(worker);
  ucp_cleanup(context);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--peer") return RunPeer(argv[2]);
  for (const auto& [name, tls] :
       {std::pair<const char*, const char*>{"tcp", "tcp"}, {"shm", "posix,sysv,cma,self"}}) {
    const std::string t = tls;
    benchmark::RegisterBenchmark((std::string("BM_ImportSequence/") + name).c_str(),
                                 [t](benchmark::State& s) { BM_ImportSequence(s, t, false); })
        ->Iterations(20)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark((std::string("BM_StartImport/") + name).c_str(),
                                 [t](benchmark::State& s) { BM_ImportSequence(s, t, true); })
        ->Iterations(20)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark((std::string("BM_PlainUcpGet/") + name).c_str(),
                                 [t](benchmark::State& s) { BM_PlainUcpGet(s, t); })
        ->Iterations(20)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
