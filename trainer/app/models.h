// The models elrun-train trains: FashionNet, the Fashion-MNIST benchmark's "2 Conv + pooling +
// BN" network, a plain MLP and a residual MLP (ResMlp), all behind Classifier so the trainer can
// pick one by name; and the interfaces through which a wrapper sees their children as they are
// built and run (ChildSink, ChildForwardHooks).
// Modules are thread-compatible (one thread forwards at a time), as every torch::nn::Module.
#ifndef ELRUN_TRAINER_APP_MODELS_H_
#define ELRUN_TRAINER_APP_MODELS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "absl/status/statusor.h"
#include "trainer/nn/linear_kernel.h"
#include "trainer/nn/module_hooks.h"

namespace elrun::trainer {

// conv 1->32 k3 pad1, BatchNorm2d, ReLU, maxpool 2; conv 32->64 k3 pad1, BatchNorm2d, ReLU,
// maxpool 2; flatten; Linear 3136->128, ReLU; Linear 128->10. Input [B, 1, 28, 28]. ReLU runs
// after the pooling, on a quarter of the values: the same outputs and gradients (max and ReLU
// commute, and both route a gradient to the same element). `linear` picks the Linear kernel.
// Children are registered as conv1, bn1, conv2, bn2, fc1, fc2. The norm layers are looked up
// in the registry at every forward, so ConvertSyncBatchNorm (sync_batch_norm.h) takes effect.
class FashionNetImpl : public Classifier {
 public:
  explicit FashionNetImpl(LinearKernel linear = LinearKernel::kOneDnn, ChildSink* sink = nullptr);
  torch::Tensor forward(const torch::Tensor& images) override;

 private:
  const LinearKernel linear_;
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(FashionNet);

struct MlpOptions {
  int64_t inputs = 28 * 28;                  // Images are flattened from dimension 1 on.
  std::vector<int64_t> hidden = {256, 128};  // One Linear + ReLU per entry.
  int64_t classes = 10;
  LinearKernel linear = LinearKernel::kOneDnn;
};

// Linear layers inputs -> hidden[0] -> ... -> classes with ReLU between, children fc0, fc1, ...
// Sizes must be positive (MakeModel checks; the constructor does not).
class MlpImpl : public Classifier {
 public:
  explicit MlpImpl(const MlpOptions& options = {}, ChildSink* sink = nullptr);
  torch::Tensor forward(const torch::Tensor& images) override;

 private:
  const LinearKernel linear_;
  std::vector<torch::nn::Linear> layers_;
};
TORCH_MODULE(Mlp);

struct ResMlpOptions {
  int64_t inputs = 28 * 28;
  int64_t width = 256;
  int64_t blocks = 4;
  int64_t expansion = 4;  // A block's hidden width is expansion x width.
  int64_t classes = 10;
  LinearKernel linear = LinearKernel::kOneDnn;
};

// A residual MLP, the shape of a transformer's feed-forward stack: proj (inputs -> width), then
// `blocks` blocks x + fc2(relu(fc1(x))) with fc1 width -> expansion x width and fc2 back, then
// head (width -> classes). Children proj, block0, block1, ..., head; each block is one child
// (one FSDP unit), whose activations (two of expansion x width per sample) are what activation
// checkpointing saves.
class ResMlpImpl : public Classifier {
 public:
  explicit ResMlpImpl(const ResMlpOptions& options = {}, ChildSink* sink = nullptr);
  torch::Tensor forward(const torch::Tensor& images) override;

 private:
  const LinearKernel linear_;
  torch::nn::Linear proj_{nullptr}, head_{nullptr};
  std::vector<std::pair<torch::nn::Linear, torch::nn::Linear>> blocks_;
};
TORCH_MODULE(ResMlp);

// "fashionnet" or "mlp" (with `mlp`), initialised from torch's default generator (seed it with
// torch::manual_seed for reproducible weights). InvalidArgument naming the choices for another
// name, or naming the size for non-positive MLP sizes. The result converts to
// std::shared_ptr<torch::nn::Module> for DistributedDataParallel.
// `linear` applies to both models (for the MLP it overrides mlp.linear). With a `sink`, each
// child goes to it as soon as it is built (ChildSink).
[[nodiscard]] absl::StatusOr<std::shared_ptr<Classifier>> MakeModel(const std::string& name, const MlpOptions& mlp = {},
                                                                    LinearKernel linear = LinearKernel::kOneDnn,
                                                                    ChildSink* sink = nullptr);
// "resmlp" with `resmlp` (sizes checked as MakeModel's), the same way.
[[nodiscard]] absl::StatusOr<std::shared_ptr<Classifier>> MakeResMlp(const ResMlpOptions& resmlp,
                                                                     ChildSink* sink = nullptr);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_APP_MODELS_H_
