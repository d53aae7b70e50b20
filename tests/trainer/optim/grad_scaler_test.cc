// GradScaler against torch.amp.GradScaler's contract: the loss is scaled, the gradients come back
// unscaled, the scale grows after growth_interval finite steps and halves on an overflow; an
// inf on one rank skips the step on every rank (2 ranks as threads over a real Gloo group).
#include "trainer/optim/grad_scaler.h"

#include <doctest/doctest.h>

#include "tests/trainer/rank_threads.h"

namespace elrun::trainer {
namespace {

TEST_CASE("finite steps: scaled loss, unscaled gradients, the step taken, the scale grown on schedule") {
  torch::Tensor w = torch::tensor({1.0f, -2.0f}).requires_grad_(true);
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.5));
  GradScalerOptions options;
  options.growth_interval = 2;
  GradScaler scaler(options, nullptr);
  for (int step = 0; step < 2; ++step) {
    sgd.zero_grad();
    torch::Tensor loss = (w * w).sum();
    torch::Tensor scaled = scaler.Scale(loss);
    CHECK(scaled.item<float>() == doctest::Approx(loss.item<float>() * 65536.0f));
    scaled.backward();
    CHECK(w.grad()[0].item<float>() == doctest::Approx(2 * w[0].item<float>() * 65536.0f));
    const torch::Tensor before = w.detach().clone();
    CHECK(scaler.Unscale({w}));
    CHECK(torch::allclose(w.grad(), 2 * before));  // Exactly the unscaled gradient.
    CHECK(scaler.Step(sgd, {w}));                  // Unscale is not repeated.
    CHECK(torch::allclose(w.detach(), before - 0.5 * 2 * before));
  }
  CHECK(scaler.scale() == 131072.0);  // Grown after 2 finite steps in a row.
  CHECK(scaler.growth_tracker() == 0);
  CHECK(scaler.skipped_steps() == 0);
}

TEST_CASE("an inf or NaN gradient skips the step and halves the scale; the state restores") {
  torch::Tensor w = torch::ones({3}).requires_grad_(true);
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  GradScaler scaler({}, nullptr);
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    sgd.zero_grad();
    scaler.Scale(w.sum()).backward();
    torch::NoGradGuard no_grad;
    w.grad()[1] = bad;
    const double scale = scaler.scale();
    CHECK_FALSE(scaler.Step(sgd, {w}));
    CHECK(torch::equal(w.detach(), torch::ones({3})));
    CHECK(scaler.scale() == scale / 2);
  }
  CHECK(scaler.skipped_steps() == 2);
  GradScaler restored({}, nullptr);
  restored.Restore(scaler.scale(), 7);
  CHECK(restored.scale() == 16384.0);
  CHECK(restored.growth_tracker() == 7);
}

TEST_CASE("an overflow on one rank's gradient shard skips the step on every rank") {
  std::vector<double> scales(2);
  RunRanks(2, [&](int rank, PG pg) {
    // Each rank steps its own shard, as under zero2/fsdp: only rank 1's holds the overflow.
    torch::Tensor shard = torch::full({4}, 1.0f + rank).requires_grad_(true);
    torch::optim::SGD sgd({shard}, torch::optim::SGDOptions(0.1));
    GradScaler scaler({}, pg);
    scaler.Scale((shard * shard).sum()).backward();
    if (rank == 1) {
      torch::NoGradGuard no_grad;
      shard.grad()[2] = std::numeric_limits<float>::infinity();
    }
    CHECK_FALSE(scaler.Unscale({shard}));
    CHECK_FALSE(scaler.Step(sgd, {shard}));
    CHECK(torch::equal(shard.detach(), torch::full({4}, 1.0f + rank)));
    scales[rank] = scaler.scale();
    // The next step is finite everywhere: taken on both.
    sgd.zero_grad();
    scaler.Scale((shard * shard).sum()).backward();
    CHECK(scaler.Step(sgd, {shard}));
    CHECK(shard[0].item<float>() == doctest::Approx((1.0f + rank) * 0.8f));
  });
  CHECK(scales[0] == 32768.0);
  CHECK(scales[1] == 32768.0);
}

}  // namespace
}  // namespace elrun::trainer
