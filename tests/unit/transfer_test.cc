// SPDX-License-Identifier: Apache-2.0
// Sequence transfer between engines over UCX (state_manager.h, docs/transfer.md): this process
// is one engine, transfer_peer processes (fork + exec) are the others, over TCP on 127.0.0.1 and
// over shared memory. UCX that cannot start fails these tests; nothing is skipped.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "blockkv/state_manager.h"
#include "test_util.h"
#include "transfer_util.h"

// UCX 1.13 keeps a few bytes of libuct's component list until exit (ucp_init's queries): not
// blockkv's, so LeakSanitizer (the asan preset) is told to ignore them.
extern "C" const char* __lsan_default_suppressions() { return "leak:libuct.so\n"; }

namespace {

using blockkv::SeqId;
using blockkv::StateManager;
using blockkv::StatusCode;
using blockkv_test::TransferLayout;

// A transfer_peer process: one command line in, one answer line out.
class Peer {
 public:
  // `stop`: BLOCKKV_TRANSFER_TEST_STOP of the process (src/transfer.cc): where it stops itself.
  // `groups`: the cache groups after group 0 (transfer_peer.cc: "d", "s" or "ds").
  Peer(const std::string& transports, int64_t layers = 3, bool prefix = false,
       const std::string& stop = "", int tp_rank = 0, int tp_size = 1,
       const std::string& groups = "") {
    int to_child[2];
    int from_child[2];
    EXPECT_EQ(pipe(to_child), 0);
    EXPECT_EQ(pipe(from_child), 0);
    const std::string layers_arg = std::to_string(layers);
    const std::string prefix_arg = (prefix ? "1" : "0") + groups;
    const std::string rank_arg = std::to_string(tp_rank);
    const std::string size_arg = std::to_string(tp_size);
    pid_ = fork();
    if (pid_ == 0) {
      setenv("UCX_LOG_FILE", "/dev/stderr", 1);  // stdout is the answers' pipe
      if (!stop.empty()) setenv("BLOCKKV_TRANSFER_TEST_STOP", stop.c_str(), 1);
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[1]);
      close(from_child[0]);
      execl(BLOCKKV_TRANSFER_PEER, BLOCKKV_TRANSFER_PEER, transports.c_str(), layers_arg.c_str(),
            prefix_arg.c_str(), rank_arg.c_str(), size_arg.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    in_ = fdopen(to_child[1], "w");
    out_ = fdopen(from_child[0], "r");
    ready_ = ReadLine();
  }
  ~Peer() {
    if (pid_ > 0 && !dead_) {
      kill(pid_, SIGCONT);
      Send("quit");
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    if (in_ != nullptr) fclose(in_);
    if (out_ != nullptr) fclose(out_);
  }
  const std::string& ready() const { return ready_; }
  std::string Send(const std::string& line) {
    Post(line);
    return line == "quit" ? "" : ReadLine();
  }
  // A command whose answer Read() gets later (the peer may stop meanwhile).
  void Post(const std::string& line) {
    fprintf(in_, "%s\n", line.c_str());
    fflush(in_);
  }
  std::string Read() { return ReadLine(); }
  // Waits until the peer has stopped itself (its BLOCKKV_TRANSFER_TEST_STOP point): true when it
  // did, false when it exited instead.
  bool WaitStopped() {
    int status = 0;
    if (waitpid(pid_, &status, WUNTRACED) != pid_) return false;
    if (WIFSTOPPED(status)) return true;
    dead_ = true;
    return false;
  }
  // The descriptor of `uid` (a sequence of `tokens` computed tokens of pattern `seed`).
  // `options`: " <namespace> <adapter> <priority>" for AddSequence, or "" for the defaults.
  std::vector<std::byte> MakeAndExport(SeqId uid, int64_t tokens, uint32_t seed,
                                       const std::string& options = "") {
    EXPECT_EQ(Send("make " + std::to_string(uid) + " " + std::to_string(tokens) + " " +
                   std::to_string(seed) + options),
              "ok");
    return Export(uid);
  }
  std::vector<std::byte> Export(SeqId uid) {
    const std::string answer = Send("export " + std::to_string(uid));
    EXPECT_EQ(answer.rfind("descriptor ", 0), 0u) << answer;
    return blockkv_test::FromHex(answer.substr(answer.find(' ') + 1));
  }
  void Signal(int sig) {
    kill(pid_, sig);
    if (sig == SIGKILL) {
      int status = 0;
      waitpid(pid_, &status, 0);
      dead_ = true;
    }
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
  std::string ready_;
  bool dead_ = false;
};

std::unique_ptr<StateManager> Receiver(const std::string& transports, TransferLayout layout = {},
                                       int32_t timeout_ms = 10000) {
  auto m = blockkv_test::MakeTransferManager(layout, transports, timeout_ms);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// Computes the first `n` of the tokens MakeAndExport gives a sequence (100, 101, ...) as sequence
// `uid` on `m`, so that their full blocks are cached there (unreferenced once it is flushed).
void Prefill(StateManager& m, SeqId uid, int n) {
  std::vector<blockkv::TokenId> prompt(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) prompt[static_cast<size_t>(i)] = 100 + i;
  ASSERT_OK(m.AddSequence(uid, prompt));
  const std::vector<SeqId> uids = {uid};
  const std::vector<int64_t> lengths = {n};
  ASSERT_OK(m.Schedule({.uids = uids, .lengths = lengths}));
  ASSERT_OK(m.PostForward(uids));
}

// What a failed import must leave as it was.
struct ReceiverState {
  int32_t free = 0;
  int32_t tracked = 0;
  explicit ReceiverState(const StateManager& m)
      : free(m.free_blocks()[0]), tracked(m.n_tracked_sequences()) {}
  bool operator==(const ReceiverState&) const = default;
};

class TransferTest : public ::testing::TestWithParam<std::string> {};

// TCP on 127.0.0.1, and shared memory (UCX's cma transport does the gets).
INSTANTIATE_TEST_SUITE_P(Transports, TransferTest, ::testing::Values("tcp", "posix,sysv,cma,self"),
                         [](const auto& param) {
                           return param.index == 0 ? "Tcp" : "SharedMemory";
                         });

TEST_P(TransferTest, ImportCopiesEveryLayerOfEveryBlockExactly) {
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  // 37 tokens in blocks of 4: 9 full blocks and a partial one.
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 11);
  auto receiver = Receiver(GetParam());
  ASSERT_NE(receiver, nullptr);
  auto seq = receiver->ImportSequence(d);
  ASSERT_OK(seq);
  EXPECT_EQ((*seq)->uid(), 7);
  EXPECT_EQ((*seq)->seen_tokens(), 37);
  EXPECT_EQ((*seq)->in_flight_tokens(), 0);
  EXPECT_EQ((*seq)->cur_allocated_blocks(), 10);
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 11), 0);
  EXPECT_EQ(receiver->free_blocks()[0], 64 - 10);
  EXPECT_OK(receiver->CheckInvariants());
}

// The smallest sequences an engine moves: one token (a partial block), exactly one full block, one
// block and one token; with and without prefix caching. Each arrives exactly and decodes on.
TEST_P(TransferTest, OneTokenAndOneBlockSequencesMoveAndDecodeOn) {
  for (const bool prefix : {false, true}) {
    for (const int64_t tokens : {1, 4, 5}) {
      SCOPED_TRACE(std::to_string(tokens) + " tokens, prefix caching " + (prefix ? "on" : "off"));
      Peer sender(GetParam(), 3, prefix);
      ASSERT_EQ(sender.ready(), "ready");
      const std::vector<std::byte> d = sender.MakeAndExport(3, tokens, 5);
      auto receiver = Receiver(GetParam(), {.prefix = prefix});
      ASSERT_NE(receiver, nullptr);
      auto seq = receiver->ImportSequence(d);
      ASSERT_OK(seq);
      EXPECT_EQ((*seq)->seen_tokens(), tokens);
      EXPECT_EQ((*seq)->cur_allocated_blocks(), (tokens + 3) / 4);
      EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 3, 5), 0);
      EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
      const std::vector<SeqId> uids = {3};
      const std::vector<int64_t> lengths = {1};
      ASSERT_OK(receiver->Schedule({.uids = uids, .lengths = lengths}));
      ASSERT_OK(receiver->PostForward(uids));
      EXPECT_EQ(receiver->GetSequence(3)->seen_tokens(), tokens + 1);
      EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 3, 5, 0, tokens), 0);
      EXPECT_OK(receiver->CheckInvariants());
    }
  }
}

TEST_P(TransferTest, ScatteredBlocksOnBothSidesArriveExactly) {
  // Flushes leave both free lists out of order: the sequence's blocks are neither ascending nor
  // consecutive on the sender, nor are the receiver's free blocks.
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  ASSERT_EQ(sender.Send("make 1 20 1"), "ok");
  ASSERT_EQ(sender.Send("make 2 8 1"), "ok");
  ASSERT_EQ(sender.Send("make 3 20 1"), "ok");
  ASSERT_EQ(sender.Send("flush 1"), "ok");
  ASSERT_EQ(sender.Send("flush 3"), "ok");
  const std::vector<std::byte> d = sender.MakeAndExport(4, 90, 21);  // 23 blocks
  auto receiver = Receiver(GetParam());
  ASSERT_NE(receiver, nullptr);
  const std::vector<SeqId> uids = {1, 2, 3};
  const std::vector<int64_t> lengths = {12, 40, 16};
  ASSERT_OK(receiver->Schedule({.uids = uids, .lengths = lengths}));
  ASSERT_OK(receiver->PostForward(uids));
  ASSERT_OK(receiver->FlushSequence(3));
  ASSERT_OK(receiver->FlushSequence(1));
  ASSERT_OK(receiver->ImportSequence(d));
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 4, 21), 0);
  EXPECT_OK(receiver->CheckInvariants());
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 1 free 62");
}

TEST_P(TransferTest, SenderFreesItsBlocksOnlyAfterTheReceiverConfirms) {
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  ASSERT_EQ(sender.Send("make 3 16 5"), "ok");
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 1 free 60");
  const std::vector<std::byte> d = sender.Export(3);
  // Exported: pinned, its blocks still held.
  EXPECT_EQ(sender.Send("state"), "pending 1 tracked 1 free 60");
  EXPECT_EQ(sender.Send("export 3").substr(0, 7), "error 4");  // kFailedPrecondition
  auto receiver = Receiver(GetParam());
  ASSERT_NE(receiver, nullptr);
  ASSERT_OK(receiver->ImportSequence(d));
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
}

TEST_P(TransferTest, ImportedSequenceContinuesDecoding) {
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(9, 8, 3);
  auto receiver = Receiver(GetParam());
  ASSERT_NE(receiver, nullptr);
  ASSERT_OK(receiver->ImportSequence(d));
  const std::vector<SeqId> uids = {9};
  const std::vector<int64_t> one = {1};
  ASSERT_OK(receiver->Schedule({.uids = uids, .lengths = one}));
  ASSERT_OK(receiver->PostForward(uids));
  EXPECT_EQ(receiver->GetSequence(9)->seen_tokens(), 9);
  EXPECT_EQ(receiver->GetSequence(9)->cur_allocated_blocks(), 3);
  EXPECT_OK(receiver->CheckInvariants());
  ASSERT_OK(receiver->FlushSequence(9));
  EXPECT_EQ(receiver->free_blocks()[0], 64);
}

TEST_P(TransferTest, KilledSenderIsUnavailableAndChangesNothing) {
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 11);
  sender.Signal(SIGKILL);
  auto receiver = Receiver(GetParam(), {}, 3000);
  ASSERT_NE(receiver, nullptr);
  const ReceiverState before(*receiver);
  auto seq = receiver->ImportSequence(d);
  EXPECT_CODE(seq, StatusCode::kUnavailable);
  EXPECT_EQ(ReceiverState(*receiver), before);
  EXPECT_EQ(receiver->GetSequence(7), nullptr);
  EXPECT_OK(receiver->CheckInvariants());
}

TEST_P(TransferTest, CancelledExportIsRefusedAndTheSenderKeepsTheSequence) {
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 20, 2);
  EXPECT_EQ(sender.Send("cancel 7"), "ok unclaimed");
  auto receiver = Receiver(GetParam());
  ASSERT_NE(receiver, nullptr);
  const ReceiverState before(*receiver);
  auto seq = receiver->ImportSequence(d);
  EXPECT_CODE(seq, StatusCode::kFailedPrecondition);
  EXPECT_NE(seq.status().message().find("refused"), std::string::npos) << seq.status();
  EXPECT_NE(seq.status().message().find("cancelled"), std::string::npos) << seq.status();
  EXPECT_EQ(ReceiverState(*receiver), before);
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 1 free 59");
  EXPECT_EQ(sender.Send("check 7 2"), "mismatches 0");
}

TEST_P(TransferTest, ThreeEnginesPassASequenceAlongAndASecondImportIsRefused) {
  Peer a(GetParam());
  Peer b(GetParam());
  Peer c(GetParam());
  ASSERT_EQ(a.ready(), "ready");
  ASSERT_EQ(b.ready(), "ready");
  ASSERT_EQ(c.ready(), "ready");
  const std::vector<std::byte> from_a = a.MakeAndExport(5, 30, 8);
  const std::string hex = blockkv_test::ToHex(from_a);
  EXPECT_EQ(b.Send("import " + hex), "imported 5 30");
  // The blocks are never held twice: A accepted B, so it refuses C.
  EXPECT_EQ(c.Send("import " + hex).substr(0, 7), "error 4");
  EXPECT_EQ(c.Send("state"), "pending 0 tracked 0 free 64");
  EXPECT_EQ(a.Send("state"), "pending 0 tracked 0 free 64");
  // B passes it on to this process.
  const std::vector<std::byte> from_b = b.Export(5);
  auto receiver = Receiver(GetParam());
  ASSERT_NE(receiver, nullptr);
  ASSERT_OK(receiver->ImportSequence(from_b));
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 5, 8), 0);
  EXPECT_EQ(b.Send("state"), "pending 0 tracked 0 free 64");
}

// ---- ownership (docs/transfer.md, "Ownership"): a stop or death at any step loses nothing ----

TEST_P(TransferTest, SenderStoppedBeforeItsGrantArrivesKeepsTheSequence) {
  // The sender grants the claim and stops before the grant is sent: the receiver times out and
  // frees what it took, and the sender, resumed, must still hold the sequence (before the
  // handshake had DONE, it freed it: the sequence was gone from both engines).
  Peer sender(GetParam(), 3, false, "sender_before_grant");
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 4);
  auto receiver = Receiver(GetParam(), {}, 1000);
  ASSERT_NE(receiver, nullptr);
  const ReceiverState before(*receiver);
  auto seq = receiver->ImportSequence(d);
  ASSERT_TRUE(sender.WaitStopped());
  EXPECT_CODE(seq, StatusCode::kUnavailable);
  EXPECT_NE(seq.status().message().find("waiting for the sender to grant"), std::string::npos)
      << seq.status();
  EXPECT_EQ(ReceiverState(*receiver), before);
  EXPECT_EQ(receiver->GetSequence(7), nullptr);
  sender.Signal(SIGCONT);
  EXPECT_EQ(sender.Send("state"), "pending 1 tracked 1 free 54");
  EXPECT_EQ(sender.Send("check 7 4"), "mismatches 0");
  // The same receiver claims again (its ABORT made the export pending, or, lost, its own grant
  // is renewed) and imports it; then the sender frees.
  ASSERT_OK(receiver->ImportSequence(d));
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 4), 0);
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
}

TEST_P(TransferTest, ReceiverKilledAfterTheGrantLeavesTheSequenceWithTheSender) {
  Peer sender(GetParam());
  Peer receiver(GetParam(), 3, false, "receiver_after_grant");
  ASSERT_EQ(sender.ready(), "ready");
  ASSERT_EQ(receiver.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 4);
  receiver.Post("import " + blockkv_test::ToHex(d));
  ASSERT_TRUE(receiver.WaitStopped());  // granted; it stopped before committing and DONE
  // Granted: still pinned, its blocks held, and another receiver is refused.
  EXPECT_EQ(sender.Send("state"), "pending 1 tracked 1 free 54");
  auto other = Receiver(GetParam());
  ASSERT_NE(other, nullptr);
  const ReceiverState before(*other);
  auto seq = other->ImportSequence(d);
  EXPECT_CODE(seq, StatusCode::kFailedPrecondition);
  EXPECT_NE(seq.status().message().find("granted it to another receiver"), std::string::npos)
      << seq.status();
  EXPECT_EQ(ReceiverState(*other), before);
  receiver.Signal(SIGKILL);
  // No DONE will come: the sender keeps the sequence, and CancelExport says a receiver had it.
  EXPECT_EQ(sender.Send("state"), "pending 1 tracked 1 free 54");
  EXPECT_EQ(sender.Send("cancel 7"), "ok granted");
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 1 free 54");
  EXPECT_EQ(sender.Send("check 7 4"), "mismatches 0");
  EXPECT_CODE(other->ImportSequence(d), StatusCode::kFailedPrecondition);  // cancelled
  EXPECT_EQ(ReceiverState(*other), before);
}

TEST_P(TransferTest, ReceiverResumedAfterTheGrantCommitsAndTheSenderFreesOnItsDone) {
  Peer sender(GetParam());
  Peer receiver(GetParam(), 3, false, "receiver_after_grant");
  ASSERT_EQ(sender.ready(), "ready");
  ASSERT_EQ(receiver.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 4);
  receiver.Post("import " + blockkv_test::ToHex(d));
  ASSERT_TRUE(receiver.WaitStopped());
  EXPECT_EQ(sender.Send("state"), "pending 1 tracked 1 free 54");  // held until DONE
  receiver.Signal(SIGCONT);
  EXPECT_EQ(receiver.Read(), "imported 7 37");
  EXPECT_EQ(receiver.Send("check 7 4"), "mismatches 0");
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
  EXPECT_EQ(sender.Send("cancel 7").substr(0, 7), "error 5");  // kNotFound: nothing to cancel
}

// ---- export timeout ----

// This process as the sender: one computed sequence of `tokens` tokens, exported.
std::vector<std::byte> ExportHere(StateManager& m, SeqId uid, int64_t tokens, uint32_t seed) {
  const std::vector<SeqId> uids = {uid};
  const std::vector<int64_t> lengths = {tokens};
  EXPECT_OK(m.Schedule({.uids = uids, .lengths = lengths}));
  EXPECT_OK(m.PostForward(uids));
  blockkv_test::WritePattern(m, uid, seed);
  auto d = m.ExportSequence(uid);
  EXPECT_OK(d);
  return d.ok() ? *d : std::vector<std::byte>{};
}

TEST(TransferTest, ExpiredExportStaysWithTheSenderAndItsDescriptorIsRefusedNamingTheExpiry) {
  auto m = Receiver("tcp", {.export_timeout_ms = 1});
  ASSERT_NE(m, nullptr);
  const std::vector<std::byte> d = ExportHere(*m, 7, 10, 3);
  EXPECT_EQ(m->pending_exports(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the 1 ms
  // The next Schedule cancels it: the sequence is schedulable again, nothing was freed.
  const std::vector<SeqId> uids = {7};
  const std::vector<int64_t> one = {1};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = one}));
  EXPECT_EQ(m->pending_exports(), 0);
  ASSERT_OK(m->PostForward(uids));
  EXPECT_EQ(m->GetSequence(7)->seen_tokens(), 11);
  EXPECT_EQ(blockkv_test::PatternMismatches(*m, 7, 3, 0, 10), 0);
  EXPECT_EQ(m->free_blocks()[0], 64 - 3);
  EXPECT_CODE(m->CancelExport(7), StatusCode::kNotFound);
  Peer receiver("tcp");
  ASSERT_EQ(receiver.ready(), "ready");
  const std::string answer = receiver.Send("import " + blockkv_test::ToHex(d));
  EXPECT_EQ(answer.substr(0, 7), "error 4") << answer;  // kFailedPrecondition
  EXPECT_NE(answer.find("expired, unclaimed for 1 ms"), std::string::npos) << answer;
  EXPECT_NE(answer.find("export_timeout_ms"), std::string::npos) << answer;
  EXPECT_EQ(receiver.Send("state"), "pending 0 tracked 0 free 64");
  EXPECT_OK(m->CheckInvariants());
}

TEST(TransferTest, ExpiryRunsAtCompleteExportsAndZeroNeverExpires) {
  auto expiring = Receiver("tcp", {.export_timeout_ms = 1});
  auto never = Receiver("tcp", {.export_timeout_ms = 0});
  ASSERT_NE(expiring, nullptr);
  ASSERT_NE(never, nullptr);
  ExportHere(*expiring, 1, 6, 1);
  ExportHere(*never, 1, 6, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(expiring->CompleteExports(), 0);  // nothing flushed: it stays here
  EXPECT_EQ(expiring->pending_exports(), 0);
  EXPECT_EQ(expiring->free_blocks()[0], 62);
  ASSERT_OK(expiring->FlushSequence(1));
  EXPECT_EQ(never->CompleteExports(), 0);
  EXPECT_EQ(never->pending_exports(), 1);
  EXPECT_CODE(never->FlushSequence(1), StatusCode::kFailedPrecondition);
}

TEST(TransferTest, GrantedExportDoesNotExpireAndIsFreedOnItsDone) {
  auto m = Receiver("tcp", {.export_timeout_ms = 1});
  ASSERT_NE(m, nullptr);
  const std::vector<std::byte> d = ExportHere(*m, 7, 10, 3);
  Peer receiver("tcp", 3, false, "receiver_after_grant");
  ASSERT_EQ(receiver.ready(), "ready");
  receiver.Post("import " + blockkv_test::ToHex(d));
  ASSERT_TRUE(receiver.WaitStopped());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(m->CompleteExports(), 0);
  EXPECT_EQ(m->pending_exports(), 1);  // granted: waits for the receiver's DONE
  receiver.Signal(SIGCONT);
  EXPECT_EQ(receiver.Read(), "imported 7 10");
  EXPECT_EQ(m->CompleteExports(), 1);
  EXPECT_EQ(m->free_blocks()[0], 64);
  EXPECT_EQ(receiver.Send("check 7 3"), "mismatches 0");
}

// ---- tensor parallelism ----

TEST(TransferTest, TensorParallelRanksTransferRankToRankAndACrossedPairingIsRefused) {
  // Two prefill ranks and two decode ranks, each rank with its own shard (another pattern).
  Peer p0("tcp", 3, false, "", 0, 2);
  Peer p1("tcp", 3, false, "", 1, 2);
  Peer d0("tcp", 3, false, "", 0, 2);
  Peer d1("tcp", 3, false, "", 1, 2);
  for (Peer* p : {&p0, &p1, &d0, &d1}) ASSERT_EQ(p->ready(), "ready");
  const std::string shard0 = blockkv_test::ToHex(p0.MakeAndExport(7, 37, 10));
  const std::string shard1 = blockkv_test::ToHex(p1.MakeAndExport(7, 37, 11));
  // Crossed: refused, naming both sides, and nothing changes on either.
  const std::string crossed = d1.Send("import " + shard0);
  EXPECT_EQ(crossed.substr(0, 7), "error 1") << crossed;  // kInvalidArgument
  EXPECT_NE(crossed.find("rank 0 of 2; this engine is rank 1 of 2"), std::string::npos) << crossed;
  EXPECT_EQ(d1.Send("state"), "pending 0 tracked 0 free 64");
  EXPECT_EQ(p0.Send("state"), "pending 1 tracked 1 free 54");
  // Rank to rank: each shard arrives on its own rank.
  EXPECT_EQ(d0.Send("import " + shard0), "imported 7 37");
  EXPECT_EQ(d1.Send("import " + shard1), "imported 7 37");
  EXPECT_EQ(d0.Send("check 7 10"), "mismatches 0");
  EXPECT_EQ(d1.Send("check 7 11"), "mismatches 0");
  EXPECT_EQ(p0.Send("state"), "pending 0 tracked 0 free 64");
  EXPECT_EQ(p1.Send("state"), "pending 0 tracked 0 free 64");
  // Another world size: this process is rank 0 of 1.
  const std::vector<std::byte> other = p0.MakeAndExport(8, 5, 12);
  auto receiver = Receiver("tcp");
  ASSERT_NE(receiver, nullptr);
  const ReceiverState before(*receiver);
  auto seq = receiver->ImportSequence(other);
  EXPECT_CODE(seq, StatusCode::kInvalidArgument);
  EXPECT_NE(seq.status().message().find("rank 0 of 2; this engine is rank 0 of 1"),
            std::string::npos)
      << seq.status();
  EXPECT_EQ(ReceiverState(*receiver), before);
  EXPECT_EQ(p0.Send("state"), "pending 1 tracked 1 free 62");
}

TEST(TransferTest, BadTransferConfigIsAnErrorAtCreateNamingTheValues) {
  const std::vector<std::pair<blockkv_test::TransferLayout, std::string>> cases = {
      {{.tp_rank = 2, .tp_size = 2}, "tp_rank is 2 and tp_size 2"},
      {{.tp_rank = -1, .tp_size = 2}, "tp_rank is -1 and tp_size 2"},
      {{.tp_rank = 0, .tp_size = 0}, "tp_rank is 0 and tp_size 0"},
      {{.export_timeout_ms = -5}, "export_timeout_ms is -5"},
  };
  for (const auto& [layout, what] : cases) {
    auto m = blockkv_test::MakeTransferManager(layout, "tcp");
    EXPECT_CODE(m, StatusCode::kInvalidArgument) << what;
    EXPECT_NE(m.status().message().find(what), std::string::npos) << m.status();
  }
  EXPECT_CODE(blockkv_test::MakeTransferManager({}, "tcp", 0), StatusCode::kInvalidArgument);
}

TEST_P(TransferTest, StoppedSenderTimesOutThenTheSameDescriptorImports) {
  // Over TCP the sender's worker serves the gets: a stopped sender stalls them. Over shared
  // memory the gets (cma: process_vm_readv) complete without it, and the wait for its grant
  // times out (no peer failure detection there: the receiver bounds its own wait and close).
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 4);
  auto receiver = Receiver(GetParam(), {}, 1000);
  ASSERT_NE(receiver, nullptr);
  const ReceiverState before(*receiver);
  sender.Signal(SIGSTOP);
  auto seq = receiver->ImportSequence(d);
  sender.Signal(SIGCONT);
  EXPECT_CODE(seq, StatusCode::kUnavailable);
  EXPECT_NE(seq.status().message().find("timed out after 1000 ms"), std::string::npos)
      << seq.status();
  EXPECT_EQ(ReceiverState(*receiver), before);
  EXPECT_OK(receiver->CheckInvariants());
  // Nothing was lost: the sender still holds it, and the descriptor still works.
  EXPECT_EQ(sender.Send("state"), "pending 1 tracked 1 free 54");
  ASSERT_OK(receiver->ImportSequence(d));
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 4), 0);
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
}

TEST(TransferTest, PrefixCachingReceiverKnowsTheTokensAndCachesTheBlocks) {
  Peer sender("tcp", 3, /*prefix=*/true);
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 17, 6);
  auto receiver = Receiver("tcp", {.prefix = true});
  ASSERT_NE(receiver, nullptr);
  ASSERT_OK(receiver->ImportSequence(d));
  // The 4 full blocks are published; a new sequence with the same 17 tokens hits 16 of them.
  std::vector<blockkv::TokenId> prompt(17);
  for (int i = 0; i < 17; ++i) prompt[static_cast<size_t>(i)] = 100 + i;  // transfer_peer's ids
  ASSERT_OK(receiver->AddSequence(8, prompt));
  const std::vector<SeqId> uids = {8};
  const std::vector<int64_t> lengths = {17};
  ASSERT_OK(receiver->Schedule({.uids = uids, .lengths = lengths}));
  EXPECT_EQ(receiver->GetSequence(8)->cached_prefix_tokens(), 16);
  EXPECT_EQ(receiver->GetSequence(8)->block_table()[0], receiver->GetSequence(7)->block_table()[0]);
  EXPECT_OK(receiver->CheckInvariants());
}

// Also with more cache groups: a second attention group of another block size (the hit is what
// both cache, in whole blocks of each), a STATE group, whose slot is always read (it is the
// state after every token), and a sliding-window group, whose blocks (the window's) are always
// read while the full-attention group's cached ones are shared.
TEST(TransferTest, PrefixBlocksTheReceiverCachesAreSharedNotCopied) {
  for (const std::string groups : {"", "d", "s", "ds", "w"}) {
    SCOPED_TRACE("groups after the first: \"" + groups + "\"");
    Peer sender("tcp", 3, /*prefix=*/true, "", 0, 1, groups);
    ASSERT_EQ(sender.ready(), "ready");
    const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 6);  // tokens 100, 101, ...
    const bool windowed = groups.find('w') != std::string::npos;
    const TransferLayout layout{
        .prefix = true,
        .second_block_size = groups.find('d') != std::string::npos ? 8 : (windowed ? 4 : 0),
        .second_window = windowed ? 8 : 0,
        .state = groups.find('s') != std::string::npos};
    auto receiver = Receiver("tcp", layout);
    ASSERT_NE(receiver, nullptr);
    // The receiver computed the first 18 of those tokens itself (4 full blocks of 4 tokens, 2 of
    // 8, cached), with KV of its own (another pattern), and finished that sequence: its blocks
    // are cached, unreferenced.
    ASSERT_NO_FATAL_FAILURE(Prefill(*receiver, 1, 18));
    blockkv_test::WritePattern(*receiver, 1, 99);
    if (layout.state) blockkv_test::WriteStatePattern(*receiver, 1, 99);
    const std::vector<blockkv::BlockId> cached(receiver->GetSequence(1)->block_table().begin(),
                                               receiver->GetSequence(1)->block_table().begin() + 4);
    ASSERT_OK(receiver->FlushSequence(1));
    ASSERT_EQ(receiver->free_blocks()[0], 64);  // 4 of them cached and evictable
    const std::vector<int32_t> free = receiver->free_blocks();

    auto seq = receiver->ImportSequence(d);
    ASSERT_OK(seq);
    const std::span<const blockkv::BlockId> table = (*seq)->block_table();
    EXPECT_TRUE(std::equal(cached.begin(), cached.end(), table.begin()));
    EXPECT_EQ((*seq)->cached_prefix_tokens(), 16);
    // Tokens 0-15 are the receiver's own KV (not copied), 16-36 the sender's, in every attention
    // group; the state slot is the sender's.
    EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 99, 0, 16), 0);
    EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 6, 16, 37), 0);
    if (layout.state) {
      EXPECT_EQ(blockkv_test::StateMismatches(*receiver, 7, 6), 0);
    }
    EXPECT_EQ(receiver->free_blocks()[0], 64 - 10);
    if (layout.second_block_size > 0) {
      // Every block the sequence holds in the second group: 5 of 8 tokens, 2 of them shared; the
      // window's last 3 of 4 tokens (the sender released the others), all read.
      const std::span<const blockkv::BlockId> second = (*seq)->block_table(1);
      const auto held =
          std::ranges::count_if(second, [](blockkv::BlockId b) { return b != blockkv::kNoBlock; });
      EXPECT_EQ(held, windowed ? 3 : 5);
      EXPECT_EQ(receiver->free_blocks()[1], free[1] - held);
    }
    if (layout.state) {
      EXPECT_EQ(receiver->free_blocks().back(), free.back() - 1);
    }
    EXPECT_OK(receiver->CheckInvariants());
    EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
  }
}

// A tenant's sequence, computed with a LoRA adapter, keeps its keys on the receiver: it does not
// share the receiver's base-model blocks of the same tokens, and only a request of that tenant
// and adapter hits its blocks afterwards.
TEST(TransferTest, ImportedBlocksKeepTheSequencesNamespaceAndAdapter) {
  Peer sender("tcp", 3, /*prefix=*/true);
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 17, 6, " tenant-a 5 80");
  auto receiver = Receiver("tcp", {.prefix = true});
  ASSERT_NE(receiver, nullptr);
  std::vector<blockkv::TokenId> prompt(17);
  for (int i = 0; i < 17; ++i) prompt[static_cast<size_t>(i)] = 100 + i;
  const auto prefill = [&](SeqId uid, const blockkv::SequenceOptions& options) {
    EXPECT_OK(receiver->AddSequence(uid, prompt, options));
    const std::vector<SeqId> uids = {uid};
    const std::vector<int64_t> lengths = {17};
    EXPECT_OK(receiver->Schedule({.uids = uids, .lengths = lengths}));
    EXPECT_OK(receiver->PostForward(uids));
    return receiver->GetSequence(uid)->cached_prefix_tokens();
  };
  // The base model's KV of the same tokens, cached here (pattern 99).
  EXPECT_EQ(prefill(1, {}), 0);
  blockkv_test::WritePattern(*receiver, 1, 99);
  ASSERT_OK(receiver->FlushSequence(1));

  auto seq = receiver->ImportSequence(d);
  ASSERT_OK(seq);
  EXPECT_EQ((*seq)->cached_prefix_tokens(), 0);  // nothing shared: other keys
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 6, 0, 17), 0);
  // The base model's request hits the base model's blocks; the tenant's adapter request the
  // imported ones.
  EXPECT_EQ(prefill(8, {}), 16);
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 8, 99, 0, 16), 0);
  EXPECT_EQ(prefill(9, {.keys = {.ns = "tenant-a", .adapter_id = 5}}), 16);
  EXPECT_EQ(receiver->GetSequence(9)->block_table()[0], receiver->GetSequence(7)->block_table()[0]);
  EXPECT_EQ(receiver->prefix_cache()->stats("tenant-a").hit_tokens, 16);
  EXPECT_OK(receiver->CheckInvariants());
}

// A hybrid model (attention blocks and a Mamba-like state per sequence): the state slot moves with
// the blocks, byte for byte, the sequence decodes on from it, and the sender frees both; an engine
// without the STATE group refuses the descriptor by its layout.
TEST_P(TransferTest, AStateGroupsSlotMovesWithTheBlocks) {
  for (const bool prefix : {false, true}) {
    SCOPED_TRACE(prefix ? "prefix caching" : "no prefix caching");
    Peer sender(GetParam(), 3, prefix, "", 0, 1, "s");
    ASSERT_EQ(sender.ready(), "ready");
    const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 13);
    auto plain = Receiver(GetParam(), {.prefix = prefix});
    ASSERT_NE(plain, nullptr);
    EXPECT_CODE(plain->ImportSequence(d), StatusCode::kInvalidArgument);
    auto receiver = Receiver(GetParam(), {.prefix = prefix, .state = true});
    ASSERT_NE(receiver, nullptr);
    const int32_t slots = receiver->free_blocks()[1];
    ASSERT_OK(receiver->ImportSequence(d));
    EXPECT_EQ(receiver->free_blocks()[1], slots - 1);
    EXPECT_EQ(receiver->GetSequence(7)->block_table(1).size(), 1u);
    EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 13), 0);
    EXPECT_EQ(blockkv_test::StateMismatches(*receiver, 7, 13), 0);
    EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
    // It decodes on here: one more token, the same slot.
    const std::vector<SeqId> uids = {7};
    const std::vector<int64_t> lengths = {1};
    const blockkv::BlockId slot = receiver->GetSequence(7)->block_table(1)[0];
    ASSERT_OK(receiver->Schedule({.uids = uids, .lengths = lengths}));
    ASSERT_OK(receiver->PostForward(uids));
    EXPECT_EQ(receiver->GetSequence(7)->seen_tokens(), 38);
    EXPECT_EQ(receiver->GetSequence(7)->block_table(1)[0], slot);
    EXPECT_OK(receiver->CheckInvariants());
    ASSERT_OK(receiver->FlushSequence(7));
    EXPECT_EQ(receiver->free_blocks()[1], slots);
  }
}

// Also started (StartImport): its ticket says why, and CompleteImports reports it, untracks it
// and gives back every block.
TEST(TransferTest, FailedImportGivesBackTheCachedBlocksItShared) {
  for (const bool started : {false, true}) {
    SCOPED_TRACE(started ? "StartImport" : "ImportSequence");
    Peer sender("tcp", 3, /*prefix=*/true);
    ASSERT_EQ(sender.ready(), "ready");
    const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 6);
    sender.Signal(SIGKILL);
    auto receiver = Receiver("tcp", {.prefix = true}, 3000);
    ASSERT_NE(receiver, nullptr);
    ASSERT_NO_FATAL_FAILURE(Prefill(*receiver, 1, 18));
    ASSERT_OK(receiver->FlushSequence(1));
    const ReceiverState before(*receiver);
    if (started) {
      auto ticket = receiver->StartImport(d);
      ASSERT_OK(ticket);
      EXPECT_CODE(ticket->Wait(), StatusCode::kUnavailable);
      const std::vector<std::pair<SeqId, blockkv::Status>> done = receiver->CompleteImports();
      ASSERT_EQ(done.size(), 1u);
      EXPECT_EQ(done[0].first, 7);
      EXPECT_CODE(done[0].second, StatusCode::kUnavailable);
      EXPECT_NE(done[0].second.message().find("the sender keeps it"), std::string_view::npos)
          << done[0].second;
      EXPECT_EQ(receiver->GetSequence(7), nullptr);
    } else {
      EXPECT_CODE(receiver->ImportSequence(d), StatusCode::kUnavailable);
    }
    EXPECT_EQ(ReceiverState(*receiver), before);
    EXPECT_EQ(receiver->prefix_cache()->cached_blocks(0), 4);
    EXPECT_EQ(receiver->pool(0).evictable_blocks(), 4);
    EXPECT_OK(receiver->CheckInvariants());
  }
}

TEST(TransferTest, LayoutMismatchNamesBothFingerprintsAndChangesNothing) {
  Peer sender("tcp", /*layers=*/2);
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 12, 1);
  auto receiver = Receiver("tcp");  // 3 layers
  ASSERT_NE(receiver, nullptr);
  const ReceiverState before(*receiver);
  auto seq = receiver->ImportSequence(d);
  EXPECT_CODE(seq, StatusCode::kInvalidArgument);
  const std::string message(seq.status().message());
  EXPECT_NE(message.find("shape [2, 2, 8]"), std::string::npos) << message;
  EXPECT_NE(message.find("shape [3, 2, 8]"), std::string::npos) << message;
  EXPECT_NE(message.find("fingerprint 0x"), message.rfind("fingerprint 0x")) << message;
  EXPECT_EQ(ReceiverState(*receiver), before);
  EXPECT_EQ(sender.Send("state"), "pending 1 tracked 1 free 61");
}

TEST(TransferTest, TruncatedCorruptOrGarbageDescriptorIsInvalidArgument) {
  Peer sender("tcp");
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 12, 1);
  auto receiver = Receiver("tcp");
  ASSERT_NE(receiver, nullptr);
  const ReceiverState before(*receiver);
  for (size_t n = 0; n < d.size(); ++n) {
    EXPECT_CODE(receiver->ImportSequence(std::span(d).first(n)), StatusCode::kInvalidArgument)
        << n << " bytes";
  }
  for (size_t i = 0; i < d.size(); i += 7) {
    std::vector<std::byte> flipped = d;
    flipped[i] ^= std::byte{0x40};
    EXPECT_CODE(receiver->ImportSequence(flipped), StatusCode::kInvalidArgument) << "byte " << i;
  }
  std::vector<std::byte> garbage(d.size());
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = std::byte(static_cast<uint8_t>(i * 37));
  EXPECT_CODE(receiver->ImportSequence(garbage), StatusCode::kInvalidArgument);
  EXPECT_EQ(ReceiverState(*receiver), before);
  // The intact descriptor still imports.
  ASSERT_OK(receiver->ImportSequence(d));
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 1), 0);
}

// A flipped byte is caught by the descriptor's checksum; these mutations are resealed (the
// checksum recomputed, as a buggy or hostile sender would send them), so every field's own check
// is what stands: each import is an error or a sequence, never a crash or a broken receiver.
TEST(TransferTest, ResealedMutationsOfADescriptorNeverBreakTheReceiver) {
  Peer sender("tcp", 3, /*prefix=*/true, "", 0, 1, "ds");
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 2);
  auto receiver = Receiver("tcp", {.prefix = true, .second_block_size = 8, .state = true}, 500);
  ASSERT_NE(receiver, nullptr);
  std::mt19937 rng(20261205);
  int imported = 0;
  for (int round = 0; round < 1000; ++round) {
    std::vector<std::byte> m = d;
    const size_t body = m.size() - sizeof(uint64_t);
    for (int k = 0; k < 1 + round % 3; ++k) {
      m[rng() % body] = std::byte(static_cast<uint8_t>(rng()));
    }
    const uint64_t sum = XXH3_64bits(m.data(), body);
    std::memcpy(m.data() + body, &sum, sizeof(sum));
    auto seq = receiver->ImportSequence(m);
    if (seq.ok()) {
      ++imported;
      ASSERT_OK(receiver->FlushSequence((*seq)->uid()));
    }
    ASSERT_OK(receiver->CheckInvariants()) << "round " << round;
  }
  EXPECT_LE(imported, 1);  // the sender grants its one export once
}

// StartImport returns at once: the engine schedules its own sequences while the sender is
// stopped, the imported one is tracked but pinned, and CompleteImports commits it once the
// transfer is done (over shared memory the stopped sender holds the transfer at its PING).
TEST_P(TransferTest, StartImportReturnsAtOnceAndTheEngineRunsMeanwhile) {
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 11);
  auto receiver = Receiver(GetParam());
  ASSERT_NE(receiver, nullptr);
  sender.Signal(SIGSTOP);
  auto ticket = receiver->StartImport(d);
  ASSERT_OK(ticket);
  EXPECT_EQ(ticket->uid(), 7);
  EXPECT_FALSE(ticket->Poll());
  // A copy waited on by another thread (an engine's I/O thread), as the scheduling thread goes on.
  blockkv::Status waited = blockkv::InternalError("not waited");
  std::jthread waiter([copy = *ticket, &waited] { waited = copy.Wait(); });
  EXPECT_EQ(receiver->pending_imports(), 1);
  EXPECT_EQ(receiver->n_tracked_sequences(), 1);
  EXPECT_EQ(receiver->free_blocks()[0], 64 - 10);  // taken now
  // Pinned while its blocks are being read.
  const std::vector<SeqId> seven = {7};
  const std::vector<int64_t> one = {1};
  EXPECT_CODE(receiver->Schedule({.uids = seven, .lengths = one}), StatusCode::kFailedPrecondition);
  EXPECT_CODE(receiver->PostForward(seven), StatusCode::kFailedPrecondition);
  EXPECT_CODE(receiver->FlushSequence(7), StatusCode::kFailedPrecondition);
  EXPECT_CODE(receiver->Fork(7, 8), StatusCode::kFailedPrecondition);
  EXPECT_CODE(receiver->ExportSequence(7), StatusCode::kFailedPrecondition);
  EXPECT_CODE(receiver->SaveSnapshot(), StatusCode::kFailedPrecondition);
  const std::vector<std::byte> empty_snapshot = *Receiver(GetParam())->SaveSnapshot();
  EXPECT_CODE(receiver->LoadSnapshot(empty_snapshot), StatusCode::kFailedPrecondition);
  // The engine runs its own sequences meanwhile.
  const std::vector<SeqId> mine = {1};
  const std::vector<int64_t> six = {6};
  ASSERT_OK(receiver->Schedule({.uids = mine, .lengths = six}));
  ASSERT_OK(receiver->PostForward(mine));
  EXPECT_TRUE(receiver->CompleteImports().empty());
  EXPECT_OK(receiver->CheckInvariants());
  sender.Signal(SIGCONT);
  waiter.join();
  EXPECT_OK(waited);
  EXPECT_OK(ticket->Wait());
  EXPECT_TRUE(ticket->Poll());
  const std::vector<std::pair<SeqId, blockkv::Status>> done = receiver->CompleteImports();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].first, 7);
  EXPECT_OK(done[0].second);
  EXPECT_EQ(receiver->pending_imports(), 0);
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 11), 0);
  ASSERT_OK(receiver->Schedule({.uids = seven, .lengths = one}));
  ASSERT_OK(receiver->PostForward(seven));
  EXPECT_EQ(receiver->GetSequence(7)->seen_tokens(), 38);
  EXPECT_OK(receiver->CheckInvariants());
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
}

// Two imports started before either finishes (they queue on the endpoint's thread): both
// tracked and pinned meanwhile, both tickets done once the sender runs, and CompleteImports
// commits both with every byte right.
TEST_P(TransferTest, TwoImportsStartedTogetherBothComplete) {
  Peer sender(GetParam());
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> first = sender.MakeAndExport(7, 37, 11);
  const std::vector<std::byte> second = sender.MakeAndExport(9, 21, 12);
  auto receiver = Receiver(GetParam());
  ASSERT_NE(receiver, nullptr);
  sender.Signal(SIGSTOP);
  auto a = receiver->StartImport(first);
  auto b = receiver->StartImport(second);
  ASSERT_OK(a);
  ASSERT_OK(b);
  EXPECT_EQ(receiver->pending_imports(), 2);
  EXPECT_EQ(receiver->n_tracked_sequences(), 2);
  EXPECT_EQ(receiver->free_blocks()[0], 64 - 10 - 6);
  EXPECT_CODE(receiver->StartImport(first), StatusCode::kAlreadyExists);
  for (const SeqId uid : {SeqId{7}, SeqId{9}}) {
    const std::vector<SeqId> uids = {uid};
    const std::vector<int64_t> one = {1};
    EXPECT_CODE(receiver->Schedule({.uids = uids, .lengths = one}),
                StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(receiver->CompleteImports().empty());
  EXPECT_OK(receiver->CheckInvariants());
  sender.Signal(SIGCONT);
  EXPECT_OK(b->Wait());
  EXPECT_OK(a->Wait());
  std::vector<std::pair<SeqId, blockkv::Status>> done = receiver->CompleteImports();
  ASSERT_EQ(done.size(), 2u);
  std::sort(done.begin(), done.end(),
            [](const auto& x, const auto& y) { return x.first < y.first; });
  EXPECT_EQ(done[0].first, 7);
  EXPECT_OK(done[0].second);
  EXPECT_EQ(done[1].first, 9);
  EXPECT_OK(done[1].second);
  EXPECT_EQ(receiver->pending_imports(), 0);
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 7, 11), 0);
  EXPECT_EQ(blockkv_test::PatternMismatches(*receiver, 9, 12), 0);
  EXPECT_OK(receiver->CheckInvariants());
  EXPECT_EQ(sender.Send("state"), "pending 0 tracked 0 free 64");
}

// The engine shuts down with an import in flight: the transfer ends (timed out here) before the
// cache is freed, nothing crashes or hangs, and the sender keeps its sequence.
TEST(TransferTest, DestroyingAManagerWithAnImportInFlightLeavesTheSenderItsSequence) {
  Peer sender("tcp");
  ASSERT_EQ(sender.ready(), "ready");
  const std::vector<std::byte> d = sender.MakeAndExport(7, 37, 4);
  sender.Signal(SIGSTOP);
  blockkv::ImportTicket ticket;
  {
    auto receiver = Receiver("tcp", {}, 500);
    ASSERT_NE(receiver, nullptr);
    auto started = receiver->StartImport(d);
    ASSERT_OK(started);
    ticket = *started;
  }
  EXPECT_TRUE(ticket.Poll());
  EXPECT_CODE(ticket.Wait(), StatusCode::kUnavailable);
  sender.Signal(SIGCONT);
  EXPECT_EQ(sender.Send("state"), "pending 1 tracked 1 free 54");
}

TEST(TransferTest, ExportedSequenceIsPinnedUntilCancelled) {
  auto m = Receiver("tcp");
  ASSERT_NE(m, nullptr);
  const std::vector<SeqId> uids = {1};
  const std::vector<int64_t> lengths = {6};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  ASSERT_OK(m->PostForward(uids));
  ASSERT_OK(m->ExportSequence(1));
  EXPECT_EQ(m->pending_exports(), 1);
  const std::vector<int64_t> one = {1};
  EXPECT_CODE(m->Schedule({.uids = uids, .lengths = one}), StatusCode::kFailedPrecondition);
  EXPECT_CODE(m->FlushSequence(1), StatusCode::kFailedPrecondition);
  EXPECT_CODE(m->Fork(1, 2), StatusCode::kFailedPrecondition);
  EXPECT_CODE(m->Rollback(1, 1), StatusCode::kFailedPrecondition);
  EXPECT_CODE(m->ExportSequence(1), StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->GetSequence(1)->seen_tokens(), 6);
  EXPECT_EQ(m->free_blocks()[0], 62);
  auto cancelled = m->CancelExport(1);
  ASSERT_OK(cancelled);
  EXPECT_EQ(*cancelled, blockkv::CancelledExport::kUnclaimed);
  EXPECT_EQ(m->pending_exports(), 0);
  EXPECT_CODE(m->CancelExport(1), StatusCode::kNotFound);
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = one}));
  EXPECT_OK(m->CheckInvariants());
}

TEST(TransferTest, ExportRefusesTokensInFlightAndUnknownSequences) {
  auto m = Receiver("tcp");
  ASSERT_NE(m, nullptr);
  const std::vector<SeqId> uids = {1};
  const std::vector<int64_t> lengths = {6};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  EXPECT_CODE(m->ExportSequence(1), StatusCode::kFailedPrecondition);
  EXPECT_CODE(m->ExportSequence(2), StatusCode::kNotFound);
  EXPECT_EQ(m->pending_exports(), 0);
}

TEST(TransferTest, WithoutTransferConfigExportAndImportAreFailedPrecondition) {
  blockkv::StateManagerConfig config;
  config.memory_config = {.mode = blockkv::AllocationMode::kAllocate, .size = 8};
  auto m = StateManager::Create(config,
                                {blockkv::KVCacheConfig{.block_size = 4, .cache_shape = {1, 1, 8}}},
                                blockkv::CpuDevice());
  ASSERT_OK(m);
  ASSERT_OK((*m)->GetOrCreateSequence(1));
  auto d = (*m)->ExportSequence(1);
  EXPECT_CODE(d, StatusCode::kFailedPrecondition);
  EXPECT_NE(d.status().message().find("StateManagerConfig.transfer"), std::string::npos);
  EXPECT_CODE((*m)->ImportSequence({}), StatusCode::kFailedPrecondition);
}

TEST(TransferTest, UnknownTransportIsAnErrorAtCreate) {
  auto m = blockkv_test::MakeTransferManager({}, "no_such_transport");
  EXPECT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("StateManagerConfig.transfer"), std::string::npos)
      << m.status();
}

}  // namespace
