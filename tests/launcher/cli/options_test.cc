#include "launcher/cli/options.h"

#include <doctest/doctest.h>

#include <csignal>
#include <map>

#include "launcher/cli/slurm_env.h"

namespace elrun {
namespace {

struct FakeEnv {
  std::map<std::string, std::string> vars;
  EnvLookup lookup() const {
    return [this](const std::string& name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    };
  }
};

absl::StatusOr<ParsedCommandLine> Parse(std::vector<std::string> args, const FakeEnv& env = {},
                                        DeviceCounts devices = {4, 0}) {
  return ParseCommandLine(args, env.lookup(), devices);
}

JobSpec MustParse(std::vector<std::string> args, const FakeEnv& env = {}) {
  auto parsed = Parse(std::move(args), env);
  REQUIRE_MESSAGE(parsed.ok(), parsed.status().ToString());
  return parsed->spec;
}

std::string ErrorOf(std::vector<std::string> args, const FakeEnv& env = {}) {
  auto parsed = Parse(std::move(args), env);
  REQUIRE_FALSE(parsed.ok());
  CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
  std::string message(parsed.status().message());
  CHECK(message.find('\n') == std::string::npos);
  return message;
}

TEST_CASE("defaults match torchrun") {
  JobSpec spec = MustParse({"train.py"});
  CHECK(spec.min_nodes == 1);
  CHECK(spec.max_nodes == 1);
  CHECK(spec.nproc_per_node == 1);
  CHECK(spec.node_rank == 0);
  CHECK(spec.rdzv_backend == "static");
  CHECK(spec.rdzv_id == "none");
  CHECK(spec.master_addr == "127.0.0.1");
  CHECK_FALSE(spec.master_port.has_value());
  CHECK(spec.max_restarts == 0);
  CHECK(spec.role == "default");
  CHECK(spec.shutdown_timeout == std::chrono::seconds(30));
  CHECK(spec.signals_to_handle == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK(spec.training_script == "train.py");
  CHECK(spec.training_script_args.empty());
}

TEST_CASE("stragglers are judged by default at 1.5; 0 turns it off") {
  CHECK(MustParse({"train.py"}).straggler_factor == 1.5);
  CHECK(MustParse({"--straggler-factor", "3", "train.py"}).straggler_factor == 3.0);
  CHECK_FALSE(MustParse({"--straggler-factor", "0", "train.py"}).straggler_factor.has_value());
  CHECK(ErrorOf({"--straggler-factor=1", "t.py"}).rfind("--straggler-factor=1:", 0) == 0);
  CHECK(ErrorOf({"--straggler-factor=-2", "t.py"}).rfind("--straggler-factor=-2:", 0) == 0);
}

TEST_CASE("the forkserver, auto heartbeats, the goodput report and fault injection") {
  JobSpec plain = MustParse({"x.py"});
  CHECK(plain.start_method == "spawn");
  CHECK(plain.preload.empty());
  CHECK_FALSE(plain.auto_heartbeat);
  CHECK(plain.report_file.empty());
  CHECK(plain.history_file.empty());
  CHECK(plain.inject_faults.empty());
  CHECK(plain.inject_seed == 0);
  JobSpec spec = MustParse({"--start-method", "forkserver", "--preload", "numpy,my_pkg.models", "--auto-heartbeat",
                            "--report-file", "/tmp/r.json", "--inject-faults", "kill-worker@5s", "--inject-seed",
                            "18446744073709551615", "--history-file", "/tmp/h.jsonl", "x.py"});
  CHECK(spec.start_method == "forkserver");
  CHECK(spec.preload == std::vector<std::string>{"numpy", "my_pkg.models"});
  CHECK(spec.auto_heartbeat);
  CHECK(spec.report_file == "/tmp/r.json");
  CHECK(spec.history_file == "/tmp/h.jsonl");
  CHECK(spec.inject_faults == "kill-worker@5s");
  CHECK(spec.inject_seed == 18446744073709551615ull);
  CHECK(MustParse({"x.py"}, FakeEnv{{{"PET_AUTO_HEARTBEAT", "1"}}}).auto_heartbeat);
  CHECK(ErrorOf({"--preload", "os;rm", "x.py"}).find("--preload=os;rm: expected Python module names") == 0);
  CHECK(ErrorOf({"--inject-faults", "kill@1s", "x.py"}).find("--inject-faults=kill@1s: 'kill@1s': unknown kind") == 0);
  CHECK(ErrorOf({"--inject-seed", "x", "x.py"}).find("--inject-seed=x: expected an integer") == 0);
}

TEST_CASE("--numa-binding takes torchrun's four modes, under both spellings and PET_NUMA_BINDING") {
  CHECK(MustParse({"x.py"}).numa_binding.empty());
  CHECK(MustParse({"--numa-binding", "node", "x.py"}).numa_binding == "node");
  CHECK(MustParse({"--numa_binding=core-complex", "x.py"}).numa_binding == "core-complex");
  CHECK(MustParse({"x.py"}, FakeEnv{{{"PET_NUMA_BINDING", "exclusive"}}}).numa_binding == "exclusive");
  CHECK(ErrorOf({"--numa-binding", "numa", "x.py"}).find("expected node, socket, exclusive or core-complex") !=
        std::string::npos);
}

TEST_CASE("under srun the topology comes from Slurm; flags and PET_ win") {
  FakeEnv slurm{{{"SLURM_JOB_ID", "77"},
                 {"SLURM_STEP_ID", "0"},
                 {"SLURM_NNODES", "2"},
                 {"SLURM_NODEID", "1"},
                 {"SLURM_JOB_NODELIST", "n[1-2]"}}};
  auto parsed = Parse({"x.py"}, slurm);
  REQUIRE(parsed.ok());
  CHECK(parsed->spec.min_nodes == 2);
  CHECK(parsed->spec.max_nodes == 2);
  CHECK(parsed->spec.node_rank == 1);
  CHECK(parsed->spec.rdzv_backend == "c10d");
  CHECK(parsed->spec.rdzv_endpoint == "n1:" + std::to_string(SlurmRendezvousPort(77, 0)));
  CHECK(parsed->spec.rdzv_id == "slurm-77.0");
  CHECK(parsed->slurm_note.rfind("from Slurm job 77: --nnodes 2 (SLURM_NNODES), --node-rank 1 (SLURM_NODEID), ", 0) ==
        0);

  slurm.vars["PET_RDZV_ID"] = "mine";
  JobSpec spec = MustParse({"--rdzv-endpoint", "head:5000", "--nnodes", "2", "x.py"}, slurm);
  CHECK(spec.rdzv_endpoint == "head:5000");
  CHECK(spec.rdzv_id == "mine");
  CHECK(spec.node_rank == 1);                                        // Not given: still Slurm's.
  CHECK(MustParse({"--standalone", "x.py"}, slurm).max_nodes == 1);  // Standalone ignores Slurm.

  slurm.vars["SLURM_JOB_NODELIST"] = "n[1-2";
  auto bad = Parse({"x.py"}, slurm);
  REQUIRE_FALSE(bad.ok());
  CHECK(std::string(bad.status().message()) ==
        "Slurm: SLURM_JOB_NODELIST: bad hostlist 'n[1-2': unbalanced or nested brackets");
}

TEST_CASE("both spellings and = form") {
  for (const char* name : {"--nproc-per-node", "--nproc_per_node"}) {
    CHECK(MustParse({name, "3", "t.py"}).nproc_per_node == 3);
    CHECK(MustParse({std::string(name) + "=3", "t.py"}).nproc_per_node == 3);
  }
  CHECK(MustParse({"--max_restarts=2", "t.py"}).max_restarts == 2);
  CHECK(MustParse({"--no_python", "/bin/true"}).no_python);
  CHECK(MustParse({"--rdzv_id", "job7", "t.py"}).rdzv_id == "job7");
}

TEST_CASE("short options") {
  JobSpec spec = MustParse({"-r", "3", "-t", "0:1,1:2", "-m", "pkg.train"});
  CHECK(spec.redirects.all == StdStreams::kAll);
  CHECK(spec.tee.For(0) == StdStreams::kOut);
  CHECK(spec.tee.For(1) == StdStreams::kErr);
  CHECK(spec.tee.For(2) == StdStreams::kNone);
  CHECK(spec.module);
  CHECK(spec.training_script == "pkg.train");
}

TEST_CASE("PET_ environment defaults, command line wins") {
  FakeEnv env{{{"PET_NPROC_PER_NODE", "5"}, {"PET_MAX_RESTARTS", "4"}, {"PET_STANDALONE", "1"}}};
  JobSpec spec = MustParse({"t.py"}, env);
  CHECK(spec.nproc_per_node == 5);
  CHECK(spec.max_restarts == 4);
  CHECK(spec.standalone);
  CHECK(MustParse({"--nproc-per-node=2", "t.py"}, env).nproc_per_node == 2);
}

TEST_CASE("a bad PET_ value is named as the env var") {
  FakeEnv env{{{"PET_NNODES", "3:2"}}};
  CHECK(ErrorOf({"t.py"}, env) == "PET_NNODES=3:2: min 3 > max 2");
}

TEST_CASE("script arguments are passed through untouched") {
  JobSpec spec = MustParse({"--nproc-per-node", "2", "train.py", "--lr", "0.1", "-m", "--nnodes=9"});
  CHECK(spec.nproc_per_node == 2);
  CHECK(spec.max_nodes == 1);
  CHECK_FALSE(spec.module);
  CHECK(spec.training_script_args == std::vector<std::string>{"--lr", "0.1", "-m", "--nnodes=9"});
}

TEST_CASE("double dash ends the options") {
  JobSpec spec = MustParse({"--no-python", "--", "-weird-name", "x"});
  CHECK(spec.training_script == "-weird-name");
  CHECK(spec.training_script_args == std::vector<std::string>{"x"});
}

TEST_CASE("nproc-per-node symbolic values") {
  CHECK(Parse({"--nproc-per-node=cpu", "t.py"}, {}, {6, 0})->spec.nproc_per_node == 6);
  CHECK(Parse({"--nproc-per-node=auto", "t.py"}, {}, {6, 0})->spec.nproc_per_node == 6);
  CHECK(Parse({"--nproc-per-node=auto", "t.py"}, {}, {6, 2})->spec.nproc_per_node == 2);
  CHECK(Parse({"--nproc-per-node=gpu", "t.py"}, {}, {6, 2})->spec.nproc_per_node == 2);
  CHECK(ErrorOf({"--nproc-per-node=gpu", "t.py"}) ==
        "--nproc-per-node=gpu: no CUDA device found; use a number or 'cpu'");
}

TEST_CASE("nnodes forms") {
  JobSpec spec = MustParse({"--nnodes=2:4", "--rdzv-backend=grpc", "t.py"});
  CHECK(spec.min_nodes == 2);
  CHECK(spec.max_nodes == 4);
  CHECK(MustParse({"--nnodes", "3", "t.py"}).max_nodes == 3);
}

TEST_CASE("bad input gives one line naming the input") {
  CHECK(ErrorOf({"--nnodes=3:2", "--rdzv-backend=grpc", "t.py"}) == "--nnodes=3:2: min 3 > max 2");
  CHECK(ErrorOf({"--nproc-per-node=0", "t.py"}).rfind("--nproc-per-node=0:", 0) == 0);
  CHECK(ErrorOf({"--nproc-per-node=abc", "t.py"}).rfind("--nproc-per-node=abc:", 0) == 0);
  CHECK(ErrorOf({"--max-restarts=-1", "t.py"}).rfind("--max-restarts=-1:", 0) == 0);
  CHECK(ErrorOf({"--rdzv-conf=join_timeout", "t.py"}).rfind("--rdzv-conf=join_timeout:", 0) == 0);
  CHECK(ErrorOf({"--rdzv-conf=a=1,a=2", "t.py"}).find("given twice") != std::string::npos);
  CHECK(ErrorOf({"--redirects=7", "t.py"}).rfind("--redirects=7:", 0) == 0);
  CHECK(ErrorOf({"--signals-to-handle=SIGKILL", "t.py"}).find("cannot be handled") != std::string::npos);
  CHECK(ErrorOf({"--shutdown-timeout=-1", "t.py"}).rfind("--shutdown-timeout=-1:", 0) == 0);
  CHECK(ErrorOf({"--start-method=thread", "t.py"}).rfind("--start-method=thread:", 0) == 0);
  CHECK(ErrorOf({"--rdzv-backend=etcd", "t.py"}).rfind("--rdzv-backend=etcd:", 0) == 0);
  CHECK(ErrorOf({"--rdzv-backend=etcd-v2", "t.py"}).find("use --rdzv-backend etcd-v3") != std::string::npos);
  CHECK(ErrorOf({"--rdzv-backend=zookeeper", "t.py"}).rfind("--rdzv-backend=zookeeper:", 0) == 0);
  CHECK(ErrorOf({"--node-rank=2", "--nnodes=2", "t.py"}).rfind("--node-rank=2:", 0) == 0);
}

TEST_CASE("unknown options and missing values") {
  CHECK(ErrorOf({"--bogus", "t.py"}) == "unknown option --bogus; see elrun --help");
  CHECK(ErrorOf({"--nnodes"}).find("nnodes") != std::string::npos);
}

TEST_CASE("missing script") {
  CHECK(ErrorOf({"--nproc-per-node=2"}).rfind("missing TRAINING_SCRIPT", 0) == 0);
  CHECK(ErrorOf({"-m"}).rfind("-m needs a module name", 0) == 0);
}

TEST_CASE("conflicting entrypoint flags") {
  CHECK(ErrorOf({"-m", "--no-python", "x"}) == "-m/--module and --no-python cannot be used together");
  CHECK(ErrorOf({"--run-path", "--no-python", "x"}).find("--run-path") != std::string::npos);
}

TEST_CASE("static backend needs a fixed node count") {
  CHECK(ErrorOf({"--nnodes=1:2", "--rdzv-backend=static", "t.py"}).rfind("--nnodes=1:2:", 0) == 0);
}

TEST_CASE("static is the default backend, as in torchrun; grpc for an elastic size") {
  CHECK(MustParse({"--nnodes=1:2", "t.py"}).rdzv_backend == "grpc");
  CHECK(MustParse({"--nnodes=2", "t.py"}).rdzv_backend == "static");
  CHECK(MustParse({"--rdzv-backend=c10d", "--nnodes=1:2", "t.py"}).rdzv_backend == "c10d");
  CHECK(MustParse({"--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "--nnodes=2", "t.py"}).rdzv_backend == "c10d");
}

TEST_CASE("a static --rdzv-endpoint HOST:PORT is node 0's store: MASTER_ADDR and MASTER_PORT") {
  JobSpec spec = MustParse({"--rdzv-endpoint=node0.example:23456", "--nnodes=2", "--node-rank=1", "t.py"});
  CHECK(spec.rdzv_backend == "static");
  CHECK(spec.master_addr == "node0.example");
  CHECK(spec.master_port == 23456);
  spec = MustParse({"--rdzv-backend=static", "--rdzv-endpoint=[fd00::1]:29501", "--master-port=1", "t.py"});
  CHECK(spec.master_addr == "fd00::1");
  CHECK(spec.master_port == 29501);  // The endpoint wins, as in torchrun.
  CHECK(ErrorOf({"--rdzv-endpoint=node0", "--nnodes=2", "t.py"})
            .rfind("--rdzv-endpoint=node0: the static rendezvous needs HOST:PORT", 0) == 0);
  CHECK(ErrorOf({"--rdzv-endpoint=[::1", "t.py"}).find("missing ']'") != std::string::npos);
}

TEST_CASE("node rank given or not") {
  CHECK_FALSE(MustParse({"t.py"}).node_rank_given);
  CHECK(MustParse({"--node-rank=0", "t.py"}).node_rank_given);
}

TEST_CASE("standalone generates an id unless one is given") {
  JobSpec spec = MustParse({"--standalone", "t.py"});
  CHECK(spec.rdzv_id_generated);
  CHECK(spec.max_nodes == 1);
  CHECK_FALSE(MustParse({"--standalone", "--rdzv-id=abc", "t.py"}).rdzv_id_generated);
}

TEST_CASE("signals by name or number") {
  CHECK(MustParse({"--signals-to-handle=TERM,10", "t.py"}).signals_to_handle == std::vector<int>{SIGTERM, 10});
}

TEST_CASE("local ranks filter") {
  JobSpec spec = MustParse({"--local-ranks-filter=0,2", "t.py"});
  REQUIRE(spec.local_ranks_filter.has_value());
  CHECK(*spec.local_ranks_filter == std::set<int>{0, 2});
}

TEST_CASE("--version is elrun's; after the script it belongs to the script") {
  auto parsed = Parse({"--version"});
  REQUIRE(parsed.ok());
  CHECK(parsed->version);
  parsed = Parse({"--nproc-per-node", "2", "t.py", "--version"});
  REQUIRE(parsed.ok());
  CHECK_FALSE(parsed->version);
  CHECK(parsed->spec.training_script_args == std::vector<std::string>{"--version"});
}

TEST_CASE("help is complete") {
  auto parsed = Parse({"--help"});
  REQUIRE(parsed.ok());
  REQUIRE(parsed->help.has_value());
  for (const char* name : {"--nnodes",
                           "--nproc-per-node",
                           "--node-rank",
                           "--master-addr",
                           "--master-port",
                           "--standalone",
                           "--rdzv-backend",
                           "--rdzv-endpoint",
                           "--rdzv-id",
                           "--rdzv-conf",
                           "--max-restarts",
                           "--monitor-interval",
                           "--start-method",
                           "--role",
                           "--log-dir",
                           "--redirects",
                           "--tee",
                           "--local-ranks-filter",
                           "--local-addr",
                           "--module",
                           "--no-python",
                           "--run-path",
                           "--signals-to-handle",
                           "--shutdown-timeout",
                           "--version",
                           "PET_NPROC_PER_NODE"}) {
    CHECK_MESSAGE(parsed->help->find(name) != std::string::npos, name);
  }
}

}  // namespace
}  // namespace elrun
