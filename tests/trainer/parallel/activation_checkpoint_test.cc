// Activation checkpointing: the same gradients bit for bit, plain and under every FSDP strategy,
// with less memory held between forward and backward (measured through the caching allocator).
#include "trainer/parallel/activation_checkpoint.h"

#include <doctest/doctest.h>

#include <mutex>

#include "tests/trainer/rank_threads.h"
#include "trainer/app/models.h"
#include "trainer/memory/caching_cpu_allocator.h"
#include "trainer/parallel/fsdp.h"

namespace elrun::trainer {
namespace {

std::shared_ptr<Classifier> Model(const ResMlpOptions& options, int seed) {
  static std::mutex mu;  // The default generator is global; ranks are threads.
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  return *MakeResMlp(options);
}

std::map<std::string, torch::Tensor> Grads(Classifier& model) {
  std::map<std::string, torch::Tensor> grads;
  for (const auto& p : model.named_parameters()) grads[p.key()] = p.value().grad().clone();
  return grads;
}

TEST_CASE("A checkpointed function gives the same gradients, also when its input needs none") {
  torch::manual_seed(3);
  torch::Tensor w = torch::randn({8, 8}, torch::requires_grad());
  for (bool input_grad : {true, false}) {
    CAPTURE(input_grad);
    torch::Tensor x = torch::randn({4, 8}).requires_grad_(input_grad);
    auto f = [&](const torch::Tensor& in) { return torch::tanh(in.matmul(w)).matmul(w).sin(); };
    f(x).sum().backward();
    torch::Tensor w_plain = w.grad().clone();
    torch::Tensor x_plain = input_grad ? x.grad().clone() : torch::Tensor();
    w.mutable_grad().reset();
    if (input_grad) x.mutable_grad().reset();
    torch::Tensor y = CheckpointedCall(x, f);
    CHECK(y.requires_grad());
    y.sum().backward();
    CHECK(torch::equal(w.grad(), w_plain));
    if (input_grad) CHECK(torch::equal(x.grad(), x_plain));
    w.mutable_grad().reset();
  }
  torch::NoGradGuard no_grad;  // Without grad mode: a plain call.
  CHECK_FALSE(
      CheckpointedCall(torch::ones({2, 8}), [&](const torch::Tensor& in) { return in.matmul(w); }).requires_grad());
}

TEST_CASE("Checkpointing every block of a ResMlp: same gradients, the blocks' activations not kept") {
  CachingCpuAllocator& allocator = CachingCpuAllocator::Instance();
  CachingCpuAllocator::Install();
  const ResMlpOptions options{64, 256, 4, 4, 10};
  const int64_t batch = 1024;  // A block's hidden activation: 1024 x 1024 floats, 4 MiB.
  torch::manual_seed(9);
  torch::Tensor x = torch::randn({batch, 64});
  torch::Tensor y = torch::randint(0, 10, {batch});
  auto model = Model(options, 4);
  CheckpointEveryChild checkpoint;
  std::map<std::string, torch::Tensor> grads[2];
  int64_t held[2];  // Bytes held by the caching allocator between forward and backward.
  for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
    model->set_child_hooks(checkpointed ? &checkpoint : nullptr);
    model->zero_grad();
    const int64_t before = allocator.stats().live_bytes;
    torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    held[checkpointed] = allocator.stats().live_bytes - before;
    loss.backward();
    grads[checkpointed] = Grads(*model);
  }
  model->set_child_hooks(nullptr);
  for (const auto& [name, grad] : grads[0]) {
    CAPTURE(name);
    CHECK(torch::equal(grad, grads[1].at(name)));
  }
  // Each block keeps at least its ReLU's output (4 MiB) unless checkpointed.
  const int64_t hidden = batch * options.expansion * options.width * 4;
  MESSAGE("held between forward and backward: ", held[0] >> 20, " MiB plain, ", held[1] >> 20, " MiB checkpointed");
  CHECK(held[0] - held[1] >= options.blocks * hidden);
}

TEST_CASE("FSDP with activation checkpointing matches FSDP without, every strategy, 2 ranks") {
  const ResMlpOptions options{16, 12, 3, 4, 5};
  auto gen = at::detail::createCPUGenerator(5);
  torch::Tensor x = torch::randn({6, 16}, gen), y = torch::randint(0, 5, {6}, gen);
  for (const std::string strategy : {"no_shard", "zero1", "zero2", "fsdp"}) {
    CAPTURE(strategy);
    std::map<std::string, torch::Tensor> params[2];
    std::vector<double> losses[2];
    for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
      std::vector<std::shared_ptr<Classifier>> models{Model(options, 8), Model(options, 8)};
      RunRanks(2, [&](int rank, PG pg) {
        FsdpOptions o;
        o.strategy = *ParseStrategy(strategy);
        o.activation_checkpointing = checkpointed == 1;
        FullyShardedDataParallel fsdp(models[rank], pg, o);
        torch::optim::Adam adam(fsdp.parameters(), torch::optim::AdamOptions(0.01));
        for (int step = 0; step < 4; ++step) {
          adam.zero_grad();
          torch::Tensor loss =
              torch::nn::functional::cross_entropy(fsdp.forward(x.narrow(0, 3 * rank, 3)), y.narrow(0, 3 * rank, 3));
          loss.backward();
          adam.step();
          if (rank == 0) losses[checkpointed].push_back(loss.item<double>());
        }
        auto full = fsdp.FullParameters();
        if (rank == 0) params[checkpointed] = full;
      });
    }
    CHECK(losses[0] == losses[1]);
    REQUIRE(params[0].size() == params[1].size());
    for (const auto& [name, value] : params[0]) {
      CAPTURE(name);
      CHECK(torch::equal(value, params[1].at(name)));
    }
  }
}

}  // namespace
}  // namespace elrun::trainer
