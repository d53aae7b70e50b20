// How the training library's wrappers reach into a model built on it: a model derives from
// Classifier and runs each child through CallChild, so FullyShardedDataParallel (fsdp.h) and
// activation checkpointing can act around each child's forward (LibTorch modules have no forward
// hooks), and a ChildSink can take each child as soon as the model's constructor built it.
// Thread-compatible, as every torch::nn::Module.
#ifndef ELRUN_TRAINER_NN_MODULE_HOOKS_H_
#define ELRUN_TRAINER_NN_MODULE_HOOKS_H_

#include <functional>
#include <string>

#include <torch/nn/module.h>

namespace elrun::trainer {

// A child's forward as a function of its one input. It may be called again in backward
// (activation checkpointing): it must capture no tensor but the module's own parameters.
using ChildFn = std::function<torch::Tensor(const torch::Tensor&)>;

// Called around the forward of each child that a model runs through Classifier::CallChild.
// FullyShardedDataParallel (fsdp.h) installs one to gather a unit's parameters just before its
// forward and to free them right after: LibTorch modules have no forward hooks of their own.
class ChildForwardHooks {
 public:
  virtual ~ChildForwardHooks() = default;
  virtual void BeforeChild(const std::string& name) = 0;
  // Runs the child: run(input), or something equivalent (activation checkpointing).
  virtual torch::Tensor RunChild(const std::string& name, const torch::Tensor& input, const ChildFn& run) {
    (void)name;
    return run(input);
  }
  // May wrap `output` (e.g. register a gradient hook on it); returns what the model goes on with.
  virtual torch::Tensor AfterChild(const std::string& name, torch::Tensor output) = 0;
};

// Takes each child of a model right after the model's constructor built and initialised it, in
// registration order, before the next child exists: a sharding wrapper (FullyShardedDataParallel
// ::Builder, fsdp.h) keeps only its shard, so no rank ever holds the whole model. The values are
// those the same seed gives without a sink (the sink draws no random numbers).
class ChildSink {
 public:
  virtual ~ChildSink() = default;
  virtual void TakeChild(const std::string& name, torch::nn::Module& child) = 0;
};

// A module mapping a batch of images [B, ...] to class logits [B, classes]. Every child with
// parameters is run through CallChild under its registered name, as a function of one tensor.
class Classifier : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& images) = 0;
  // Installs (or, with nullptr, removes) the hooks; not owned, must outlive their use.
  void set_child_hooks(ChildForwardHooks* hooks) { hooks_ = hooks; }

 protected:
  torch::Tensor CallChild(const std::string& name, const torch::Tensor& input, const ChildFn& run) {
    if (hooks_ == nullptr) return run(input);
    hooks_->BeforeChild(name);
    return hooks_->AfterChild(name, hooks_->RunChild(name, input, run));
  }

 private:
  ChildForwardHooks* hooks_ = nullptr;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_NN_MODULE_HOOKS_H_
