#include "trainer/sync_batch_norm.h"

namespace elrun::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Dimensions reduced for per-channel statistics: all but dim 1.
std::vector<int64_t> ReduceDims(const torch::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// Shape that broadcasts a [C] tensor against x.
std::vector<int64_t> ChannelShape(const torch::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = x.size(1);
  return shape;
}


// Normalises with statistics already reduced across ranks; backward reduces across ranks too.
class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor input, torch::Tensor weight,
                               torch::Tensor bias, torch::Tensor mean, torch::Tensor invstd,
                               double count, c10d::ProcessGroup* pg, ShmAllreduce* shm) {
    auto shape = ChannelShape(input);
    torch::Tensor xhat = (input - mean.view(shape)) * invstd.view(shape);
    torch::Tensor out = weight.defined() ? xhat * weight.view(shape) + bias.view(shape) : xhat;
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["count"] = count;
    ctx->saved_data["pg"] = reinterpret_cast<int64_t>(pg);
    ctx->saved_data["shm"] = reinterpret_cast<int64_t>(shm);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    torch::Tensor input = saved[0], weight = saved[1], mean = saved[2], invstd = saved[3];
    double count = ctx->saved_data["count"].toDouble();
    auto* pg = reinterpret_cast<c10d::ProcessGroup*>(ctx->saved_data["pg"].toInt());
    auto* shm = reinterpret_cast<ShmAllreduce*>(ctx->saved_data["shm"].toInt());
    torch::Tensor dy = grads[0];
    auto dims = ReduceDims(input);
    auto shape = ChannelShape(input);
    const int64_t channels = input.size(1);

    torch::Tensor xmu = input - mean.view(shape);
    // Local sums, reduced across ranks in one collective: [sum_dy, sum_dy_xmu].
    torch::Tensor local = torch::cat({dy.sum(dims), (dy * xmu).sum(dims)}).to(torch::kDouble);
    torch::Tensor global = local.clone();
    AllreduceSum(*pg, shm, global)->wait();
    torch::Tensor sum_dy = global.narrow(0, 0, channels).to(input.scalar_type());
    torch::Tensor sum_dy_xmu = global.narrow(0, channels, channels).to(input.scalar_type());

    torch::Tensor scale = weight.defined() ? weight * invstd : invstd;
    torch::Tensor grad_input;
    if (count > 0) {
      grad_input = scale.view(shape) *
                   (dy - (sum_dy / count).view(shape) -
                    xmu * (invstd * invstd * sum_dy_xmu / count).view(shape));
    } else {
      grad_input = torch::zeros_like(input);
    }
    // Parameter gradients are this rank's own share (DDP then reduces them like any other).
    torch::Tensor local_sum_dy = local.narrow(0, 0, channels).to(input.scalar_type());
    torch::Tensor local_sum_dy_xmu = local.narrow(0, channels, channels).to(input.scalar_type());
    torch::Tensor grad_weight = weight.defined() ? local_sum_dy_xmu * invstd : torch::Tensor();
    torch::Tensor grad_bias = weight.defined() ? local_sum_dy : torch::Tensor();
    return {grad_input, grad_weight, grad_bias, torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};  // None for mean, invstd, count, pg, shm.
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                                     c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<ShmAllreduce> shm)
    : options_(options), pg_(std::move(pg)), shm_(std::move(shm)) {
  TORCH_CHECK(!shm_ || shm_->Spans(*pg_),
              "SyncBatchNorm: the shared-memory all-reduce spans other ranks than the process group");
  const int64_t c = options_.num_features();
  if (options_.affine()) {
    weight = register_parameter("weight", torch::ones({c}));
    bias = register_parameter("bias", torch::zeros({c}));
  }
  if (options_.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
  }
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2 && input.size(1) == options_.num_features(),
              "SyncBatchNorm: expected input [N, ", options_.num_features(), ", ...], got ",
              input.sizes());
  const int64_t c = options_.num_features();
  auto shape = ChannelShape(input);
  if (!is_training() && options_.track_running_stats()) {
    // Eval: running stats, no communication.
    torch::Tensor invstd = torch::rsqrt(running_var + options_.eps());
    torch::Tensor out = (input - running_mean.view(shape)) * invstd.view(shape);
    return options_.affine() ? out * weight.view(shape) + bias.view(shape) : out;
  }

  // Sums and count of this rank, reduced across ranks in one collective: [sum, sumsq, count].
  auto dims = ReduceDims(input);
  torch::Tensor x = input.detach().to(torch::kDouble);
  double local_count = input.size(1) > 0 ? static_cast<double>(input.numel() / c) : 0.0;
  torch::Tensor stats = torch::cat({x.sum(dims), (x * x).sum(dims),
                                    torch::full({1}, local_count, torch::kDouble)});
  AllreduceSum(*pg_, shm_.get(), stats)->wait();
  double count = stats[2 * c].item<double>();
  TORCH_CHECK(count > 0, "SyncBatchNorm: every rank's batch is empty");
  torch::Tensor mean = stats.narrow(0, 0, c) / count;
  torch::Tensor var = (stats.narrow(0, c, c) / count - mean * mean).clamp_min(0);

  if (options_.track_running_stats()) {
    torch::NoGradGuard no_grad;
    num_batches_tracked += 1;
    double momentum = options_.momentum().has_value()
                          ? *options_.momentum()
                          : 1.0 / num_batches_tracked.item<double>();
    torch::Tensor unbiased = count > 1 ? var * (count / (count - 1)) : var;
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.scalar_type()) * momentum);
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.scalar_type()) * momentum);
  }
  torch::Tensor invstd = torch::rsqrt(var + options_.eps()).to(input.scalar_type());
  return SyncBatchNormFunction::apply(input, options_.affine() ? weight : torch::Tensor(),
                                      options_.affine() ? bias : torch::Tensor(),
                                      mean.to(input.scalar_type()), invstd, count, pg_.get(), shm_.get());
}

namespace {

template <typename BatchNormImpl>
std::shared_ptr<SyncBatchNormImpl> ConvertOne(const std::shared_ptr<torch::nn::Module>& child,
                                              const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                              const std::shared_ptr<ShmAllreduce>& shm) {
  auto bn = std::dynamic_pointer_cast<BatchNormImpl>(child);
  if (!bn) return nullptr;
  auto sync = std::make_shared<SyncBatchNormImpl>(bn->options, pg, shm);
  torch::NoGradGuard no_grad;
  if (bn->options.affine()) {
    sync->weight.copy_(bn->weight);
    sync->bias.copy_(bn->bias);
  }
  if (bn->options.track_running_stats()) {
    sync->running_mean.copy_(bn->running_mean);
    sync->running_var.copy_(bn->running_var);
    sync->num_batches_tracked.copy_(bn->num_batches_tracked);
  }
  if (!child->is_training()) sync->eval();
  return sync;
}

}  // namespace

int ConvertSyncBatchNorm(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                         std::shared_ptr<ShmAllreduce> shm) {
  int replaced = 0;
  for (const auto& item : module.named_children()) {
    std::shared_ptr<SyncBatchNormImpl> sync = ConvertOne<torch::nn::BatchNorm1dImpl>(item.value(), pg, shm);
    if (!sync) sync = ConvertOne<torch::nn::BatchNorm2dImpl>(item.value(), pg, shm);
    if (!sync) sync = ConvertOne<torch::nn::BatchNorm3dImpl>(item.value(), pg, shm);
    if (sync) {
      module.replace_module(item.key(), sync);
      ++replaced;
    } else {
      replaced += ConvertSyncBatchNorm(*item.value(), pg, shm);
    }
  }
  return replaced;
}

torch::Tensor ApplyNorm(torch::nn::Module& norm, const torch::Tensor& x) {
  if (auto* m = dynamic_cast<SyncBatchNormImpl*>(&norm)) return m->forward(x);
  if (auto* m = dynamic_cast<torch::nn::BatchNorm2dImpl*>(&norm)) return m->forward(x);
  if (auto* m = dynamic_cast<torch::nn::BatchNorm1dImpl*>(&norm)) return m->forward(x);
  if (auto* m = dynamic_cast<torch::nn::BatchNorm3dImpl*>(&norm)) return m->forward(x);
  TORCH_CHECK(false, "ApplyNorm: ", norm.name(), " is not a batch norm layer");
}

}  // namespace elrun::trainer
