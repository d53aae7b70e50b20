#include "launcher/report/failure_report.h"

#include <sys/stat.h>

#include <csignal>
#include <ctime>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "launcher/spec/value_parsers.h"

namespace elrun {
namespace {

constexpr int kTracebackLines = 12;

std::string FormatTime(std::chrono::system_clock::time_point time) {
  std::time_t seconds = std::chrono::system_clock::to_time_t(time);
  std::tm utc;
  gmtime_r(&seconds, &utc);
  char buffer[64];
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buffer;
}

std::optional<std::string> ReadFileText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

bool FileExists(const std::string& path) {
  struct stat st;
  return !path.empty() && ::stat(path.c_str(), &st) == 0;
}

std::string Ending(const WorkerFailure& f) {
  if (!f.start_error.empty()) return absl::StrCat("could not start: ", f.start_error);
  if (f.status.signal == 0) return absl::StrCat("exitcode  : ", f.status.code);
  std::string text = absl::StrCat("exitcode  : ", -f.status.signal, " (", SignalName(f.status.signal), ")");
  if (!f.cause.empty()) {
    absl::StrAppend(&text, ", by elrun's ", f.cause);
  } else if (f.stopped_by_elrun) {
    absl::StrAppend(&text, ", sent by elrun to stop the group");
  } else if (f.status.signal == SIGKILL) {
    absl::StrAppend(&text, ", not sent by elrun: the kernel's OOM killer or another process");
  }
  return text;
}

void AppendDetails(const WorkerFailure& f, const JobSummary& job, std::string* out) {
  absl::StrAppend(out, "  time      : ", FormatTime(f.time), "\n");
  absl::StrAppend(out, "  host      : ", job.host, "\n");
  absl::StrAppend(out, "  rank      : ", f.rank, " (local_rank: ", f.local_rank, ", group_rank: ", job.group_rank,
                  ")\n");
  absl::StrAppend(out, "  ", Ending(f), "\n");
  if (f.pid > 0) absl::StrAppend(out, "  pid       : ", f.pid, "\n");
  if (f.error) {
    absl::StrAppend(out, "  error     : ", f.error->message, "\n");
    if (!f.error->traceback.empty()) {
      std::vector<std::string> lines = absl::StrSplit(f.error->traceback, '\n', absl::SkipEmpty());
      size_t first = lines.size() > kTracebackLines ? lines.size() - kTracebackLines : 0;
      absl::StrAppend(out, "  traceback :", first > 0 ? " (last lines)" : "", "\n");
      for (size_t i = first; i < lines.size(); ++i) absl::StrAppend(out, "    ", lines[i], "\n");
    }
    absl::StrAppend(out, "  error_file: ", f.error_file, "\n");
  } else if (f.start_error.empty()) {
    absl::StrAppend(out,
                    "  error_file: none written (a Python worker records one when its main is "
                    "decorated with torch.distributed.elastic.multiprocessing.errors.record)\n");
  }
  if (!f.stdout_log.empty()) absl::StrAppend(out, "  stdout    : ", f.stdout_log, "\n");
  if (!f.stderr_log.empty()) absl::StrAppend(out, "  stderr    : ", f.stderr_log, "\n");
}

}  // namespace

size_t RootCauseIndex(const std::vector<WorkerFailure>& failures) {
  for (size_t i = 0; i < failures.size(); ++i) {
    if (!failures[i].stopped_by_elrun) return i;
  }
  return 0;
}

int TorchExitCode(const WorkerFailure& failure) {
  return failure.status.signal != 0 ? -failure.status.signal : failure.status.code;
}

std::string ParentErrorJson(const std::vector<WorkerFailure>& failures, const std::string& report,
                            std::chrono::system_clock::time_point now) {
  const WorkerFailure& root = failures[RootCauseIndex(failures)];
  int code = TorchExitCode(root);
  if (root.error) {
    auto contents = ReadFileText(root.error_file);
    if (contents) {
      auto json = RootCauseErrorJson(*contents, code);
      if (json.ok()) return *json;
    }
  }
  std::string what =
      !root.start_error.empty()
          ? absl::StrCat("local_rank ", root.local_rank, " could not start: ", root.start_error)
          : absl::StrCat("local_rank ", root.local_rank, " (rank ", root.rank, ") ",
                         root.status.signal != 0 ? absl::StrCat("was killed by ", SignalName(root.status.signal))
                                                 : absl::StrCat("exited with code ", root.status.code),
                         root.cause.empty() ? "" : absl::StrCat(" (", root.cause, ")"));
  return ErrorRecordJson(absl::StrCat("ChildFailedError: ", what), report, now, code);
}

std::string FormatFailureReport(const JobSummary& job, const std::vector<WorkerFailure>& failures) {
  std::string out = std::string(60, '=') + "\n";
  absl::StrAppend(&out, job.entrypoint, " FAILED (run_id ", job.run_id, ", ", job.attempts,
                  job.attempts == 1 ? " attempt" : " attempts", ", max_restarts ", job.max_restarts, ")\n");
  if (failures.empty()) {
    absl::StrAppend(&out, "no worker failure was recorded\n", std::string(60, '=') + "\n");
    return out;
  }
  size_t root = RootCauseIndex(failures);
  absl::StrAppend(&out, std::string(60, '-'), "\nRoot Cause (first observed failure):\n");
  AppendDetails(failures[root], job, &out);
  bool others = false;
  for (size_t i = 0; i < failures.size(); ++i) {
    if (i == root) continue;
    if (!others) absl::StrAppend(&out, std::string(60, '-'), "\nOther Failures:\n");
    others = true;
    AppendDetails(failures[i], job, &out);
  }
  absl::StrAppend(&out, std::string(60, '='), "\n");
  return out;
}

void AttachWorkerFiles(const WorkerLaunch& launch, WorkerFailure* failure) {
  failure->error_file = launch.error_file;
  auto error = ReadErrorFile(launch.error_file);
  if (error.ok()) {
    failure->error = *error;
  } else if (error.status().code() != absl::StatusCode::kNotFound) {
    failure->error =
        WorkerError{absl::StrCat("(unreadable error file: ", error.status().message(), ")"), "", std::nullopt};
  }
  if (launch.out.target != StreamTarget::kInherit && FileExists(launch.out.path)) {
    failure->stdout_log = launch.out.path;
  }
  if (launch.err.target != StreamTarget::kInherit && FileExists(launch.err.path)) {
    failure->stderr_log = launch.err.path;
  }
}

std::string DescribeFirstFailure(const std::vector<WorkerFailure>& failures) {
  for (const WorkerFailure& f : failures) {
    if (f.stopped_by_elrun) continue;
    if (!f.start_error.empty()) return absl::StrCat("local_rank ", f.local_rank, ": ", f.start_error);
    return absl::StrCat("local_rank ", f.local_rank, " (rank ", f.rank, ", pid ", f.pid, ") ended with ",
                        f.status.Describe(), f.cause.empty() ? "" : absl::StrCat(" (", f.cause, ")"));
  }
  return "no failure recorded";
}

}  // namespace elrun
