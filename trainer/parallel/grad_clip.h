// Gradient clipping by global L2 norm, as torch.nn.utils.clip_grad_norm_ and FSDP's
// clip_grad_norm_: every gradient is scaled by max_norm / (norm + 1e-6) when that is below 1,
// where norm is the norm of the whole model's gradient. Under sharding a rank holds only its
// shards, so the squared norms of the shards are summed across ranks first: every strategy
// then clips exactly as DDP does. Sums in float64.
#ifndef ELRUN_TRAINER_PARALLEL_GRAD_CLIP_H_
#define ELRUN_TRAINER_PARALLEL_GRAD_CLIP_H_

#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace elrun::trainer {

// `params`: this rank's parameters with their gradients (those without one are skipped).
// `shards_over`: the group the gradients are sharded over (collective: every rank calls it),
// or nullptr when every rank holds whole gradients. Returns the global norm before clipping.
// Throws c10::Error when the collective fails.
double ClipGradNorm(const std::vector<torch::Tensor>& params, double max_norm, c10d::Backend* shards_over);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_GRAD_CLIP_H_
