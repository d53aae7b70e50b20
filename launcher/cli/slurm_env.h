// Running under Slurm without topology flags: what `srun elrun ...` (or elrun inside an sbatch
// script) can take from the SLURM_* variables, and Slurm's hostlist syntax. Pure; thread-safe.
#ifndef ELRUN_LAUNCHER_CLI_SLURM_ENV_H_
#define ELRUN_LAUNCHER_CLI_SLURM_ENV_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace elrun {

// Expands a Slurm hostlist: "gpu[01-04,07],cpu3" -> gpu01 gpu02 gpu03 gpu04 gpu07 cpu3. Ranges
// keep the lower bound's zero padding, several bracket groups in one name multiply
// ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2), and names may hold any character but ",[]".
// Anything else (unbalanced brackets, "5-3", an empty name, more than kMaxHosts hosts) is
// InvalidArgument naming the offending part.
inline constexpr size_t kMaxHosts = 1 << 20;
absl::StatusOr<std::vector<std::string>> ExpandHostlist(absl::string_view hostlist);

// One option elrun takes from Slurm unless the command line or a PET_ variable set it.
struct SlurmValue {
  std::string option;  // elrun's option name, e.g. "nnodes".
  std::string value;
  std::string source;  // The variable(s) it came from, for messages: "SLURM_NNODES".
};

// What this Slurm context gives, in option order. Empty outside Slurm (no SLURM_JOB_ID).
// Inside a job step (srun: SLURM_STEP_ID): --nnodes from the step's node count, --node-rank
// from SLURM_NODEID, --rdzv-backend c10d, --rdzv-endpoint on the step's first host at a port
// derived from the job and step ids (the same on every node, different per step), --rdzv-id
// slurm-<job>.<step>, and --nproc-per-node from SLURM_GPUS_ON_NODE when it is above 0. A step
// with more tasks than nodes is an error: one elrun per node. Outside a step (the sbatch
// script itself) only --nproc-per-node, from SLURM_GPUS_ON_NODE, else SLURM_NTASKS_PER_NODE.
using EnvGet = std::function<std::optional<std::string>(const std::string&)>;
absl::StatusOr<std::vector<SlurmValue>> SlurmValues(const EnvGet& env);

// The port of a step's rendezvous endpoint: 10000 + (16 * job + step) mod 20000, below the
// usual ephemeral range.
int SlurmRendezvousPort(long long job_id, long long step_id);  // NOLINT(runtime/int)

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_CLI_SLURM_ENV_H_
