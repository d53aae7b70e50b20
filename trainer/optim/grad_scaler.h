// Dynamic loss scaling for fp16 training, as torch.amp.GradScaler (and FSDP's ShardedGradScaler):
// the loss is multiplied by a scale before backward so small fp16 gradients do not flush to zero;
// the gradients are divided by it again before clipping and the step; a step whose gradients hold
// an inf or a NaN on any rank is skipped on every rank, and the scale is multiplied by
// backoff_factor; after growth_interval steps in a row without one, by growth_factor. The finding
// is agreed across the ranks with one MAX all-reduce (a sharded strategy's ranks hold different
// gradient shards, so one rank alone may see the overflow). The unscale and the update are ATen's
// own kernels (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_), the ones
// torch.amp.GradScaler runs. Thread-compatible.
#ifndef ELRUN_TRAINER_OPTIM_GRAD_SCALER_H_
#define ELRUN_TRAINER_OPTIM_GRAD_SCALER_H_

#include <cstdint>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace elrun::trainer {

struct GradScalerOptions {  // torch.amp.GradScaler's defaults.
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class GradScaler {
 public:
  // `pg`: the ranks that skip together (nullptr: this process alone).
  GradScaler(GradScalerOptions options, c10::intrusive_ptr<c10d::Backend> pg);

  // loss * scale.
  torch::Tensor Scale(const torch::Tensor& loss) const;
  // Divides the gradients of `params` by the scale, in place, and finds whether any is inf or
  // NaN on any rank (collective). Once per step: later calls before Step return the same answer.
  // True when every gradient everywhere is finite.
  bool Unscale(const std::vector<torch::Tensor>& params);
  // Unscales (if Unscale was not called), steps `optimizer` unless a rank found inf or NaN, and
  // updates the scale. Returns whether it stepped.
  bool Step(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& params);

  double scale() const;
  int64_t growth_tracker() const;  // Steps in a row without inf or NaN since the last change.
  int64_t skipped_steps() const { return skipped_; }
  // A checkpoint's scale and growth tracker.
  void Restore(double scale, int64_t growth_tracker);

 private:
  const GradScalerOptions options_;
  const c10::intrusive_ptr<c10d::Backend> pg_;
  torch::Tensor scale_;           // float [1]
  torch::Tensor growth_tracker_;  // int32 [1]
  torch::Tensor found_inf_;       // float [1]: > 0 when a rank found one in this step.
  bool unscaled_ = false;
  int64_t skipped_ = 0;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_OPTIM_GRAD_SCALER_H_
