// Which kernel computes the models' fully connected layers, y = x W^T + b.
//
// LibTorch on CPU sends Linear to the BLAS it was linked with. Debian's LibTorch 1.13, which
// elrun-train used to link, had the generic reference BLAS (libblas3: plain loops, no SIMD,
// ~3 GFLOP/s here), so FashionNet's 3136 -> 128 layer took ~40% of a training step. Its
// convolutions go to oneDNN's JIT kernels instead, and a Linear layer is a 1x1 convolution:
// kOneDnn computes it as one. Same parameters, same result up to float rounding (relative
// differences ~1e-6), 5-8x faster than that BLAS for batches of 16 rows or more
// (bench/README.md). The torch 2.11 wheel's Linear (MKL) beats the oneDNN route, so
// --linear auto now means kAten (train_main.cc). Checkpoints do not change: the weight keeps its
// [out, in] shape.
#ifndef ELRUN_TRAINER_NN_LINEAR_KERNEL_H_
#define ELRUN_TRAINER_NN_LINEAR_KERNEL_H_

#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace elrun::trainer {

enum class LinearKernel {
  kAten,    // torch::nn::functional::linear, as Python's nn.Linear.
  kOneDnn,  // A 1x1 convolution, which ATen runs with oneDNN.
};

// "aten" or "onednn"; InvalidArgument naming both otherwise.
[[nodiscard]] absl::StatusOr<LinearKernel> ParseLinearKernel(std::string_view name);
std::string LinearKernelName(LinearKernel kernel);

// x [N, in], W [out, in], b [out] or undefined -> [N, out], differentiable in all three.
// kOneDnn falls back to kAten where ATen would not pick oneDNN for the convolution (fewer than
// 16 rows on one thread or 2 on several, not float32, not CPU, a LibTorch without oneDNN), where it is slower.
at::Tensor Linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, LinearKernel kernel);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_NN_LINEAR_KERNEL_H_
