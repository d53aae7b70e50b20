#include "launcher/cli/slurm_env.h"

#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace elrun {
namespace {

// The top-level entries of a hostlist: split at commas outside brackets.
absl::StatusOr<std::vector<std::string>> SplitEntries(absl::string_view hostlist) {
  std::vector<std::string> entries;
  std::string current;
  int depth = 0;
  for (char c : hostlist) {
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) break;
    if (c == '[' && depth > 1) break;
    if (c == ',' && depth == 0) {
      entries.push_back(current);
      current.clear();
      continue;
    }
    current += c;
  }
  if (depth != 0) {
    return absl::InvalidArgumentError("unbalanced or nested brackets");
  }
  entries.push_back(current);
  return entries;
}

// The members of one bracket group's body, "01-04,07" -> 01 02 03 04 07.
absl::StatusOr<std::vector<std::string>> ExpandRanges(absl::string_view body, absl::string_view entry) {
  std::vector<std::string> out;
  for (absl::string_view item : absl::StrSplit(body, ',')) {
    std::vector<absl::string_view> bounds = absl::StrSplit(item, absl::MaxSplits('-', 1));
    auto digits = [](absl::string_view s) {
      if (s.empty() || s.size() > 9) return false;
      for (char c : s) {
        if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
      }
      return true;
    };
    absl::string_view lo_text = bounds[0];
    absl::string_view hi_text = bounds.size() == 2 ? bounds[1] : bounds[0];
    uint32_t lo = 0;
    uint32_t hi = 0;
    if (!digits(lo_text) || !digits(hi_text) || !absl::SimpleAtoi(lo_text, &lo) || !absl::SimpleAtoi(hi_text, &hi) ||
        hi < lo) {
      return absl::InvalidArgumentError(
          absl::StrCat("'[", body, "]' in '", entry, "' is not a list of numbers and ranges such as [01-04,07]"));
    }
    if (hi - lo >= kMaxHosts || out.size() + (hi - lo + 1) > kMaxHosts) {
      return absl::InvalidArgumentError(absl::StrCat("'", entry, "' names more than ", kMaxHosts, " hosts"));
    }
    int width = static_cast<int>(lo_text.size());
    for (uint32_t n = lo; n <= hi; ++n) out.push_back(absl::StrFormat("%0*u", width, n));
  }
  return out;
}

absl::Status ExpandEntry(absl::string_view entry, std::vector<std::string>* hosts) {
  if (entry.empty()) return absl::InvalidArgumentError("an empty host name");
  std::vector<std::string> names = {""};
  size_t i = 0;
  while (i < entry.size()) {
    if (entry[i] == '[') {
      size_t close = entry.find(']', i);
      auto members = ExpandRanges(entry.substr(i + 1, close - i - 1), entry);
      if (!members.ok()) return members.status();
      if (names.size() * members->size() > kMaxHosts) {
        return absl::InvalidArgumentError(absl::StrCat("'", entry, "' names more than ", kMaxHosts, " hosts"));
      }
      std::vector<std::string> product;
      product.reserve(names.size() * members->size());
      for (const std::string& name : names) {
        for (const std::string& member : *members) product.push_back(name + member);
      }
      names = std::move(product);
      i = close + 1;
    } else {
      size_t next = entry.find('[', i);
      if (next == absl::string_view::npos) next = entry.size();
      for (std::string& name : names) absl::StrAppend(&name, entry.substr(i, next - i));
      i = next;
    }
  }
  if (hosts->size() + names.size() > kMaxHosts) {
    return absl::InvalidArgumentError(absl::StrCat("the hostlist names more than ", kMaxHosts, " hosts"));
  }
  hosts->insert(hosts->end(), names.begin(), names.end());
  return absl::OkStatus();
}

absl::StatusOr<long long> Number(const EnvGet& env, const std::string& name, long long lo,  // NOLINT
                                 long long hi) {                                            // NOLINT
  std::optional<std::string> text = env(name);
  long long value = 0;  // NOLINT(runtime/int)
  if (!text || !absl::SimpleAtoi(*text, &value) || value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=", text.value_or("(unset)"), ": expected an integer in [", lo, ", ", hi, "]"));
  }
  return value;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandHostlist(absl::string_view hostlist) {
  auto entries = SplitEntries(hostlist);
  if (!entries.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bad hostlist '", hostlist, "': ", entries.status().message()));
  }
  std::vector<std::string> hosts;
  for (const std::string& entry : *entries) {
    absl::Status expanded = ExpandEntry(entry, &hosts);
    if (!expanded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("bad hostlist '", hostlist, "': ", expanded.message()));
    }
  }
  return hosts;
}

int SlurmRendezvousPort(long long job_id, long long step_id) {  // NOLINT(runtime/int)
  return static_cast<int>(10000 + ((job_id % 20000) * 16 + step_id % 20000) % 20000);
}

absl::StatusOr<std::vector<SlurmValue>> SlurmValues(const EnvGet& env) {
  std::vector<SlurmValue> values;
  if (!env("SLURM_JOB_ID")) return values;
  auto job = Number(env, "SLURM_JOB_ID", 0, 1LL << 40);
  if (!job.ok()) return job.status();
  std::optional<std::string> gpus = env("SLURM_GPUS_ON_NODE");
  long long gpu_count = 0;  // NOLINT(runtime/int)
  if (gpus) {
    auto n = Number(env, "SLURM_GPUS_ON_NODE", 0, 1 << 16);
    if (!n.ok()) return n.status();
    gpu_count = *n;
  }

  std::optional<std::string> step_text = env("SLURM_STEP_ID");
  // The batch script itself ("batch", or no step) runs on one node: only the worker count.
  long long step = 0;  // NOLINT(runtime/int)
  if (!step_text || !absl::SimpleAtoi(*step_text, &step) || step < 0) {
    if (gpu_count > 0) {
      values.push_back({"nproc-per-node", std::to_string(gpu_count), "SLURM_GPUS_ON_NODE"});
    } else if (env("SLURM_NTASKS_PER_NODE")) {
      auto n = Number(env, "SLURM_NTASKS_PER_NODE", 1, 1 << 16);
      if (!n.ok()) return n.status();
      values.push_back({"nproc-per-node", std::to_string(*n), "SLURM_NTASKS_PER_NODE"});
    }
    return values;
  }

  bool in_step_vars = env("SLURM_STEP_NUM_NODES").has_value();
  const char* nodes_var = in_step_vars ? "SLURM_STEP_NUM_NODES" : "SLURM_NNODES";
  auto nodes = Number(env, nodes_var, 1, 1 << 20);
  if (!nodes.ok()) return nodes.status();
  auto node_id = Number(env, "SLURM_NODEID", 0, *nodes - 1);
  if (!node_id.ok()) return node_id.status();
  if (env("SLURM_STEP_NUM_TASKS")) {
    auto tasks = Number(env, "SLURM_STEP_NUM_TASKS", 1, 1 << 24);
    if (!tasks.ok()) return tasks.status();
    if (*tasks > *nodes) {
      return absl::InvalidArgumentError(
          absl::StrCat("this Slurm step runs ", *tasks, " tasks on ", *nodes,
                       " nodes; elrun starts the workers itself: run one elrun per node (srun --ntasks-per-node=1)"));
    }
  }
  const char* list_var = env("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
  std::optional<std::string> list = env(list_var);
  if (!list) return absl::InvalidArgumentError(absl::StrCat(list_var, " is not set inside a Slurm step"));
  auto hosts = ExpandHostlist(*list);
  if (!hosts.ok()) return absl::InvalidArgumentError(absl::StrCat(list_var, ": ", hosts.status().message()));
  if (static_cast<long long>(hosts->size()) != *nodes) {  // NOLINT(runtime/int)
    return absl::InvalidArgumentError(
        absl::StrCat(list_var, "=", *list, " names ", hosts->size(), " hosts but ", nodes_var, "=", *nodes));
  }
  values.push_back({"nnodes", std::to_string(*nodes), nodes_var});
  values.push_back({"node-rank", std::to_string(*node_id), "SLURM_NODEID"});
  if (gpu_count > 0) values.push_back({"nproc-per-node", std::to_string(gpu_count), "SLURM_GPUS_ON_NODE"});
  values.push_back({"rdzv-backend", "c10d", "SLURM_JOB_ID"});
  values.push_back({"rdzv-endpoint", absl::StrCat(hosts->front(), ":", SlurmRendezvousPort(*job, step)),
                    absl::StrCat(list_var, ", SLURM_JOB_ID, SLURM_STEP_ID")});
  values.push_back({"rdzv-id", absl::StrCat("slurm-", *job, ".", step), "SLURM_JOB_ID, SLURM_STEP_ID"});
  return values;
}

}  // namespace elrun
