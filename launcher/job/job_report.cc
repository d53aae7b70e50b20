#include "launcher/job/job_report.h"

#include <unistd.h>

#include <chrono>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "launcher/os/host_info.h"
#include "launcher/os/output_pump.h"
#include "launcher/report/error_file.h"
#include "launcher/report/failure_report.h"

namespace elrun {
namespace {

constexpr char kErrorFileEnv[] = "TORCHELASTIC_ERROR_FILE";

void WriteParentErrorFile(const std::map<std::string, std::string>& env, const std::string& json) {
  auto path = env.find(kErrorFileEnv);
  if (path == env.end() || path->second.empty() || json.empty()) return;
  absl::Status written = WriteErrorFile(path->second, json);
  if (!written.ok()) spdlog::warn("{}", std::string(written.message()));
}

}  // namespace

void WriteLauncherErrorFile(const std::map<std::string, std::string>& env, const std::string& type,
                            const std::string& text) {
  WriteParentErrorFile(env, ErrorRecordJson(absl::StrCat(type, ": ", text), "", std::chrono::system_clock::now(), 0));
}

void PrintFailureReport(const JobSpec& spec, const Supervisor& supervisor, const std::string& run_id, int group_rank,
                        const std::map<std::string, std::string>& env) {
  std::vector<WorkerFailure> failures = supervisor.failures();
  for (WorkerFailure& failure : failures) {
    for (const WorkerLaunch& launch : supervisor.launches()) {
      if (launch.local_rank == failure.local_rank) AttachWorkerFiles(launch, &failure);
    }
  }
  JobSummary summary{spec.training_script, HostName(), run_id, group_rank, supervisor.attempt() + 1, spec.max_restarts};
  std::string report = FormatFailureReport(summary, failures);
  WriteAll(STDERR_FILENO, report.data(), report.size());
  if (!failures.empty()) {
    WriteParentErrorFile(env, ParentErrorJson(failures, report, std::chrono::system_clock::now()));
  }
}

}  // namespace elrun
