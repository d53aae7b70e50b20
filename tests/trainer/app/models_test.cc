// FashionNet and Mlp: shapes, exact parameter counts, BatchNorm layers, forward/backward, the
// MakeModel factory, and that ConvertSyncBatchNorm reaches FashionNet's norm layers.
#include "trainer/app/models.h"

#include <doctest/doctest.h>

#include <torch/torch.h>

#include "tests/trainer/rank_threads.h"
#include "trainer/parallel/sync_batch_norm.h"

namespace elrun::trainer {
namespace {

int64_t CountParameters(torch::nn::Module& m) {
  int64_t n = 0;
  for (const torch::Tensor& p : m.parameters()) n += p.numel();
  return n;
}

torch::Tensor Images(int64_t batch) { return torch::randn({batch, 1, 28, 28}); }

TEST_CASE("FashionNet maps [B, 1, 28, 28] to [B, 10]") {
  torch::manual_seed(0);
  FashionNet net;
  CHECK(net->forward(Images(4)).sizes() == torch::IntArrayRef({4, 10}));
  net->eval();  // Batch of one: BatchNorm needs running stats for that.
  CHECK(net->forward(Images(1)).sizes() == torch::IntArrayRef({1, 10}));
}

TEST_CASE("FashionNet has exactly 421,834 parameters") {
  // conv1  32 * (1 * 3 * 3) weights + 32 biases     =     320
  // bn1    32 weights + 32 biases                    =      64
  // conv2  64 * (32 * 3 * 3) + 64 = 18,432 + 64      =  18,496
  // bn2    64 + 64                                   =     128
  // fc1    3136 * 128 + 128 = 401,408 + 128          = 401,536   (3136 = 64 channels * 7 * 7)
  // fc2    128 * 10 + 10                             =   1,290
  // total  320 + 64 + 18,496 + 128 + 401,536 + 1,290 = 421,834
  FashionNet net;
  CHECK(CountParameters(*net) == 421834);
  auto named = net->named_parameters();
  CHECK(named["conv1.weight"].sizes() == torch::IntArrayRef({32, 1, 3, 3}));
  CHECK(named["conv2.weight"].sizes() == torch::IntArrayRef({64, 32, 3, 3}));
  CHECK(named["fc1.weight"].sizes() == torch::IntArrayRef({128, 3136}));
  CHECK(named["fc2.weight"].sizes() == torch::IntArrayRef({10, 128}));
  CHECK(named.size() == 12);
}

TEST_CASE("FashionNet has two BatchNorm2d layers with running stats") {
  FashionNet net;
  auto children = net->named_children();
  auto* bn1 = dynamic_cast<torch::nn::BatchNorm2dImpl*>(children["bn1"].get());
  auto* bn2 = dynamic_cast<torch::nn::BatchNorm2dImpl*>(children["bn2"].get());
  REQUIRE(bn1 != nullptr);
  REQUIRE(bn2 != nullptr);
  CHECK(bn1->options.num_features() == 32);
  CHECK(bn2->options.num_features() == 64);
  // running_mean + running_var + num_batches_tracked per layer.
  CHECK(net->buffers().size() == 6);
  net->forward(Images(8));
  CHECK(bn1->num_batches_tracked.item<int64_t>() == 1);
}

TEST_CASE("FashionNet forward and backward give every parameter a gradient") {
  torch::manual_seed(1);
  FashionNet net;
  torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(Images(6)), torch::randint(0, 10, {6}));
  loss.backward();
  for (const auto& p : net->named_parameters()) {
    CAPTURE(p.key());
    REQUIRE(p.value().grad().defined());
    CHECK(p.value().grad().abs().sum().item<double>() > 0);
  }
}

TEST_CASE("FashionNet learns a fixed batch") {
  torch::manual_seed(2);
  FashionNet net;
  torch::Tensor x = Images(32);
  torch::Tensor y = torch::randint(0, 10, {32});
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 25; ++step) {
    opt.zero_grad();
    torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  CHECK(last < first / 10);  // Measured: 2.39 -> 0.018.
}

TEST_CASE("Mlp: default sizes, custom sizes, flattening") {
  Mlp mlp;
  // 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10 = 200,960 + 32,896 + 1,290
  CHECK(CountParameters(*mlp) == 235146);
  CHECK(mlp->forward(Images(3)).sizes() == torch::IntArrayRef({3, 10}));

  Mlp small(MlpOptions{5, {}, 3});  // One Linear 5 -> 3.
  CHECK(CountParameters(*small) == 5 * 3 + 3);
  CHECK(small->forward(torch::randn({2, 5})).sizes() == torch::IntArrayRef({2, 3}));

  Mlp deep(MlpOptions{12, {8, 8, 4}, 2});
  CHECK(CountParameters(*deep) == (12 * 8 + 8) + (8 * 8 + 8) + (8 * 4 + 4) + (4 * 2 + 2));
  torch::Tensor out = deep->forward(torch::randn({7, 3, 4}));  // Flattened to [7, 12].
  CHECK(out.sizes() == torch::IntArrayRef({7, 2}));
  out.sum().backward();
  for (const torch::Tensor& p : deep->parameters()) CHECK(p.grad().defined());
}

TEST_CASE("MakeModel builds by name and rejects the rest") {
  absl::StatusOr<std::shared_ptr<Classifier>> net = MakeModel("fashionnet");
  REQUIRE(net.ok());
  CHECK(dynamic_cast<FashionNetImpl*>(net->get()) != nullptr);
  CHECK((*net)->forward(Images(2)).sizes() == torch::IntArrayRef({2, 10}));
  std::shared_ptr<torch::nn::Module> as_module = *net;  // What DistributedDataParallel takes.
  CHECK(CountParameters(*as_module) == 421834);

  absl::StatusOr<std::shared_ptr<Classifier>> mlp = MakeModel("mlp", MlpOptions{784, {64}, 10});
  REQUIRE(mlp.ok());
  CHECK(dynamic_cast<MlpImpl*>(mlp->get()) != nullptr);
  CHECK(CountParameters(**mlp) == 784 * 64 + 64 + 64 * 10 + 10);

  absl::Status unknown = MakeModel("resnet").status();
  CHECK(unknown.code() == absl::StatusCode::kInvalidArgument);
  CHECK(unknown.message() == "unknown model 'resnet': expected fashionnet or mlp");

  absl::Status bad = MakeModel("mlp", MlpOptions{784, {64, 0}, 10}).status();
  CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(bad.message() == "mlp: hidden layer 1 has 0 units, need at least 1");
  CHECK(MakeModel("mlp", MlpOptions{0, {}, 10}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(MakeModel("mlp", MlpOptions{4, {}, 0}).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("ConvertSyncBatchNorm replaces the norm layers FashionNet's forward uses") {
  torch::manual_seed(3);
  FashionNet net;
  torch::Tensor x = Images(4);
  torch::Tensor before = net->forward(x);  // Training mode: batch statistics.
  RunRanks(1, [&](int, PG pg) {
    CHECK(ConvertSyncBatchNorm(*net, pg) == 2);
    auto* sync = dynamic_cast<SyncBatchNormImpl*>(net->named_children()["bn1"].get());
    REQUIRE(sync != nullptr);
    const int64_t tracked = sync->num_batches_tracked.item<int64_t>();
    torch::Tensor after = net->forward(x);
    CHECK(sync->num_batches_tracked.item<int64_t>() == tracked + 1);  // The new layer ran.
    CHECK((after - before).abs().max().item<double>() < 1e-4);        // One rank: same as BatchNorm.
  });
}

}  // namespace
}  // namespace elrun::trainer
