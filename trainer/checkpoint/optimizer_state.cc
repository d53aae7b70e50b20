#include "trainer/checkpoint/optimizer_state.h"

#include "absl/strings/str_cat.h"

namespace elrun::trainer {
namespace {

// How LibTorch's optimizers key their per-parameter state.
void* StateKey(const torch::Tensor& param) { return param.unsafeGetTensorImpl(); }

absl::StatusOr<torch::Tensor> Field(const ParamState& state, const std::string& name, const torch::Tensor& param) {
  auto it = state.find(name);
  if (it == state.end()) return absl::InvalidArgumentError(absl::StrCat("optimizer state lacks ", name));
  if (it->second.sizes() != param.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer state ", name, " has another shape"));
  }
  return it->second.to(param.device(), param.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

// Adam's and AdamW's state: the same fields in two classes.
template <typename State>
void ExportAdamState(const State& adam, ParamState& out) {
  out["exp_avg"] = CpuCopy(adam.exp_avg());
  out["exp_avg_sq"] = CpuCopy(adam.exp_avg_sq());
  if (adam.max_exp_avg_sq().defined()) out["max_exp_avg_sq"] = CpuCopy(adam.max_exp_avg_sq());
  out["step"] = torch::tensor(adam.step(), torch::kLong);
}

template <typename State>
absl::StatusOr<std::unique_ptr<State>> ImportAdamState(const torch::Tensor& param, const ParamState& state) {
  auto exp_avg = Field(state, "exp_avg", param);
  auto exp_avg_sq = Field(state, "exp_avg_sq", param);
  if (!exp_avg.ok()) return exp_avg.status();
  if (!exp_avg_sq.ok()) return exp_avg_sq.status();
  auto step = state.find("step");
  if (step == state.end()) return absl::InvalidArgumentError("optimizer state lacks step");
  auto s = std::make_unique<State>();
  s->step(step->second.item<int64_t>());
  s->exp_avg(*exp_avg);
  s->exp_avg_sq(*exp_avg_sq);
  if (state.count("max_exp_avg_sq")) {
    auto max = Field(state, "max_exp_avg_sq", param);
    if (!max.ok()) return max.status();
    s->max_exp_avg_sq(*max);
  }
  return s;
}

}  // namespace

absl::StatusOr<std::string> OptimizerKind(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return std::string("sgd");
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return std::string("adam");
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return std::string("adamw");
  return absl::InvalidArgumentError("only SGD, Adam and AdamW state can be checkpointed");
}

ParamState ExportParamState(const torch::optim::Optimizer& optimizer, const torch::Tensor& param) {
  ParamState out;
  auto it = optimizer.state().find(StateKey(param));
  if (it == optimizer.state().end()) return out;
  if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) {
    if (sgd->momentum_buffer().defined()) out["momentum_buffer"] = CpuCopy(sgd->momentum_buffer());
  } else if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get())) {
    ExportAdamState(*adam, out);
  } else if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) {
    ExportAdamState(*adamw, out);
  }
  return out;
}

absl::Status ImportParamState(torch::optim::Optimizer& optimizer, const torch::Tensor& param, const ParamState& state) {
  absl::StatusOr<std::string> kind = OptimizerKind(optimizer);
  if (!kind.ok()) return kind.status();
  if (state.empty()) {
    optimizer.state().erase(StateKey(param));
    return absl::OkStatus();
  }
  if (*kind == "sgd") {
    auto momentum = Field(state, "momentum_buffer", param);
    if (!momentum.ok()) return momentum.status();
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(*momentum);
    optimizer.state()[StateKey(param)] = std::move(s);
    return absl::OkStatus();
  }
  if (*kind == "adamw") {
    auto s = ImportAdamState<torch::optim::AdamWParamState>(param, state);
    if (!s.ok()) return s.status();
    optimizer.state()[StateKey(param)] = std::move(*s);
    return absl::OkStatus();
  }
  auto s = ImportAdamState<torch::optim::AdamParamState>(param, state);
  if (!s.ok()) return s.status();
  optimizer.state()[StateKey(param)] = std::move(*s);
  return absl::OkStatus();
}

}  // namespace elrun::trainer
