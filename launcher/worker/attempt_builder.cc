#include "launcher/worker/attempt_builder.h"

#include <utility>

#include "launcher/worker/entrypoint.h"

namespace elrun {

constexpr int kTorchrunDefaultMasterPort = 29500;

AttemptBuilder::AttemptBuilder(const JobSpec& spec, std::vector<std::string> argv_template, std::string run_id,
                               const LogLayout& layout, const std::map<std::string, std::string>& parent_env,
                               PortPicker pick_port)
    : spec_(spec),
      argv_template_(std::move(argv_template)),
      run_id_(std::move(run_id)),
      layout_(layout),
      parent_env_(parent_env),
      pick_port_(std::move(pick_port)) {}

absl::StatusOr<NodeAssignment> AttemptBuilder::Assign() {
  bool static_backend = spec_.rdzv_backend == "static";
  std::string addr = static_backend ? spec_.master_addr : (spec_.local_addr.empty() ? "127.0.0.1" : spec_.local_addr);
  int port = kTorchrunDefaultMasterPort;
  if (static_backend && spec_.master_port) {
    port = *spec_.master_port;
  } else if (spec_.max_nodes == 1) {
    auto picked = pick_port_();
    if (!picked.ok()) return picked.status();
    port = picked->port();
    held_port_ = std::move(*picked);
  }
  return StaticAssignment(spec_, addr, port);
}

WorkerLaunch AttemptBuilder::Preview() const {
  std::map<std::string, std::string> merged = parent_env_;
  for (const auto& [name, value] : extra_env_) merged[name] = value;
  WorkerLaunch launch;
  launch.argv = SubstituteLocalRank(argv_template_, 0);
  launch.env = BuildWorkerEnv(spec_, StaticAssignment(spec_, "127.0.0.1", kTorchrunDefaultMasterPort),
                              AttemptEnv{run_id_, 0}, 0, "", merged);
  return launch;
}

absl::StatusOr<std::vector<WorkerLaunch>> AttemptBuilder::Build(int attempt, int restart_count) {
  auto node = Assign();
  if (!node.ok()) return node.status();
  return BuildFor(attempt, restart_count, *node);
}

absl::StatusOr<std::vector<WorkerLaunch>> AttemptBuilder::BuildFor(int attempt, int restart_count,
                                                                   const NodeAssignment& node) {
  node_ = node;
  AttemptEnv attempt_env{run_id_, restart_count};
  std::map<std::string, std::string> merged;
  if (!extra_env_.empty()) {
    merged = parent_env_;
    for (const auto& [name, value] : extra_env_) merged[name] = value;
  }
  const std::map<std::string, std::string>& parent_env = extra_env_.empty() ? parent_env_ : merged;
  std::vector<WorkerLaunch> launches;
  for (int local_rank = 0; local_rank < spec_.nproc_per_node; ++local_rank) {
    absl::Status prepared = layout_.PrepareRankDir(attempt, local_rank);
    if (!prepared.ok()) return prepared;
    WorkerLaunch launch;
    launch.local_rank = local_rank;
    launch.rank = node_.rank_offset + local_rank;
    launch.error_file = layout_.ErrorFilePath(attempt, local_rank);
    launch.argv = SubstituteLocalRank(argv_template_, local_rank);
    launch.env = BuildWorkerEnv(spec_, node_, attempt_env, local_rank, launch.error_file, parent_env);
    StreamRoutes routes = RouteStreams(spec_, layout_, attempt, local_rank);
    if (local_rank < static_cast<int>(bindings_.size())) {
      launch.cpus = bindings_[local_rank].cpus;
      launch.memory_node = bindings_[local_rank].memory_node;
    }
    launch.out = routes.out;
    launch.err = routes.err;
    launch.console_prefix = ConsolePrefix(spec_, launch.rank, local_rank);
    launch.fork_from_server = fork_from_server_;
    launches.push_back(std::move(launch));
  }
  return launches;
}

}  // namespace elrun
