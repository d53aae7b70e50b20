#include "trainer/app/models.h"

#include <torch/torch.h>

#include "absl/strings/str_format.h"
#include "trainer/nn/linear_kernel.h"
#include "trainer/parallel/sync_batch_norm.h"

namespace elrun::trainer {
namespace {

// The child registered as `name`: what ConvertSyncBatchNorm may have swapped in since
// construction (members keep pointing at the original).
torch::nn::Module& Child(torch::nn::Module& parent, const std::string& name) { return *parent.named_children()[name]; }

}  // namespace

FashionNetImpl::FashionNetImpl(LinearKernel linear, ChildSink* sink) : linear_(linear) {
  namespace nn = torch::nn;
  auto built = [&](const std::string& name) {
    if (sink != nullptr) sink->TakeChild(name, Child(*this, name));
  };
  conv1_ = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
  built("conv1");
  register_module("bn1", nn::BatchNorm2d(32));
  built("bn1");
  conv2_ = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
  built("conv2");
  register_module("bn2", nn::BatchNorm2d(64));
  built("bn2");
  fc1_ = register_module("fc1", nn::Linear(64 * 7 * 7, 128));
  built("fc1");
  fc2_ = register_module("fc2", nn::Linear(128, 10));
  built("fc2");
}

torch::Tensor FashionNetImpl::forward(const torch::Tensor& images) {
  auto norm = [&](const std::string& name, const torch::Tensor& x) {
    return CallChild(name, x, [this, name](const torch::Tensor& in) { return ApplyNorm(Child(*this, name), in); });
  };
  torch::Tensor x = CallChild("conv1", images, [this](const torch::Tensor& in) { return conv1_->forward(in); });
  x = torch::relu(torch::max_pool2d(norm("bn1", x), 2));                                       // [B, 32, 14, 14]
  x = CallChild("conv2", x, [this](const torch::Tensor& in) { return conv2_->forward(in); });  // [B, 64, 14, 14]
  x = torch::relu(torch::max_pool2d(norm("bn2", x), 2));                                       // [B, 64, 7, 7]
  x = torch::relu(CallChild("fc1", x.flatten(1),
                            [this](const torch::Tensor& in) { return Linear(in, fc1_->weight, fc1_->bias, linear_); }));
  return CallChild("fc2", x, [this](const torch::Tensor& in) {
    return Linear(in, fc2_->weight, fc2_->bias, linear_);  // [B, 10]
  });
}

MlpImpl::MlpImpl(const MlpOptions& options, ChildSink* sink) : linear_(options.linear) {
  int64_t width = options.inputs;
  for (size_t i = 0; i <= options.hidden.size(); ++i) {
    const int64_t out = i < options.hidden.size() ? options.hidden[i] : options.classes;
    const std::string name = "fc" + std::to_string(i);
    layers_.push_back(register_module(name, torch::nn::Linear(width, out)));
    if (sink != nullptr) sink->TakeChild(name, *layers_.back());
    width = out;
  }
}

torch::Tensor MlpImpl::forward(const torch::Tensor& images) {
  torch::Tensor x = images.flatten(1);
  for (size_t i = 0; i < layers_.size(); ++i) {
    x = CallChild("fc" + std::to_string(i), x, [this, i](const torch::Tensor& in) {
      return Linear(in, layers_[i]->weight, layers_[i]->bias, linear_);
    });
    if (i + 1 < layers_.size()) x = torch::relu(x);
  }
  return x;
}

ResMlpImpl::ResMlpImpl(const ResMlpOptions& options, ChildSink* sink) : linear_(options.linear) {
  auto built = [&](const std::string& name) {
    if (sink != nullptr) sink->TakeChild(name, Child(*this, name));
  };
  proj_ = register_module("proj", torch::nn::Linear(options.inputs, options.width));
  built("proj");
  for (int64_t b = 0; b < options.blocks; ++b) {
    const std::string name = "block" + std::to_string(b);
    auto block = std::make_shared<torch::nn::Module>();
    torch::nn::Linear fc1 =
        block->register_module("fc1", torch::nn::Linear(options.width, options.expansion * options.width));
    torch::nn::Linear fc2 =
        block->register_module("fc2", torch::nn::Linear(options.expansion * options.width, options.width));
    register_module(name, block);
    blocks_.emplace_back(fc1, fc2);
    built(name);
  }
  head_ = register_module("head", torch::nn::Linear(options.width, options.classes));
  built("head");
}

torch::Tensor ResMlpImpl::forward(const torch::Tensor& images) {
  torch::Tensor x = CallChild("proj", images.flatten(1), [this](const torch::Tensor& in) {
    return Linear(in, proj_->weight, proj_->bias, linear_);
  });
  for (size_t b = 0; b < blocks_.size(); ++b) {
    x = CallChild("block" + std::to_string(b), x, [this, b](const torch::Tensor& in) {
      const auto& [fc1, fc2] = blocks_[b];
      return in + Linear(torch::relu(Linear(in, fc1->weight, fc1->bias, linear_)), fc2->weight, fc2->bias, linear_);
    });
  }
  return CallChild("head", x,
                   [this](const torch::Tensor& in) { return Linear(in, head_->weight, head_->bias, linear_); });
}

absl::StatusOr<std::shared_ptr<Classifier>> MakeResMlp(const ResMlpOptions& resmlp, ChildSink* sink) {
  for (const auto& [what, value] : std::vector<std::pair<const char*, int64_t>>{{"inputs", resmlp.inputs},
                                                                                {"width", resmlp.width},
                                                                                {"blocks", resmlp.blocks},
                                                                                {"expansion", resmlp.expansion},
                                                                                {"classes", resmlp.classes}}) {
    if (value < 1) return absl::InvalidArgumentError(absl::StrFormat("resmlp: %s is %d, need at least 1", what, value));
  }
  return std::shared_ptr<Classifier>(ResMlp(resmlp, sink).ptr());
}

absl::StatusOr<std::shared_ptr<Classifier>> MakeModel(const std::string& name, const MlpOptions& mlp,
                                                      LinearKernel linear, ChildSink* sink) {
  if (name == "fashionnet") return std::shared_ptr<Classifier>(FashionNet(linear, sink).ptr());
  if (name == "mlp") {
    if (mlp.inputs < 1) {
      return absl::InvalidArgumentError(absl::StrFormat("mlp: %d inputs, need at least 1", mlp.inputs));
    }
    for (size_t i = 0; i < mlp.hidden.size(); ++i) {
      if (mlp.hidden[i] < 1) {
        return absl::InvalidArgumentError(
            absl::StrFormat("mlp: hidden layer %d has %d units, need at least 1", i, mlp.hidden[i]));
      }
    }
    if (mlp.classes < 1) {
      return absl::InvalidArgumentError(absl::StrFormat("mlp: %d classes, need at least 1", mlp.classes));
    }
    MlpOptions options = mlp;
    options.linear = linear;
    return std::shared_ptr<Classifier>(Mlp(options, sink).ptr());
  }
  return absl::InvalidArgumentError(absl::StrFormat("unknown model '%s': expected fashionnet or mlp", name));
}

}  // namespace elrun::trainer
