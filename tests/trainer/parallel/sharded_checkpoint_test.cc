// Sharded checkpoints: a 2 -> 3 -> 1 rank round trip keeps parameters and optimizer state
// exactly; strategies share the layout; a failed save leaves the previous set current; the
// consolidated export opens with LoadCheckpoint; bad checkpoints are clear errors.
// Ranks are threads over a real Gloo group on loopback.
#include "trainer/parallel/sharded_checkpoint.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>

#include "tests/temp_dir.h"
#include "tests/trainer/parallel/small_mlp.h"
#include "tests/trainer/rank_threads.h"
#include "trainer/app/models.h"

namespace elrun::trainer {
namespace {

struct Snapshot {
  std::map<std::string, torch::Tensor> params;
  std::map<std::string, ParamState> state;
  TrainProgress progress;
};

void CheckEqual(const Snapshot& a, const Snapshot& b) {
  REQUIRE(a.params.size() == b.params.size());
  for (const auto& [name, t] : a.params) CHECK_MESSAGE(torch::equal(t, b.params.at(name)), name);
  REQUIRE(a.state.size() == b.state.size());
  for (const auto& [name, fields] : a.state) {
    REQUIRE(b.state.count(name));
    REQUIRE(fields.size() == b.state.at(name).size());
    for (const auto& [field, t] : fields) CHECK_MESSAGE(torch::equal(t, b.state.at(name).at(field)), name, ".", field);
  }
}

// On `world` ranks with `strategy`: loads `dir` if it holds a checkpoint, trains `steps` Adam
// steps, saves, and returns rank 0's snapshot (taken after the load when steps == 0).
Snapshot Run(int world, const std::string& strategy, const std::string& dir, int steps, bool expect_resume) {
  Snapshot snapshot;
  std::vector<std::shared_ptr<Classifier>> models;
  for (int r = 0; r < world; ++r) models.push_back(SmallMlp(100 + r));
  RunRanks(world, [&](int rank, PG pg) {
    FsdpOptions options;
    options.strategy = *ParseStrategy(strategy);
    FullyShardedDataParallel fsdp(models[rank], pg, options);
    torch::optim::Adam adam(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    TrainProgress progress;
    auto loaded = LoadSharded(dir, fsdp, adam);
    if (expect_resume) {
      REQUIRE_MESSAGE(loaded.ok(), loaded.status().ToString());
      progress = *loaded;
    } else {
      CHECK(loaded.status().code() == absl::StatusCode::kNotFound);
    }
    auto gen = at::detail::createCPUGenerator(progress.step * 10 + rank);
    TrainSmallMlp(fsdp, adam, gen, steps, progress);
    progress.world_size = world;
    REQUIRE(SaveSharded(dir, fsdp, adam, progress).ok());
    auto params = fsdp.FullParameters();
    auto state = FullOptimizerState(fsdp, adam);
    if (rank == 0) snapshot = {params, state, progress};
  });
  return snapshot;
}

TEST_CASE("Resharding round trip 2 -> 3 -> 1 ranks keeps parameters and Adam state exactly") {
  const std::string dir = elrun::testing::MakeTempDir("sharded");
  Snapshot trained = Run(2, "fsdp", dir, 3, false);
  REQUIRE(trained.progress.step == 3);
  REQUIRE(trained.state.at("fc0.weight").count("exp_avg_sq"));
  CHECK(trained.state.at("fc0.weight").at("step").item<int64_t>() == 3);
  CHECK(std::filesystem::exists(dir + "/sharded/step-3-of-2/shard-1-of-2.pt"));

  Snapshot on3 = Run(3, "fsdp", dir, 0, true);
  CHECK(on3.progress.step == 3);
  CheckEqual(on3, trained);
  CHECK(std::filesystem::exists(dir + "/sharded/step-3-of-3/shard-2-of-3.pt"));

  Snapshot on1 = Run(1, "fsdp", dir, 0, true);
  CheckEqual(on1, trained);

  // The layout does not depend on the strategy: zero2 on 3 ranks and no_shard on 2 load it too.
  CheckEqual(Run(3, "zero2", dir, 0, true), trained);
  CheckEqual(Run(2, "no_shard", dir, 0, true), trained);
  CHECK(std::filesystem::exists(dir + "/sharded/step-3-of-1/shard-0-of-1.pt"));
  CHECK_FALSE(std::filesystem::exists(dir + "/sharded/step-3-of-2"));  // Superseded.
}

TEST_CASE("Training resumed on another world size continues from the saved state") {
  const std::string dir = elrun::testing::MakeTempDir("sharded");
  Run(2, "fsdp", dir, 2, false);
  Snapshot more = Run(3, "fsdp", dir, 2, true);
  CHECK(more.progress.step == 4);
  CHECK(more.state.at("fc1.bias").at("step").item<int64_t>() == 4);
  CHECK_FALSE(std::filesystem::exists(dir + "/sharded/step-2-of-2"));  // Superseded sets are removed.
  std::ifstream latest(dir + "/sharded/LATEST");
  std::string current;
  latest >> current;
  CHECK(current == "step-4-of-3");
}

TEST_CASE("A save that fails on one rank leaves the previous checkpoint current on every rank") {
  const std::string dir = elrun::testing::MakeTempDir("sharded");
  Snapshot first = Run(2, "fsdp", dir, 1, false);
  // Rank 1's next file can not be written: a directory is in its way.
  std::filesystem::create_directories(dir + "/sharded/step-2-of-2/shard-1-of-2.pt/blocker");
  std::vector<std::shared_ptr<Classifier>> models{SmallMlp(1), SmallMlp(2)};
  RunRanks(2, [&](int rank, PG pg) {
    FullyShardedDataParallel fsdp(models[rank], pg);
    torch::optim::Adam adam(fsdp.parameters());
    TrainProgress progress = *LoadSharded(dir, fsdp, adam);
    progress.step = 2;
    absl::Status saved = SaveSharded(dir, fsdp, adam, progress);
    CHECK_FALSE(saved.ok());
    if (rank == 0) CHECK(saved.code() == absl::StatusCode::kAborted);
  });
  std::ifstream latest(dir + "/sharded/LATEST");
  std::string current;
  latest >> current;
  CHECK(current == "step-1-of-2");
  CheckEqual(Run(2, "fsdp", dir + "", 0, true), first);
}

TEST_CASE("The consolidated export opens with LoadCheckpoint in one plain process") {
  const std::string dir = elrun::testing::MakeTempDir("sharded");
  Snapshot trained = Run(3, "fsdp", dir, 2, false);
  std::vector<std::shared_ptr<Classifier>> models{SmallMlp(1), SmallMlp(2), SmallMlp(3)};
  const std::string path = dir + "/consolidated.pt";
  RunRanks(3, [&](int rank, PG pg) {
    FullyShardedDataParallel fsdp(models[rank], pg);
    torch::optim::Adam adam(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    TrainProgress progress = *LoadSharded(dir, fsdp, adam);
    REQUIRE(ExportConsolidated(path, fsdp, adam, progress).ok());
  });
  auto plain = SmallMlp(9);
  torch::optim::Adam adam(plain->parameters(), torch::optim::AdamOptions(0.01));
  auto progress = LoadCheckpoint(path, *plain, adam);
  REQUIRE_MESSAGE(progress.ok(), progress.status().ToString());
  CHECK(progress->step == 2);
  Snapshot loaded;
  for (const auto& p : plain->named_parameters()) {
    loaded.params[p.key()] = p.value().detach();
    loaded.state[p.key()] = ExportParamState(adam, p.value());
  }
  CheckEqual(loaded, trained);
}

TEST_CASE("Checkpoints of another model or optimizer are refused with a reason") {
  const std::string dir = elrun::testing::MakeTempDir("sharded");
  Run(2, "fsdp", dir, 1, false);
  auto other = *MakeModel("mlp", MlpOptions{12, {9}, 3});
  RunRanks(1, [&](int, PG pg) {
    FullyShardedDataParallel fsdp(other, pg);
    torch::optim::Adam adam(fsdp.parameters());
    auto loaded = LoadSharded(dir, fsdp, adam);
    CHECK(loaded.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(loaded.status().message()).find("units") != std::string::npos);
  });
  auto same = SmallMlp(4);
  RunRanks(1, [&](int, PG pg) {
    FullyShardedDataParallel fsdp(same, pg);
    torch::optim::SGD sgd(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto loaded = LoadSharded(dir, fsdp, sgd);
    CHECK(loaded.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(loaded.status().message()).find("holds adam state; this run uses sgd") != std::string::npos);
  });
}

}  // namespace
}  // namespace elrun::trainer
