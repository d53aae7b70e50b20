#include "trainer/parallel/sync_batch_norm.h"

namespace elrun::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Shape that broadcasts a [C] tensor against x.
std::vector<int64_t> ChannelShape(const torch::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = x.size(1);
  return shape;
}

// A channels-last input (NHWC, NDHWC) as the [M, C] matrix its memory is, M = N x spatial: a
// view. Undefined for any other layout (contiguous NCHW included).
torch::Tensor ChannelRows(const torch::Tensor& x) {
  const bool rows = (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
                    (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d));
  if (!rows || x.is_contiguous() || x.numel() == 0) return {};
  return x.movedim(1, -1).reshape({-1, x.size(1)});
}

// This rank's per-channel mean and biased variance, in double. ATen's batch-norm statistics
// kernel is one fused pass, and exact enough over a contiguous (NCHW) input, where it sums each
// channel's run with cascaded partial sums; over a channels-last input its CPU kernel keeps one
// float accumulator per channel through all M rows, which at M = 25,088 (FashionNet's first
// layer) puts the mean off by ~1e-5 of its value: a visible share of a standard deviation when
// the mean is large against it (issue 33). Channels-last inputs are therefore reduced over the
// rows with ATen's sum (cascaded along the rows too), around a first estimate of the mean so
// the sums that matter are of small numbers: shift = sum(x) / M, d = x - shift,
// mean = shift + sum(d) / M, var = sum(d^2) / M - (sum(d) / M)^2.
std::pair<torch::Tensor, torch::Tensor> LocalStats(const torch::Tensor& input) {
  torch::Tensor rows = ChannelRows(input);
  if (!rows.defined()) {
    auto [mean, var] = at::batch_norm_update_stats(input, {}, {}, 0);
    return {mean.to(torch::kDouble), var.to(torch::kDouble)};
  }
  const double m = static_cast<double>(rows.size(0));
  torch::Tensor shift = rows.sum(0).div_(m);
  torch::Tensor d = rows - shift;
  torch::Tensor s1 = d.sum(0).to(torch::kDouble) / m;
  torch::Tensor s2 = d.mul_(d).sum(0).to(torch::kDouble) / m;
  return {shift.to(torch::kDouble) + s1, (s2 - s1 * s1).clamp_min(0)};
}

// This rank's sum(dy) and sum(dy * xhat) per channel, xhat = (x - mean) * invstd: the bias and
// weight gradients of a batch norm with these statistics. ATen's backward kernel reduces both in
// one pass; channels-last inputs go over the rows instead, as in LocalStats.
std::pair<torch::Tensor, torch::Tensor> LocalGradSums(const torch::Tensor& dy, const torch::Tensor& input,
                                                      const torch::Tensor& weight, const torch::Tensor& mean,
                                                      const torch::Tensor& invstd) {
  torch::Tensor rows = ChannelRows(input), dy_rows = ChannelRows(dy);
  if (!rows.defined() || !dy_rows.defined()) {
    torch::Tensor sum_dy, sum_dy_xhat;
    std::tie(std::ignore, sum_dy_xhat, sum_dy) = at::native_batch_norm_backward(
        dy, input, weight, {}, {}, mean, invstd, /*train=*/true, /*eps=*/0, {false, true, true});
    return {sum_dy, sum_dy_xhat};
  }
  torch::Tensor sum_dy = dy_rows.sum(0);
  torch::Tensor sum_dy_xhat = (rows - mean).mul_(dy_rows).sum(0).mul_(invstd);
  return {sum_dy, sum_dy_xhat};
}

// Normalises with statistics already reduced across ranks; backward reduces across ranks too.
// Every pass over the activations is one of ATen's fused, vectorised batch-norm kernels or a
// single broadcast op (channels-last reductions: a few row sums, LocalStats); the composite
// version (sums over dims, double copies, one op per term) took several times longer.
class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  // `mean` and `var`: the global batch statistics, in the input's type. Without `affine`,
  // `weight` and `bias` are ones and zeros and get no gradient (LibTorch 1.13's custom functions
  // cannot take undefined tensors).
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor input, torch::Tensor weight, torch::Tensor bias,
                               torch::Tensor mean, torch::Tensor var, double eps, double count, bool affine,
                               c10d::Backend* pg, ShmAllreduce* shm) {
    // Inference-mode batch norm with the global statistics as its "running" ones: one pass.
    // ATen's kernel divides by the batch size, so an empty batch does not go through it.
    torch::Tensor out = input.numel() == 0
                            ? at::empty_like(input)
                            : std::get<0>(at::native_batch_norm(input, weight, bias, mean, var,
                                                                /*training=*/false, /*momentum=*/0, eps));
    ctx->save_for_backward({input, weight, mean, torch::rsqrt(var + eps)});
    ctx->saved_data["count"] = count;
    ctx->saved_data["affine"] = affine;
    ctx->saved_data["pg"] = reinterpret_cast<int64_t>(pg);
    ctx->saved_data["shm"] = reinterpret_cast<int64_t>(shm);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    torch::Tensor input = saved[0], weight = saved[1], mean = saved[2], invstd = saved[3];
    double count = ctx->saved_data["count"].toDouble();
    const bool affine = ctx->saved_data["affine"].toBool();
    auto* pg = reinterpret_cast<c10d::Backend*>(ctx->saved_data["pg"].toInt());
    auto* shm = reinterpret_cast<ShmAllreduce*>(ctx->saved_data["shm"].toInt());
    torch::Tensor dy = grads[0].contiguous(input.suggest_memory_format());
    const int64_t channels = input.size(1);
    // This rank's sum(dy) and sum(dy * xhat), xhat = (x - mean) * invstd: the bias and weight
    // gradients of a batch norm with these statistics, which ATen's backward kernel reduces in
    // one pass. They are summed across ranks in one collective.
    torch::Tensor sum_dy, sum_dy_xhat;
    if (input.numel() > 0) {
      std::tie(sum_dy, sum_dy_xhat) = LocalGradSums(dy, input, weight, mean, invstd);
    } else {
      sum_dy = torch::zeros({channels}, input.options());
      sum_dy_xhat = torch::zeros({channels}, input.options());
    }
    torch::Tensor global = torch::cat({sum_dy, sum_dy_xhat}).to(torch::kDouble);
    AllreduceSum(*pg, shm, global)->wait();
    torch::Tensor grad_input;
    if (input.numel() > 0) {
      // grad_input = a * (dy - sum_dy / n - xhat * sum_dy_xhat / n), a = weight * invstd, is
      // a * dy + b * x + c per channel: two passes.
      torch::Tensor invstd_d = invstd.to(torch::kDouble);
      torch::Tensor a = weight.detach().to(torch::kDouble) * invstd_d;
      torch::Tensor b = -a * invstd_d * global.narrow(0, channels, channels) / count;
      torch::Tensor c = -a * global.narrow(0, 0, channels) / count - b * mean.to(torch::kDouble);
      auto shape = ChannelShape(input);
      auto per_channel = [&](const torch::Tensor& t) { return t.to(input.scalar_type()).view(shape); };
      grad_input = at::addcmul(per_channel(c), input, per_channel(b));
      grad_input.addcmul_(dy, per_channel(a));
    } else {
      grad_input = torch::zeros_like(input);
    }
    // Parameter gradients are this rank's own share (DDP then reduces them like any other).
    torch::Tensor grad_weight = affine ? sum_dy_xhat : torch::Tensor();
    torch::Tensor grad_bias = affine ? sum_dy : torch::Tensor();
    return {grad_input,      grad_weight,     grad_bias,       torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};  // None: statistics, flags.
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, c10::intrusive_ptr<c10d::Backend> pg,
                                     std::shared_ptr<ShmAllreduce> shm)
    : options_(options) {
  Attach(std::move(pg), std::move(shm));
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

void SyncBatchNormImpl::Attach(c10::intrusive_ptr<c10d::Backend> pg, std::shared_ptr<ShmAllreduce> shm) {
  TORCH_CHECK(pg || !shm, "SyncBatchNorm: a shared-memory all-reduce needs its process group");
  TORCH_CHECK(!shm || shm->Spans(*pg),
              "SyncBatchNorm: the shared-memory all-reduce spans other ranks than the process group");
  pg_ = std::move(pg);
  shm_ = std::move(shm);
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2 && input.size(1) == options_.num_features(), "SyncBatchNorm: expected input [N, ",
              options_.num_features(), ", ...], got ", input.sizes());
  const int64_t c = options_.num_features();
  if (!pg_) {  // No group (yet): BatchNorm of this process's batch, as torch::nn::BatchNorm.
    double momentum = 0.0;
    const bool batch_stats = is_training() || !options_.track_running_stats();
    if (is_training() && options_.track_running_stats()) {
      torch::NoGradGuard no_grad;
      num_batches_tracked += 1;
      momentum = options_.momentum().has_value() ? *options_.momentum() : 1.0 / num_batches_tracked.item<double>();
    }
    const bool track = options_.track_running_stats();
    return torch::batch_norm(input, options_.affine() ? weight : torch::Tensor(),
                             options_.affine() ? bias : torch::Tensor(), track ? running_mean : torch::Tensor(),
                             track ? running_var : torch::Tensor(), batch_stats, momentum, options_.eps(),
                             at::globalContext().userEnabledCuDNN());
  }
  if (!is_training() && options_.track_running_stats()) {  // Running stats, no communication.
    if (input.numel() == 0) return input.clone();          // ATen's kernel divides by the batch size.
    return std::get<0>(at::native_batch_norm(input, options_.affine() ? weight : torch::Tensor(),
                                             options_.affine() ? bias : torch::Tensor(), running_mean, running_var,
                                             /*training=*/false, /*momentum=*/0, options_.eps()));
  }
  // This rank's sums and count, reduced across ranks in one collective: [sum, sum of squares,
  // count], in double, from the local mean and biased variance (LocalStats).
  const int64_t local_count = c > 0 ? input.numel() / c : 0;
  torch::Tensor stats = torch::zeros({2 * c + 1}, input.options().dtype(torch::kDouble));
  if (local_count > 0) {
    torch::NoGradGuard no_grad;
    auto [m, v] = LocalStats(input.detach());
    stats.narrow(0, 0, c).copy_(m * local_count);
    stats.narrow(0, c, c).copy_((v + m * m) * local_count);
  }
  stats[2 * c] = static_cast<double>(local_count);
  AllreduceSum(*pg_, shm_.get(), stats)->wait();
  double count = stats[2 * c].item<double>();
  TORCH_CHECK(count > 0, "SyncBatchNorm: every rank's batch is empty");
  torch::Tensor mean = stats.narrow(0, 0, c) / count;
  torch::Tensor var = (stats.narrow(0, c, c) / count - mean * mean).clamp_min(0);
  if (options_.track_running_stats()) {
    torch::NoGradGuard no_grad;
    num_batches_tracked += 1;
    double momentum = options_.momentum().has_value() ? *options_.momentum() : 1.0 / num_batches_tracked.item<double>();
    torch::Tensor unbiased = count > 1 ? var * (count / (count - 1)) : var;
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.scalar_type()) * momentum);
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.scalar_type()) * momentum);
  }
  const bool affine = options_.affine();
  return SyncBatchNormFunction::apply(
      input, affine ? weight : torch::ones({c}, input.options()), affine ? bias : torch::zeros({c}, input.options()),
      mean.to(input.scalar_type()), var.to(input.scalar_type()), options_.eps(), count, affine, pg_.get(), shm_.get());
}

namespace {

template <typename BatchNormImpl>
std::shared_ptr<SyncBatchNormImpl> ConvertOne(const std::shared_ptr<torch::nn::Module>& child,
                                              const c10::intrusive_ptr<c10d::Backend>& pg,
                                              const std::shared_ptr<ShmAllreduce>& shm) {
  auto bn = std::dynamic_pointer_cast<BatchNormImpl>(child);
  if (!bn) return nullptr;
  auto sync = std::make_shared<SyncBatchNormImpl>(bn->options, pg, shm);
  // On the device of the layer it replaces, CPU or CUDA (Module::to with a dtype would also
  // convert num_batches_tracked, so the device alone; the copies below keep the values).
  if (bn->options.affine()) {
    sync->to(bn->weight.device());
  } else if (bn->options.track_running_stats()) {
    sync->to(bn->running_mean.device());
  }
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

int ConvertSyncBatchNorm(torch::nn::Module& module, c10::intrusive_ptr<c10d::Backend> pg,
                         std::shared_ptr<ShmAllreduce> shm) {
  int replaced = 0;
  for (const auto& item : module.named_children()) {
    std::shared_ptr<SyncBatchNormImpl> sync = ConvertOne<torch::nn::BatchNorm1dImpl>(item.value(), pg, shm);
    if (!sync) sync = ConvertOne<torch::nn::BatchNorm2dImpl>(item.value(), pg, shm);
    if (!sync) sync = ConvertOne<torch::nn::BatchNorm3dImpl>(item.value(), pg, shm);
    if (auto* own = dynamic_cast<SyncBatchNormImpl*>(item.value().get()); own != nullptr && !own->attached()) {
      own->Attach(pg, shm);  // Declared by the model as a SyncBatchNorm: reached through its member.
      ++replaced;
    } else if (sync) {
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
