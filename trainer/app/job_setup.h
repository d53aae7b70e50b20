// Building a run: Setup turns the options and the environment (elrun's or torchrun's contract,
// a standby spare's hand-over) into a Job with its data, process group, model, wrapper and
// optimizer, resumed from the checkpoint or from the survivors' live state. BuildModel and
// SetUpSharedMemory are also what a regroup in place (regroup.h) builds again for the new world.
#pragma once

#include <atomic>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/app/job.h"
#include "trainer/app/train_options.h"

namespace elrun::trainer::app {

// The run of `o`: collective (every rank of the group calls it). Cancelled when `stop` was set
// while a standby spare waited to be called in; InvalidArgument/FailedPrecondition for what the
// user must change; Unavailable for data, peers and files. `stop` must outlive the Job.
absl::StatusOr<std::unique_ptr<Job>> Setup(const TrainOptions& o, const std::atomic<bool>& stop);

// The model, its data-parallel wrapper and the optimizer over job.dist, from --seed: collective
// (the sharded strategies check the ranks built alike; ddp and sharding without a sink broadcast
// rank 0's values unless `joining`). Also at a sharded strategy's regroup in place, for the new
// world. Throws c10::Error when a collective fails.
absl::Status BuildModel(Job& job, bool joining);

// DDP's buckets and SyncBatchNorm's statistics go through shared memory where every rank can map
// it (all on this host, CPU tensors); the sharded strategies' collectives stay on the backend.
absl::Status SetUpSharedMemory(Job& job);

}  // namespace elrun::trainer::app
