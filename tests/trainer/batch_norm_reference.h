// A batch-norm layer's training step at a real layer's size (FashionNet's first: 32 channels over
// 28 x 28, batch 32 per rank) with means large against the spread, and what a float64 BatchNorm
// over the union of the ranks' batches makes of it: the yardstick SyncBatchNorm is held to in
// both memory layouts, on CPU (sync_batch_norm_test) and CUDA (cuda_test). Issue 33: ATen's CPU
// kernels reduce a channels-last tensor with one float accumulator per channel, ~3e-5 off on a
// mean of 5, a third of a percent of a standard deviation of 0.1.
#ifndef ELRUN_TESTS_TRAINER_BATCH_NORM_REFERENCE_H_
#define ELRUN_TESTS_TRAINER_BATCH_NORM_REFERENCE_H_

#include <torch/torch.h>

namespace elrun::trainer {

struct BatchNormCase {
  static constexpr int64_t kChannels = 32;
  static constexpr int64_t kPerRank = 32;
  torch::Tensor gamma, beta;  // [C]

  BatchNormCase() {
    auto gen = at::detail::createCPUGenerator(90);
    gamma = torch::rand({kChannels}, gen) + 0.5;
    beta = torch::randn({kChannels}, gen);
  }
  // Rank `rank`'s input (contiguous NCHW, float): means 2 to 7, standard deviation 0.1.
  torch::Tensor Input(int rank) const {
    const torch::Tensor offsets = torch::rand({1, kChannels, 1, 1}, at::detail::createCPUGenerator(40)) * 5 + 2;
    return torch::randn({kPerRank, kChannels, 28, 28}, at::detail::createCPUGenerator(50 + rank)) * 0.1 + offsets;
  }
  // The weights of rank `rank`'s loss sum(y * w): zero-mean, so each channel's sum of dy cancels.
  torch::Tensor LossWeights(int rank) const {
    return torch::randn({kPerRank, kChannels, 28, 28}, at::detail::createCPUGenerator(70 + rank));
  }
};

struct BatchNormResult {
  torch::Tensor out, grad_input, grad_weight, grad_bias, running_mean, running_var;
};

// One training step of a float64 BatchNorm (momentum 0.1, eps 1e-5) over the union of `world`
// ranks' batches.
inline BatchNormResult BatchNormReference(const BatchNormCase& c, int world) {
  std::vector<torch::Tensor> xs, ws;
  for (int rank = 0; rank < world; ++rank) {
    xs.push_back(c.Input(rank));
    ws.push_back(c.LossWeights(rank));
  }
  torch::Tensor x = torch::cat(xs).to(torch::kDouble).requires_grad_(true);
  torch::Tensor w = c.gamma.to(torch::kDouble).requires_grad_(true);
  torch::Tensor b = c.beta.to(torch::kDouble).requires_grad_(true);
  BatchNormResult r;
  r.running_mean = torch::zeros({BatchNormCase::kChannels}, torch::kDouble);
  r.running_var = torch::ones({BatchNormCase::kChannels}, torch::kDouble);
  torch::Tensor out = torch::batch_norm(x, w, b, r.running_mean, r.running_var, true, 0.1, 1e-5, false);
  (out * torch::cat(ws).to(torch::kDouble)).sum().backward();
  r.out = out.detach();
  r.grad_input = x.grad();
  r.grad_weight = w.grad();
  r.grad_bias = b.grad();
  return r;
}

// max |a - reference| / max |reference|, a on any device and dtype.
inline double RelativeToLargest(const torch::Tensor& a, const torch::Tensor& reference) {
  return (a.detach().cpu().to(torch::kDouble) - reference).abs().max().item<double>() /
         reference.abs().max().item<double>();
}

}  // namespace elrun::trainer

#endif  // ELRUN_TESTS_TRAINER_BATCH_NORM_REFERENCE_H_
