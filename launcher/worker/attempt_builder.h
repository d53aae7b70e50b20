// Builds the WorkerLaunch list of each attempt on this node: the log directories, each worker's
// environment (env_contract), argv with ${local_rank} substituted and stream routes. Port
// choice is injected so that tests pin it. Thread-compatible.
#ifndef ELRUN_LAUNCHER_WORKER_ATTEMPT_BUILDER_H_
#define ELRUN_LAUNCHER_WORKER_ATTEMPT_BUILDER_H_

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/os/numa_binding.h"
#include "launcher/os/port_reservation.h"
#include "launcher/spec/job_spec.h"
#include "launcher/spec/worker_launch.h"
#include "launcher/worker/env_contract.h"
#include "launcher/worker/log_layout.h"

namespace elrun {

class AttemptBuilder {
 public:
  using PortPicker = std::function<absl::StatusOr<PortReservation>()>;

  // `spec`, `layout` and `parent_env` must outlive the builder.
  AttemptBuilder(const JobSpec& spec, std::vector<std::string> argv_template, std::string run_id,
                 const LogLayout& layout, const std::map<std::string, std::string>& parent_env, PortPicker pick_port);

  // Prepares attempt `attempt` (directories made, stale error files removed) with this node's
  // static or single-node assignment.
  absl::StatusOr<std::vector<WorkerLaunch>> Build(int attempt, int restart_count);

  // The same with an assignment decided elsewhere (a rendezvous round).
  absl::StatusOr<std::vector<WorkerLaunch>> BuildFor(int attempt, int restart_count, const NodeAssignment& node);

  // Binds local rank i to `by_local_rank[i]` in every later attempt (--numa-binding).
  void BindWorkers(std::vector<CpuBinding> by_local_rank) { bindings_ = std::move(by_local_rank); }

  // Sets `name`=`value` in every worker's environment of later attempts, over elrun's own.
  void SetWorkerEnv(const std::string& name, const std::string& value) { extra_env_[name] = value; }

  // What local rank 0 of the first attempt will run (argv, environment with a placeholder
  // assignment); nothing is made on disk. For a forkserver started before the first attempt.
  WorkerLaunch Preview() const;

  // Marks every later launch to be forked from the forkserver (--start-method forkserver).
  void ForkFromServer() { fork_from_server_ = true; }

  // Where this node's workers find the store in the current attempt.
  const NodeAssignment& node() const { return node_; }

 private:
  // The static / single-node assignment of an attempt: MASTER_PORT is --master-port, else a
  // fresh port for a one-node job (no stale TIME_WAIT from the previous attempt), held until the
  // next attempt's pick, else the torchrun default 29500 that the other nodes also assume.
  absl::StatusOr<NodeAssignment> Assign();

  const JobSpec& spec_;
  const std::vector<std::string> argv_template_;
  const std::string run_id_;
  const LogLayout& layout_;
  const std::map<std::string, std::string>& parent_env_;
  const PortPicker pick_port_;
  NodeAssignment node_;
  std::optional<PortReservation> held_port_;  // The current attempt's MASTER_PORT, if picked.
  std::vector<CpuBinding> bindings_;
  std::map<std::string, std::string> extra_env_;
  bool fork_from_server_ = false;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_WORKER_ATTEMPT_BUILDER_H_
