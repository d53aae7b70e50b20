// Group rank assignment for a new round. Pure function; thread-safe.
//
// Survivors keep their previous group rank when it still fits (rank 0, which hosts the store,
// stays rank 0 as long as it lives); the other places go to the remaining nodes: survivors whose
// rank no longer fits first, by previous rank, then newcomers at their --node-rank hint when that
// place is free, then the rest by join order.
#ifndef ELRUN_AGENT_COORDINATOR_GROUP_RANKS_H_
#define ELRUN_AGENT_COORDINATOR_GROUP_RANKS_H_

#include <cstdint>
#include <vector>

namespace elrun::rdzv {

struct RankCandidate {
  int previous_rank = -1;  // -1: a newcomer.
  int rank_hint = -1;
  uint64_t join_order = 0;
};

// Returns group ranks, one per candidate in input order: a permutation of 0..n-1.
std::vector<int> AssignGroupRanks(const std::vector<RankCandidate>& candidates);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_COORDINATOR_GROUP_RANKS_H_
