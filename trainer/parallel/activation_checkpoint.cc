#include "trainer/parallel/activation_checkpoint.h"

#include <torch/csrc/autograd/custom_function.h>

namespace elrun::trainer {
namespace {

// Carries `run` from forward to backward in the autograd context.
struct RunHolder : torch::CustomClassHolder {
  explicit RunHolder(TensorFn fn) : run(std::move(fn)) {}
  TensorFn run;
};

class Checkpoint : public torch::autograd::Function<Checkpoint> {
 public:
  // `anchor` is a scalar that requires grad, so the output does whatever `input` is.
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& anchor, c10::intrusive_ptr<RunHolder> holder) {
    ctx->save_for_backward({input});
    ctx->saved_data["run"] = c10::IValue::make_capsule(holder);
    torch::Tensor output = holder->run(input);  // Grad mode is off in a custom forward.
    (void)anchor;
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::Tensor input = ctx->get_saved_variables()[0];
    auto holder = c10::static_intrusive_pointer_cast<RunHolder>(ctx->saved_data["run"].toCapsule());
    torch::Tensor x = input.detach();
    x.requires_grad_(input.requires_grad());
    torch::Tensor output;
    {
      torch::AutoGradMode enable(true);
      output = holder->run(x);
    }
    // Reentrant: accumulates into the parameters' .grad (their hooks fire as usual).
    torch::autograd::backward({output}, {grads[0]});
    return {input.requires_grad() ? x.grad() : torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Carries a TensorsFn from forward to backward.
struct RunManyHolder : torch::CustomClassHolder {
  explicit RunManyHolder(TensorsFn fn) : run(std::move(fn)) {}
  TensorsFn run;
};

class CheckpointMany : public torch::autograd::Function<CheckpointMany> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                const torch::Tensor& anchor, c10::intrusive_ptr<RunManyHolder> holder) {
    (void)anchor;
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["run"] = c10::IValue::make_capsule(holder);
    return holder->run(inputs.vec());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list inputs = ctx->get_saved_variables();
    auto holder = c10::static_intrusive_pointer_cast<RunManyHolder>(ctx->saved_data["run"].toCapsule());
    std::vector<torch::Tensor> xs;
    for (const auto& input : inputs) {
      if (!input.defined()) {
        xs.emplace_back();
        continue;
      }
      torch::Tensor x = input.detach();
      x.requires_grad_(input.requires_grad());
      xs.push_back(x);
    }
    std::vector<torch::Tensor> outputs;
    {
      torch::AutoGradMode enable(true);
      outputs = holder->run(xs);
    }
    torch::autograd::variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (!grads[i].defined() || !outputs[i].defined() || !outputs[i].requires_grad()) continue;
      roots.push_back(outputs[i]);
      root_grads.push_back(grads[i]);
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list result;
    for (size_t i = 0; i < xs.size(); ++i) {
      result.push_back(xs[i].defined() && xs[i].requires_grad() ? xs[i].grad() : torch::Tensor());
    }
    result.emplace_back();  // anchor
    result.emplace_back();  // holder
    return result;
  }
};

}  // namespace

std::vector<torch::Tensor> CheckpointedCall(const std::vector<torch::Tensor>& inputs, TensorsFn run) {
  if (!torch::GradMode::is_enabled()) return run(inputs);
  torch::TensorOptions options;
  for (const auto& input : inputs) {
    if (input.defined()) {
      options = input.options();
      break;
    }
  }
  torch::Tensor anchor = torch::zeros({}, options.dtype(torch::kFloat).requires_grad(true));
  return CheckpointMany::apply(at::TensorList(inputs), anchor, c10::make_intrusive<RunManyHolder>(std::move(run)));
}

torch::Tensor CheckpointedCall(const torch::Tensor& input, TensorFn run) {
  if (!torch::GradMode::is_enabled()) return run(input);
  // Integer inputs (token ids) cannot require grad: the anchor is then a float.
  const auto dtype = at::isFloatingType(input.scalar_type()) ? input.scalar_type() : torch::kFloat;
  torch::Tensor anchor = torch::zeros({}, input.options().dtype(dtype).requires_grad(true));
  return Checkpoint::apply(input, anchor, c10::make_intrusive<RunHolder>(std::move(run)));
}

}  // namespace elrun::trainer
