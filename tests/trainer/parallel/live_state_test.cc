// Regrouping in place: a DDP wrapper rebound to a new group, and the live state of the rank
// furthest along handed to every rank of it (survivors and a replacement without state).
#include "trainer/parallel/live_state.h"

#include <doctest/doctest.h>

#include <mutex>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "tests/trainer/rank_threads.h"
#include "trainer/checkpoint/optimizer_state.h"
#include "trainer/parallel/data_parallel.h"

namespace elrun::trainer {
namespace {

class TinyNet : public Classifier {
 public:
  explicit TinyNet(int seed) {
    static std::mutex mu;  // The default generator is global and the ranks are threads.
    std::lock_guard<std::mutex> lock(mu);
    torch::manual_seed(seed);
    fc_ = register_module("fc", torch::nn::Linear(4, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fc_->forward(x); }

 private:
  torch::nn::Linear fc_{nullptr};
};

FsdpOptions Ddp() {
  FsdpOptions options;
  options.strategy = Strategy::kDdp;
  return options;
}

DdpOptions Joining() {
  DdpOptions options;
  options.broadcast_from_rank0 = false;  // As a replacement and the survivors regroup.
  return options;
}

TEST_CASE("SyncLiveState gives every rank the state of the rank furthest along") {
  std::vector<torch::Tensor> weights(3), momenta(3);
  std::vector<LiveSync> syncs(3);
  RunRanks(3, [&](int rank, PG pg) {
    auto model = std::make_shared<TinyNet>(100 + rank);  // Different on every rank.
    auto dp = DataParallel::Create(model, pg, Ddp(), Joining());
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    std::optional<TrainProgress> mine;
    if (rank < 2) {
      for (auto& p : model->parameters()) p.mutable_grad() = torch::full_like(p, rank + 1.0);
      optimizer.step();  // Momentum buffers that differ by rank.
      mine = TrainProgress{};
      mine->step = rank == 0 ? 7 : 9;  // Rank 1 finished one more step; rank 2 has no state.
      mine->epoch = 1;
      mine->samples_seen = 40 + rank;
    }
    auto sync = SyncLiveState(*pg, *dp, optimizer, mine);
    REQUIRE_MESSAGE(sync.ok(), sync.status().ToString());
    syncs[rank] = *sync;
    weights[rank] = model->parameters()[0].detach().clone();
    momenta[rank] = ExportParamState(optimizer, model->parameters()[0]).at("momentum_buffer");
  });
  for (int rank = 0; rank < 3; ++rank) {
    CAPTURE(rank);
    CHECK(syncs[rank].source_rank == 1);
    CHECK(syncs[rank].stateless_ranks == 1);
    CHECK(syncs[rank].bytes > 0);
    CHECK(syncs[rank].progress.step == 9);
    CHECK(syncs[rank].progress.samples_seen == 41);
    CHECK(syncs[rank].progress.world_size == 3);
    CHECK(torch::equal(weights[rank], weights[1]));
    CHECK(torch::equal(momenta[rank], momenta[1]));
  }
}

TEST_CASE("SyncLiveState fails on every rank when no rank holds state") {
  RunRanks(2, [&](int, PG pg) {
    auto model = std::make_shared<TinyNet>(1);
    auto dp = DataParallel::Create(model, pg, Ddp(), Joining());
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    auto sync = SyncLiveState(*pg, *dp, optimizer, std::nullopt);
    CHECK(sync.status().code() == absl::StatusCode::kFailedPrecondition);
  });
}

TEST_CASE("A DDP wrapper rebound to a new group averages over it") {
  std::vector<torch::Tensor> grads(2);
  auto second = c10::make_intrusive<c10d::HashStore>();
  RunRanks(2, [&](int rank, PG pg) {
    auto model = std::make_shared<TinyNet>(5);
    auto dp = DataParallel::Create(model, pg, Ddp());
    REQUIRE(dp->CanRegroup());
    const torch::Tensor x = torch::full({2, 4}, rank + 1.0);
    // The new group: another store, ranks swapped, as a regroup may hand out.
    PG next = MakeGlooBackend(c10::make_intrusive<c10d::PrefixStore>("next", second), 1 - rank, 2,
                              GlooDevice{{}, "127.0.0.1"}, std::chrono::seconds(30));
    REQUIRE(dp->Rebind(next, nullptr).ok());
    model->zero_grad();
    dp->Backward(dp->Forward(x).sum(), /*synchronize=*/true);
    grads[rank] = model->parameters()[0].grad().clone();
  });
  // d(sum(W x + b))/dW is every row of x summed over the batch: rank r gives 2 (r + 1); the
  // average over both ranks is 3, on both.
  CHECK(torch::allclose(grads[0], torch::full({3, 4}, 3.0)));
  CHECK(torch::equal(grads[0], grads[1]));
}

TEST_CASE("A DDP wrapper rebound to a group of one no longer averages") {
  RunRanks(2, [&](int rank, PG pg) {
    auto model = std::make_shared<TinyNet>(5);
    auto dp = DataParallel::Create(model, pg, Ddp());
    if (rank == 1) return;  // Left; rank 0 goes on alone.
    PG alone = MakeGlooBackend(c10::make_intrusive<c10d::HashStore>(), 0, 1, GlooDevice{{}, "127.0.0.1"},
                               std::chrono::seconds(30));
    REQUIRE(dp->Rebind(alone, nullptr).ok());
    model->zero_grad();
    dp->Backward(dp->Forward(torch::ones({2, 4})).sum(), /*synchronize=*/true);
    CHECK(torch::allclose(model->parameters()[0].grad(), torch::full({3, 4}, 2.0)));
  });
}

}  // namespace
}  // namespace elrun::trainer
