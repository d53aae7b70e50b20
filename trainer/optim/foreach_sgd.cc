#include "trainer/optim/foreach_sgd.h"

#include <utility>

namespace elrun::trainer {

torch::Tensor ForeachSgd::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups()) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
    std::vector<torch::Tensor> params, grads, buffers;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      params.push_back(p);
      grads.push_back(p.grad());
    }
    if (params.empty()) continue;
    if (options.weight_decay() != 0) grads = at::_foreach_add(grads, params, options.weight_decay());
    std::vector<torch::Tensor> steps = grads;
    if (options.momentum() != 0) {
      // A parameter's first step starts its buffer at its gradient, as torch::optim::SGD does;
      // the others decay and accumulate together.
      std::vector<torch::Tensor> running, running_grads;
      for (size_t i = 0; i < params.size(); ++i) {
        auto found = state().find(params[i].unsafeGetTensorImpl());
        if (found == state().end()) {
          auto fresh = std::make_unique<torch::optim::SGDParamState>();
          fresh->momentum_buffer(torch::clone(grads[i]).detach());
          buffers.push_back(fresh->momentum_buffer());
          state()[params[i].unsafeGetTensorImpl()] = std::move(fresh);
        } else {
          buffers.push_back(static_cast<torch::optim::SGDParamState&>(*found->second).momentum_buffer());
          running.push_back(buffers.back());
          running_grads.push_back(grads[i]);
        }
      }
      if (!running.empty()) {
        at::_foreach_mul_(running, options.momentum());
        at::_foreach_add_(running, running_grads, 1 - options.dampening());
      }
      steps = options.nesterov() ? at::_foreach_add(grads, buffers, options.momentum()) : buffers;
    }
    if (device_lr_.defined()) {
      at::_foreach_sub_(params, at::_foreach_mul(steps, device_lr_));
    } else {
      at::_foreach_add_(params, steps, -options.lr());
    }
  }
  return loss;
}

}  // namespace elrun::trainer
