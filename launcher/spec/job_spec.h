// The resolved configuration of one elrun invocation: what the command line, PET_* environment
// variables and defaults say, after validation. Plain data, constant once parsed; safe to share
// read-only between threads.
#ifndef ELRUN_LAUNCHER_SPEC_JOB_SPEC_H_
#define ELRUN_LAUNCHER_SPEC_JOB_SPEC_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace elrun {

// Which of a worker's standard streams go to files: torchrun's Std (0 none, 1 out, 2 err, 3 both).
enum class StdStreams { kNone = 0, kOut = 1, kErr = 2, kAll = 3 };

// A --redirects / --tee value: one setting for every local rank, or a per-rank map ("0:1,1:2").
struct StdSetting {
  StdStreams all = StdStreams::kNone;
  std::map<int, StdStreams> per_rank;  // Overrides `all` for the listed local ranks.
  StdStreams For(int local_rank) const {
    auto it = per_rank.find(local_rank);
    return it == per_rank.end() ? all : it->second;
  }
};

struct JobSpec {
  // Membership.
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;
  int node_rank = 0;
  bool node_rank_given = false;  // A hint for dynamic rendezvous only when given.
  bool standalone = false;

  // Rendezvous.
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";
  bool rdzv_id_generated = false;  // --standalone without --rdzv-id: a fresh id per run.
  std::map<std::string, std::string> rdzv_conf;
  std::string master_addr = "127.0.0.1";
  std::optional<int> master_port;  // Unset: a free port on single-node jobs, 29500 otherwise.
  std::string local_addr;

  // Supervision.
  int max_restarts = 0;
  double monitor_interval_s = 0.1;     // Accepted for torchrun compatibility; exits are event-driven.
  std::string start_method = "spawn";  // forkserver: Python workers forked from a server (fork_server.h).
  std::vector<std::string> preload;    // Modules the forkserver imports besides torch.
  bool auto_heartbeat = false;         // --auto-heartbeat: Python workers beat per optimizer step.
  // --keep-survivors: a failed worker restarts alone where the others can regroup in place.
  bool keep_survivors = false;
  std::string role = "default";
  std::chrono::milliseconds shutdown_timeout{30000};
  // Progress heartbeats (heartbeat.h): seconds without a beat once beating, and before the first.
  std::optional<double> worker_timeout_s;
  std::optional<double> worker_start_timeout_s;
  std::optional<double> straggler_factor;  // Also opens the heartbeat channel.
  std::vector<int> signals_to_handle;

  // Goodput and experiments.
  std::string report_file;    // --report-file: the goodput report's JSON; empty: none.
  std::string history_file;   // --history-file: the elastic agent's history (round_history.h).
  std::string inject_faults;  // --inject-faults plan (fault_plan.h), validated; empty: none.
  uint64_t inject_seed = 0;

  // Logs.
  std::string log_dir;  // Empty: a fresh directory under $TMPDIR.
  StdSetting redirects;
  StdSetting tee;
  std::optional<std::set<int>> local_ranks_filter;  // Console only; unset shows every rank.
  // TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: replaces "[<role><local_rank>]:" before each console
  // line, with ${role_name}, ${rank} and ${local_rank} substituted (Python's safe_substitute).
  std::optional<std::string> log_line_prefix_template;
  // --duplicate-stdout/stderr-filters: tee'd lines holding any of these strings are also
  // written to <attempt dir>/filtered_stdout.log / filtered_stderr.log.
  std::vector<std::string> duplicate_stdout_filters;
  std::vector<std::string> duplicate_stderr_filters;

  // Devices.
  // --virtual-local-rank: LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES its one device.
  bool virtual_local_rank = false;
  std::string numa_binding;  // --numa-binding mode (numa_binding.h); empty: none.

  // The entrypoint.
  bool module = false;
  bool no_python = false;
  bool run_path = false;
  std::string training_script;
  std::vector<std::string> training_script_args;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_SPEC_JOB_SPEC_H_
