#include <gtest/gtest.h>

#include "blockkv/blockkv.h"

TEST(Smoke, AllocatorGoldenOrder) {
  auto a = blockkv::BlockedAllocator::Create(8);
  ASSERT_TRUE(a.ok());
  auto ids = a->Allocate(3);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<blockkv::BlockId>{0, 1, 2}));
  ASSERT_TRUE(a->Free(*ids).ok());
  EXPECT_EQ(*a->Allocate(4), (std::vector<blockkv::BlockId>{2, 1, 0, 3}));
}
