// The data-parallel wrapper elrun-train trains through, chosen by --strategy (one Strategy,
// strategy.h, in FsdpOptions::strategy): "ddp" is
// DistributedDataParallel (bucketed all-reduce overlapping backward, ddp.h); "no_shard",
// "zero1", "zero2" and "fsdp" are FullyShardedDataParallel strategies (fsdp.h). Checkpoints:
// ddp writes <dir>/checkpoint.pt from rank 0; the sharded strategies write sharded checkpoints
// from every rank (sharded_checkpoint.h) and export a consolidated <dir>/model.pt at the end.
// Thread-compatible; Save, Load and Export are collective for the sharded strategies.
#ifndef ELRUN_TRAINER_PARALLEL_DATA_PARALLEL_H_
#define ELRUN_TRAINER_PARALLEL_DATA_PARALLEL_H_

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "absl/status/statusor.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/memory/memory.h"
#include "trainer/nn/module_hooks.h"
#include "trainer/parallel/ddp.h"
#include "trainer/parallel/fsdp.h"
#include "trainer/parallel/sharded_checkpoint.h"
#include "trainer/parallel/strategy.h"

namespace elrun::trainer {

class DataParallel {
 public:
  // `options.strategy` decides: kDdp is DistributedDataParallel with `ddp_options` (then no other
  // field of `options` may ask for anything: activation checkpointing and mixed precision are
  // refused); the others are FullyShardedDataParallel with `options`. With a `sink` from
  // ShardingSink, the model was built through it (sharded as it was built) and the sink's options
  // apply. Throws c10::Error when the first collective fails or the ranks built different values
  // through the sink.
  static std::unique_ptr<DataParallel> Create(std::shared_ptr<Classifier> model, c10::intrusive_ptr<c10d::Backend> pg,
                                              const FsdpOptions& options, const DdpOptions& ddp_options = {},
                                              std::unique_ptr<ChildSink> sink = nullptr);
  // For the sharded strategies: a sink for MakeModel that shards each child as soon as it is
  // built and moves it to `device`, so no rank ever holds the whole model
  // (FullyShardedDataParallel::Builder); hand it to Create afterwards. nullptr for kDdp. Every
  // rank must seed alike before MakeModel (checked by Create).
  static std::unique_ptr<ChildSink> ShardingSink(c10::intrusive_ptr<c10d::Backend> pg, torch::Device device,
                                                 const FsdpOptions& options);
  virtual ~DataParallel() = default;

  virtual torch::Tensor Forward(const torch::Tensor& input) = 0;
  // Backward of `loss`; without `synchronize`, gradients accumulate locally (NoSync).
  virtual void Backward(const torch::Tensor& loss, bool synchronize) = 0;
  // What the optimizer steps.
  virtual std::vector<torch::Tensor> OptimizerParameters() = 0;
  // Clips the gradients of OptimizerParameters() by the whole model's global L2 norm
  // (grad_clip.h; collective for the sharded strategies). Returns the norm before clipping.
  virtual double ClipGradNorm(double max_norm) = 0;

  // NotFound when `dir` holds no checkpoint of this kind.
  virtual absl::StatusOr<TrainProgress> Load(const std::string& dir, torch::optim::Optimizer& optimizer) = 0;
  virtual absl::Status Save(const std::string& dir, torch::optim::Optimizer& optimizer,
                            const TrainProgress& progress) = 0;
  // The end-of-run artefact Python opens: ddp's checkpoint.pt already is one; the sharded
  // strategies write a consolidated <dir>/model.pt.
  virtual absl::Status Export(const std::string& dir, torch::optim::Optimizer& optimizer,
                              const TrainProgress& progress) = 0;

  // This rank's model-state bytes now, and the peak of params + grads + buffers (+ state).
  virtual MemoryReport Memory(const torch::optim::Optimizer& optimizer) = 0;

  // Regrouping in place (elrun --keep-survivors). ddp, whose state every rank holds whole, goes
  // on over the new group (Rebind) and takes the live state of the rank furthest along
  // (StateBytes, live_state.h). The sharded strategies' wrapper is built again for the new world
  // and loads a whole set of shard files that the new group holds in memory (LiveShard,
  // LoadShards; shard_copies.h).
  virtual bool CanRegroup() const { return false; }
  // ddp: goes on over `pg` and `shm` (spanning the same ranks; may be null) after the old group
  // failed (DistributedDataParallel::Rebind); a null `pg` only drops the old group's handles.
  virtual absl::Status Rebind(c10::intrusive_ptr<c10d::Backend> /*pg*/, std::shared_ptr<ShmAllreduce> /*shm*/) {
    return absl::UnimplementedError("this strategy cannot regroup in place");
  }
  // This rank's whole state as a checkpoint's bytes (checkpoint.h), and loading them; `origin`
  // names them in errors.
  virtual absl::StatusOr<std::vector<char>> StateBytes(torch::optim::Optimizer& /*optimizer*/,
                                                       const TrainProgress& /*progress*/) {
    return absl::UnimplementedError("this strategy cannot regroup in place");
  }
  // The sharded strategies: this rank's shard file now (no collective), and loading a whole set
  // of them resharded for this wrapper (sharded_checkpoint.h).
  virtual absl::StatusOr<ShardBytes> LiveShard(torch::optim::Optimizer& /*optimizer*/,
                                               const TrainProgress& /*progress*/) {
    return absl::UnimplementedError("this strategy holds no shards");
  }
  virtual absl::StatusOr<TrainProgress> LoadShards(const std::vector<std::vector<char>>& /*files*/,
                                                   const std::string& /*origin*/,
                                                   torch::optim::Optimizer& /*optimizer*/) {
    return absl::UnimplementedError("this strategy holds no shards");
  }
  virtual absl::StatusOr<TrainProgress> LoadStateBytes(const std::vector<char>& /*bytes*/,
                                                       const std::string& /*origin*/,
                                                       torch::optim::Optimizer& /*optimizer*/) {
    return absl::UnimplementedError("this strategy cannot regroup in place");
  }
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_DATA_PARALLEL_H_
