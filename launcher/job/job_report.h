// What the job layer reports when a job fails: the root-cause report of a Supervisor's failed
// attempt on stderr, and elrun's own TORCHELASTIC_ERROR_FILE record, as torchrun writes them.
// Thread-compatible: called from the loop's thread once the job has ended.
#ifndef ELRUN_LAUNCHER_JOB_JOB_REPORT_H_
#define ELRUN_LAUNCHER_JOB_JOB_REPORT_H_

#include <map>
#include <string>

#include "launcher/job/supervisor.h"
#include "launcher/spec/job_spec.h"

namespace elrun {

// Prints the root-cause report of a supervisor whose attempt failed (to stderr) and, when
// `env` (elrun's own) sets TORCHELASTIC_ERROR_FILE, writes the root cause there as torchrun does.
void PrintFailureReport(const JobSpec& spec, const Supervisor& supervisor, const std::string& run_id, int group_rank,
                        const std::map<std::string, std::string>& env);

// For a job that failed without a worker of this node to blame (a failure on another node, a
// lost rendezvous): writes a "<Type>: <text>" record to env's TORCHELASTIC_ERROR_FILE, if set.
void WriteLauncherErrorFile(const std::map<std::string, std::string>& env, const std::string& type,
                            const std::string& text);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_JOB_JOB_REPORT_H_
