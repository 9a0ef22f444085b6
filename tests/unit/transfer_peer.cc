// SPDX-License-Identifier: Apache-2.0
// The other engine of transfer_test.cc: a process with its own StateManager (and UCX endpoint),
// driven by one command per line on stdin, answering one line per command on stdout.
//   transfer_peer <transports> <layers> <prefix 0|1>[d|w][s] [<tp_rank> <tp_size>]
//     (after the prefix flag, "d": a second attention group, blocks of 8 tokens; "w": a second,
//     sliding-window group, blocks of 4, window 8; "s": a STATE group, its slot written and
//     checked with the KV)
//   make <uid> <tokens> <seed> [<namespace> <adapter> <priority>]
//                               a sequence of that many computed tokens, KV = the pattern
//   export <uid>                -> descriptor <hex>
//   import <hex>                -> imported <uid> <seen>
//   state                       -> pending <exports> tracked <sequences> free <blocks>
//   cancel <uid>                -> ok unclaimed | ok granted
//   flush <uid> | check <uid> <seed> (-> mismatches <n>) | quit
// Errors: "error <code> <message>".
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "blockkv/state_manager.h"
#include "transfer_util.h"

// As transfer_test.cc: UCX's own bytes left at exit are not blockkv's.
extern "C" const char* __lsan_default_suppressions() { return "leak:libuct.so\n"; }

namespace {

using blockkv::SeqId;
using blockkv::Status;

void Reply(const std::string& line) { std::cout << line << std::endl; }
void ReplyError(const Status& s) {
  Reply("error " + std::to_string(static_cast<int>(s.code())) + " " + std::string(s.message()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 6) {
    std::cerr << "usage: transfer_peer <transports> <layers> <prefix 0|1> [<tp_rank> <tp_size>]\n";
    return 2;
  }
  blockkv_test::TransferLayout layout;
  layout.layers = std::stoll(argv[2]);
  layout.prefix = argv[3][0] == '1';
  const std::string_view groups(argv[3]);
  if (groups.find('d') != std::string_view::npos) layout.second_block_size = 8;
  if (groups.find('w') != std::string_view::npos) {
    layout.second_block_size = 4;
    layout.second_window = 8;
  }
  layout.state = groups.find('s') != std::string_view::npos;
  if (argc == 6) {
    layout.tp_rank = std::stoi(argv[4]);
    layout.tp_size = std::stoi(argv[5]);
  }
  auto made = blockkv_test::MakeTransferManager(layout, argv[1]);
  if (!made.ok()) {
    ReplyError(made.status());
    return 1;
  }
  blockkv::StateManager& m = **made;
  Reply("ready");
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "make") {
      SeqId uid = 0;
      int64_t tokens = 0;
      uint32_t seed = 0;
      in >> uid >> tokens >> seed;
      blockkv::SequenceOptions options;
      in >> options.keys.ns >> options.keys.adapter_id >> options.priority;
      std::vector<blockkv::TokenId> ids(static_cast<size_t>(tokens));
      std::iota(ids.begin(), ids.end(), 100);
      auto added = m.AddSequence(uid, ids, options);
      if (!added.ok()) {
        ReplyError(added.status());
        continue;
      }
      const std::vector<SeqId> uids = {uid};
      const std::vector<int64_t> lengths = {tokens};
      if (Status s = m.Schedule({.uids = uids, .lengths = lengths}); !s.ok()) {
        ReplyError(s);
        continue;
      }
      if (Status s = m.PostForward(uids); !s.ok()) {
        ReplyError(s);
        continue;
      }
      blockkv_test::WritePattern(m, uid, seed);
      if (layout.state) blockkv_test::WriteStatePattern(m, uid, seed);
      Reply("ok");
    } else if (cmd == "export") {
      SeqId uid = 0;
      in >> uid;
      auto d = m.ExportSequence(uid);
      if (!d.ok()) {
        ReplyError(d.status());
      } else {
        Reply("descriptor " + blockkv_test::ToHex(*d));
      }
    } else if (cmd == "import") {
      std::string hex;
      in >> hex;
      auto seq = m.ImportSequence(blockkv_test::FromHex(hex));
      if (!seq.ok()) {
        ReplyError(seq.status());
      } else {
        Reply("imported " + std::to_string((*seq)->uid()) + " " +
              std::to_string((*seq)->seen_tokens()));
      }
    } else if (cmd == "state") {
      m.CompleteExports();
      Reply("pending " + std::to_string(m.pending_exports()) + " tracked " +
            std::to_string(m.n_tracked_sequences()) + " free " +
            std::to_string(m.free_blocks()[0]));
    } else if (cmd == "flush") {
      SeqId uid = 0;
      in >> uid;
      const Status s = m.FlushSequence(uid);
      s.ok() ? Reply("ok") : ReplyError(s);
    } else if (cmd == "cancel") {
      SeqId uid = 0;
      in >> uid;
      auto taken = m.CancelExport(uid);
      if (!taken.ok()) {
        ReplyError(taken.status());
      } else {
        Reply(*taken == blockkv::CancelledExport::kGranted ? "ok granted" : "ok unclaimed");
      }
    } else if (cmd == "check") {
      SeqId uid = 0;
      uint32_t seed = 0;
      in >> uid >> seed;
      if (m.GetSequence(uid) == nullptr) {
        Reply("error 5 not tracked");
      } else {
        int64_t bad = blockkv_test::PatternMismatches(m, uid, seed);
        if (layout.state) bad += blockkv_test::StateMismatches(m, uid, seed);
        Reply("mismatches " + std::to_string(bad));
      }
    } else if (cmd == "quit") {
      return 0;
    } else {
      Reply("error 1 unknown command " + cmd);
    }
  }
  return 0;
}
