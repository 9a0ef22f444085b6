// SPDX-License-Identifier: Apache-2.0
// StateManager::SaveSnapshot / LoadSnapshot: byte-exact round trips of random states, a loaded
// cache that hits and evicts as the saved one did, config mismatches named field by field, file
// errors, and fault injection — every truncation, random flipped bytes, and random changes with
// the checksums recomputed so that they reach the structural checks: each gives kDataLoss or
// kInvalidArgument (or loads a state CheckInvariants accepts), never a crash, and a failed load
// changes nothing.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "blockkv/log.h"
#include "blockkv/state_manager.h"
#include "unit/snapshot_util.h"
#include "unit/test_util.h"

namespace blockkv {
namespace {

using blockkv_test::MakeSnapshotManager;
using blockkv_test::Reseal;
using blockkv_test::SnapshotConfig;
using blockkv_test::SnapshotGroups;
using blockkv_test::SnapshotSections;
using blockkv_test::SnapshotWorkload;
using Bytes = std::vector<std::byte>;

constexpr SeqId kMaxUid = 2000;

// Every manager logs a line per cache group; hundreds are made here.
const bool kQuiet =
    (SetLogLevel(LogLevel::kWarning), true);  // every workload's uids are below this

uint64_t Hash(const void* data, size_t n) { return XXH3_64bits(data, n); }

// Everything about a manager an engine can see, as text (so a difference prints readably).
// Chain ids are internal and renumbered by a load: only their order and equality are shown.
// `exact` adds what a load may change without being observable as state — the contents of free
// blocks, the prefix-cache stats — for checking that a failed load changed nothing at all.
std::string Dump(const StateManager& m, bool exact = false) {
  std::ostringstream os;
  os << "tracked " << m.n_tracked_sequences() << "\n";
  for (int g = 0; g < m.num_groups(); ++g) os << "free[" << g << "] " << m.free_blocks()[g] << "\n";
  for (SeqId uid = 0; uid < kMaxUid; ++uid) {
    const Sequence* seq = m.GetSequence(uid);
    if (seq == nullptr) continue;
    os << "seq " << uid << " slot " << seq->tracking_slot() << " seen " << seq->seen_tokens()
       << " in_flight " << seq->in_flight_tokens() << " cached " << seq->cached_prefix_tokens();
    for (int g = 0; g < m.num_groups(); ++g) {
      os << " | g" << g << " released " << seq->released_blocks(g) << " [";
      for (const BlockId b : seq->block_table(g)) os << b << " ";
      os << "]";
    }
    os << "\n";
  }
  for (int g = 0; g < m.num_groups(); ++g) {
    const BlockPool& pool = m.pool(g);
    const TensorView storage = m.kv_cache().GetGroupStorage(g).value();
    const KVCacheConfig& c = m.kv_cache().config(g);
    const auto layer_block =
        static_cast<size_t>(c.elements_per_layer_block()) * ElementSize(c.cache_dtype);
    const auto* bytes = static_cast<const unsigned char*>(storage.data);
    for (BlockId b = 0; b < pool.num_blocks(); ++b) {
      const bool used = pool.ref_count(b) > 0 || pool.is_cached(b);
      if (!used && !exact) continue;
      os << "g" << g << " block " << b << " refs " << pool.ref_count(b);
      if (pool.is_cached(b)) os << " cached p" << pool.priority(b);
      os << " contents";
      for (int64_t layer = 0; layer < c.num_caches(); ++layer) {
        os << " " << std::hex
           << Hash(bytes + (static_cast<size_t>(layer) * static_cast<size_t>(pool.num_blocks()) +
                            static_cast<size_t>(b)) *
                               layer_block,
                   layer_block)
           << std::dec;
      }
      os << "\n";
    }
    os << "g" << g << " eviction order:";
    pool.ForEachEvictable([&](BlockId b) { os << " " << b; });
    os << "\n";
    if (m.prefix_cache() == nullptr) continue;
    std::vector<PrefixCache::CachedBlock> cached = m.prefix_cache()->CachedBlocks(g);
    std::vector<uint64_t> ids;
    for (const auto& b : cached) ids.insert(ids.end(), {b.chain_id, b.parent_id});
    std::sort(ids.begin(), ids.end());
    auto rank = [&](uint64_t id) {
      return std::lower_bound(ids.begin(), ids.end(), id) - ids.begin();
    };
    os << "g" << g << " index (restore order):";
    for (const auto& b : cached) os << " " << b.block;
    os << "\n";
    for (const auto& b : cached) {
      os << "g" << g << " cached " << b.block << " key " << ToString(b.key) << " parent "
         << ToString(b.parent_key) << " chain " << rank(b.chain_id) << " after "
         << rank(b.parent_id) << " adapter " << b.adapter_id << " ns '" << b.ns << "' bytes '"
         << b.bytes << "' tokens";
      for (const TokenId t : b.tokens) os << " " << t;
      os << "\n";
    }
  }
  if (exact) {
    for (int g = 0; g < m.num_groups(); ++g) {
      const TensorView s = m.kv_cache().GetGroupStorage(g).value();
      os << "storage " << g << " "
         << Hash(s.data, static_cast<size_t>(s.numel()) * ElementSize(s.dtype)) << "\n";
    }
    if (m.prefix_cache() != nullptr) {
      const PrefixCacheStats st = m.prefix_cache()->total_stats();
      os << "stats " << st.lookups << " " << st.queried_tokens << " " << st.hit_tokens << " "
         << st.evictions << "\n";
    }
  }
  return os.str();
}

// The keys of `blocks` (released entries skipped).
std::vector<std::string> Keys(const StateManager& m, int g, std::span<const BlockId> blocks) {
  std::map<BlockId, std::string> key_of;
  for (const auto& c : m.prefix_cache()->CachedBlocks(g)) key_of[c.block] = ToString(c.key);
  std::vector<std::string> keys;
  for (const BlockId b : blocks) {
    if (b != kNoBlock) keys.push_back(key_of.count(b) != 0 ? key_of[b] : "not cached");
  }
  return keys;
}

Bytes Save(const StateManager& m) {
  Result<Bytes> bytes = m.SaveSnapshot();
  EXPECT_OK(bytes);
  return bytes.ok() ? *bytes : Bytes{};
}

// A manager after a random workload, its contents random.
std::unique_ptr<StateManager> RandomState(uint64_t seed, int steps = 200,
                                          StateManagerConfig config = SnapshotConfig()) {
  auto m = MakeSnapshotManager(std::move(config));
  SnapshotWorkload w(*m, seed);
  w.Run(steps);
  w.FillContents();
  EXPECT_OK(m->CheckInvariants());
  return m;
}

// ---- round trips ------------------------------------------------------------------------------

TEST(SnapshotTest, RoundTripOfRandomStatesIsByteExact) {
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    auto a = RandomState(seed);
    const Bytes bytes = Save(*a);
    // The target is busy with other work, which the load replaces.
    auto b = RandomState(seed + 1000, 100);
    ASSERT_OK(b->LoadSnapshot(bytes));
    ASSERT_OK(b->CheckInvariants());
    EXPECT_EQ(Dump(*b), Dump(*a));
    EXPECT_EQ(Save(*b), bytes);
  }
}

TEST(SnapshotTest, RoundTripWithoutPrefixCachingAndOfAnEmptyManager) {
  auto a = RandomState(5, 200, SnapshotConfig(/*prefix=*/false));
  auto b = MakeSnapshotManager(SnapshotConfig(/*prefix=*/false));
  ASSERT_OK(b->LoadSnapshot(Save(*a)));
  ASSERT_OK(b->CheckInvariants());
  EXPECT_EQ(Dump(*b), Dump(*a));
  EXPECT_EQ(Save(*b), Save(*a));

  auto empty = MakeSnapshotManager();
  auto c = RandomState(6);
  ASSERT_OK(c->LoadSnapshot(Save(*empty)));
  ASSERT_OK(c->CheckInvariants());
  EXPECT_EQ(c->n_tracked_sequences(), 0);
  EXPECT_EQ(c->free_blocks(), empty->free_blocks());
  EXPECT_EQ(Save(*c), Save(*empty));
}

// The state after a load is a function of the snapshot alone (free blocks and slots are handed
// out lowest first), so two managers loaded from one snapshot go on identically.
TEST(SnapshotTest, OneSnapshotLoadedTwiceHasOneFuture) {
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    const Bytes bytes = Save(*RandomState(seed));
    auto b = RandomState(seed + 100, 50);
    auto c = RandomState(seed + 200, 150);
    ASSERT_OK(b->LoadSnapshot(bytes));
    ASSERT_OK(c->LoadSnapshot(bytes));
    SnapshotWorkload wb(*b, seed * 7, /*first_uid=*/1000);
    SnapshotWorkload wc(*c, seed * 7, /*first_uid=*/1000);
    wb.Run(200);
    wc.Run(200);
    wb.FillContents();  // blocks that were free in the snapshot hold whatever they held before
    wc.FillContents();
    ASSERT_OK(b->CheckInvariants());
    EXPECT_EQ(Dump(*b), Dump(*c)) << "seed " << seed;
  }
}

// The same prompts hit the same blocks, and forced evictions take the same keys in the same
// order, in the saved manager and in the loaded one.
TEST(SnapshotTest, LoadedCacheHitsAndEvictsLikeTheSavedOne) {
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    auto a = RandomState(seed, 300);
    auto b = MakeSnapshotManager();
    ASSERT_OK(b->LoadSnapshot(Save(*a)));
    a->DrainCacheEvents();
    b->DrainCacheEvents();
    SnapshotWorkload prompts(*a, seed + 5);
    for (SeqId uid = 1500; uid < 1510; ++uid) {
      // Room for the probe: flush the oldest live sequence of both, as an engine would.
      if (a->n_tracked_sequences() == SnapshotConfig().max_tracked_sequences) {
        for (SeqId old = 0; old < kMaxUid; ++old) {
          if (a->GetSequence(old) == nullptr) continue;
          ASSERT_OK(a->FlushSequence(old));
          ASSERT_OK(b->FlushSequence(old));
          break;
        }
      }
      const std::vector<TokenId> prompt = prompts.Prompt();
      const SeqId uids[] = {uid};
      const int64_t lengths[] = {static_cast<int64_t>(prompt.size())};
      for (StateManager* m : {a.get(), b.get()}) {
        ASSERT_OK(m->AddSequence(uid, prompt));
        const Status s = m->Schedule({.uids = uids, .lengths = lengths});
        if (s.ok()) {
          ASSERT_OK(m->PostForward(uids));
        }
      }
      const Sequence* sa = a->GetSequence(uid);
      const Sequence* sb = b->GetSequence(uid);
      ASSERT_EQ(sa->cached_prefix_tokens(), sb->cached_prefix_tokens()) << "probe " << uid;
      for (int g = 0; g < a->num_groups(); ++g) {
        // The hit's blocks hold the same keys. (The first probe hits the very same blocks; later
        // ones may hit blocks an earlier probe took fresh, and the order in which free blocks
        // are handed out is not part of a snapshot.)
        const auto hit = static_cast<size_t>(sa->cached_prefix_tokens() / a->kv_block_size(g));
        const auto ta = sa->block_table(g).first(hit);
        const auto tb = sb->block_table(g).first(hit);
        if (uid == 1500) {
          ASSERT_TRUE(std::equal(ta.begin(), ta.end(), tb.begin())) << "group " << g;
        }
        ASSERT_EQ(Keys(*a, g, ta), Keys(*b, g, tb)) << "probe " << uid << " group " << g;
      }
      std::vector<std::string> removed[2];
      int i = 0;
      for (StateManager* m : {a.get(), b.get()}) {
        for (const CacheEvent& e : m->DrainCacheEvents().events) {
          if (const auto* r = std::get_if<BlockRemoved>(&e)) {
            removed[i].push_back(ToString(r->hash) + "/" + std::to_string(r->group));
          }
        }
        ++i;
      }
      EXPECT_EQ(removed[0], removed[1]) << "probe " << uid;
    }
  }
}

TEST(SnapshotTest, LoadQueuesAllClearedThenEveryCachedKey) {
  auto a = RandomState(3, 300);
  auto b = RandomState(4, 100);
  b->DrainCacheEvents();
  ASSERT_OK(b->LoadSnapshot(Save(*a)));
  const CacheEventBatch batch = b->DrainCacheEvents();
  ASSERT_FALSE(batch.events.empty());
  EXPECT_TRUE(std::holds_alternative<AllCleared>(batch.events.front()));
  std::set<std::string> stored;
  for (size_t i = 1; i < batch.events.size(); ++i) {
    const auto* s = std::get_if<BlockStored>(&batch.events[i]);
    ASSERT_NE(s, nullptr) << "event " << i;
    stored.insert(ToString(s->hash) + "/" + std::to_string(s->group));
  }
  std::set<std::string> keys;
  for (int g = 0; g < a->num_groups(); ++g) {
    for (const auto& c : a->prefix_cache()->CachedBlocks(g)) {
      keys.insert(ToString(c.key) + "/" + std::to_string(g));
    }
  }
  EXPECT_EQ(stored, keys);
}

// ---- what Save refuses ------------------------------------------------------------------------

TEST(SnapshotTest, SaveRefusesWhileTokensAreInFlight) {
  auto m = MakeSnapshotManager();
  const std::vector<TokenId> prompt = {1, 2, 3, 4, 5};
  ASSERT_OK(m->AddSequence(42, prompt));
  const SeqId uids[] = {42};
  const int64_t lengths[] = {5};
  ASSERT_OK(m->Schedule({.uids = uids, .lengths = lengths}));
  const Result<Bytes> bytes = m->SaveSnapshot();
  ASSERT_CODE(bytes, StatusCode::kFailedPrecondition);
  EXPECT_NE(bytes.status().message().find("sequence 42 has 5 tokens in flight"), std::string::npos)
      << bytes.status();
  ASSERT_OK(m->PostForward(uids));
  EXPECT_OK(m->SaveSnapshot());
}

BlockHash ZeroHash(std::span<const std::byte>, uint64_t) { return {}; }

TEST(SnapshotTest, CustomHashFunctionIsRefused) {
  StateManagerConfig custom = SnapshotConfig();
  custom.prefix_cache.hash_function = ZeroHash;
  auto m = MakeSnapshotManager(custom);
  ASSERT_CODE(m->SaveSnapshot(), StatusCode::kFailedPrecondition);
  const Status s = m->LoadSnapshot(Save(*MakeSnapshotManager()));
  ASSERT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("prefix_cache.hash_function: expected custom"), std::string::npos)
      << s;
}

// ---- config mismatches ------------------------------------------------------------------------

TEST(SnapshotTest, EachConfigMismatchIsInvalidArgumentNamingTheFieldAndChangesNothing) {
  const Bytes bytes = Save(*RandomState(11));
  struct Case {
    const char* message;  // expected in the status
    std::function<void(StateManagerConfig&, std::vector<KVCacheConfig>&)> change;
  };
  const Case cases[] = {
      {"the number of cache groups: expected 1 (this manager), found 2",
       [](auto& c, auto& g) {
         g.pop_back();
         c.prefix_cache.sliding_windows = {0};
       }},
      {"cache group 1 block_size: expected 8 (this manager), found 4",
       [](auto&, auto& g) { g[1].block_size = 8; }},
      {"cache group 0 cache_shape[1]: expected 2 (this manager), found 1",
       [](auto&, auto& g) { g[0].cache_shape[1] = 2; }},
      {"cache group 1 cache_dtype: expected bf16 (this manager), found fp32",
       [](auto&, auto& g) { g[1].cache_dtype = DType::kBFloat16; }},
      {"cache group 0 max_blocks_per_allocation_group: expected 40 (this manager), found 32",
       [](auto&, auto& g) { g[0].max_blocks_per_allocation_group = 40; }},
      {"cache group 0 num_blocks: expected 41 (this manager), found 40",
       [](auto& c, auto&) { c.memory_config.size = 41; }},
      {"max_tracked_sequences: expected 9 (this manager), found 8",
       [](auto& c, auto&) { c.max_tracked_sequences = 9; }},
      {"max_context: expected 60 (this manager), found 64",
       [](auto& c, auto&) { c.max_context = 60; }},
      {"prefix_cache.enabled: expected off (this manager), found on",
       [](auto& c, auto&) { c.prefix_cache.enabled = false; }},
      {"prefix_cache.hash_seed: expected 8 (this manager), found 7",
       [](auto& c, auto&) { c.prefix_cache.hash_seed = 8; }},
      {"prefix_cache.sliding_windows[1]: expected 0 (this manager), found 8",
       [](auto& c, auto&) { c.prefix_cache.sliding_windows = {0}; }},
  };
  for (const Case& c : cases) {
    StateManagerConfig config = SnapshotConfig();
    std::vector<KVCacheConfig> groups = SnapshotGroups();
    c.change(config, groups);
    auto m = MakeSnapshotManager(config, groups);
    SnapshotWorkload(*m, 3).Run(50);
    const std::string before = Dump(*m, /*exact=*/true);
    const Status s = m->LoadSnapshot(bytes);
    ASSERT_CODE(s, StatusCode::kInvalidArgument) << c.message;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
    EXPECT_EQ(Dump(*m, /*exact=*/true), before) << c.message;
  }
}

// ---- files ------------------------------------------------------------------------------------

class SnapshotFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "snapshot_test.XXXXXX";
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override {
    for (const char* name : {"/a.snap", "/a.snap.tmp"}) ::unlink((dir_ + name).c_str());
    ::rmdir(dir_.c_str());
  }
  static Bytes ReadAll(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    Bytes bytes(chars.size());
    std::memcpy(bytes.data(), chars.data(), chars.size());
    return bytes;
  }
  static bool Exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

  std::string dir_;
};

TEST_F(SnapshotFileTest, SaveWritesTheInMemoryBytesAtomicallyAndLoadReadsThem) {
  auto a = RandomState(21);
  const std::string path = dir_ + "/a.snap";
  ASSERT_OK(MakeSnapshotManager()->SaveSnapshot(path));  // an older snapshot, replaced
  ASSERT_OK(a->SaveSnapshot(path));
  EXPECT_EQ(ReadAll(path), Save(*a));
  EXPECT_FALSE(Exists(path + ".tmp"));
  auto b = MakeSnapshotManager();
  ASSERT_OK(b->LoadSnapshot(path));
  ASSERT_OK(b->CheckInvariants());
  EXPECT_EQ(Dump(*b), Dump(*a));
}

// A save killed part-way (kill -9) leaves path.tmp, as large as the snapshot. The next load or
// save of the path removes it, even one that then fails.
TEST_F(SnapshotFileTest, AStaleTmpOfAKilledSaveIsRemovedWhenASaveOrLoadStarts) {
  const std::string path = dir_ + "/a.snap";
  const std::string tmp = path + ".tmp";
  auto a = RandomState(24, 50);
  ASSERT_OK(a->SaveSnapshot(path));
  const Bytes saved = ReadAll(path);
  const auto leave_stale = [&] {
    std::ofstream(tmp, std::ios::binary) << std::string(saved.size() / 2, 'x');
    ASSERT_TRUE(Exists(tmp));
  };
  leave_stale();
  auto b = MakeSnapshotManager();
  ASSERT_OK(b->LoadSnapshot(path));
  EXPECT_FALSE(Exists(tmp));
  EXPECT_EQ(Dump(*b), Dump(*a));
  leave_stale();
  ASSERT_OK(a->SaveSnapshot(path));
  EXPECT_FALSE(Exists(tmp));
  EXPECT_EQ(ReadAll(path), saved);
  // A save refused before it writes (tokens in flight) still removes it, and keeps the snapshot.
  leave_stale();
  auto c = MakeSnapshotManager();
  const std::vector<TokenId> prompt = {1, 2, 3, 4, 5};
  ASSERT_OK(c->AddSequence(42, prompt));
  const SeqId uids[] = {42};
  const int64_t lengths[] = {5};
  ASSERT_OK(c->Schedule({.uids = uids, .lengths = lengths}));
  EXPECT_CODE(c->SaveSnapshot(path), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(Exists(tmp));
  EXPECT_EQ(ReadAll(path), saved);
  // And a load that fails (of a missing file) too.
  leave_stale();
  EXPECT_CODE(MakeSnapshotManager()->LoadSnapshot(dir_ + "/missing.snap"), StatusCode::kNotFound);
  EXPECT_TRUE(Exists(tmp));  // another path's tmp is left alone
  const std::string missing_tmp = dir_ + "/missing.snap.tmp";
  std::ofstream(missing_tmp) << "x";
  EXPECT_CODE(MakeSnapshotManager()->LoadSnapshot(dir_ + "/missing.snap"), StatusCode::kNotFound);
  EXPECT_FALSE(Exists(missing_tmp));
}

TEST_F(SnapshotFileTest, MissingFileIsNotFoundAndADirectoryIsInvalidArgument) {
  auto m = RandomState(22, 50);
  const std::string before = Dump(*m, /*exact=*/true);
  const Status missing = m->LoadSnapshot(dir_ + "/none.snap");
  EXPECT_CODE(missing, StatusCode::kNotFound);
  EXPECT_NE(missing.message().find(dir_ + "/none.snap"), std::string::npos) << missing;
  EXPECT_CODE(m->LoadSnapshot(dir_), StatusCode::kInvalidArgument);
  EXPECT_EQ(Dump(*m, /*exact=*/true), before);
}

// Root may write anywhere but a read-only sysfs directory; /sys is mounted on every machine
// these tests run on (a test that cannot reach the case fails rather than skips).
TEST_F(SnapshotFileTest, SaveWhereWritingIsNotAllowedIsPermissionDenied) {
  const std::string path = "/sys/devices/system/cpu/blockkv.snap";
  auto m = RandomState(24, 50);
  const std::string before = Dump(*m, /*exact=*/true);
  const Status s = m->SaveSnapshot(path);
  ASSERT_CODE(s, StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find(path + ".tmp"), std::string::npos) << s;
  EXPECT_EQ(Dump(*m, /*exact=*/true), before);
}

TEST_F(SnapshotFileTest, SaveIntoAMissingDirectoryIsNotFoundNamingThePath) {
  const std::string path = dir_ + "/no/such/dir/a.snap";
  const Status s = RandomState(23, 50)->SaveSnapshot(path);
  ASSERT_CODE(s, StatusCode::kNotFound);
  EXPECT_NE(s.message().find(path + ".tmp"), std::string::npos) << s;
  EXPECT_NE(s.message().find("No such file or directory"), std::string::npos) << s;
}

// A write that fails part-way (here the file-size limit, as a full disk would) is reported with
// the path and errno's text, leaves no .tmp file, and leaves an older snapshot at the path as it
// was.
TEST_F(SnapshotFileTest, WriteErrorLeavesNoPartialFileAndKeepsTheOldOne) {
  const std::string path = dir_ + "/a.snap";
  auto old = MakeSnapshotManager();
  ASSERT_OK(old->SaveSnapshot(path));
  const Bytes old_bytes = ReadAll(path);
  auto m = RandomState(24);
  ASSERT_GT(Save(*m).size(), old_bytes.size() + 1024);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = old_bytes.size() + 1024;
  struct sigaction ignore {};
  struct sigaction previous {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &previous), 0);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const Status s = m->SaveSnapshot(path);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  ASSERT_EQ(::sigaction(SIGXFSZ, &previous, nullptr), 0);
  ASSERT_CODE(s, StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find(path + ".tmp"), std::string::npos) << s;
  EXPECT_NE(s.message().find("File too large"), std::string::npos) << s;
  EXPECT_FALSE(Exists(path + ".tmp"));
  EXPECT_EQ(ReadAll(path), old_bytes);
}

// ---- corrupt snapshots ------------------------------------------------------------------------

// A small snapshot (the fuzzer's seed state) and a manager in another state to load it into.
class SnapshotFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto source = MakeSnapshotManager();
    SnapshotWorkload w(*source, 77);
    w.Run(40);
    w.FillContents();
    good_ = Save(*source);
    target_ = RandomState(78, 60);
    before_ = Save(*target_);
    before_dump_ = Dump(*target_, /*exact=*/true);
  }

  Bytes good_;
  std::unique_ptr<StateManager> target_;
  Bytes before_;
  std::string before_dump_;
};

TEST_F(SnapshotFaultTest, EveryTruncationIsDataLossAndChangesNothing) {
  for (size_t n = 0; n < good_.size(); ++n) {
    ASSERT_CODE(target_->LoadSnapshot(std::span(good_).first(n)), StatusCode::kDataLoss)
        << "length " << n;
    ASSERT_EQ(Save(*target_), before_) << "length " << n;
  }
  Bytes longer = good_;
  longer.push_back(std::byte{0});
  EXPECT_CODE(target_->LoadSnapshot(longer), StatusCode::kDataLoss);
  EXPECT_EQ(Dump(*target_, /*exact=*/true), before_dump_);
}

TEST_F(SnapshotFaultTest, FlippedBytesAreDataLossAndChangeNothing) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 5000; ++i) {
    Bytes bad = good_;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      bad[rng() % bad.size()] ^= static_cast<std::byte>(1 + rng() % 255);
    }
    ASSERT_CODE(target_->LoadSnapshot(bad), StatusCode::kDataLoss) << "try " << i;
    ASSERT_EQ(Save(*target_), before_) << "try " << i;
  }
  EXPECT_EQ(Dump(*target_, /*exact=*/true), before_dump_);
}

// Changes made with the checksums recomputed reach the structural checks: each load fails with
// kDataLoss or kInvalidArgument and changes nothing, or loads a state CheckInvariants accepts
// and that saves and loads again byte for byte.
TEST_F(SnapshotFaultTest, ResealedChangesFailCleanlyOrLoadAConsistentState) {
  std::mt19937_64 rng(2);
  const auto sections = SnapshotSections(good_);
  ASSERT_EQ(sections.size(), 4u);
  int loaded = 0;
  int data_loss = 0;
  int invalid = 0;
  for (int i = 0; i < 5000; ++i) {
    Bytes bad = good_;
    // A byte of one section's payload: most checks are about those. CONF, SEQS and PRFX are
    // picked as often as BLKS, whose bytes are mostly block contents.
    const auto& [at, length] = sections[rng() % sections.size()];
    const size_t p = at + rng() % length;
    switch (rng() % 4) {
      case 0:
        bad[p] ^= static_cast<std::byte>(1u << (rng() % 8));
        break;
      case 1:
        bad[p] = static_cast<std::byte>(std::to_integer<unsigned>(bad[p]) + 1);
        break;
      case 2:
        bad[p] = std::byte{0};
        break;
      default:
        bad[p] = std::byte{0xff};
        break;
    }
    Reseal(bad);
    const Status s = target_->LoadSnapshot(bad);
    if (s.ok()) {
      ++loaded;
      ASSERT_OK(target_->CheckInvariants()) << "try " << i;
      const Bytes again = Save(*target_);
      ASSERT_OK(target_->LoadSnapshot(again)) << "try " << i;
      ASSERT_EQ(Save(*target_), again) << "try " << i;
      ASSERT_OK(target_->LoadSnapshot(before_));
      continue;
    }
    ASSERT_TRUE(s.code() == StatusCode::kDataLoss || s.code() == StatusCode::kInvalidArgument)
        << "try " << i << ": " << s;
    ++(s.code() == StatusCode::kDataLoss ? data_loss : invalid);
    ASSERT_EQ(Save(*target_), before_) << "try " << i << ": " << s;
  }
  // Block contents and many values load; structural damage and config fields do not.
  EXPECT_GT(loaded, 100);
  EXPECT_GT(data_loss, 100);
  EXPECT_GT(invalid, 10);
}

// Structural damage of each kind the loader names, made at known places of a known state.
TEST(SnapshotCorruptionTest, EachStructuralErrorIsDataLossNamingIt) {
  auto source = MakeSnapshotManager();
  const std::vector<TokenId> shared = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<TokenId> longer = {1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52, 53, 54};
  for (const SeqId uid : {1000, 2000, 3000}) {  // slots 0, 1, 2
    const std::vector<TokenId>& prompt = uid == 3000 ? longer : shared;
    ASSERT_OK(source->AddSequence(uid, prompt));
    const SeqId uids[] = {uid};
    const int64_t lengths[] = {std::ssize(prompt)};
    ASSERT_OK(source->Schedule({.uids = uids, .lengths = lengths}));
    ASSERT_OK(source->PostForward(uids));
  }
  ASSERT_OK(source->FlushSequence(3000));  // its own full blocks: cached, evictable
  ASSERT_GT(source->pool(0).evictable_blocks(), 0);
  const Bytes good = Save(*source);
  const auto sections = SnapshotSections(good);
  ASSERT_EQ(sections.size(), 4u);
  const size_t blks = sections[1].first;
  const size_t seqs = sections[2].first;
  const size_t prfx = sections[3].first;
  BlockId free_block = 0;
  while (source->pool(0).ref_count(free_block) > 0 || source->pool(0).is_cached(free_block)) {
    ++free_block;
  }
  const BlockId held = source->GetSequence(1000)->block_table(0)[0];
  auto put32 = [](Bytes& b, size_t at, int32_t v) { std::memcpy(b.data() + at, &v, 4); };
  auto put64 = [](Bytes& b, size_t at, int64_t v) { std::memcpy(b.data() + at, &v, 8); };
  // The first SEQS record: uid (8), slot (4), seen (8), cached (8); group 0: allocated (4),
  // released (4), then its table.
  const size_t first = seqs + 8;
  // PRFX: the chain id count (8); group 0: its cached block count (8), 88-byte records (80 +
  // two tokens), the evictable count (8), the eviction order.
  uint64_t cached0 = 0;
  std::memcpy(&cached0, good.data() + prfx + 8, 8);
  const size_t order0 = prfx + 16 + cached0 * 88 + 8;
  struct Case {
    const char* message;
    std::function<void(Bytes&)> edit;
  };
  const Case cases[] = {
      {"not a blockkv snapshot", [](Bytes& b) { b[0] = std::byte{'X'}; }},
      {"format version 3; this build reads version 2", [](Bytes& b) { b[8] = std::byte{3}; }},
      {"byte-order mark 0x0000000004030201", [&](Bytes& b) { put32(b, 12, 0x04030201); }},
      {"block id 40 of cache group 0 is outside [0, 40)",
       [&](Bytes& b) { put32(b, blks + 16, 40); }},
      {"the sequence count is 9, more than the limit 8", [&](Bytes& b) { put64(b, seqs, 9); }},
      {"uid 2000 appears twice", [&](Bytes& b) { put64(b, first, 2000); }},
      {"tracking slot 8 is outside [0, 8)", [&](Bytes& b) { put32(b, first + 8, 8); }},
      {"seen tokens, outside [0, 64]", [&](Bytes& b) { put64(b, first + 12, 65); }},
      {"a block the blocks section does not hold",
       [&](Bytes& b) { put32(b, first + 36, free_block); }},
      {"not kNoBlock (released)", [&](Bytes& b) { put32(b, first + 32, 1); }},
      {"is not an unreferenced cached block", [&](Bytes& b) { put32(b, order0, held); }},
      {"more than the", [&](Bytes& b) { put64(b, prfx, 1000); }},
      {"cache group 0 lists 0 evictable blocks; 2 cached blocks are unreferenced",
       [&](Bytes& b) { put64(b, order0 - 8, 0); }},
  };
  auto target = RandomState(31, 80);
  const std::string before = Dump(*target, /*exact=*/true);
  for (const Case& c : cases) {
    Bytes bad = good;
    c.edit(bad);
    Reseal(bad);
    const Status s = target->LoadSnapshot(bad);
    ASSERT_CODE(s, StatusCode::kDataLoss) << c.message;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
    EXPECT_NE(s.message().find("offset"), std::string::npos) << s;
  }
  EXPECT_EQ(Dump(*target, /*exact=*/true), before);
  ASSERT_OK(target->LoadSnapshot(good));  // the unchanged snapshot loads
}

// ---- devices and offload ----------------------------------------------------------------------

// Host memory whose copies fail on demand: a device error in the middle of a save or a load.
class FaultyDevice : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int ordinal() const override { return 0; }
  std::string name() const override { return "faulty"; }
  int64_t total_memory() const override { return 64 << 20; }
  int64_t available_memory() const override { return 64 << 20; }
  Result<DeviceBuffer> Allocate(int64_t bytes) override {
    const auto rounded = static_cast<size_t>((bytes + 255) / 256 * 256);
    return MakeBuffer(std::aligned_alloc(256, rounded == 0 ? 256 : rounded), bytes);
  }
  void EmptyCache() override {}
  Status CopyFromHost(void* dst, const void* src, int64_t bytes) override {
    if (fail_) return InternalError("injected copy failure");
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return Status::Ok();
  }
  Status CopyToHost(void* dst, const void* src, int64_t bytes) override {
    return CopyFromHost(dst, src, bytes);
  }
  bool fail_ = false;

 protected:
  void Deallocate(void* data, int64_t) override { std::free(data); }
};

TEST(SnapshotDeviceTest, DeviceErrorsFailSaveCleanlyAndEmptyTheManagerOnLoad) {
  auto device = std::make_shared<FaultyDevice>();
  auto m = std::move(StateManager::Create(SnapshotConfig(), SnapshotGroups(), device).value());
  SnapshotWorkload w(*m, 41);
  w.Run(150);
  w.FillContents();
  const Bytes good = Save(*m);
  ASSERT_GT(m->n_tracked_sequences(), 0);

  device->fail_ = true;
  const Result<Bytes> saved = m->SaveSnapshot();
  ASSERT_CODE(saved, StatusCode::kInternal);
  EXPECT_NE(saved.status().message().find("injected copy failure"), std::string::npos);
  const std::string path = ::testing::TempDir() + "snapshot_device_test.snap";
  EXPECT_CODE(m->SaveSnapshot(path), StatusCode::kInternal);
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  EXPECT_NE(::access((path + ".tmp").c_str(), F_OK), 0);

  const Status loaded = m->LoadSnapshot(good);
  ASSERT_CODE(loaded, StatusCode::kInternal);
  EXPECT_NE(loaded.message().find("emptied"), std::string::npos) << loaded;
  EXPECT_EQ(m->n_tracked_sequences(), 0);
  EXPECT_EQ(m->prefix_cache()->cached_blocks(0), 0);
  ASSERT_OK(m->CheckInvariants());

  device->fail_ = false;
  ASSERT_OK(m->LoadSnapshot(good));
  EXPECT_EQ(Save(*m), good);
}

TEST(SnapshotOffloadTest, SaveRefusesAPreemptedSequenceAndALoadReplacesIt) {
  StateManagerConfig config = SnapshotConfig();
  config.offload = true;
  config.offload_config.host_blocks = 40;
  auto m = MakeSnapshotManager(config);
  SnapshotWorkload w(*m, 9);
  w.Run(100);
  ASSERT_FALSE(w.live().empty());
  const SeqId uid = w.live().front();
  Result<OffloadTicket> ticket = m->PreemptSequence(uid);  // not waited for: copies in flight
  ASSERT_OK(ticket);
  const Result<Bytes> refused = m->SaveSnapshot();
  ASSERT_CODE(refused, StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("is preempted"), std::string::npos) << refused.status();

  auto a = RandomState(10);
  ASSERT_OK(m->LoadSnapshot(Save(*a)));
  ASSERT_OK(m->CheckInvariants());
  EXPECT_EQ(Dump(*m), Dump(*a));
  EXPECT_EQ(Save(*m), Save(*a));
}

}  // namespace
}  // namespace blockkv
