// The root-cause summary printed when a job fails: which worker failed first, how (exit code or
// signal name), where, its own error message from TORCHELASTIC_ERROR_FILE and its logs, then the
// other workers' ends. Pure formatting; thread-safe.
#ifndef ELRUN_LAUNCHER_FAILURE_REPORT_H_
#define ELRUN_LAUNCHER_FAILURE_REPORT_H_

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "launcher/error_file.h"
#include "launcher/exit_status.h"
#include "launcher/worker_launch.h"

namespace elrun {

// One worker that ended badly in the attempt that ended the job.
struct WorkerFailure {
  int local_rank = 0;
  int rank = 0;
  int pid = 0;  // 0 when the worker could not be started.
  ExitStatus status;
  std::chrono::system_clock::time_point time;
  bool stopped_by_elrun = false;  // Ended after elrun signalled it to stop.
  std::string start_error;        // Set when the worker could not be started.
  std::string error_file;
  std::optional<WorkerError> error;  // From error_file, when the worker wrote one.
  std::string stdout_log;            // Paths of log files that exist; empty otherwise.
  std::string stderr_log;
};

struct JobSummary {
  std::string entrypoint;  // The training script or binary as the user gave it.
  std::string host;
  std::string run_id;
  int group_rank = 0;
  int attempts = 1;  // Attempts run, the failed restarts included.
  int max_restarts = 0;
};

// `failures` in the order they were observed; the first is the root cause unless an earlier
// listed one was stopped by elrun and a later one was not.
std::string FormatFailureReport(const JobSummary& job, const std::vector<WorkerFailure>& failures);

// Fills error, stdout_log and stderr_log of a failure from the files its worker left behind.
void AttachWorkerFiles(const WorkerLaunch& launch, WorkerFailure* failure);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_FAILURE_REPORT_H_
