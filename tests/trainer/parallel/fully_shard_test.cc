// FullyShard on a user's own module (fully_shard.h): blocks whose forward takes two tensors and
// returns a tuple, a root that returns a pair and holds parameters and a buffer of its own.
// Every sharded strategy on 2 and 3 ranks, with and without activation checkpointing, equals
// one process training the plain model on the global batch (losses and parameters, 1e-5), and so
// do units nested in a unit, with an evaluation forward between steps; the names are the plain
// model's; fsdp never holds a whole block after wrapping it; sharded
// checkpoints of the user module reshard from 2 ranks to 3 and export a consolidated file the
// plain model loads; bf16 compute stays near fp32; DDP trains the same module.
// Ranks are threads over a real Gloo group on loopback.
#include "trainer/parallel/fully_shard.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <mutex>

#include "tests/trainer/rank_threads.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/parallel/ddp.h"
#include "trainer/parallel/sharded_checkpoint.h"

namespace elrun::trainer {
namespace {

constexpr int64_t kIn = 5, kWidth = 7, kClasses = 3, kDepth = 3, kGlobalBatch = 12;
constexpr int kSteps = 5;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width)
      : fc1(register_module("fc1", torch::nn::Linear(width, 2 * width))),
        fc2(register_module("fc2", torch::nn::Linear(2 * width, width))) {}
  // Two tensors in, two out: the residual stream and an auxiliary loss term.
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& gate) {
    torch::Tensor h = torch::tanh(fc1(x)) * gate;
    return {x + fc2(h), h.pow(2).mean()};
  }
  torch::nn::Linear fc1, fc2;
};

struct NetImpl : torch::nn::Module {
  // With a group, each block is sharded as soon as it is built; without, the wrappers run plainly.
  explicit NetImpl(const ShardGroup* group) {
    embed = register_module("embed", torch::nn::Linear(kIn, kWidth));
    for (int i = 0; i < kDepth; ++i) {
      auto block = std::make_shared<BlockImpl>(kWidth);
      blocks.push_back(
          register_module("block" + std::to_string(i), group ? FullyShard(block, *group) : Sharded<BlockImpl>(block)));
    }
    head = register_module("head", torch::nn::Linear(kWidth, kClasses));
    temperature = register_buffer("temperature", torch::full({1}, 2.0));
  }
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& gate) {
    torch::Tensor h = embed(x);
    torch::Tensor aux = torch::zeros({});
    for (auto& block : blocks) {
      auto [y, a] = block->forward(h, gate);
      h = y;
      aux = aux + a;
    }
    return {head(h) / temperature, aux};
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<Sharded<BlockImpl>> blocks;
  torch::Tensor temperature;
};

// The default generator is global and the ranks are threads: seed and build atomically.
template <class Net>
std::shared_ptr<Net> Build(const ShardGroup* group, uint64_t seed) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  return std::make_shared<Net>(group);
}

std::shared_ptr<NetImpl> BuildNet(const ShardGroup* group) { return Build<NetImpl>(group, 11); }

struct Data {
  torch::Tensor x, gate, y;
};

Data Batch(int step) {
  torch::Generator gen = at::detail::createCPUGenerator(100 + step);
  return {torch::randn({kGlobalBatch, kIn}, gen), torch::rand({kGlobalBatch, 2 * kWidth}, gen) + 0.5,
          torch::randint(kClasses, {kGlobalBatch}, gen)};
}

torch::Tensor Loss(const std::pair<torch::Tensor, torch::Tensor>& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.first, y) + 0.1 * out.second;
}

struct Trained {
  std::vector<double> losses;  // The global batch's, per step.
  std::map<std::string, torch::Tensor> params;
};

// One process on the global batch: the reference.
Trained TrainPlain() {
  auto net = BuildNet(nullptr);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Trained t;
  for (int step = 0; step < kSteps; ++step) {
    Data d = Batch(step);
    sgd.zero_grad();
    torch::Tensor loss = Loss(net->forward(d.x, d.gate), d.y);
    loss.backward();
    sgd.step();
    t.losses.push_back(loss.item<double>());
  }
  for (const auto& p : net->named_parameters()) t.params[p.key()] = p.value().detach().clone();
  return t;
}

double RelativeDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-12, b.abs().max().item<double>());
}

// This rank's rows of the global batch.
torch::Tensor Rows(const torch::Tensor& t, int rank, int world) {
  const int64_t per = kGlobalBatch / world;
  return t.narrow(0, rank * per, per);
}

// One step of `model` (a root made by FullyShard, or a plain model under DDP) on this rank's rows
// of the global batch; the mean over ranks of the local losses.
template <class Model>
double StepRank(Model& model, torch::optim::Optimizer& optimizer, int step, int rank, int world, c10d::Backend& pg) {
  Data d = Batch(step);
  auto rows = [&](const torch::Tensor& t) { return Rows(t, rank, world); };
  optimizer.zero_grad();
  torch::Tensor loss = Loss(model->forward(rows(d.x), rows(d.gate)), rows(d.y));
  loss.backward();
  optimizer.step();
  std::vector<torch::Tensor> sum{loss.detach().clone().reshape({1})};
  pg.allreduce(sum)->wait();
  return sum[0].item<double>() / world;
}

TEST_CASE("every sharded strategy on a user module equals one process on the global batch") {
  const Trained reference = TrainPlain();
  for (const char* strategy : {"no_shard", "zero1", "zero2", "fsdp"}) {
    for (int world : {2, 3}) {
      for (bool checkpointing : {false, true}) {
        CAPTURE(strategy);
        CAPTURE(world);
        CAPTURE(checkpointing);
        RunRanks(world, [&](int rank, PG pg) {
          FsdpOptions options;
          options.strategy = *ParseStrategy(strategy);
          options.activation_checkpointing = checkpointing;
          ShardGroup group(pg, options);
          Sharded<NetImpl> model = FullyShard(BuildNet(&group), group);
          torch::optim::SGD sgd(model->fsdp().parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          for (int step = 0; step < kSteps; ++step) {
            const double loss = StepRank(model, sgd, step, rank, world, *pg);
            CHECK(std::abs(loss - reference.losses[step]) <= 1e-5 * std::abs(reference.losses[step]));
          }
          const auto full = model->fsdp().FullParameters();
          REQUIRE(full.size() == reference.params.size());
          for (const auto& [name, value] : reference.params) {
            CAPTURE(name);
            REQUIRE(full.count(name) == 1);
            CHECK(RelativeDiff(full.at(name), value) <= 1e-5);
          }
        });
      }
    }
  }
}

// A unit holding units of its own: a stage of two blocks and a projection. With a group the
// blocks are wrapped first, then the stage; the stage's unit is its projection alone.
struct StageImpl : torch::nn::Module {
  explicit StageImpl(const ShardGroup* group) {
    for (int i = 0; i < 2; ++i) {
      auto block = std::make_shared<BlockImpl>(kWidth);
      blocks.push_back(
          register_module("block" + std::to_string(i), group ? FullyShard(block, *group) : Sharded<BlockImpl>(block)));
    }
    proj = register_module("proj", torch::nn::Linear(kWidth, kWidth));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& gate) {
    torch::Tensor h = x, aux = torch::zeros({});
    for (auto& block : blocks) {
      auto [y, a] = block->forward(h, gate);
      h = y;
      aux = aux + a;
    }
    return {proj(h), aux};
  }
  std::vector<Sharded<BlockImpl>> blocks;
  torch::nn::Linear proj{nullptr};
};

struct NestedNetImpl : torch::nn::Module {
  explicit NestedNetImpl(const ShardGroup* group) {
    embed = register_module("embed", torch::nn::Linear(kIn, kWidth));
    auto stage_impl = std::make_shared<StageImpl>(group);
    stage = register_module("stage", group ? FullyShard(stage_impl, *group) : Sharded<StageImpl>(stage_impl));
    head = register_module("head", torch::nn::Linear(kWidth, kClasses));
  }
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& gate) {
    auto [h, aux] = stage->forward(embed(x), gate);
    return {head(h), aux};
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  Sharded<StageImpl> stage{nullptr};
};

std::shared_ptr<NestedNetImpl> BuildNested(const ShardGroup* group) { return Build<NestedNetImpl>(group, 13); }

TEST_CASE("nested units, and an evaluation forward between steps, equal one process") {
  // The reference: the plain nested model, one process, the global batch; an evaluation forward
  // (no grad, eval mode) after each step, whose output is kept.
  auto plain = BuildNested(nullptr);
  torch::optim::SGD reference_sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<torch::Tensor> evaluations;
  for (int step = 0; step < kSteps; ++step) {
    Data d = Batch(step);
    reference_sgd.zero_grad();
    Loss(plain->forward(d.x, d.gate), d.y).backward();
    reference_sgd.step();
    torch::NoGradGuard no_grad;
    plain->eval();
    evaluations.push_back(plain->forward(d.x, d.gate).first);
    plain->train();
  }
  for (const char* strategy : {"zero2", "fsdp"}) {
    CAPTURE(strategy);
    RunRanks(2, [&](int rank, PG pg) {
      ShardGroup group(pg, FsdpOptions{*ParseStrategy(strategy)});
      Sharded<NestedNetImpl> model = FullyShard(BuildNested(&group), group);
      CHECK(model->fsdp().units().size() == 4);  // Two blocks, the stage's projection, the root.
      torch::optim::SGD sgd(model->fsdp().parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < kSteps; ++step) {
        StepRank(model, sgd, step, rank, 2, *pg);
        Data d = Batch(step);
        auto rows = [&](const torch::Tensor& t) { return Rows(t, rank, 2); };
        torch::NoGradGuard no_grad;
        model->eval();
        CHECK(RelativeDiff(model->forward(rows(d.x), rows(d.gate)).first, rows(evaluations[step])) <= 1e-5);
        model->train();
      }
      const auto full = model->fsdp().FullParameters();
      for (const auto& p : plain->named_parameters()) {
        CAPTURE(p.key());
        REQUIRE(full.count(p.key()) == 1);
        CHECK(RelativeDiff(full.at(p.key()), p.value().detach()) <= 1e-5);
      }
    });
  }
}

TEST_CASE("the wrappers keep the plain model's names and fsdp never holds a whole block") {
  auto plain = BuildNet(nullptr);
  std::vector<std::string> plain_names;
  for (const auto& p : plain->named_parameters()) plain_names.push_back(p.key());
  std::vector<std::string> plain_buffers;
  for (const auto& b : plain->named_buffers()) plain_buffers.push_back(b.key());
  RunRanks(2, [&](int, PG pg) {
    ShardGroup group(pg, FsdpOptions{Strategy::kFsdp});
    auto net = BuildNet(&group);
    // Each block, once wrapped, holds only its shard: its parameters have no memory of their own.
    for (auto& block : net->blocks) {
      for (const auto& p : block->parameters()) CHECK(p.storage().nbytes() == 0);
    }
    Sharded<NetImpl> model = FullyShard(net, group);
    std::vector<std::string> names;
    for (const auto& p : model->named_parameters()) names.push_back(p.key());
    CHECK(names == plain_names);
    std::vector<std::string> buffers;
    for (const auto& b : model->named_buffers()) buffers.push_back(b.key());
    CHECK(buffers == plain_buffers);
    FullyShardedDataParallel& fsdp = model->fsdp();
    CHECK(fsdp.units().size() == kDepth + 1);  // The blocks and the root's embed + head.
    int64_t shard_bytes = 0;
    for (const auto& s : fsdp.parameters()) shard_bytes += s.numel() * s.element_size();
    CHECK(fsdp.memory().params == shard_bytes);  // Nothing gathered outside a forward.
  });
}

TEST_CASE("sharded checkpoints of a user module reshard from 2 ranks to 3 and export for the plain model") {
  const auto dir = std::filesystem::temp_directory_path() / ("fully_shard_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::map<std::string, torch::Tensor> saved;
  std::mutex mu;
  RunRanks(2, [&](int rank, PG pg) {
    ShardGroup group(pg, FsdpOptions{Strategy::kFsdp});
    Sharded<NetImpl> model = FullyShard(BuildNet(&group), group);
    torch::optim::SGD sgd(model->fsdp().parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 2; ++step) StepRank(model, sgd, step, rank, 2, *pg);
    TrainProgress progress;
    progress.step = 2;
    progress.world_size = 2;
    REQUIRE(SaveSharded(dir.string(), model->fsdp(), sgd, progress).ok());
    auto full = model->fsdp().FullParameters();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      saved = full;
    }
  });
  RunRanks(3, [&](int, PG pg) {
    ShardGroup group(pg, FsdpOptions{Strategy::kZero2});
    Sharded<NetImpl> model = FullyShard(BuildNet(&group), group);
    torch::optim::SGD sgd(model->fsdp().parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto progress = LoadSharded(dir.string(), model->fsdp(), sgd);
    REQUIRE(progress.ok());
    CHECK(progress->step == 2);
    for (const auto& [name, value] : model->fsdp().FullParameters()) {
      CAPTURE(name);
      CHECK(torch::equal(value, saved.at(name)));
    }
    REQUIRE(ExportConsolidated((dir / "model.pt").string(), model->fsdp(), sgd, *progress).ok());
  });
  auto plain = BuildNet(nullptr);
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto progress = LoadCheckpoint((dir / "model.pt").string(), *plain, sgd);
  REQUIRE(progress.ok());
  for (const auto& p : plain->named_parameters()) {
    CAPTURE(p.key());
    CHECK(torch::equal(p.value(), saved.at(p.key())));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("bf16 compute on a user module stays near fp32 and returns fp32") {
  const Trained reference = TrainPlain();
  RunRanks(2, [&](int rank, PG pg) {
    FsdpOptions options;
    options.param_dtype = torch::kBFloat16;
    options.reduce_dtype = torch::kFloat32;
    ShardGroup group(pg, options);
    Sharded<NetImpl> model = FullyShard(BuildNet(&group), group);
    torch::optim::SGD sgd(model->fsdp().parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    Data d = Batch(0);
    const bool fp32_out = model->forward(d.x, d.gate).first.scalar_type() == torch::kFloat32;
    CHECK(fp32_out);
    const bool fp32_shards = model->fsdp().parameters().front().scalar_type() == torch::kFloat32;
    CHECK(fp32_shards);
    for (int step = 0; step < kSteps; ++step) {
      const double loss = StepRank(model, sgd, step, rank, 2, *pg);
      CHECK(std::abs(loss - reference.losses[step]) <= 2e-2 * std::abs(reference.losses[step]));
    }
  });
}

TEST_CASE("DistributedDataParallel trains the same user module as one process") {
  const Trained reference = TrainPlain();
  RunRanks(2, [&](int rank, PG pg) {
    auto net = BuildNet(nullptr);
    DistributedDataParallel ddp(net, pg);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) StepRank(net, sgd, step, rank, 2, *pg);
    for (const auto& p : net->named_parameters()) {
      CAPTURE(p.key());
      CHECK(RelativeDiff(p.value().detach(), reference.params.at(p.key())) <= 1e-5);
    }
  });
}

}  // namespace
}  // namespace elrun::trainer
