// One parameter's optimizer state as named tensors, for checkpoints: SGD {"momentum_buffer"};
// Adam and AdamW {"exp_avg", "exp_avg_sq", ["max_exp_avg_sq"], "step" (0-d int64)}. Other optimizers are
// refused. Exported tensors are CPU copies (checkpoints written on a GPU load on a CPU and the
// reverse); imported ones move to the parameter's device. Thread-compatible.
#ifndef ELRUN_TRAINER_CHECKPOINT_OPTIMIZER_STATE_H_
#define ELRUN_TRAINER_CHECKPOINT_OPTIMIZER_STATE_H_

#include <map>
#include <string>

#include <torch/torch.h>

#include "absl/status/statusor.h"

namespace elrun::trainer {

using ParamState = std::map<std::string, torch::Tensor>;

// A detached copy of `t` in CPU memory (a copy even when `t` is on the CPU).
inline torch::Tensor CpuCopy(const torch::Tensor& t) {
  return t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
}

// "sgd", "adam" or "adamw"; InvalidArgument for other optimizer types.
absl::StatusOr<std::string> OptimizerKind(const torch::optim::Optimizer& optimizer);

// The state of `param` (CPU copies); empty before the optimizer's first step on it.
ParamState ExportParamState(const torch::optim::Optimizer& optimizer, const torch::Tensor& param);

// Replaces the state of `param`; InvalidArgument when a tensor is missing or has another size.
absl::Status ImportParamState(torch::optim::Optimizer& optimizer, const torch::Tensor& param, const ParamState& state);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_CHECKPOINT_OPTIMIZER_STATE_H_
