// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: StateManager::LoadSnapshot on arbitrary bytes, into a manager holding the
// seed state (tests/unit/snapshot_util.h's small two-group manager after a short workload). The
// first input byte chooses whether the rest has its checksums recomputed before the load (bit 0),
// so that mutations get past the checksums to the structural checks. It aborts, describing what
// happened, when
//   - a load fails with a code other than kDataLoss or kInvalidArgument,
//   - a failed load changed the state (the manager's own snapshot before and after differ),
//   - a successful load leaves a state CheckInvariants refuses, or one that does not save and
//     load again byte for byte.
// Keep each crash found as a named regression test in tests/unit/snapshot_test.cc.
//
//   snapshot_fuzz -max_total_time=60 snapshot_corpus/
//
// Built with BLOCKKV_SNAPSHOT_FUZZ_SEED_MAIN, the same file is snapshot_fuzz_seed: it writes the
// seed corpus (the seed snapshot, raw and to be resealed) into the directory it is given.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "blockkv/log.h"
#include "blockkv/state_manager.h"
#include "unit/snapshot_util.h"

namespace {

using Bytes = std::vector<std::byte>;

[[noreturn]] void Fail(const char* what, const blockkv::Status& status) {
  std::fprintf(stderr, "snapshot_fuzz: %s: %s\n", what, status.ToString().c_str());
  std::abort();
}

Bytes SaveOrDie(const blockkv::StateManager& m) {
  blockkv::Result<Bytes> bytes = m.SaveSnapshot();
  if (!bytes.ok()) Fail("SaveSnapshot failed", bytes.status());
  return std::move(bytes).value();
}

// The manager every input is loaded into, and the snapshot of its seed state.
struct Fixture {
  std::unique_ptr<blockkv::StateManager> manager;
  Bytes seed;
};

Fixture& TheFixture() {
  static Fixture* fixture = [] {
    blockkv::SetLogLevel(blockkv::LogLevel::kWarning);
    auto* f = new Fixture{blockkv_test::MakeSnapshotManager(), {}};
    blockkv_test::SnapshotWorkload workload(*f->manager, /*seed=*/77);
    workload.Run(40);
    workload.FillContents();
    f->seed = SaveOrDie(*f->manager);
    // From here on the manager is always in the state the seed loads into.
    if (blockkv::Status s = f->manager->LoadSnapshot(f->seed); !s.ok()) Fail("seed load", s);
    return f;
  }();
  return *fixture;
}

}  // namespace

#ifndef BLOCKKV_SNAPSHOT_FUZZ_SEED_MAIN

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = TheFixture();
  blockkv::StateManager& m = *f.manager;
  if (size == 0) return 0;
  Bytes bytes(size - 1);
  if (size > 1) std::memcpy(bytes.data(), data + 1, size - 1);
  if ((data[0] & 1) != 0) blockkv_test::Reseal(bytes);
  const Bytes before = SaveOrDie(m);
  const blockkv::Status s = m.LoadSnapshot(bytes);
  if (!s.ok()) {
    if (s.code() != blockkv::StatusCode::kDataLoss &&
        s.code() != blockkv::StatusCode::kInvalidArgument) {
      Fail("a load failed with an unexpected code", s);
    }
    if (SaveOrDie(m) != before) Fail("a failed load changed the state", s);
    return 0;
  }
  if (blockkv::Status c = m.CheckInvariants(); !c.ok()) Fail("a loaded state is inconsistent", c);
  const Bytes again = SaveOrDie(m);
  if (blockkv::Status r = m.LoadSnapshot(again); !r.ok()) Fail("a re-saved state fails to load", r);
  if (SaveOrDie(m) != again) Fail("a re-saved state loads differently", blockkv::Status::Ok());
  if (blockkv::Status r = m.LoadSnapshot(f.seed); !r.ok()) Fail("the seed fails to load", r);
  return 0;
}

#else

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const Bytes& seed = TheFixture().seed;
  for (const unsigned char mode : {static_cast<unsigned char>(0), static_cast<unsigned char>(1)}) {
    const std::string path = std::string(argv[1]) + (mode == 0 ? "/seed_raw" : "/seed_resealed");
    std::FILE* out = std::fopen(path.c_str(), "wb");
    if (out == nullptr || std::fwrite(&mode, 1, 1, out) != 1 ||
        std::fwrite(seed.data(), 1, seed.size(), out) != seed.size() || std::fclose(out) != 0) {
      std::perror(path.c_str());
      return 1;
    }
  }
  return 0;
}

#endif
