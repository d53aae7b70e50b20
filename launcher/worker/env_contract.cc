#include "launcher/worker/env_contract.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "launcher/spec/value_parsers.h"

namespace elrun {

NodeAssignment StaticAssignment(const JobSpec& spec, const std::string& master_addr, int master_port) {
  NodeAssignment node;
  node.group_rank = spec.node_rank;
  node.group_world_size = spec.max_nodes;
  node.rank_offset = spec.node_rank * spec.nproc_per_node;
  node.world_size = spec.max_nodes * spec.nproc_per_node;
  node.role_rank_offset = node.rank_offset;
  node.role_world_size = node.world_size;
  node.master_addr = master_addr;
  node.master_port = master_port;
  return node;
}

bool DefaultsOmpThreads(const JobSpec& spec, const std::map<std::string, std::string>& parent_env) {
  return spec.nproc_per_node > 1 && parent_env.count("OMP_NUM_THREADS") == 0;
}

std::vector<std::string> BuildWorkerEnv(const JobSpec& spec, const NodeAssignment& node, const AttemptEnv& attempt,
                                        int local_rank, const std::string& error_file,
                                        const std::map<std::string, std::string>& parent_env) {
  std::map<std::string, std::string> env = parent_env;
  auto set = [&env](const char* name, const std::string& value) { env[name] = value; };
  auto num = [](int value) { return std::to_string(value); };

  set("LOCAL_RANK", num(local_rank));
  set("RANK", num(node.rank_offset + local_rank));
  set("GROUP_RANK", num(node.group_rank));
  set("GROUP_WORLD_SIZE", num(node.group_world_size));
  set("ROLE_NAME", spec.role);
  set("ROLE_RANK", num(node.role_rank_offset + local_rank));
  set("ROLE_WORLD_SIZE", num(node.role_world_size));
  set("LOCAL_WORLD_SIZE", num(spec.nproc_per_node));
  set("WORLD_SIZE", num(node.world_size));
  set("MASTER_ADDR", node.master_addr);
  set("MASTER_PORT", num(node.master_port));
  set("TORCHELASTIC_RESTART_COUNT", num(attempt.restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", num(spec.max_restarts));
  set("TORCHELASTIC_RUN_ID", attempt.run_id);
  set("TORCHELASTIC_USE_AGENT_STORE", "False");
  set("TORCHELASTIC_ERROR_FILE", error_file);
  // torchrun exports --signals-to-handle to its workers, whose torch handlers read it.
  std::vector<std::string> signals;
  for (int signo : spec.signals_to_handle) signals.push_back(SignalName(signo));
  set("TORCHELASTIC_SIGNALS_TO_HANDLE", absl::StrJoin(signals, ","));
  env.erase("ELRUN_RDZV_TOKEN");  // The rendezvous tokens are elrun's, never a worker's.
  env.erase("ELRUN_RUN_TOKEN");
  env.erase("ELRUN_ETCD_PASSWORD");  // The etcd backend's, likewise.
  env.emplace("NCCL_ASYNC_ERROR_HANDLING", "1");
  env.emplace("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  if (DefaultsOmpThreads(spec, parent_env)) set("OMP_NUM_THREADS", "1");
  if (spec.virtual_local_rank) {
    // torchrun's virtual local rank: each worker sees only its own device, as device 0.
    set("LOCAL_RANK", "0");
    std::string device = num(local_rank);
    if (auto visible = parent_env.find("CUDA_VISIBLE_DEVICES"); visible != parent_env.end()) {
      std::vector<std::string> ids = absl::StrSplit(visible->second, ',');
      if (local_rank < static_cast<int>(ids.size())) device = std::string(absl::StripAsciiWhitespace(ids[local_rank]));
    }
    set("CUDA_VISIBLE_DEVICES", device);
  }

  std::vector<std::string> entries;
  entries.reserve(env.size());
  for (const auto& [name, value] : env) entries.push_back(name + "=" + value);
  return entries;
}

std::map<std::string, std::string> EnvToMap(const char* const* environ_entries) {
  std::map<std::string, std::string> env;
  for (const char* const* entry = environ_entries; entry && *entry; ++entry) {
    const char* eq = std::strchr(*entry, '=');
    if (eq == nullptr) continue;
    env.emplace(std::string(*entry, eq), std::string(eq + 1));
  }
  return env;
}

}  // namespace elrun
