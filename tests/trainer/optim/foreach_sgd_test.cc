#include "trainer/optim/foreach_sgd.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace elrun::trainer {
namespace {

struct Case {
  std::string name;
  torch::optim::SGDOptions options;
};

// The same five steps of two optimizers on two identical parameter sets; one parameter gets no
// gradient on some steps (skipped, its buffer untouched), one joins the momentum late.
void ExpectSameTrajectory(const torch::optim::SGDOptions& options, const torch::Device& device) {
  torch::manual_seed(7);
  std::vector<torch::Tensor> a, b;
  for (auto shape : std::vector<std::vector<int64_t>>{{4, 3}, {5}, {2, 3, 3, 3}, {1}}) {
    a.push_back(torch::randn(shape).to(device).requires_grad_());
    b.push_back(a.back().detach().clone().requires_grad_());
  }
  torch::optim::SGD reference(a, options);
  ForeachSgd foreach (b, options);
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      a[i].mutable_grad() = torch::Tensor();
      b[i].mutable_grad() = torch::Tensor();
      const bool skipped = (i == 1 && step % 2 == 1) || (i == 3 && step < 2);
      if (skipped) continue;
      torch::Tensor g = torch::randn(a[i].sizes()).to(device);
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
    reference.step();
    foreach
      .step();
    for (size_t i = 0; i < a.size(); ++i) {
      CAPTURE(step);
      CAPTURE(i);
      CHECK(torch::equal(a[i], b[i]));
    }
  }
  // The same state, parameter by parameter, as checkpoints and memory reports read it.
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& sa = reference.state();
    const auto& sb = foreach.state();
    auto ia = sa.find(a[i].unsafeGetTensorImpl());
    auto ib = sb.find(b[i].unsafeGetTensorImpl());
    REQUIRE((ia == sa.end()) == (ib == sb.end()));
    if (ia == sa.end()) continue;
    CHECK(torch::equal(static_cast<torch::optim::SGDParamState&>(*ia->second).momentum_buffer(),
                       static_cast<torch::optim::SGDParamState&>(*ib->second).momentum_buffer()));
  }
}

TEST_CASE("ForeachSgd steps exactly as torch::optim::SGD, on every option") {
  const std::vector<Case> cases = {
      {"plain", torch::optim::SGDOptions(0.1)},
      {"momentum", torch::optim::SGDOptions(0.05).momentum(0.9)},
      {"momentum, weight decay", torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-2)},
      {"dampening", torch::optim::SGDOptions(0.05).momentum(0.8).dampening(0.3)},
      {"nesterov", torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3)},
  };
  for (const auto& c : cases) {
    SUBCASE(c.name.c_str()) { ExpectSameTrajectory(c.options, torch::kCPU); }
  }
}

TEST_CASE("ForeachSgd is still an SGD to code that inspects the optimizer") {
  std::vector<torch::Tensor> params{torch::zeros({2}, torch::requires_grad())};
  ForeachSgd sgd(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::Optimizer& base = sgd;
  CHECK(dynamic_cast<torch::optim::SGD*>(&base) != nullptr);
}

}  // namespace
}  // namespace elrun::trainer
