#include "launcher/worker/attempt_builder.h"
#include "tests/port_probe.h"
#include "tests/temp_dir.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace elrun {
namespace {

std::string EnvValue(const WorkerLaunch& launch, const std::string& name) {
  for (const std::string& entry : launch.env) {
    if (entry.rfind(name + "=", 0) == 0) return entry.substr(name.size() + 1);
  }
  return "<unset>";
}

struct Fixture {
  std::string dir = testing::MakeTempDir("attempt");
  JobSpec spec;
  std::map<std::string, std::string> env{{"PATH", "/bin"}};
  std::vector<int> picked;  // Each port the builder reserved, in order.
  LogLayout layout{dir, "run"};

  AttemptBuilder Builder() {
    return AttemptBuilder(spec, {"/bin/worker", "--rank", "${local_rank}"}, "run", layout, env,
                          [this]() -> absl::StatusOr<PortReservation> {
                            auto held = PortReservation::Take();
                            if (held.ok()) picked.push_back(held->port());
                            return held;
                          });
  }
};

TEST_CASE("one launch per local rank, with its argv, env, logs and prefix") {
  Fixture f;
  f.spec.nproc_per_node = 2;
  f.spec.role = "r";
  auto builder = f.Builder();
  auto launches = builder.Build(0, 0);
  REQUIRE(launches.ok());
  REQUIRE(launches->size() == 2);
  const WorkerLaunch& second = (*launches)[1];
  CHECK(second.local_rank == 1);
  CHECK(second.rank == 1);
  CHECK(second.argv == std::vector<std::string>{"/bin/worker", "--rank", "1"});
  CHECK(EnvValue(second, "LOCAL_RANK") == "1");
  REQUIRE(f.picked.size() == 1);
  CHECK(EnvValue(second, "MASTER_PORT") == std::to_string(f.picked[0]));
  CHECK(EnvValue(second, "TORCHELASTIC_ERROR_FILE") == f.dir + "/run/attempt_0/1/error.json");
  CHECK(second.error_file == f.dir + "/run/attempt_0/1/error.json");
  CHECK(second.console_prefix == "[r1]:");
}

TEST_CASE("--numa-binding: each local rank carries its CPUs and memory node, in every attempt") {
  Fixture f;
  f.spec.nproc_per_node = 2;
  auto builder = f.Builder();
  auto unbound = builder.Build(0, 0);
  REQUIRE(unbound.ok());
  CHECK((*unbound)[0].cpus.empty());
  CHECK((*unbound)[0].memory_node == -1);
  builder.BindWorkers({CpuBinding{{0, 1}, 0}, CpuBinding{{8, 9}, 2}});
  for (int attempt : {1, 2}) {
    auto launches = builder.Build(attempt, attempt);
    REQUIRE(launches.ok());
    CHECK((*launches)[0].cpus == std::vector<int>{0, 1});
    CHECK((*launches)[0].memory_node == 0);
    CHECK((*launches)[1].cpus == std::vector<int>{8, 9});
    CHECK((*launches)[1].memory_node == 2);
  }
}

TEST_CASE("single-node jobs get a fresh port per attempt, held until the next attempt's pick") {
  Fixture f;
  auto builder = f.Builder();
  auto first = builder.Build(0, 0);
  auto second = builder.Build(1, 1);
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  REQUIRE(f.picked.size() == 2);
  CHECK(f.picked[0] != f.picked[1]);
  CHECK(EnvValue((*first)[0], "MASTER_PORT") == std::to_string(f.picked[0]));
  CHECK(EnvValue((*second)[0], "MASTER_PORT") == std::to_string(f.picked[1]));
  CHECK(testing::PortHeld(f.picked[1]));  // Until the next attempt's pick.
  CHECK_FALSE(testing::PortHeld(f.picked[0]));
  CHECK(EnvValue((*second)[0], "TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK(EnvValue((*second)[0], "TORCHELASTIC_ERROR_FILE") == f.dir + "/run/attempt_1/0/error.json");
}

TEST_CASE("--master-port wins on the static backend") {
  Fixture f;
  f.spec.master_port = 23456;
  auto launches = f.Builder().Build(0, 0);
  REQUIRE(launches.ok());
  CHECK(EnvValue((*launches)[0], "MASTER_PORT") == "23456");
  CHECK(f.picked.empty());
}

TEST_CASE("multi-node static jobs default to torchrun's 29500, never a random port") {
  Fixture f;
  f.spec.min_nodes = f.spec.max_nodes = 2;
  f.spec.node_rank = 1;
  f.spec.nproc_per_node = 2;
  f.spec.master_addr = "10.0.0.1";
  auto launches = f.Builder().Build(0, 0);
  REQUIRE(launches.ok());
  CHECK(EnvValue((*launches)[1], "MASTER_PORT") == "29500");
  CHECK(EnvValue((*launches)[1], "MASTER_ADDR") == "10.0.0.1");
  CHECK(EnvValue((*launches)[1], "RANK") == "3");
  CHECK((*launches)[1].rank == 3);
  CHECK(f.picked.empty());
}

TEST_CASE("standalone uses --local-addr and ignores --master-port") {
  Fixture f;
  f.spec.standalone = true;
  f.spec.rdzv_backend = "c10d";
  f.spec.local_addr = "127.0.0.5";
  f.spec.master_port = 1111;
  auto launches = f.Builder().Build(0, 0);
  REQUIRE(launches.ok());
  CHECK(EnvValue((*launches)[0], "MASTER_ADDR") == "127.0.0.5");
  REQUIRE(f.picked.size() == 1);
  CHECK(EnvValue((*launches)[0], "MASTER_PORT") == std::to_string(f.picked[0]));
}

TEST_CASE("a port that cannot be picked fails the attempt") {
  Fixture f;
  AttemptBuilder builder(f.spec, {"/bin/w"}, "run", f.layout, f.env,
                         []() -> absl::StatusOr<PortReservation> { return absl::InternalError("no ports"); });
  CHECK(builder.Build(0, 0).status().message() == "no ports");
}

}  // namespace
}  // namespace elrun
