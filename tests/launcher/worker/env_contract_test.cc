#include "launcher/worker/env_contract.h"

#include <doctest/doctest.h>

#include <csignal>

namespace elrun {
namespace {

std::map<std::string, std::string> AsMap(const std::vector<std::string>& entries) {
  std::map<std::string, std::string> map;
  for (const std::string& e : entries) {
    auto eq = e.find('=');
    REQUIRE(eq != std::string::npos);
    CHECK_MESSAGE(map.emplace(e.substr(0, eq), e.substr(eq + 1)).second, "duplicate ", e);
  }
  return map;
}

JobSpec TwoNodesOfThree() {
  JobSpec spec;
  spec.min_nodes = spec.max_nodes = 2;
  spec.nproc_per_node = 3;
  spec.node_rank = 1;
  spec.max_restarts = 4;
  spec.role = "trainer";
  spec.signals_to_handle = {SIGTERM, SIGUSR1};
  return spec;
}

TEST_CASE("every variable of the contract, static backend, node 1 of 2") {
  JobSpec spec = TwoNodesOfThree();
  NodeAssignment node = StaticAssignment(spec, "10.1.2.3", 29555);
  auto env = AsMap(
      BuildWorkerEnv(spec, node, AttemptEnv{"job42", 2}, 1, "/logs/e.json", {{"PATH", "/bin"}, {"HOME", "/root"}}));
  CHECK(env["LOCAL_RANK"] == "1");
  CHECK(env["RANK"] == "4");
  CHECK(env["GROUP_RANK"] == "1");
  CHECK(env["GROUP_WORLD_SIZE"] == "2");
  CHECK(env["ROLE_NAME"] == "trainer");
  CHECK(env["ROLE_RANK"] == "4");
  CHECK(env["ROLE_WORLD_SIZE"] == "6");
  CHECK(env["LOCAL_WORLD_SIZE"] == "3");
  CHECK(env["WORLD_SIZE"] == "6");
  CHECK(env["MASTER_ADDR"] == "10.1.2.3");
  CHECK(env["MASTER_PORT"] == "29555");
  CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "2");
  CHECK(env["TORCHELASTIC_MAX_RESTARTS"] == "4");
  CHECK(env["TORCHELASTIC_RUN_ID"] == "job42");
  CHECK(env["TORCHELASTIC_USE_AGENT_STORE"] == "False");
  CHECK(env["TORCHELASTIC_ERROR_FILE"] == "/logs/e.json");
  CHECK(env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1");
  CHECK(env["NCCL_ASYNC_ERROR_HANDLING"] == "1");
  CHECK(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1");
  CHECK(env["OMP_NUM_THREADS"] == "1");
  CHECK(env["PATH"] == "/bin");
  CHECK(env["HOME"] == "/root");
  CHECK(env.size() == 22);
}

TEST_CASE("contract variables override inherited ones") {
  JobSpec spec;
  auto env = AsMap(BuildWorkerEnv(spec, StaticAssignment(spec, "127.0.0.1", 1234), {"none", 0}, 0, "e",
                                  {{"RANK", "99"}, {"MASTER_PORT", "1"}}));
  CHECK(env["RANK"] == "0");
  CHECK(env["MASTER_PORT"] == "1234");
}

TEST_CASE("NCCL async error handling is kept when the user set it") {
  JobSpec spec;
  auto env = AsMap(BuildWorkerEnv(spec, StaticAssignment(spec, "a", 1), {"r", 0}, 0, "e",
                                  {{"NCCL_ASYNC_ERROR_HANDLING", "0"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"}}));
  CHECK(env["NCCL_ASYNC_ERROR_HANDLING"] == "0");
  CHECK(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3");
}

TEST_CASE("OMP_NUM_THREADS: 1 only when unset and nproc > 1") {
  JobSpec one;
  CHECK_FALSE(DefaultsOmpThreads(one, {}));
  auto env1 = AsMap(BuildWorkerEnv(one, StaticAssignment(one, "a", 1), {"r", 0}, 0, "e", {}));
  CHECK(env1.count("OMP_NUM_THREADS") == 0);

  JobSpec two;
  two.nproc_per_node = 2;
  CHECK(DefaultsOmpThreads(two, {}));
  CHECK_FALSE(DefaultsOmpThreads(two, {{"OMP_NUM_THREADS", "4"}}));
  auto env2 = AsMap(BuildWorkerEnv(two, StaticAssignment(two, "a", 1), {"r", 0}, 1, "e", {{"OMP_NUM_THREADS", "4"}}));
  CHECK(env2["OMP_NUM_THREADS"] == "4");
}

TEST_CASE("rank offsets of a static node") {
  JobSpec spec = TwoNodesOfThree();
  spec.node_rank = 0;
  NodeAssignment node = StaticAssignment(spec, "h", 1);
  CHECK(node.rank_offset == 0);
  CHECK(node.world_size == 6);
  CHECK(node.group_world_size == 2);
}

TEST_CASE("EnvToMap splits at the first '='") {
  const char* entries[] = {"A=1", "B=x=y", "NOEQUALS", "C=", nullptr};
  auto env = EnvToMap(entries);
  CHECK(env.size() == 3);
  CHECK(env["B"] == "x=y");
  CHECK(env["C"] == "");
}

}  // namespace
}  // namespace elrun

namespace elrun {
namespace {

TEST_CASE("the rendezvous token never reaches a worker") {
  JobSpec spec;
  auto env = AsMap(BuildWorkerEnv(
      spec, StaticAssignment(spec, "a", 1), {"r", 0}, 0, "e",
      {{"ELRUN_RDZV_TOKEN", "s3cret"}, {"ELRUN_RUN_TOKEN", "r"}, {"ELRUN_ETCD_PASSWORD", "pw"}, {"HOME", "/root"}}));
  CHECK(env.count("ELRUN_RDZV_TOKEN") == 0);
  CHECK(env.count("ELRUN_RUN_TOKEN") == 0);
  CHECK(env.count("ELRUN_ETCD_PASSWORD") == 0);
  CHECK(env["HOME"] == "/root");
}

TEST_CASE("--virtual-local-rank: LOCAL_RANK 0, the worker's own device visible") {
  JobSpec spec;
  spec.nproc_per_node = 2;
  spec.virtual_local_rank = true;
  auto env =
      AsMap(BuildWorkerEnv(spec, StaticAssignment(spec, "a", 1), {"r", 0}, 1, "e", {{"CUDA_VISIBLE_DEVICES", "4, 6"}}));
  CHECK(env["LOCAL_RANK"] == "0");
  CHECK(env["RANK"] == "1");
  CHECK(env["CUDA_VISIBLE_DEVICES"] == "6");
  env = AsMap(BuildWorkerEnv(spec, StaticAssignment(spec, "a", 1), {"r", 0}, 1, "e", {}));
  CHECK(env["CUDA_VISIBLE_DEVICES"] == "1");
}

}  // namespace
}  // namespace elrun
