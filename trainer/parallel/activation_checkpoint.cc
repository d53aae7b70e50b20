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

}  // namespace

torch::Tensor CheckpointedCall(const torch::Tensor& input, TensorFn run) {
  if (!torch::GradMode::is_enabled()) return run(input);
  // Integer inputs (token ids) cannot require grad: the anchor is then a float.
  const auto dtype = at::isFloatingType(input.scalar_type()) ? input.scalar_type() : torch::kFloat;
  torch::Tensor anchor = torch::zeros({}, input.options().dtype(dtype).requires_grad(true));
  return Checkpoint::apply(input, anchor, c10::make_intrusive<RunHolder>(std::move(run)));
}

}  // namespace elrun::trainer
