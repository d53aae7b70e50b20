// The root-cause summary printed when a job fails: which worker failed first, how (exit code or
// signal name), where, its own error message from TORCHELASTIC_ERROR_FILE and its logs, then the
// other workers' ends. Formatting, apart from ParentErrorJson and AttachWorkerFiles, which read
// the worker's files; thread-safe.
#ifndef ELRUN_LAUNCHER_REPORT_FAILURE_REPORT_H_
#define ELRUN_LAUNCHER_REPORT_FAILURE_REPORT_H_

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "launcher/report/error_file.h"
#include "launcher/spec/exit_status.h"
#include "launcher/spec/worker_launch.h"

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
  std::string cause;              // Why elrun signalled it outside a stop (the FileTimer watchdog).
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

// The root cause among `failures` (in the order observed): the first one that elrun did not
// stop itself, else the first. `failures` must not be empty.
size_t RootCauseIndex(const std::vector<WorkerFailure>& failures);

// The exit code torchrun reports for a failure: the code, or minus the signal number.
int TorchExitCode(const WorkerFailure& failure);

std::string FormatFailureReport(const JobSummary& job, const std::vector<WorkerFailure>& failures);

// The JSON for elrun's own TORCHELASTIC_ERROR_FILE: the root-cause worker's error file with its
// exit code (RootCauseErrorJson) when it wrote one, else a ChildFailedError record holding
// `report` (ErrorRecordJson). `failures` must not be empty.
std::string ParentErrorJson(const std::vector<WorkerFailure>& failures, const std::string& report,
                            std::chrono::system_clock::time_point now);

// "local_rank 1 (rank 3, pid 77) ended with exit code 1": the first failure not caused by elrun,
// or "no failure recorded".
std::string DescribeFirstFailure(const std::vector<WorkerFailure>& failures);

// Fills error_file, error, stdout_log and stderr_log of a failure from the files its worker left
// behind; an error file that does not parse becomes an error saying so.
void AttachWorkerFiles(const WorkerLaunch& launch, WorkerFailure* failure);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_REPORT_FAILURE_REPORT_H_
