// elrun --keep-survivors for the sharded strategies (zero1, zero2, fsdp; no_shard too): a rank's
// shards exist nowhere else, so each rank keeps in memory a copy of its neighbour's shard file
// (rank + 1 mod world), refreshed every K steps by a ring exchange, beside a copy of its own taken
// at the same step. When a rank is lost, the new group rebuilds the newest whole set of shard
// files from what its ranks hold - survivors' live shards (nothing lost: a node joined), else the
// copies (every rank goes back to the step they were taken at) - and every rank loads it,
// resharded for the new world (sharded_checkpoint.h). No whole set: the caller falls back to the
// checkpoint. Thread-compatible.
#ifndef ELRUN_TRAINER_PARALLEL_SHARD_COPIES_H_
#define ELRUN_TRAINER_PARALLEL_SHARD_COPIES_H_

#include <cstdint>
#include <optional>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "absl/status/statusor.h"
#include "trainer/parallel/sharded_checkpoint.h"

namespace elrun::trainer {

class ShardCopies {
 public:
  // Collective over `pg` (point to point): sends `own` to rank - 1 and takes rank + 1's. The new
  // pair is kept beside the previous one until Settle: a rank lost during the exchange leaves
  // some ranks with the new pair and some without, and only the previous step's set is whole.
  // Unavailable when the exchange fails (the caller regroups); nothing held changes then.
  absl::Status Refresh(c10d::Backend& pg, ShardBytes own);
  // Every rank completed the newest Refresh (a collective after it completed): the previous pair
  // is dropped.
  void Settle();
  void Clear() { pairs_.clear(); }
  // What this rank holds: its own shards and its neighbour's, newest first.
  std::vector<const ShardBytes*> held() const;
  int64_t bytes() const;

 private:
  struct Pair {
    ShardBytes own;
    std::optional<ShardBytes> neighbour;  // None in a world of one.
  };
  std::vector<Pair> pairs_;  // Oldest first; at most two.
};

// One held shard file as a rank announces it.
struct ShardKey {
  int shard = 0;
  int count = 1;
  int64_t step = 0;
  bool copy = false;  // A neighbour's (or a rank's own taken at a refresh), not live.
};

struct ShardSetChoice {
  int64_t step = 0;
  int count = 0;
  std::vector<int> holders;  // holders[k]: the rank that sends shard k.
  int from_copies = 0;       // Shards sent from a copy rather than a live shard.
};

// The newest (step, count) set of which every shard is held by some rank (`by_rank[r]`: what rank
// r holds); a live shard before a copy, then the lowest rank. nullopt when no set is whole.
std::optional<ShardSetChoice> ChooseShardSet(const std::vector<std::vector<ShardKey>>& by_rank);

struct ShardedSync {
  ShardSetChoice choice;
  std::vector<std::vector<char>> files;  // The chosen set, in shard order.
  int64_t bytes = 0;                     // Their size together.
  int stateless_ranks = 0;               // Ranks that held nothing (replacements).
  int64_t reached = -1;                  // The furthest step of a live shard; -1: none.
};

// Collective over `pg`: every rank says what it holds (`live`: its shard now, if it has state;
// `copies`: ShardCopies::held()), the ranks agree on ChooseShardSet's set, and each of its files
// is broadcast from its holder. NotFound when no set is whole; Unavailable when a collective
// fails. Every rank gets the same outcome.
absl::StatusOr<ShardedSync> GatherShardSet(c10d::Backend& pg, const std::optional<ShardBytes>& live,
                                           const std::vector<const ShardBytes*>& copies);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_SHARD_COPIES_H_
