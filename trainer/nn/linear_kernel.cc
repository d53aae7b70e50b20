#include "trainer/nn/linear_kernel.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>

#include "absl/strings/str_cat.h"

namespace elrun::trainer {
namespace {

// ATen's rule (ConvParams::use_mkldnn, 1.13) for a 1x1 convolution of float32 CPU tensors:
// oneDNN from 16 rows on, or from 2 rows with more than one intra-op thread; otherwise its own
// 1x1 path, which is slower than the BLAS product.
bool OneDnnTakesIt(const at::Tensor& input, const at::Tensor& weight) {
  return at::hasMKLDNN() && at::globalContext().userEnabledMkldnn() && input.dim() == 2 && input.device().is_cpu() &&
         weight.device().is_cpu() && input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
         (input.size(0) >= 16 || (input.size(0) > 1 && at::get_num_threads() > 1));
}

}  // namespace

absl::StatusOr<LinearKernel> ParseLinearKernel(std::string_view name) {
  if (name == "aten") return LinearKernel::kAten;
  if (name == "onednn") return LinearKernel::kOneDnn;
  return absl::InvalidArgumentError(absl::StrCat("linear kernel '", std::string(name), "': expected onednn or aten"));
}

std::string LinearKernelName(LinearKernel kernel) { return kernel == LinearKernel::kOneDnn ? "onednn" : "aten"; }

at::Tensor Linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, LinearKernel kernel) {
  if (kernel == LinearKernel::kAten || !OneDnnTakesIt(input, weight)) return at::linear(input, weight, bias);
  const int64_t rows = input.size(0), in = input.size(1), out = weight.size(0);
  return at::conv2d(input.reshape({rows, in, 1, 1}), weight.reshape({out, in, 1, 1}), bias).reshape({rows, out});
}

}  // namespace elrun::trainer
