// The models elrun-train trains: FashionNet, the Fashion-MNIST benchmark's "2 Conv + pooling +
// BN" network, and a plain MLP, both behind Classifier so the trainer can pick one by name.
// Modules are thread-compatible (one thread forwards at a time), as every torch::nn::Module.
#ifndef ELRUN_TRAINER_MODELS_H_
#define ELRUN_TRAINER_MODELS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "absl/status/statusor.h"

namespace elrun::trainer {

// A module mapping a batch of images [B, ...] to class logits [B, classes].
class Classifier : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& images) = 0;
};

// conv 1->32 k3 pad1, BatchNorm2d, ReLU, maxpool 2; conv 32->64 k3 pad1, BatchNorm2d, ReLU,
// maxpool 2; flatten; Linear 3136->128, ReLU; Linear 128->10. Input [B, 1, 28, 28].
// Children are registered as conv1, bn1, conv2, bn2, fc1, fc2. The norm layers are looked up
// in the registry at every forward, so ConvertSyncBatchNorm (sync_batch_norm.h) takes effect.
class FashionNetImpl : public Classifier {
 public:
  FashionNetImpl();
  torch::Tensor forward(const torch::Tensor& images) override;

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(FashionNet);

struct MlpOptions {
  int64_t inputs = 28 * 28;  // Images are flattened from dimension 1 on.
  std::vector<int64_t> hidden = {256, 128};  // One Linear + ReLU per entry.
  int64_t classes = 10;
};

// Linear layers inputs -> hidden[0] -> ... -> classes with ReLU between, in one Sequential
// child named "layers". Sizes must be positive (MakeModel checks; the constructor does not).
class MlpImpl : public Classifier {
 public:
  explicit MlpImpl(const MlpOptions& options = {});
  torch::Tensor forward(const torch::Tensor& images) override;

 private:
  torch::nn::Sequential layers_{nullptr};
};
TORCH_MODULE(Mlp);

// "fashionnet" or "mlp" (with `mlp`), initialised from torch's default generator (seed it with
// torch::manual_seed for reproducible weights). InvalidArgument naming the choices for another
// name, or naming the size for non-positive MLP sizes. The result converts to
// std::shared_ptr<torch::nn::Module> for DistributedDataParallel.
[[nodiscard]] absl::StatusOr<std::shared_ptr<Classifier>> MakeModel(const std::string& name,
                                                                    const MlpOptions& mlp = {});

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_MODELS_H_
