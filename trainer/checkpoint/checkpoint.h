// Checkpoints in torch.save's format (SaveForPython), which Python's torch.load opens: a dict with
// "model" (name -> tensor, parameters and buffers), "optimizer" (SGD momentum buffers by
// parameter name; Adam's exp_avg, exp_avg_sq and step as "<name>.<field>"), "optimizer_kind", and "step", "epoch",
// "samples_seen" (the global sample position) and "world_size". Written atomically (temp file, fsync, rename).
// Thread-compatible.
#ifndef ELRUN_TRAINER_CHECKPOINT_CHECKPOINT_H_
#define ELRUN_TRAINER_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "trainer/checkpoint/optimizer_state.h"

namespace elrun::trainer {

struct TrainProgress {
  int64_t step = 0;          // Optimizer steps taken.
  int64_t epoch = 0;         // The epoch in progress.
  int64_t samples_seen = 0;  // Samples of this epoch consumed by all ranks together.
  int64_t world_size = 1;    // The world that wrote it (a restart may have another).
  // fp16's dynamic loss scale (GradScaler, trainer/optim/grad_scaler.h) and its growth tracker;
  // 0: none (the keys "loss_scale" and "loss_scale_growth_tracker" are then absent).
  double loss_scale = 0;
  int64_t loss_scale_growth_tracker = 0;
};

// The progress fields of a checkpoint dict ("step", "epoch", "samples_seen", "world_size", and
// the loss scale's when there is one).
void InsertProgress(c10::impl::GenericDict& dict, const TrainProgress& progress);
TrainProgress ReadProgress(const c10::impl::GenericDict& dict);  // Throws c10::Error if missing.

// `value` in torch.save's format (a zip with data.pkl and one record per tensor storage, CUDA
// tensors copied to the CPU) that Python's torch.load opens with its default weights_only=True:
// unlike torch::pickle_save, no dict or list is tagged with its element types (restore_type_tag,
// a global weights_only refuses). torch::pickle_load reads it back. Throws c10::Error.
std::vector<char> SaveForPython(const c10::IValue& value);

// Writes `bytes` to `path` through a temporary file, fsync and rename. FailedPrecondition
// naming the step that failed.
absl::Status WriteAtomically(const std::string& path, const std::vector<char>& bytes);

// The checkpoint file of a directory (one per job; replaced atomically on every save).
std::string CheckpointPath(const std::string& dir);

// Saves module parameters and buffers, the optimizer's state (SGD or Adam) and `progress`.
// InvalidArgument for another optimizer; WriteAtomically's errors, or Internal from LibTorch.
absl::Status SaveCheckpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                            const TrainProgress& progress);

// The bytes SaveCheckpoint writes (for a copy held in memory or sent to a peer). InvalidArgument
// for another optimizer, Internal from LibTorch.
absl::StatusOr<std::vector<char>> CheckpointBytes(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                                  const TrainProgress& progress);

// Writes the file SaveCheckpoint writes from its parts: parameters and buffers by name, the
// optimizer state by parameter name. FSDP's consolidated export uses it.
absl::Status WriteCheckpointFile(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                                 const std::map<std::string, ParamState>& optimizer_state,
                                 const std::string& optimizer_kind, const TrainProgress& progress);

// Loads a checkpoint into module and optimizer. NotFound when there is none; InvalidArgument
// when it does not match the module (names or shapes).
absl::StatusOr<TrainProgress> LoadCheckpoint(const std::string& path, torch::nn::Module& module,
                                             torch::optim::Optimizer& optimizer);

// LoadCheckpoint from the bytes of a checkpoint file; `path` names them in errors (a file, or
// where they came from).
absl::StatusOr<TrainProgress> LoadCheckpointBytes(const std::vector<char>& bytes, const std::string& path,
                                                  torch::nn::Module& module, torch::optim::Optimizer& optimizer);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_CHECKPOINT_CHECKPOINT_H_
