// DDP against one process on the concatenated batch: 2 ranks on threads, a real Gloo group over
// loopback TCP with an in-memory store.
#include "trainer/parallel/ddp.h"

#include <doctest/doctest.h>

#include <functional>
#include <mutex>

#include "tests/trainer/rank_threads.h"

namespace elrun::trainer {
namespace {

std::shared_ptr<torch::nn::SequentialImpl> Mlp(int seed) {
  // The default generator is global and the ranks are threads: seed and initialise atomically.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  return std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(10, 32), torch::nn::ReLU(),
                                                     torch::nn::Linear(32, 16), torch::nn::ReLU(),
                                                     torch::nn::Linear(16, 4));
}

struct Data {
  torch::Tensor x, y;
};

Data Batch(int64_t n, int seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return {torch::randn({n, 10}, gen), torch::randint(0, 4, {n}, gen)};
}

// One process, the whole batch, `steps` SGD steps; returns the flattened parameters.
torch::Tensor Reference(const std::vector<Data>& steps_data, int seed) {
  auto model = Mlp(seed);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  for (const Data& d : steps_data) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(d.x), d.y).backward();
    opt.step();
  }
  std::vector<torch::Tensor> flat;
  for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}));
  return torch::cat(flat);
}

torch::Tensor Flat(torch::nn::Module& m) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : m.parameters()) flat.push_back(p.detach().reshape({-1}));
  return torch::cat(flat);
}

void CheckClose(const torch::Tensor& a, const torch::Tensor& b) {
  double diff = (a - b).abs().max().item<double>();
  CHECK_MESSAGE(diff < 1e-5, "max |difference| ", diff);
}

constexpr int kWorld = 2;
constexpr int64_t kPerRank = 8;
constexpr int kSteps = 10;

std::vector<Data> StepsData() {
  std::vector<Data> steps;
  for (int s = 0; s < kSteps; ++s) steps.push_back(Batch(kWorld * kPerRank, 100 + s));
  return steps;
}

// With `shm`, buckets are summed through a ShmAllreduce (shm_allreduce.h) instead of Gloo.
void TrainDdp(double bucket_cap_mb, int accum, std::vector<torch::Tensor>* results,
              std::vector<DdpStats>* stats = nullptr, std::vector<size_t>* buckets = nullptr, bool shm = false) {
  std::vector<Data> steps = StepsData();
  results->assign(kWorld, {});
  if (stats) stats->assign(kWorld, {});
  RunRanksWithStore(kWorld, [&](int rank, PG pg, c10d::Store& store) {
    auto model = Mlp(rank == 0 ? 7 : 99);  // Rank 1 starts different: the wrap must fix that.
    DdpOptions options;
    options.bucket_cap_mb = bucket_cap_mb;
    if (shm) {
      auto created = ShmAllreduce::Create(store, "ddp_test_shm", rank, kWorld, 1 << 20, std::chrono::seconds(30));
      REQUIRE_MESSAGE(created.ok(), created.status().ToString());
      options.shm = std::move(*created);
    }
    DistributedDataParallel ddp(model, pg, options);
    if (buckets && rank == 0) *buckets = {ddp.bucket_layout().size()};
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    for (const Data& d : steps) {
      opt.zero_grad();
      auto x = d.x.narrow(0, rank * kPerRank, kPerRank);
      auto y = d.y.narrow(0, rank * kPerRank, kPerRank);
      int64_t micro = kPerRank / accum;
      for (int m = 0; m < accum; ++m) {
        auto loss = torch::nn::functional::cross_entropy(model->forward(x.narrow(0, m * micro, micro)),
                                                         y.narrow(0, m * micro, micro)) /
                    accum;
        if (m + 1 < accum) {
          DistributedDataParallel::NoSync no_sync(ddp);
          loss.backward();
        } else {
          loss.backward();
        }
      }
      opt.step();
    }
    (*results)[rank] = Flat(*model);
    if (stats) (*stats)[rank] = ddp.last_stats();
  });
}

TEST_CASE("2 ranks with DDP equal one process on the concatenated batch") {
  std::vector<torch::Tensor> results;
  TrainDdp(25.0, 1, &results);
  torch::Tensor expected = Reference(StepsData(), 7);
  CheckClose(results[0], expected);
  CheckClose(results[1], expected);
}

TEST_CASE("gradient accumulation: k micro-batches of b equal one batch of k*b") {
  std::vector<torch::Tensor> results;
  TrainDdp(25.0, 4, &results);
  torch::Tensor expected = Reference(StepsData(), 7);
  CheckClose(results[0], expected);
  CheckClose(results[1], expected);
}

TEST_CASE("uneven bucket boundaries give the same parameters") {
  std::vector<torch::Tensor> results;
  std::vector<size_t> buckets;
  TrainDdp(0.0001, 1, &results, nullptr, &buckets);  // ~105 bytes: layers split across buckets.
  REQUIRE(buckets.size() == 1);
  CHECK(buckets[0] >= 4);
  torch::Tensor expected = Reference(StepsData(), 7);
  CheckClose(results[0], expected);
  CheckClose(results[1], expected);
}

TEST_CASE("over shared memory: one bucket, uneven buckets and accumulation equal one process") {
  torch::Tensor expected = Reference(StepsData(), 7);
  for (double cap : {25.0, 0.0001}) {
    for (int accum : {1, 4}) {
      CAPTURE(cap);
      CAPTURE(accum);
      std::vector<torch::Tensor> shm, gloo;
      TrainDdp(cap, accum, &shm, nullptr, nullptr, /*shm=*/true);
      TrainDdp(cap, accum, &gloo);
      CheckClose(shm[0], expected);
      CHECK(torch::equal(shm[0], shm[1]));  // Every rank copies out the same sums.
      CheckClose(shm[0], gloo[0]);
    }
  }
}

TEST_CASE("a shared-memory all-reduce of other ranks than the group is refused") {
  RunRanksWithStore(kWorld, [&](int rank, PG pg, c10d::Store& store) {
    auto created = ShmAllreduce::Create(store, "alone" + std::to_string(rank), 0, 1, 1024, std::chrono::seconds(30));
    REQUIRE(created.ok());
    DdpOptions options;
    options.shm = std::move(*created);
    if (rank == 1) {
      CHECK_THROWS_WITH(
          DistributedDataParallel(Mlp(1), pg, options),
          doctest::Contains("the shared-memory all-reduce spans rank 0 of 1, the process group rank 1 of 2"));
    }
  });
}

TEST_CASE("overlap: the first bucket's all-reduce starts before backward has all gradients") {
  std::vector<torch::Tensor> results;
  std::vector<DdpStats> stats;
  TrainDdp(0.0001, 1, &results, &stats);
  for (const DdpStats& s : stats) {
    CHECK(s.buckets >= 4);
    CHECK(s.buckets_launched_before_backward_end == s.buckets);
    CHECK(s.first_launch < s.last_grad_ready);
    CHECK(s.last_grad_ready <= s.backward_end);
  }
}

TEST_CASE("buckets follow reverse registration order") {
  RunRanks(1, [](int, PG pg) {
    auto model = Mlp(1);
    DistributedDataParallel ddp(model, pg, DdpOptions{25.0});
    REQUIRE(ddp.bucket_layout().size() == 1);
    const auto& order = ddp.bucket_layout()[0];
    REQUIRE(order.size() == 6);
    CHECK(order.front() == 5);
    CHECK(order.back() == 0);
  });
}

// Parameters of given float counts, registered in order p0, p1, ...
struct Sized : torch::nn::Module {
  explicit Sized(const std::vector<int64_t>& numels) {
    for (size_t i = 0; i < numels.size(); ++i) register_parameter("p" + std::to_string(i), torch::zeros({numels[i]}));
  }
};

TEST_CASE("bucket limits follow PyTorch: a small first bucket, a bucket closes once it reaches its limit") {
  constexpr int64_t kMiB = 1024 * 1024 / 4;  // floats
  // Reverse registration order: p4 (0.5 MiB), p3 (0.6 MiB), p2 (0.1 MiB), p1 (3 MiB), p0 (1 KiB).
  auto model = std::make_shared<Sized>(std::vector<int64_t>{256, 3 * kMiB, kMiB / 10, kMiB * 6 / 10, kMiB / 2});
  RunRanks(1, [&](int, PG pg) {
    DistributedDataParallel ddp(model, pg, DdpOptions{/*bucket_cap_mb=*/2.0});
    const std::vector<std::vector<size_t>> expected{{4, 3}, {2, 1}, {0}};
    CHECK(ddp.bucket_layout() == expected);
    DdpOptions one_bucket;
    one_bucket.bucket_cap_mb = 25.0;
    one_bucket.first_bucket_mb = 25.0;
    DistributedDataParallel single(model, pg, one_bucket);
    CHECK(single.bucket_layout().size() == 1);
  });
}

struct WithUnused : torch::nn::Module {
  WithUnused() {
    used = register_module("used", torch::nn::Linear(4, 2));
    unused = register_module("unused", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return used->forward(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};

TEST_CASE("parameters without a gradient are a clear error unless expected") {
  RunRanks(kWorld, [](int, PG pg) {
    auto model = std::make_shared<WithUnused>();
    DistributedDataParallel ddp(model, pg, DdpOptions{25.0, false});
    auto loss = model->forward(torch::ones({3, 4})).sum();
    std::string message;
    try {
      loss.backward();
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    CHECK(message.find("2 parameter(s) got no gradient") != std::string::npos);
    CHECK(message.find("unused.weight") != std::string::npos);
  });
  RunRanks(kWorld, [](int, PG pg) {
    auto model = std::make_shared<WithUnused>();
    DistributedDataParallel ddp(model, pg, DdpOptions{25.0, true});
    model->forward(torch::ones({3, 4})).sum().backward();
    CHECK(model->unused->weight.grad().abs().sum().item<double>() == 0.0);
    CHECK(model->used->weight.grad().defined());
  });
}

TEST_CASE("NoSync communicates nothing; grads stay local") {
  RunRanks(kWorld, [](int rank, PG pg) {
    auto model = Mlp(3);
    DistributedDataParallel ddp(model, pg);
    {
      DistributedDataParallel::NoSync no_sync(ddp);
      auto x = torch::full({2, 10}, rank + 1.0);
      model->forward(x).sum().backward();
    }
    CHECK(ddp.last_stats().bytes_reduced == 0);
    // The first layer's weight gradient depends on the (different) inputs of each rank.
    auto g = model->parameters().front().grad().clone();
    std::vector<torch::Tensor> both{g};
    pg->allreduce(both)->wait();  // Sum of two different local grads != 2x either.
    CHECK_FALSE(torch::allclose(both[0], 2 * model->parameters().front().grad()));
  });
}

}  // namespace
}  // namespace elrun::trainer
