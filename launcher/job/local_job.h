// Runs a job whose ranks this node can decide alone: --standalone, or --rdzv-backend static
// (every node knows its --node-rank). Restarts the local worker group within --max-restarts.
// Returns the launcher's exit code. Call once per process (it owns signal dispositions).
#ifndef ELRUN_LAUNCHER_JOB_LOCAL_JOB_H_
#define ELRUN_LAUNCHER_JOB_LOCAL_JOB_H_

#include <map>
#include <string>
#include <vector>

#include "launcher/spec/job_spec.h"

namespace elrun {

// `argv_template` comes from ResolveEntrypoint.
int RunLocalJob(const JobSpec& spec, const std::map<std::string, std::string>& env,
                const std::vector<std::string>& argv_template);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_JOB_LOCAL_JOB_H_
