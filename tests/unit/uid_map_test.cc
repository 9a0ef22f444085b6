// SPDX-License-Identifier: Apache-2.0
// UidMap (src/internal/uid_map.h) on its own: lookups, backward-shift deletion across wrapped
// probe runs, and a random program of operations against std::unordered_map.
#include "internal/uid_map.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <unordered_map>
#include <vector>

namespace blockkv::internal {
namespace {

// Every (key, value) the map holds, by ForEach.
std::map<int64_t, int32_t> Contents(const UidMap& map) {
  std::map<int64_t, int32_t> out;
  map.ForEach([&](int64_t key, int32_t value) { out.emplace(key, value); });
  return out;
}

TEST(UidMapTest, EmptyMapFindsNothing) {
  const UidMap map(4);
  EXPECT_EQ(map.size(), 0);
  EXPECT_EQ(map.Find(0), UidMap::kAbsent);
  EXPECT_EQ(map.Find(-1), UidMap::kAbsent);
  EXPECT_EQ(map.reader().Find(7), UidMap::kAbsent);
  EXPECT_TRUE(Contents(map).empty());
}

TEST(UidMapTest, FindsWhatWasInsertedAndNothingElse) {
  UidMap map(4);
  map.Insert(7, 0);
  map.Insert(-3, 1);
  map.Insert(std::numeric_limits<int64_t>::max(), 2);
  map.Insert(std::numeric_limits<int64_t>::min(), 3);
  EXPECT_EQ(map.size(), 4);
  EXPECT_EQ(map.Find(7), 0);
  EXPECT_EQ(map.Find(-3), 1);
  EXPECT_EQ(map.Find(std::numeric_limits<int64_t>::max()), 2);
  EXPECT_EQ(map.Find(std::numeric_limits<int64_t>::min()), 3);
  EXPECT_EQ(map.Find(8), UidMap::kAbsent);
  EXPECT_EQ(map.Find(0), UidMap::kAbsent);
  const UidMap::Reader reader = map.reader();
  EXPECT_EQ(reader.Find(-3), 1);
  EXPECT_EQ(reader.Find(6), UidMap::kAbsent);
  map.Prefetch(7);  // only a hint: nothing changes
  reader.Prefetch(8);
  EXPECT_EQ(Contents(map), (std::map<int64_t, int32_t>{{std::numeric_limits<int64_t>::min(), 3},
                                                       {-3, 1},
                                                       {7, 0},
                                                       {std::numeric_limits<int64_t>::max(), 2}}));
}

TEST(UidMapTest, EraseKeepsTheOtherKeysFindable) {
  UidMap map(8);
  for (int32_t i = 0; i < 8; ++i) map.Insert(i, i);
  map.Erase(3);
  map.Erase(0);
  EXPECT_EQ(map.size(), 6);
  EXPECT_EQ(map.Find(3), UidMap::kAbsent);
  EXPECT_EQ(map.Find(0), UidMap::kAbsent);
  for (int32_t i : {1, 2, 4, 5, 6, 7}) EXPECT_EQ(map.Find(i), i) << "key " << i;
}

TEST(UidMapTest, ErasedKeyCanBeInsertedAgainWithAnotherValue) {
  UidMap map(1);
  map.Insert(42, 0);
  map.Erase(42);
  EXPECT_EQ(map.size(), 0);
  map.Insert(42, 5);
  EXPECT_EQ(map.Find(42), 5);
  EXPECT_EQ(map.size(), 1);
}

// Keys that all hash to the same home slot: one long probe run, wrapping past the table's end
// when the home is near it. Erasing from its middle must shift the later ones back so that
// each stays findable.
TEST(UidMapTest, EraseFromACollidingRunThatWrapsAroundTheTable) {
  // max_entries 7 → 16 entries (shift 60): keys whose product with the Fibonacci constant has
  // the same top four bits share a home. Found by search rather than written out.
  constexpr int kEntries = 16;
  const auto home = [](int64_t key) {
    return static_cast<int>((static_cast<uint64_t>(key) * 0x9e3779b97f4a7c15ULL) >> 60);
  };
  std::vector<int64_t> keys;
  for (int64_t key = 0; keys.size() < 6; ++key) {
    if (home(key) == kEntries - 2) keys.push_back(key);  // runs over slots 14, 15, 0, 1, 2, 3
  }
  UidMap map(7);
  for (size_t i = 0; i < keys.size(); ++i) map.Insert(keys[i], static_cast<int32_t>(i));
  map.Erase(keys[1]);  // a hole at 15, before the wrap
  map.Erase(keys[3]);  // a hole after the wrap
  for (size_t i = 0; i < keys.size(); ++i) {
    const int32_t want = i == 1 || i == 3 ? UidMap::kAbsent : static_cast<int32_t>(i);
    EXPECT_EQ(map.Find(keys[i]), want) << "key " << keys[i];
  }
  EXPECT_EQ(map.size(), 4);
}

TEST(UidMapTest, HoldsMaxEntriesConsecutiveUids) {
  constexpr int32_t kMax = 2048;
  UidMap map(kMax);
  for (int32_t i = 0; i < kMax; ++i) map.Insert(i, kMax - 1 - i);
  EXPECT_EQ(map.size(), kMax);
  for (int32_t i = 0; i < kMax; ++i) ASSERT_EQ(map.Find(i), kMax - 1 - i);
  EXPECT_EQ(map.Find(kMax), UidMap::kAbsent);
}

// A random program of inserts, erases and finds at up to full capacity, against
// std::unordered_map; keys from a small range so that erased keys come back.
TEST(UidMapTest, RandomOperationsMatchAReferenceMap) {
  constexpr int32_t kMax = 64;
  std::mt19937_64 rng(20261204);
  for (int round = 0; round < 20; ++round) {
    UidMap map(kMax);
    std::unordered_map<int64_t, int32_t> model;
    std::uniform_int_distribution<int64_t> key_of(-100, 100);
    for (int op = 0; op < 2000; ++op) {
      const int64_t key = key_of(rng);
      const bool present = model.count(key) != 0;
      if (present && rng() % 2 == 0) {
        map.Erase(key);
        model.erase(key);
      } else if (!present && std::ssize(model) < kMax) {
        const auto value = static_cast<int32_t>(rng() % 1000);
        map.Insert(key, value);
        model.emplace(key, value);
      }
      ASSERT_EQ(map.size(), std::ssize(model));
      const auto it = model.find(key);
      ASSERT_EQ(map.Find(key), it == model.end() ? UidMap::kAbsent : it->second) << "key " << key;
    }
    for (int64_t key = -100; key <= 100; ++key) {
      const auto it = model.find(key);
      ASSERT_EQ(map.Find(key), it == model.end() ? UidMap::kAbsent : it->second) << "key " << key;
    }
    const std::map<int64_t, int32_t> sorted(model.begin(), model.end());
    EXPECT_EQ(Contents(map), sorted);
  }
}

TEST(UidMapDeathTest, InsertPastCapacityIsABug) {
  UidMap map(1);
  map.Insert(1, 0);
  EXPECT_DEATH(map.Insert(2, 1), "UidMap::Insert past capacity");
}

TEST(UidMapDeathTest, InsertOfAPresentKeyIsABug) {
  UidMap map(2);
  map.Insert(1, 0);
  EXPECT_DEATH(map.Insert(1, 1), "UidMap::Insert of a present key");
}

TEST(UidMapDeathTest, EraseOfAnAbsentKeyIsABug) {
  UidMap map(2);
  map.Insert(1, 0);
  EXPECT_DEATH(map.Erase(2), "UidMap::Erase of an absent key");
}

}  // namespace
}  // namespace blockkv::internal
