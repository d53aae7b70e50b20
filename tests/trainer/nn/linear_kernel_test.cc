// The Linear kernels: the oneDNN route computes what ATen's Linear computes (values and all three
// gradients), takes oneDNN only where ATen would, and FashionNet/Mlp give the same outputs and
// gradients with either kernel and with FashionNet's pooling before its ReLU.
#include "trainer/nn/linear_kernel.h"

#include <doctest/doctest.h>

#include <string>

#include <torch/torch.h>

#include "trainer/app/models.h"

namespace elrun::trainer {
namespace {

// max |a - b| / max(|b|, floor): the kernels sum in different orders, so compare relative to
// the scale of the values (or of their model's largest gradient, for gradients that are ~0).
double RelativeError(const torch::Tensor& a, const torch::Tensor& b, double floor = 1e-12) {
  return (a - b).abs().max().item<double>() / std::max(floor, b.abs().max().item<double>());
}

struct Grads {
  torch::Tensor out, input, weight, bias;
};

Grads Run(const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0, LinearKernel kernel) {
  torch::Tensor x = x0.clone().requires_grad_(true);
  torch::Tensor w = w0.clone().requires_grad_(true);
  torch::Tensor b = b0.defined() ? b0.clone().requires_grad_(true) : torch::Tensor();
  torch::Tensor out = Linear(x, w, b, kernel);
  // A random upstream gradient, the same for both kernels, so every output element matters.
  torch::manual_seed(42);
  (out * torch::rand_like(out)).sum().backward();
  return {out.detach(), x.grad(), w.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

// The autograd node that computed `out` (under the reshape back to [N, out]).
std::string ProducerName(const torch::Tensor& out) {
  auto node = out.grad_fn();
  while (node && (node->name().find("View") != std::string::npos || node->name().find("Reshape") != std::string::npos ||
                  node->name().find("Unsafe") != std::string::npos)) {
    node = node->next_edge(0).function;
  }
  return node ? node->name() : "";
}

TEST_CASE("ParseLinearKernel names both kernels and rejects others") {
  CHECK(*ParseLinearKernel("onednn") == LinearKernel::kOneDnn);
  CHECK(*ParseLinearKernel("aten") == LinearKernel::kAten);
  CHECK(LinearKernelName(LinearKernel::kOneDnn) == "onednn");
  CHECK(LinearKernelName(LinearKernel::kAten) == "aten");
  absl::Status bad = ParseLinearKernel("mkl").status();
  CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(bad.message() == "linear kernel 'mkl': expected onednn or aten");
}

TEST_CASE("oneDNN Linear equals ATen's Linear: output and input, weight and bias gradients") {
  torch::manual_seed(0);
  struct Shape {
    int64_t rows, in, out;
  };
  for (Shape s : {Shape{64, 3136, 128}, Shape{64, 128, 10}, Shape{16, 784, 256}, Shape{15, 20, 7}, Shape{1, 9, 4}}) {
    CAPTURE(s.rows);
    CAPTURE(s.in);
    torch::Tensor x = torch::randn({s.rows, s.in});
    torch::Tensor w = torch::randn({s.out, s.in}) / std::sqrt(static_cast<double>(s.in));
    torch::Tensor b = torch::randn({s.out});
    Grads aten = Run(x, w, b, LinearKernel::kAten);
    Grads onednn = Run(x, w, b, LinearKernel::kOneDnn);
    CHECK(onednn.out.sizes() == torch::IntArrayRef({s.rows, s.out}));
    CHECK(RelativeError(onednn.out, aten.out) < 1e-5);
    CHECK(RelativeError(onednn.input, aten.input) < 1e-5);
    CHECK(RelativeError(onednn.weight, aten.weight) < 1e-5);
    CHECK(RelativeError(onednn.bias, aten.bias) < 1e-5);
    CHECK(onednn.weight.sizes() == w.sizes());  // The weight keeps its [out, in] shape.
  }
}

TEST_CASE("oneDNN Linear without bias and on a non-contiguous input") {
  torch::manual_seed(1);
  torch::Tensor x = torch::randn({300, 32}).t();  // [32, 300], strided.
  REQUIRE_FALSE(x.is_contiguous());
  torch::Tensor w = torch::randn({50, 300}) / 17.0;
  Grads aten = Run(x, w, torch::Tensor(), LinearKernel::kAten);
  Grads onednn = Run(x, w, torch::Tensor(), LinearKernel::kOneDnn);
  CHECK(RelativeError(onednn.out, aten.out) < 1e-5);
  CHECK(RelativeError(onednn.input, aten.input) < 1e-5);
  CHECK(RelativeError(onednn.weight, aten.weight) < 1e-5);
}

TEST_CASE("oneDNN Linear convolves from 16 rows on one thread and falls back below or for doubles") {
  if (!at::hasMKLDNN()) return;  // Debian's LibTorch has it; another build falls back everywhere.
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  torch::Tensor w = torch::randn({8, 24}, torch::requires_grad());
  CHECK(ProducerName(Linear(torch::randn({16, 24}), w, torch::Tensor(), LinearKernel::kOneDnn)).find("Convolution") !=
        std::string::npos);
  CHECK(ProducerName(Linear(torch::randn({15, 24}), w, torch::Tensor(), LinearKernel::kOneDnn)).find("Convolution") ==
        std::string::npos);
  CHECK(ProducerName(Linear(torch::randn({16, 24}), w, torch::Tensor(), LinearKernel::kAten)).find("Convolution") ==
        std::string::npos);
  torch::Tensor wd = torch::randn({8, 24}, torch::dtype(torch::kDouble).requires_grad(true));
  CHECK(ProducerName(Linear(torch::randn({32, 24}, torch::kDouble), wd, torch::Tensor(), LinearKernel::kOneDnn))
            .find("Convolution") == std::string::npos);
  torch::set_num_threads(threads);
}

// The pre-change FashionNet forward, ReLU before pooling and ATen's Linear, from the same modules.
torch::Tensor ReferenceForward(FashionNetImpl& net, const torch::Tensor& images) {
  auto children = net.named_children();
  auto conv1 = children["conv1"]->as<torch::nn::Conv2dImpl>();
  auto conv2 = children["conv2"]->as<torch::nn::Conv2dImpl>();
  auto bn1 = children["bn1"]->as<torch::nn::BatchNorm2dImpl>();
  auto bn2 = children["bn2"]->as<torch::nn::BatchNorm2dImpl>();
  auto fc1 = children["fc1"]->as<torch::nn::LinearImpl>();
  auto fc2 = children["fc2"]->as<torch::nn::LinearImpl>();
  torch::Tensor x = torch::max_pool2d(torch::relu(bn1->forward(conv1->forward(images))), 2);
  x = torch::max_pool2d(torch::relu(bn2->forward(conv2->forward(x))), 2);
  x = torch::relu(fc1->forward(x.flatten(1)));
  return fc2->forward(x);
}

TEST_CASE("FashionNet: both kernels and the pool-then-ReLU order give the reference outputs and gradients") {
  torch::manual_seed(2);
  torch::Tensor images = torch::randn({32, 1, 28, 28});
  torch::Tensor labels = torch::randint(0, 10, {32});
  auto grads = [&](torch::nn::Module& net, const torch::Tensor& logits) {
    torch::nn::functional::cross_entropy(logits, labels).backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : net.parameters()) g.push_back(p.grad().clone());
    net.zero_grad();
    return g;
  };
  for (LinearKernel kernel : {LinearKernel::kOneDnn, LinearKernel::kAten}) {
    CAPTURE(LinearKernelName(kernel));
    torch::manual_seed(3);
    FashionNet net(kernel);
    torch::Tensor ours = net->forward(images);
    std::vector<torch::Tensor> our_grads = grads(*net, ours);
    torch::Tensor reference = ReferenceForward(*net, images);
    std::vector<torch::Tensor> reference_grads = grads(*net, reference);
    CHECK(RelativeError(ours, reference) < 1e-5);
    REQUIRE(our_grads.size() == reference_grads.size());
    // The conv biases feed BatchNorm, which subtracts their effect: their gradients are ~1e-9,
    // rounding noise, so errors are taken relative to at least a tenth of the largest gradient.
    double scale = 0;
    for (const torch::Tensor& g : reference_grads) scale = std::max(scale, g.abs().max().item<double>());
    for (size_t i = 0; i < our_grads.size(); ++i) {
      CAPTURE(i);
      CHECK(RelativeError(our_grads[i], reference_grads[i], 0.1 * scale) < 1e-5);
    }
  }
}

TEST_CASE("Mlp and MakeModel pass the kernel on; the parameters do not depend on it") {
  torch::manual_seed(4);
  auto onednn = *MakeModel("mlp", MlpOptions{784, {256, 128}, 10}, LinearKernel::kOneDnn);
  torch::manual_seed(4);
  auto aten = *MakeModel("mlp", MlpOptions{784, {256, 128}, 10}, LinearKernel::kAten);
  auto a = onednn->named_parameters(), b = aten->named_parameters();
  REQUIRE(a.size() == b.size());
  for (const auto& p : a) CHECK(torch::equal(p.value(), b[p.key()]));
  torch::Tensor images = torch::randn({64, 1, 28, 28});
  CHECK(RelativeError(onednn->forward(images), aten->forward(images)) < 1e-5);
}

}  // namespace
}  // namespace elrun::trainer
