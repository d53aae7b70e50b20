#include "agent/coordinator/group_ranks.h"

#include <doctest/doctest.h>

#include <algorithm>

namespace elrun::rdzv {
namespace {

bool IsPermutation(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] != static_cast<int>(i)) return false;
  }
  return true;
}

TEST_CASE("newcomers are ranked by join order") {
  CHECK(AssignGroupRanks({{-1, -1, 5}, {-1, -1, 2}, {-1, -1, 9}}) == std::vector<int>{1, 0, 2});
}

TEST_CASE("survivors keep their rank when it fits") {
  CHECK(AssignGroupRanks({{2, -1, 0}, {0, -1, 1}, {-1, -1, 2}}) == std::vector<int>{2, 0, 1});
}

TEST_CASE("survivors whose rank no longer fits fill holes by previous rank") {
  // 4 nodes, rank 1 died: ranks 0, 2, 3 survive into a round of 3.
  CHECK(AssignGroupRanks({{0, -1, 0}, {2, -1, 1}, {3, -1, 2}}) == std::vector<int>{0, 2, 1});
}

TEST_CASE("hints place newcomers, survivors win conflicts") {
  CHECK(AssignGroupRanks({{-1, 0, 0}, {0, -1, 1}}) == std::vector<int>{1, 0});
  CHECK(AssignGroupRanks({{-1, 1, 0}, {-1, 0, 1}}) == std::vector<int>{1, 0});
  CHECK(AssignGroupRanks({{-1, 7, 0}, {-1, -1, 1}}) == std::vector<int>{0, 1});
}

TEST_CASE("always a permutation") {
  std::vector<RankCandidate> candidates;
  for (int i = 0; i < 50; ++i) candidates.push_back({(i * 7) % 60 - 5, (i * 3) % 13 - 2, uint64_t(i * 11 % 50)});
  CHECK(IsPermutation(AssignGroupRanks(candidates)));
  CHECK(AssignGroupRanks({}).empty());
}

}  // namespace
}  // namespace elrun::rdzv
