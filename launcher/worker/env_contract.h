// The worker environment contract (docs/architecture.md, the same as torchrun's): which
// variables each worker gets, from the job spec and this node's place in the rendezvous round.
// Pure functions.
#ifndef ELRUN_LAUNCHER_WORKER_ENV_CONTRACT_H_
#define ELRUN_LAUNCHER_WORKER_ENV_CONTRACT_H_

#include <map>
#include <string>
#include <vector>

#include "launcher/spec/job_spec.h"

namespace elrun {

// This node's place in one rendezvous round: what a rendezvous (or the static config) decides.
struct NodeAssignment {
  int group_rank = 0;
  int group_world_size = 1;
  int rank_offset = 0;  // Global rank of this node's local rank 0 (prefix sum of nprocs).
  int world_size = 1;   // Sum of all nodes' nproc.
  int role_rank_offset = 0;
  int role_world_size = 1;
  std::string master_addr;
  int master_port = 0;
};

// The static backend: every node has nproc workers and knows its --node-rank.
NodeAssignment StaticAssignment(const JobSpec& spec, const std::string& master_addr, int master_port);

// What changes from one attempt to the next on this node.
struct AttemptEnv {
  std::string run_id;
  int restart_count = 0;
};

// True when elrun sets OMP_NUM_THREADS=1 for the workers (unset and nproc > 1), which torchrun
// announces with a warning.
bool DefaultsOmpThreads(const JobSpec& spec, const std::map<std::string, std::string>& parent_env);

// The full environment of one worker as "NAME=value" entries, sorted by name: the launcher's
// environment with the contract's variables set on top.
std::vector<std::string> BuildWorkerEnv(const JobSpec& spec, const NodeAssignment& node, const AttemptEnv& attempt,
                                        int local_rank, const std::string& error_file,
                                        const std::map<std::string, std::string>& parent_env);

// Parses "NAME=value" entries (as in environ) into a map; entries without '=' are skipped.
std::map<std::string, std::string> EnvToMap(const char* const* environ_entries);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_WORKER_ENV_CONTRACT_H_
