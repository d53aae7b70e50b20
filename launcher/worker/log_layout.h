// Where a job's files go: <log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log and
// error.json, and which of a worker's streams go to files, the console or both. Pure apart from
// PrepareRankDir and RemoveEmptyDirs, which make and remove directories. Thread-compatible.
#ifndef ELRUN_LAUNCHER_WORKER_LOG_LAYOUT_H_
#define ELRUN_LAUNCHER_WORKER_LOG_LAYOUT_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "launcher/spec/job_spec.h"
#include "launcher/spec/worker_launch.h"

namespace elrun {

class LogLayout {
 public:
  // `log_dir` is the user's --log-dir (or a temp dir); files go below log_dir/run_id.
  LogLayout(std::string log_dir, std::string run_id);

  std::string RunDir() const;
  std::string AttemptDir(int attempt) const;
  std::string RankDir(int attempt, int local_rank) const;
  std::string StdoutPath(int attempt, int local_rank) const;
  std::string StderrPath(int attempt, int local_rank) const;
  std::string ErrorFilePath(int attempt, int local_rank) const;
  // <attempt dir>/filtered_stdout.log and filtered_stderr.log (--duplicate-*-filters).
  std::string FilteredPath(int attempt, bool stdout_stream) const;

  // mkdir -p of RankDir, and removes a stale error.json left by an earlier run in the same
  // directory, so that a report never shows another run's error (for local rank 0, the
  // attempt's filtered logs too). FailedPrecondition when a directory cannot be made or a
  // stale file cannot be removed.
  absl::Status PrepareRankDir(int attempt, int local_rank) const;

  // Removes the directories below RunDir (and RunDir itself) that are empty; files stay.
  void RemoveEmptyDirs() const;

 private:
  const std::string log_dir_;
  const std::string run_id_;
};

struct StreamRoutes {
  StreamRoute out;
  StreamRoute err;
};

// torchrun's rules: --tee copies a stream to file and console, --redirects sends it to the file
// only (tee wins when both name a stream); --local-ranks-filter hides a rank from the console,
// whose streams then go to the files instead of being lost.
StreamRoutes RouteStreams(const JobSpec& spec, const LogLayout& layout, int attempt, int local_rank);

// What precedes each tee'd console line: "[default0]:" (the role and local rank) as torchrun
// does, or TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE with ${role_name}, ${rank} and ${local_rank}
// substituted.
std::string ConsolePrefix(const JobSpec& spec, int rank, int local_rank);

// Python's string.Template(text).safe_substitute(values): $name and ${name} become their value,
// "$$" a "$"; anything else stays as it is.
std::string SafeSubstitute(const std::string& text, const std::map<std::string, std::string>& values);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_WORKER_LOG_LAYOUT_H_
