// --keep-survivors: regrouping in place. A survivor whose collective failed drops its old group,
// waits for elrun's new contract and builds the new group; every rank of it then takes the job's
// live state (ddp: the rank furthest along; the sharded strategies: the newest whole set of shard
// copies held in memory, shard_copies.h) instead of reading the checkpoint. Called from the
// training thread only.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "trainer/app/job.h"

namespace elrun::trainer::app {

// For a survivor: when its collective failed, when elrun's regroup came, and when the new group
// was built.
struct RegroupTimes {
  std::chrono::steady_clock::time_point failed, told, grouped;
};

// Sharded strategies with copies: agreed by every rank of the group (a collective), this rank's
// shards and its neighbour's are copied into memory now, and every --shard-copy-every steps.
absl::Status StartShardCopies(Job& job);

// --keep-survivors: this rank takes the job's live state. ddp: that of the rank furthest along
// (live_state.h); `mine` is this rank's progress, nullopt for a replacement without state. The
// sharded strategies: TakeShardedState with `live`. The new group's rank 0 says whose state and
// how long the regroup took.
absl::Status TakeLiveState(Job& job, const std::optional<TrainProgress>& mine,
                           const std::optional<ShardBytes>& live = std::nullopt,
                           const std::optional<RegroupTimes>& survivor = std::nullopt);

// --keep-survivors: a collective failed (`error`), because a peer died. elrun restarts only that
// worker and tells this one the new group: every handle on the old group is dropped first (so
// peers still blocked in it see its sockets close), then the new group is built and the job's
// live state taken. Unavailable (the worker then fails, and elrun restarts the whole group) when
// no regroup comes within job.regroup_wait or the new group cannot be built; Cancelled on SIGTERM.
// Also entered between steps when elrun's regroup came while this rank's collectives still worked
// (a new round of a multi-node job): dropping the old group then fails its peers' collectives.
absl::Status RegroupInPlace(Job& job, const std::string& error);

// Every SyncBatchNorm of the model over `pg` and `shm` (null: none, the old group dropped).
void AttachSyncBatchNorms(Job& job, c10::intrusive_ptr<c10d::Backend> pg, std::shared_ptr<ShmAllreduce> shm);

}  // namespace elrun::trainer::app
