#include "trainer/parallel/grad_clip.h"

#include <cmath>

#include "trainer/dist/collectives.h"

namespace elrun::trainer {

double ClipGradNorm(const std::vector<torch::Tensor>& params, double max_norm, c10d::Backend* shards_over) {
  torch::Tensor squares;
  for (const torch::Tensor& p : params) {
    const torch::Tensor& g = p.grad();
    if (!g.defined()) continue;
    torch::Tensor s = g.detach().to(torch::kFloat64).pow(2).sum();
    squares = squares.defined() ? squares + s : s;
  }
  if (!squares.defined()) {
    squares = torch::zeros({}, torch::TensorOptions()
                                   .dtype(torch::kFloat64)
                                   .device(params.empty() ? torch::Device(torch::kCPU) : params.front().device()));
  }
  if (shards_over != nullptr) {
    // On the backend's device (offloaded shards are CPU tensors, NCCL takes CUDA ones).
    std::vector<torch::Tensor> sum = {squares.reshape({1}).to(CommDevice(*shards_over))};
    shards_over->allreduce(sum)->wait();
    squares = sum[0].reshape({}).cpu();
  }
  const double norm = std::sqrt(squares.item<double>());
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    torch::NoGradGuard no_grad;
    for (const torch::Tensor& p : params) {
      if (p.grad().defined()) p.grad().mul_(coefficient);
    }
  }
  return norm;
}

}  // namespace elrun::trainer
