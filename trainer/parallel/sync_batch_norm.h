// SyncBatchNorm for LibTorch: CPU tensors with Gloo (or shared memory), CUDA tensors with NCCL.
// In training, per-channel sums and counts of every rank are combined in one all-reduce, so the
// statistics are those of the union of all ranks' batches (ranks may have different or empty
// batches); the backward pass all-reduces sum(dy) and sum(dy * (x - mean)) in one collective.
// Running stats follow the global unbiased variance. In eval mode (with running stats) nothing is
// communicated. Every rank must run the same forward/backward sequence, as for any collective.
#ifndef ELRUN_TRAINER_PARALLEL_SYNC_BATCH_NORM_H_
#define ELRUN_TRAINER_PARALLEL_SYNC_BATCH_NORM_H_

#include <memory>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "trainer/dist/shm_allreduce.h"

namespace elrun::trainer {

class SyncBatchNormImpl : public torch::nn::Module {
 public:
  // With `shm` (same ranks as `pg`), the statistics are summed through shared memory instead of
  // `pg` (shm_allreduce.h): for ranks on one host. Without `pg` it is BatchNorm of the local
  // batch until Attach (or ConvertSyncBatchNorm) gives it a group: a model may declare its norm
  // layers as SyncBatchNorm and keep calling them through their members.
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, c10::intrusive_ptr<c10d::Backend> pg = nullptr,
                             std::shared_ptr<ShmAllreduce> shm = nullptr);
  void Attach(c10::intrusive_ptr<c10d::Backend> pg, std::shared_ptr<ShmAllreduce> shm = nullptr);
  bool attached() const { return static_cast<bool>(pg_); }

  // Input [N, C, ...] for any number of trailing dimensions (BatchNorm1d/2d/3d alike).
  torch::Tensor forward(const torch::Tensor& input);

  const torch::nn::BatchNormOptions& options() const { return options_; }

  torch::Tensor weight, bias;                                    // Parameters when affine.
  torch::Tensor running_mean, running_var, num_batches_tracked;  // Buffers when tracking.

 private:
  const torch::nn::BatchNormOptions options_;
  c10::intrusive_ptr<c10d::Backend> pg_;
  std::shared_ptr<ShmAllreduce> shm_;
};
TORCH_MODULE(SyncBatchNorm);

// Makes every batch norm in `module`'s tree (its registered children, recursively) synchronised
// over `pg`: a SyncBatchNorm without a group gets this one (any model: it keeps calling its
// member), and a BatchNorm1d/2d/3d is replaced by a SyncBatchNorm with the same options, weights
// and running stats. Call before wrapping with DistributedDataParallel. Returns how many.
// C++ modules keep their children in members as well as in the registry: a replaced BatchNorm
// takes effect only where the model reaches its norm layers through the registry at forward
// time (ApplyNorm), as elrun-train's FashionNet (trainer/app/models.h) does; a model calling
// typed members declares them as SyncBatchNorm instead. `shm`: see SyncBatchNormImpl.
int ConvertSyncBatchNorm(torch::nn::Module& module, c10::intrusive_ptr<c10d::Backend> pg,
                         std::shared_ptr<ShmAllreduce> shm = nullptr);

// Runs a registered normalisation child (BatchNorm1d/2d/3d or SyncBatchNorm) on `x`.
torch::Tensor ApplyNorm(torch::nn::Module& norm, const torch::Tensor& x);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_SYNC_BATCH_NORM_H_
