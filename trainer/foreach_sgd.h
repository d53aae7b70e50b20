// torch::optim::SGD whose step runs as a few multi-tensor (foreach) kernels over all parameters
// instead of three kernels per parameter, as torch.optim.SGD does by default on CUDA: FashionNet's
// step on a GPU at batch 64 is bound by kernel launches (README, "GPU"). The arithmetic, the
// options and the state (SGDParamState's momentum buffers, so checkpoints and memory reports
// see an SGD) are LibTorch's; the results equal torch::optim::SGD's (tests/trainer).
#ifndef ELRUN_TRAINER_FOREACH_SGD_H_
#define ELRUN_TRAINER_FOREACH_SGD_H_

#include <torch/torch.h>

#include <vector>

namespace elrun::trainer {

class ForeachSgd : public torch::optim::SGD {
 public:
  ForeachSgd(const std::vector<torch::Tensor>& params, torch::optim::SGDOptions options)
      : torch::optim::SGD(params, options) {}
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_FOREACH_SGD_H_
