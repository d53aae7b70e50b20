// Sharded checkpoints of FullyShardedDataParallel, loadable by another world size.
// Layout under a checkpoint directory:
//   sharded/step-<S>-of-<K>/shard-<k>-of-<K>.pt   one per shard (K = the wrapper's shard count; one
//                                          file for no_shard), dicts in torch.save's format
//                                          (SaveForPython, checkpoint.h) holding
//                                          the unit layout, the flat parameter shard and the
//                                          optimizer state of that shard, progress, and (in
//                                          shard 0) the module's buffers.
//   sharded/LATEST                         "step-<S>-of-<K>", replaced atomically by rank 0 once every
//                                          rank has written its file (agreed by an all-reduce),
//                                          so a crash mid-save leaves the previous set current;
//                                          older step-* directories are then removed.
// Loading reads the K files and cuts each unit's flat parameters and optimizer state again for
// this wrapper's shard count (resharding): an elastic restart with fewer or more ranks resumes.
// Every function here is collective: all ranks call it in the same order. Save and Load fail on
// every rank when one rank fails (Aborted on the others).
#ifndef ELRUN_TRAINER_PARALLEL_SHARDED_CHECKPOINT_H_
#define ELRUN_TRAINER_PARALLEL_SHARDED_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/optimizer_state.h"
#include "trainer/parallel/fsdp.h"

namespace elrun::trainer {

absl::Status SaveSharded(const std::string& dir, FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer,
                         const TrainProgress& progress);

// NotFound when `dir` holds no sharded checkpoint; InvalidArgument when it does not match the
// model (units, names, sizes) or the optimizer type.
absl::StatusOr<TrainProgress> LoadSharded(const std::string& dir, FullyShardedDataParallel& fsdp,
                                          torch::optim::Optimizer& optimizer);

// One shard file of a set, held in memory (elrun --keep-survivors: shard_copies.h): shard `shard`
// of `count`, at optimizer step `step`, in the file's format.
struct ShardBytes {
  int shard = 0;
  int count = 1;
  int64_t step = 0;
  std::vector<char> bytes;
};

// This rank's shard file as it would be saved now, without writing it or any collective.
// Internal when serialising fails.
absl::StatusOr<ShardBytes> LiveShardBytes(FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer,
                                          const TrainProgress& progress);

// Loads a whole set of shard files (`files[k]` is shard k of files.size()), resharded for
// `fsdp`, as LoadSharded does from disk but with no collective. `origin` names them in errors;
// InvalidArgument when they are not such a set or do not match the model or the optimizer.
absl::StatusOr<TrainProgress> LoadShardSet(const std::vector<std::vector<char>>& files, const std::string& origin,
                                           FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer);

// The unsharded optimizer state by parameter name (empty before the first step).
std::map<std::string, ParamState> FullOptimizerState(FullyShardedDataParallel& fsdp,
                                                     const torch::optim::Optimizer& optimizer);

// Rank 0 writes a consolidated checkpoint in SaveCheckpoint's format (full parameters, buffers,
// full optimizer state), which LoadCheckpoint and Python's torch.load open.
absl::Status ExportConsolidated(const std::string& path, FullyShardedDataParallel& fsdp,
                                torch::optim::Optimizer& optimizer, const TrainProgress& progress);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_SHARDED_CHECKPOINT_H_
