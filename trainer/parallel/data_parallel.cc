#include "trainer/parallel/data_parallel.h"

#include "absl/strings/str_cat.h"
#include "trainer/parallel/ddp.h"
#include "trainer/parallel/fsdp.h"
#include "trainer/parallel/grad_clip.h"
#include "trainer/parallel/sharded_checkpoint.h"

namespace elrun::trainer {
namespace {

int64_t Bytes(const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

class Ddp final : public DataParallel {
 public:
  Ddp(std::shared_ptr<Classifier> model, c10::intrusive_ptr<c10d::Backend> pg, const DdpOptions& options)
      : model_(model), rank_(pg->getRank()), ddp_(model, std::move(pg), options) {}

  torch::Tensor Forward(const torch::Tensor& input) override { return model_->forward(input); }

  void Backward(const torch::Tensor& loss, bool synchronize) override {
    if (synchronize) {
      loss.backward();
    } else {
      DistributedDataParallel::NoSync no_sync(ddp_);
      loss.backward();
    }
  }

  std::vector<torch::Tensor> OptimizerParameters() override { return model_->parameters(); }
  // DDP's gradients are whole and equal on every rank after the all-reduce.
  double ClipGradNorm(double max_norm) override {
    return trainer::ClipGradNorm(model_->parameters(), max_norm, nullptr);
  }

  absl::StatusOr<TrainProgress> Load(const std::string& dir, torch::optim::Optimizer& optimizer) override {
    return LoadCheckpoint(CheckpointPath(dir), *model_, optimizer);
  }

  absl::Status Save(const std::string& dir, torch::optim::Optimizer& optimizer,
                    const TrainProgress& progress) override {
    return rank_ == 0 ? SaveCheckpoint(CheckpointPath(dir), *model_, optimizer, progress) : absl::OkStatus();
  }

  absl::Status Export(const std::string& dir, torch::optim::Optimizer& optimizer,
                      const TrainProgress& progress) override {
    return Save(dir, optimizer, progress);
  }

  MemoryReport Memory(const torch::optim::Optimizer& optimizer) override {
    MemoryReport r;
    for (const auto& p : model_->parameters()) {
      r.params += Bytes(p);
      r.grads += Bytes(p.grad());
    }
    r.working = ddp_.bucket_bytes();
    r.optimizer_state = OptimizerStateBytes(optimizer);
    r.peak = r.params + r.grads + r.working + r.optimizer_state;  // Nothing transient.
    r.peak_rss = PeakRssBytes();
    return r;
  }

  bool CanRegroup() const override { return true; }

  absl::Status Rebind(c10::intrusive_ptr<c10d::Backend> pg, std::shared_ptr<ShmAllreduce> shm) override {
    try {
      if (pg) rank_ = pg->getRank();
      ddp_.Rebind(std::move(pg), std::move(shm));
      return absl::OkStatus();
    } catch (const c10::Error& error) {
      return absl::InternalError(error.what_without_backtrace());
    }
  }

  absl::StatusOr<std::vector<char>> StateBytes(torch::optim::Optimizer& optimizer,
                                               const TrainProgress& progress) override {
    return CheckpointBytes(*model_, optimizer, progress);
  }

  absl::StatusOr<TrainProgress> LoadStateBytes(const std::vector<char>& bytes, const std::string& origin,
                                               torch::optim::Optimizer& optimizer) override {
    return LoadCheckpointBytes(bytes, origin, *model_, optimizer);
  }

 private:
  const std::shared_ptr<Classifier> model_;
  int rank_;  // Of the group; Rebind may change it.
  DistributedDataParallel ddp_;
};

class Fsdp final : public DataParallel {
 public:
  Fsdp(std::shared_ptr<Classifier> model, c10::intrusive_ptr<c10d::Backend> pg, const FsdpOptions& options)
      : fsdp_(std::move(model), std::move(pg), options) {}
  Fsdp(std::shared_ptr<Classifier> model, FullyShardedDataParallel::Builder built)
      : fsdp_(std::move(model), std::move(built)) {}

  torch::Tensor Forward(const torch::Tensor& input) override { return fsdp_.forward(input); }

  void Backward(const torch::Tensor& loss, bool synchronize) override {
    if (synchronize) {
      loss.backward();
    } else {
      FullyShardedDataParallel::NoSync no_sync(fsdp_);
      loss.backward();
    }
  }

  std::vector<torch::Tensor> OptimizerParameters() override { return fsdp_.parameters(); }
  double ClipGradNorm(double max_norm) override {
    return trainer::ClipGradNorm(fsdp_.parameters(), max_norm,
                                 fsdp_.shard_count() > 1 ? &fsdp_.process_group() : nullptr);
  }

  absl::StatusOr<TrainProgress> Load(const std::string& dir, torch::optim::Optimizer& optimizer) override {
    return LoadSharded(dir, fsdp_, optimizer);
  }

  absl::Status Save(const std::string& dir, torch::optim::Optimizer& optimizer,
                    const TrainProgress& progress) override {
    return SaveSharded(dir, fsdp_, optimizer, progress);
  }

  absl::Status Export(const std::string& dir, torch::optim::Optimizer& optimizer,
                      const TrainProgress& progress) override {
    absl::Status saved = Save(dir, optimizer, progress);
    if (!saved.ok()) return saved;
    return ExportConsolidated(dir + "/model.pt", fsdp_, optimizer, progress);
  }

  MemoryReport Memory(const torch::optim::Optimizer& optimizer) override {
    const FsdpMemory m = fsdp_.memory();
    MemoryReport r;
    r.params = m.params;
    r.grads = m.grads;
    r.working = m.working;
    r.optimizer_state = OptimizerStateBytes(optimizer);
    r.peak = m.peak + r.optimizer_state;  // The state exists from the first step on.
    r.peak_rss = PeakRssBytes();
    return r;
  }

  bool CanRegroup() const override { return true; }

  absl::StatusOr<ShardBytes> LiveShard(torch::optim::Optimizer& optimizer, const TrainProgress& progress) override {
    return LiveShardBytes(fsdp_, optimizer, progress);
  }

  absl::StatusOr<TrainProgress> LoadShards(const std::vector<std::vector<char>>& files, const std::string& origin,
                                           torch::optim::Optimizer& optimizer) override {
    return LoadShardSet(files, origin, fsdp_, optimizer);
  }

 private:
  FullyShardedDataParallel fsdp_;
};

}  // namespace

std::unique_ptr<ChildSink> DataParallel::ShardingSink(c10::intrusive_ptr<c10d::Backend> pg, torch::Device device,
                                                      const FsdpOptions& options) {
  if (options.strategy == Strategy::kDdp) return nullptr;
  return std::make_unique<FullyShardedDataParallel::Builder>(std::move(pg), options, device);
}

std::unique_ptr<DataParallel> DataParallel::Create(std::shared_ptr<Classifier> model,
                                                   c10::intrusive_ptr<c10d::Backend> pg, const FsdpOptions& options,
                                                   const DdpOptions& ddp_options, std::unique_ptr<ChildSink> sink) {
  if (options.strategy == Strategy::kDdp) {
    TORCH_CHECK(!options.activation_checkpointing && !options.param_dtype,
                "activation checkpointing and mixed precision need a sharded strategy");
    return std::unique_ptr<DataParallel>(new Ddp(std::move(model), std::move(pg), ddp_options));
  }
  if (auto* built = dynamic_cast<FullyShardedDataParallel::Builder*>(sink.get())) {
    return std::unique_ptr<DataParallel>(new Fsdp(std::move(model), std::move(*built)));
  }
  return std::unique_ptr<DataParallel>(new Fsdp(std::move(model), std::move(pg), options));
}

}  // namespace elrun::trainer
