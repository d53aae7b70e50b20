// Runs one job on this node from a parsed JobSpec: resolves the entrypoint, sets up logs, the
// guardian, signal handling and the event loop, supervises the workers and prints the failure
// report. Returns the launcher's exit code. Call once per process (it owns signal dispositions).
#ifndef ELRUN_LAUNCHER_LOCAL_JOB_H_
#define ELRUN_LAUNCHER_LOCAL_JOB_H_

#include <map>
#include <string>

#include "launcher/job_spec.h"

namespace elrun {

int RunLocalJob(const JobSpec& spec, const std::map<std::string, std::string>& env);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_LOCAL_JOB_H_
