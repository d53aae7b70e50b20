#include "trainer/optim/grad_scaler.h"

#include <map>
#include <utility>

#include "trainer/dist/collectives.h"

namespace elrun::trainer {

GradScaler::GradScaler(GradScalerOptions options, c10::intrusive_ptr<c10d::Backend> pg)
    : options_(options), pg_(std::move(pg)) {
  TORCH_CHECK(options_.init_scale > 0 && options_.growth_factor > 1 && options_.backoff_factor > 0 &&
                  options_.backoff_factor < 1 && options_.growth_interval > 0,
              "GradScaler: expected init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0");
  Restore(options_.init_scale, 0);
}

void GradScaler::Restore(double scale, int64_t growth_tracker) {
  TORCH_CHECK(scale > 0 && growth_tracker >= 0, "GradScaler: bad state (scale ", scale, ", growth tracker ",
              growth_tracker, ")");
  scale_ = torch::full({1}, scale, torch::kFloat);
  growth_tracker_ = torch::full({1}, growth_tracker, torch::kInt);
  found_inf_ = torch::zeros({1}, torch::kFloat);
  unscaled_ = false;
}

double GradScaler::scale() const { return scale_.item<double>(); }
int64_t GradScaler::growth_tracker() const { return growth_tracker_.item<int64_t>(); }

torch::Tensor GradScaler::Scale(const torch::Tensor& loss) const {
  return loss * scale_.to(loss.device()).to(loss.scalar_type()).squeeze();
}

bool GradScaler::Unscale(const std::vector<torch::Tensor>& params) {
  if (!unscaled_) {
    torch::NoGradGuard no_grad;
    found_inf_.zero_();
    // ATen's kernel takes gradients of one device and dtype at a time.
    std::map<std::pair<std::string, c10::ScalarType>, std::vector<torch::Tensor>> groups;
    for (const auto& p : params) {
      const torch::Tensor& g = p.grad();
      if (g.defined()) groups[{g.device().str(), g.scalar_type()}].push_back(g);
    }
    const torch::Tensor inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
    for (auto& [key, grads] : groups) {
      const torch::Device device = grads.front().device();
      torch::Tensor found = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(device));
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device));
      found_inf_.add_(found.cpu());
    }
    if (pg_ && pg_->getSize() > 1) {
      std::vector<torch::Tensor> one{found_inf_.to(CommDevice(*pg_))};
      c10d::AllreduceOptions max;
      max.reduceOp = c10d::ReduceOp::MAX;
      pg_->allreduce(one, max)->wait();
      found_inf_.copy_(one[0].cpu());
    }
    unscaled_ = true;
  }
  return found_inf_.item<float>() == 0;
}

bool GradScaler::Step(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& params) {
  const bool finite = Unscale(params);
  if (finite) {
    optimizer.step();
  } else {
    ++skipped_;
  }
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor, options_.backoff_factor,
                         options_.growth_interval);
  unscaled_ = false;
  return finite;
}

}  // namespace elrun::trainer
