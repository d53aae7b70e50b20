// The CUDA + NCCL path on every visible GPU (one rank per device, ranks on threads, NCCL over an
// in-memory store): DDP on CUDA equals one CPU process on the concatenated batch; SyncBatchNorm on
// CUDA equals batch norm over the union on the CPU; FSDP (full shard) equals DDP on CUDA; NCCL's
// reduce-scatter and all-gather; a checkpoint written from CUDA loads on the CPU; the caching
// allocator's statistics. Without a visible CUDA device the binary prints one ELRUN_SKIP line and
// exits 0, which scripts/test.sh counts as skipped, never as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/temp_dir.h"
#include "tests/trainer/batch_norm_reference.h"
#include "tests/trainer/rank_threads.h"
#include "trainer/app/models.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/dist/collectives.h"
#include "trainer/dist/process_group.h"
#include "trainer/memory/cuda_memory.h"
#include "trainer/optim/foreach_sgd.h"
#include "trainer/parallel/data_parallel.h"
#include "trainer/parallel/ddp.h"
#include "trainer/parallel/fsdp.h"
#include "trainer/parallel/sync_batch_norm.h"
#include "trainer/runtime/cuda_graph_step.h"

namespace elrun::trainer {
namespace {

int World() { return std::min<int>(8, static_cast<int>(torch::cuda::device_count())); }

// One thread per visible device, each with an NCCL backend bound to cuda:rank.
void RunCudaRanks(const std::function<void(int rank, PG pg)>& body) {
  RunRanksOn(
      World(),
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int world) {
        return MakeNcclBackend(store, rank, world, rank, std::chrono::seconds(60));
      },
      [&](int rank, PG pg, c10d::Store&) { body(rank, pg); });
}

torch::Device Cuda(int rank) { return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank)); }

std::shared_ptr<Classifier> Model(int seed, const std::string& name = "mlp") {
  static std::mutex mu;  // The default generator is global and the ranks are threads.
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  return *MakeModel(name, MlpOptions{12, {32, 16}, 4}, LinearKernel::kAten);
}

struct Batch {
  torch::Tensor x, y;  // CPU, all ranks' rows: rank r takes rows [r*n, (r+1)*n).
};

std::vector<Batch> Data(int steps, int64_t rows) {
  auto gen = at::detail::createCPUGenerator(7);
  std::vector<Batch> data;
  for (int s = 0; s < steps; ++s) data.push_back({torch::randn({rows, 12}, gen), torch::randint(0, 4, {rows}, gen)});
  return data;
}

torch::Tensor Flat(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.detach().cpu().reshape({-1}));
  return torch::cat(flat);
}

constexpr int kSteps = 3;
constexpr int64_t kPerRank = 8;

TEST_CASE("DDP on CUDA with NCCL equals one CPU process on the concatenated batch") {
  const int world = World();
  auto data = Data(kSteps, world * kPerRank);
  auto reference = Model(3);
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (const Batch& b : data) {
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(b.x), b.y).backward();
    ref_opt.step();
  }
  const torch::Tensor expected = Flat(reference->parameters());
  RunCudaRanks([&](int rank, PG pg) {
    auto model = Model(3);
    model->to(Cuda(rank));
    DistributedDataParallel ddp(model, pg);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (const Batch& b : data) {
      opt.zero_grad();
      auto x = b.x.narrow(0, rank * kPerRank, kPerRank).to(Cuda(rank));
      auto y = b.y.narrow(0, rank * kPerRank, kPerRank).to(Cuda(rank));
      torch::nn::functional::cross_entropy(model->forward(x), y).backward();
      opt.step();
    }
    const double diff = (Flat(model->parameters()) - expected).abs().max().item<double>();
    CHECK_MESSAGE(diff < 1e-4, "rank ", rank, ": CUDA vs CPU max |difference| ", diff);
  });
}

TEST_CASE("SyncBatchNorm on CUDA equals batch norm over the union of the ranks' batches") {
  const int world = World();
  auto gen = at::detail::createCPUGenerator(11);
  torch::Tensor all = torch::randn({world * 4, 3, 5, 5}, gen) * 2 + 1;
  torch::Tensor upstream = torch::randn({world * 4, 3, 5, 5}, gen);
  torch::Tensor x_ref = all.clone().requires_grad_(true);
  torch::Tensor y_ref =
      torch::nn::functional::batch_norm(x_ref, torch::zeros({3}), torch::ones({3}),
                                        torch::nn::functional::BatchNormFuncOptions().training(true).eps(1e-5));
  (y_ref * upstream).sum().backward();
  RunCudaRanks([&](int rank, PG pg) {
    SyncBatchNorm bn(torch::nn::BatchNormOptions(3), pg);
    bn->to(Cuda(rank));
    torch::Tensor x = all.narrow(0, rank * 4, 4).to(Cuda(rank)).requires_grad_(true);
    torch::Tensor y = bn->forward(x);
    (y * upstream.narrow(0, rank * 4, 4).to(Cuda(rank))).sum().backward();
    const double out_diff = (y.detach().cpu() - y_ref.detach().narrow(0, rank * 4, 4)).abs().max().item<double>();
    const double grad_diff = (x.grad().cpu() - x_ref.grad().narrow(0, rank * 4, 4)).abs().max().item<double>();
    CHECK_MESSAGE(out_diff < 1e-4, "output max |difference| ", out_diff);
    CHECK_MESSAGE(grad_diff < 1e-4, "input gradient max |difference| ", grad_diff);
  });
}

// Issue 33 on CUDA: both memory layouts at a real layer's size against a float64 BatchNorm
// over the union (batch_norm_reference.h), 1e-5 of the largest value.
TEST_CASE("SyncBatchNorm on CUDA, NCHW and channels-last, equals a float64 BatchNorm over the union") {
  const int world = World();
  const BatchNormCase c;
  const BatchNormResult expected = BatchNormReference(c, world);
  for (bool channels_last : {false, true}) {
    CAPTURE(channels_last);
    std::vector<BatchNormResult> ranks(world);
    RunCudaRanks([&](int rank, PG pg) {
      SyncBatchNorm bn(torch::nn::BatchNormOptions(BatchNormCase::kChannels).momentum(0.1), pg);
      {
        torch::NoGradGuard no_grad;
        bn->weight.copy_(c.gamma);
        bn->bias.copy_(c.beta);
      }
      bn->to(Cuda(rank));
      torch::Tensor x = c.Input(rank).to(Cuda(rank));
      if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      x.requires_grad_(true);
      torch::Tensor y = bn->forward(x);
      (y * c.LossWeights(rank).to(Cuda(rank))).sum().backward();
      ranks[rank] = {y.detach().cpu(),      x.grad().cpu(),         bn->weight.grad().cpu(),
                     bn->bias.grad().cpu(), bn->running_mean.cpu(), bn->running_var.cpu()};
    });
    std::vector<torch::Tensor> outs, grads;
    torch::Tensor grad_weight = torch::zeros({BatchNormCase::kChannels}),
                  grad_bias = torch::zeros({BatchNormCase::kChannels});
    for (const BatchNormResult& r : ranks) {
      outs.push_back(r.out);
      grads.push_back(r.grad_input);
      grad_weight += r.grad_weight;
      grad_bias += r.grad_bias;
      CHECK(RelativeToLargest(r.running_mean, expected.running_mean) <= 1e-5);
      CHECK(RelativeToLargest(r.running_var, expected.running_var) <= 1e-5);
    }
    CHECK(RelativeToLargest(torch::cat(outs), expected.out) <= 1e-5);
    CHECK(RelativeToLargest(torch::cat(grads), expected.grad_input) <= 1e-5);
    CHECK(RelativeToLargest(grad_weight, expected.grad_weight) <= 1e-5);
    CHECK(RelativeToLargest(grad_bias, expected.grad_bias) <= 1e-5);
  }
}

TEST_CASE("FSDP (full shard) on CUDA trains to DDP's parameters") {
  const int world = World();
  auto data = Data(kSteps, world * kPerRank);
  std::vector<torch::Tensor> ddp_params(world), fsdp_params(world);
  for (const bool sharded : {false, true}) {
    RunCudaRanks([&](int rank, PG pg) {
      auto model = Model(5);
      model->to(Cuda(rank));
      std::unique_ptr<DistributedDataParallel> ddp;
      std::unique_ptr<FullyShardedDataParallel> fsdp;
      std::vector<torch::Tensor> params;
      if (sharded) {
        fsdp = std::make_unique<FullyShardedDataParallel>(model, pg, FsdpOptions{Strategy::kFsdp});
        params = fsdp->parameters();
      } else {
        ddp = std::make_unique<DistributedDataParallel>(model, pg);
        params = model->parameters();
      }
      torch::optim::Adam opt(params, torch::optim::AdamOptions(0.01));
      for (const Batch& b : data) {
        opt.zero_grad();
        auto x = b.x.narrow(0, rank * kPerRank, kPerRank).to(Cuda(rank));
        auto y = b.y.narrow(0, rank * kPerRank, kPerRank).to(Cuda(rank));
        auto logits = sharded ? fsdp->forward(x) : model->forward(x);
        torch::nn::functional::cross_entropy(logits, y).backward();
        opt.step();
      }
      if (sharded) {
        std::vector<torch::Tensor> full;
        for (const auto& [name, value] : fsdp->FullParameters()) full.push_back(value);
        fsdp_params[rank] = Flat(full);
      } else {
        // FullParameters is ordered by name: order DDP's the same way.
        std::map<std::string, torch::Tensor> by_name;
        for (const auto& p : model->named_parameters()) by_name[p.key()] = p.value();
        std::vector<torch::Tensor> full;
        for (const auto& [name, value] : by_name) full.push_back(value);
        ddp_params[rank] = Flat(full);
      }
    });
  }
  for (int rank = 0; rank < world; ++rank) {
    REQUIRE(ddp_params[rank].defined());
    REQUIRE(fsdp_params[rank].defined());
    const double diff = (ddp_params[rank] - fsdp_params[rank]).abs().max().item<double>();
    CHECK_MESSAGE(diff < 1e-4, "rank ", rank, ": FSDP vs DDP max |difference| ", diff);
  }
}

TEST_CASE("NCCL's reduce-scatter and all-gather into flat buffers") {
  const int world = World();
  RunCudaRanks([&](int rank, PG pg) {
    CHECK(CommDevice(*pg) == Cuda(rank));
    torch::Tensor input = (torch::arange(world * 4, torch::kFloat) * (rank + 1)).to(Cuda(rank));
    torch::Tensor shard = torch::zeros({4}, input.options());
    CommBytes bytes;
    ReduceScatter(*pg, input, shard, &bytes);
    const double factor = world * (world + 1) / 2.0;
    torch::Tensor expected = torch::arange(world * 4, torch::kFloat) * factor;
    CHECK(torch::allclose(shard.cpu(), expected.narrow(0, rank * 4, 4)));
    torch::Tensor full = torch::zeros({world * 4}, input.options());
    AllGather(*pg, shard, full, &bytes);
    CHECK(torch::allclose(full.cpu(), expected));
  });
}

TEST_CASE("a checkpoint written from CUDA loads into a CPU model, optimizer state included") {
  const std::string path = elrun::testing::MakeTempDir("cuda") + "/checkpoint.pt";
  auto cuda_model = Model(9);
  cuda_model->to(Cuda(0));
  torch::optim::SGD cuda_opt(cuda_model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::nn::functional::cross_entropy(cuda_model->forward(torch::randn({4, 12}).to(Cuda(0))),
                                       torch::tensor({0, 1, 2, 3}).to(Cuda(0)))
      .backward();
  cuda_opt.step();
  REQUIRE(SaveCheckpoint(path, *cuda_model, cuda_opt, {1, 0, 4, 1}).ok());
  auto cpu_model = Model(10);
  torch::optim::SGD cpu_opt(cpu_model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto loaded = LoadCheckpoint(path, *cpu_model, cpu_opt);
  REQUIRE_MESSAGE(loaded.ok(), loaded.status().ToString());
  CHECK(torch::equal(Flat(cpu_model->parameters()), Flat(cuda_model->parameters())));
  // And back onto the GPU.
  auto again = Model(11);
  again->to(Cuda(0));
  torch::optim::SGD again_opt(again->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  REQUIRE(LoadCheckpoint(path, *again, again_opt).ok());
  CHECK(torch::equal(Flat(again->parameters()), Flat(cuda_model->parameters())));
}

TEST_CASE("the caching allocator's statistics follow an allocation") {
  ResetCudaPeak(0);
  const CudaMemory before = CudaMemoryStats(0);
  {
    torch::Tensor big = torch::empty({16 << 20}, torch::TensorOptions().dtype(torch::kFloat).device(Cuda(0)));
    const CudaMemory during = CudaMemoryStats(0);
    CHECK(during.allocated - before.allocated >= (int64_t{64} << 20));
    CHECK(during.reserved >= during.allocated);
  }
  const CudaMemory after = CudaMemoryStats(0);
  CHECK(after.allocated == before.allocated);
  CHECK(after.peak_allocated - before.allocated >= (int64_t{64} << 20));
}

TEST_CASE("a DDP step captured in a CUDA graph trains as the eager steps do, short batches and a schedule included") {
  // FashionNet on random images: 2 warm-up steps, the capture, replays, one short batch (eager,
  // gradients zeroed in place), then replays again; the learning rate changes every step.
  RunCudaRanks([&](int rank, PG pg) {
    const std::vector<int64_t> sizes = {16, 16, 16, 16, 16, 7, 16, 16};
    auto gen = at::detail::createCPUGenerator(100 + rank);
    std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
    for (int64_t n : sizes) batches.emplace_back(torch::randn({n, 1, 28, 28}, gen), torch::randint(0, 10, {n}, gen));
    std::vector<std::vector<torch::Tensor>> trained;
    std::vector<std::vector<double>> losses;
    for (bool graphed : {false, true}) {
      auto model = Model(5, "fashionnet");
      model->to(Cuda(rank));
      CudaGraphStep graph(Cuda(rank), 16, /*warmup_steps=*/2);
      std::unique_ptr<DataParallel> dp;
      graph.OnStream([&] { dp = DataParallel::Create(model, pg, FsdpOptions{Strategy::kDdp}); });
      ForeachSgd sgd(dp->OptimizerParameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      if (graphed) graph.Bind(*dp, sgd);
      losses.emplace_back();
      for (size_t i = 0; i < batches.size(); ++i) {
        const double lr = 0.05 / (1.0 + static_cast<double>(i));
        auto fetch = [&] { return std::make_pair(batches[i].first.to(Cuda(rank)), batches[i].second.to(Cuda(rank))); };
        if (graphed) {
          losses.back().push_back(graph.Step(fetch, lr));
        } else {
          auto [x, y] = fetch();
          for (auto& group : sgd.param_groups()) group.options().set_lr(lr);
          sgd.zero_grad();
          torch::Tensor loss = torch::nn::functional::cross_entropy(dp->Forward(x), y);
          dp->Backward(loss, true);
          sgd.step();
          losses.back().push_back(loss.item<double>());
        }
      }
      CHECK(graph.captured() == graphed);
      trained.emplace_back();
      for (const auto& t : model->parameters()) trained.back().push_back(t.detach().cpu());
      for (const auto& t : model->buffers()) trained.back().push_back(t.detach().cpu().to(torch::kDouble));
    }
    for (size_t i = 0; i < losses[0].size(); ++i) {
      CAPTURE(i);
      CHECK(losses[1][i] == doctest::Approx(losses[0][i]).epsilon(1e-5));
    }
    CHECK(torch::allclose(Flat(trained[0]).to(torch::kDouble), Flat(trained[1]).to(torch::kDouble), 1e-5, 1e-5));
  });
}

TEST_CASE("ForeachSgd on CUDA (multi-tensor kernels) steps as torch::optim::SGD does") {
  torch::manual_seed(11);
  std::vector<torch::Tensor> a, b;
  for (auto shape : std::vector<std::vector<int64_t>>{{64, 32, 3, 3}, {64}, {128, 3136}, {10}}) {
    a.push_back(torch::randn(shape).to(Cuda(0)).requires_grad_());
    b.push_back(a.back().detach().clone().requires_grad_());
  }
  const auto options = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4);
  torch::optim::SGD reference(a, options);
  ForeachSgd foreach (b, options);
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      torch::Tensor g = torch::randn(a[i].sizes()).to(Cuda(0));
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
    reference.step();
    foreach
      .step();
  }
  // Both compute p - lr * (m * buf + g + wd * p) per element in fp32; the multi-tensor kernel may
  // contract to fused multiply-adds where the elementwise one does not.
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    CHECK(torch::allclose(a[i], b[i], /*rtol=*/1e-6, /*atol=*/1e-6));
  }
}

}  // namespace
}  // namespace elrun::trainer

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::cout << "ELRUN_SKIP: no CUDA device visible (torch::cuda::device_count() == 0); the CUDA and NCCL "
                 "tests need a GPU (scripts/gpu_check.sh runs them there)"
              << std::endl;
    return 0;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
