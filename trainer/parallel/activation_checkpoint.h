// Activation checkpointing of one function of one tensor, as torch.utils.checkpoint's reentrant
// variant: the forward runs without recording a graph, so none of the function's intermediate
// activations are kept, only its input; the backward runs it again with the graph recorded and
// backpropagates through that, accumulating the parameters' gradients as a plain backward would
// (the same values, bit for bit: the same operations on the same inputs).
// `run` must be deterministic (the models here draw no random numbers in forward) and must not
// capture tensors that change between forward and backward: it is called again in backward.
// The output requires grad whenever grad mode is on, even when `input` does not (a first layer):
// the function's parameters still get their gradients.
#ifndef ELRUN_TRAINER_PARALLEL_ACTIVATION_CHECKPOINT_H_
#define ELRUN_TRAINER_PARALLEL_ACTIVATION_CHECKPOINT_H_

#include <functional>

#include <torch/torch.h>

#include "trainer/nn/module_hooks.h"

namespace elrun::trainer {

using TensorFn = std::function<torch::Tensor(const torch::Tensor&)>;

// run(input), checkpointed when grad mode is on; plainly otherwise.
torch::Tensor CheckpointedCall(const torch::Tensor& input, TensorFn run);

// The same for a function of several tensors returning several (undefined inputs allowed):
// forward keeps only `inputs`; backward recomputes run(inputs) with grad on and back-propagates
// the outputs that received a gradient. `run` must capture no tensor but parameters.
using TensorsFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
std::vector<torch::Tensor> CheckpointedCall(const std::vector<torch::Tensor>& inputs, TensorsFn run);

// Checkpoints every child a Classifier runs through CallChild (a plain model, as in the tests;
// FullyShardedDataParallel checkpoints its units itself).
class CheckpointEveryChild final : public ChildForwardHooks {
 public:
  void BeforeChild(const std::string&) override {}
  torch::Tensor RunChild(const std::string&, const torch::Tensor& input, const ChildFn& run) override {
    return CheckpointedCall(input, run);
  }
  torch::Tensor AfterChild(const std::string&, torch::Tensor output) override { return output; }
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_ACTIVATION_CHECKPOINT_H_
