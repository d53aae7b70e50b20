#include "agent/coordinator/group_ranks.h"

#include <algorithm>
#include <numeric>

namespace elrun::rdzv {

std::vector<int> AssignGroupRanks(const std::vector<RankCandidate>& candidates) {
  const int n = static_cast<int>(candidates.size());
  std::vector<int> ranks(n, -1);
  std::vector<bool> taken(n, false);

  // Survivors whose previous rank still fits keep it (ties cannot happen between survivors of
  // one round, but be safe: the earlier joiner wins).
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return candidates[a].join_order < candidates[b].join_order; });
  for (int i : order) {
    int previous = candidates[i].previous_rank;
    if (previous >= 0 && previous < n && !taken[previous]) {
      ranks[i] = previous;
      taken[previous] = true;
    }
  }
  // Newcomers with a free hint.
  for (int i : order) {
    int hint = candidates[i].rank_hint;
    if (ranks[i] < 0 && candidates[i].previous_rank < 0 && hint >= 0 && hint < n && !taken[hint]) {
      ranks[i] = hint;
      taken[hint] = true;
    }
  }
  // Everyone else fills the free places: displaced survivors by previous rank, then newcomers
  // by join order.
  std::vector<int> rest;
  for (int i : order) {
    if (ranks[i] < 0) rest.push_back(i);
  }
  std::stable_sort(rest.begin(), rest.end(), [&](int a, int b) {
    bool a_survivor = candidates[a].previous_rank >= 0;
    bool b_survivor = candidates[b].previous_rank >= 0;
    if (a_survivor != b_survivor) return a_survivor;
    if (a_survivor) return candidates[a].previous_rank < candidates[b].previous_rank;
    return false;  // Keep join order.
  });
  int next = 0;
  for (int i : rest) {
    while (taken[next]) ++next;
    ranks[i] = next;
    taken[next] = true;
  }
  return ranks;
}

}  // namespace elrun::rdzv
