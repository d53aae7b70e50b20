// After a regroup in place (elrun --keep-survivors): every rank of the new group takes the state
// of the rank furthest along - parameters, buffers, optimizer state and progress, as one
// checkpoint's bytes (DataParallel::StateBytes) broadcast over the group - so survivors go on
// from the step they reached and a replacement worker starts from a survivor's live state
// rather than from disk. Thread-compatible.
#ifndef ELRUN_TRAINER_PARALLEL_LIVE_STATE_H_
#define ELRUN_TRAINER_PARALLEL_LIVE_STATE_H_

#include <cstdint>
#include <optional>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "absl/status/statusor.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/parallel/data_parallel.h"

namespace elrun::trainer {

struct LiveSync {
  int source_rank = 0;      // Whose state every rank now holds.
  TrainProgress progress;   // Its progress (world_size: the new group's).
  int64_t bytes = 0;        // The state's size on the wire.
  int stateless_ranks = 0;  // Ranks that joined without state (replacements).
};

// Collective over `pg`. `mine` is this rank's progress, or nullopt for a rank without state (a
// replacement). The source is the rank with the highest step, the lowest such rank on a tie:
// after a failure some survivors may have finished one more step than others (its all-reduce
// completed for them), and that step's state is whole. FailedPrecondition when no rank holds
// state; Unavailable when a collective fails; the source's or a loader's error otherwise (every
// rank then fails: the caller falls back to restarting the group).
absl::StatusOr<LiveSync> SyncLiveState(c10d::Backend& pg, DataParallel& dp, torch::optim::Optimizer& optimizer,
                                       const std::optional<TrainProgress>& mine);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_LIVE_STATE_H_
