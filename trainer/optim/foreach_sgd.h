// torch::optim::SGD whose step runs as a few multi-tensor (foreach) kernels over all parameters
// instead of three kernels per parameter, as torch.optim.SGD does by default on CUDA: FashionNet's
// step on a GPU at batch 64 is bound by kernel launches (docs/gpu.md). The arithmetic, the
// options and the state (SGDParamState's momentum buffers, so checkpoints and memory reports
// see an SGD) are LibTorch's; the results equal torch::optim::SGD's (tests/trainer).
#ifndef ELRUN_TRAINER_OPTIM_FOREACH_SGD_H_
#define ELRUN_TRAINER_OPTIM_FOREACH_SGD_H_

#include <torch/torch.h>

#include <utility>
#include <vector>

namespace elrun::trainer {

class ForeachSgd : public torch::optim::SGD {
 public:
  ForeachSgd(const std::vector<torch::Tensor>& params, torch::optim::SGDOptions options)
      : torch::optim::SGD(params, options) {}
  torch::Tensor step(LossClosure closure = nullptr) override;

  // From now on the learning rate is this 0-dim tensor on the parameters' device, not the
  // options' number: a step captured in a CUDA graph (cuda_graph_step.h) reads the rate each
  // replay instead of baking one in. The step becomes p -= lr * d, the same number as
  // p += (-lr) * d up to the contraction of the multiply-add.
  void set_device_lr(torch::Tensor lr) { device_lr_ = std::move(lr); }

 private:
  torch::Tensor device_lr_;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_OPTIM_FOREACH_SGD_H_
