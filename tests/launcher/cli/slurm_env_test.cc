// Slurm's hostlist syntax and what elrun takes from SLURM_* variables.
#include "launcher/cli/slurm_env.h"

#include <doctest/doctest.h>

#include <map>

namespace elrun {
namespace {

std::vector<std::string> Hosts(const std::string& list) {
  auto hosts = ExpandHostlist(list);
  REQUIRE_MESSAGE(hosts.ok(), hosts.status().ToString());
  return *hosts;
}

std::string Error(const std::string& list) {
  auto hosts = ExpandHostlist(list);
  REQUIRE_FALSE(hosts.ok());
  return std::string(hosts.status().message());
}

TEST_CASE("hostlists: ranges, lists, zero padding, several groups") {
  CHECK(Hosts("n1") == std::vector<std::string>{"n1"});
  CHECK(Hosts("gpu[01-04,07],cpu3") == std::vector<std::string>{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"});
  CHECK(Hosts("n[8-11]") == std::vector<std::string>{"n8", "n9", "n10", "n11"});
  CHECK(Hosts("n[008-010]") == std::vector<std::string>{"n008", "n009", "n010"});
  CHECK(Hosts("rack[1-2]-node[01-02]") ==
        std::vector<std::string>{"rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"});
  CHECK(Hosts("[1-2]x") == std::vector<std::string>{"1x", "2x"});
  CHECK(Hosts("a.example.org,b-1") == std::vector<std::string>{"a.example.org", "b-1"});
  CHECK(Hosts("n[5]") == std::vector<std::string>{"n5"});
}

TEST_CASE("bad hostlists are one-line errors naming the part") {
  CHECK(Error("n[1-2") == "bad hostlist 'n[1-2': unbalanced or nested brackets");
  CHECK(Error("n1-2]") == "bad hostlist 'n1-2]': unbalanced or nested brackets");
  CHECK(Error("n[[1]]") == "bad hostlist 'n[[1]]': unbalanced or nested brackets");
  CHECK(Error("n[5-3]") ==
        "bad hostlist 'n[5-3]': '[5-3]' in 'n[5-3]' is not a list of numbers and ranges such as [01-04,07]");
  CHECK(Error("n[a-b]").find("'[a-b]' in 'n[a-b]'") != std::string::npos);
  CHECK(Error("n[]").find("'[]' in 'n[]'") != std::string::npos);
  CHECK(Error("n[1-]").find("'[1-]'") != std::string::npos);
  CHECK(Error("a,,b") == "bad hostlist 'a,,b': an empty host name");
  CHECK(Error("") == "bad hostlist '': an empty host name");
  CHECK(Error("n[0-9999999]").find("more than") != std::string::npos);
  CHECK(Error("a[0-1023]b[0-1023]c[0-1]").find("more than") != std::string::npos);
}

using Env = std::map<std::string, std::string>;

std::map<std::string, std::string> Values(const Env& vars) {
  auto values = SlurmValues([&vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
  REQUIRE_MESSAGE(values.ok(), values.status().ToString());
  std::map<std::string, std::string> out;
  for (const SlurmValue& v : *values) out[v.option] = v.value + " <- " + v.source;
  return out;
}

std::string ValuesError(const Env& vars) {
  auto values = SlurmValues([&vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
  REQUIRE_FALSE(values.ok());
  return std::string(values.status().message());
}

Env Step() {
  return {{"SLURM_JOB_ID", "4711"},
          {"SLURM_STEP_ID", "2"},
          {"SLURM_NNODES", "4"},
          {"SLURM_STEP_NUM_NODES", "3"},
          {"SLURM_NODEID", "1"},
          {"SLURM_JOB_NODELIST", "gpu[01-04]"},
          {"SLURM_STEP_NODELIST", "gpu[02-04]"},
          {"SLURM_STEP_NUM_TASKS", "3"},
          {"SLURM_GPUS_ON_NODE", "8"}};
}

TEST_CASE("outside Slurm nothing is taken") { CHECK(Values({{"PATH", "/bin"}}).empty()); }

TEST_CASE("inside an srun step: nodes, node rank, endpoint on the step's first host, run id, GPUs") {
  auto v = Values(Step());
  CHECK(v["nnodes"] == "3 <- SLURM_STEP_NUM_NODES");
  CHECK(v["node-rank"] == "1 <- SLURM_NODEID");
  CHECK(v["nproc-per-node"] == "8 <- SLURM_GPUS_ON_NODE");
  CHECK(v["rdzv-backend"] == "c10d <- SLURM_JOB_ID");
  CHECK(v["rdzv-endpoint"] == "gpu02:" + std::to_string(SlurmRendezvousPort(4711, 2)) +
                                  " <- SLURM_STEP_NODELIST, SLURM_JOB_ID, SLURM_STEP_ID");
  CHECK(v["rdzv-id"] == "slurm-4711.2 <- SLURM_JOB_ID, SLURM_STEP_ID");
  CHECK(v.size() == 6);
}

TEST_CASE("the endpoint's port is the same for a step everywhere and differs between steps") {
  CHECK(SlurmRendezvousPort(4711, 2) == SlurmRendezvousPort(4711, 2));
  CHECK(SlurmRendezvousPort(4711, 2) != SlurmRendezvousPort(4711, 3));
  CHECK(SlurmRendezvousPort(4711, 2) != SlurmRendezvousPort(4712, 2));
  for (long long job : {0LL, 1LL, 123456789LL, 1LL << 40}) {  // NOLINT(runtime/int)
    for (long long step : {0LL, 15LL, 99999LL}) {             // NOLINT(runtime/int)
      int port = SlurmRendezvousPort(job, step);
      CHECK(port >= 10000);
      CHECK(port < 30000);
    }
  }
}

TEST_CASE("without GPUs the worker count is left to --nproc-per-node") {
  Env env = Step();
  env.erase("SLURM_GPUS_ON_NODE");
  CHECK(Values(env).count("nproc-per-node") == 0);
  env["SLURM_GPUS_ON_NODE"] = "0";
  CHECK(Values(env).count("nproc-per-node") == 0);
}

TEST_CASE("the batch script itself: one node, workers from GPUs or tasks per node") {
  CHECK(Values({{"SLURM_JOB_ID", "9"}, {"SLURM_NNODES", "2"}, {"SLURM_NTASKS_PER_NODE", "4"}}) ==
        std::map<std::string, std::string>{{"nproc-per-node", "4 <- SLURM_NTASKS_PER_NODE"}});
  CHECK(Values({{"SLURM_JOB_ID", "9"},
                {"SLURM_STEP_ID", "batch"},
                {"SLURM_GPUS_ON_NODE", "2"},
                {"SLURM_NTASKS_PER_NODE", "4"}}) ==
        std::map<std::string, std::string>{{"nproc-per-node", "2 <- SLURM_GPUS_ON_NODE"}});
  CHECK(Values({{"SLURM_JOB_ID", "9"}}).empty());
}

TEST_CASE("inconsistent or malformed Slurm variables are one-line errors") {
  Env env = Step();
  env["SLURM_STEP_NUM_TASKS"] = "6";
  CHECK(ValuesError(env) ==
        "this Slurm step runs 6 tasks on 3 nodes; elrun starts the workers itself: run one elrun per "
        "node (srun --ntasks-per-node=1)");
  env = Step();
  env["SLURM_NODEID"] = "3";
  CHECK(ValuesError(env) == "SLURM_NODEID=3: expected an integer in [0, 2]");
  env = Step();
  env["SLURM_STEP_NODELIST"] = "gpu[02-04";
  CHECK(ValuesError(env).rfind("SLURM_STEP_NODELIST: bad hostlist 'gpu[02-04'", 0) == 0);
  env = Step();
  env["SLURM_STEP_NODELIST"] = "gpu[02-03]";
  CHECK(ValuesError(env) == "SLURM_STEP_NODELIST=gpu[02-03] names 2 hosts but SLURM_STEP_NUM_NODES=3");
  env = Step();
  env["SLURM_JOB_ID"] = "x";
  CHECK(ValuesError(env) == "SLURM_JOB_ID=x: expected an integer in [0, 1099511627776]");
  env = Step();
  env["SLURM_GPUS_ON_NODE"] = "-1";
  CHECK(ValuesError(env).rfind("SLURM_GPUS_ON_NODE=-1", 0) == 0);
}

}  // namespace
}  // namespace elrun
