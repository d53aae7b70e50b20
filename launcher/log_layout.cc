#include "launcher/log_layout.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace elrun {
namespace {

absl::Status MakeDirs(const std::string& path) {
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    partial = path.substr(0, pos);
    if (partial.empty()) continue;
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create log directory ", partial, ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

bool Shows(StdStreams streams, bool is_stdout) {
  int bit = is_stdout ? 1 : 2;
  return (static_cast<int>(streams) & bit) != 0;
}

StreamRoute Route(const JobSpec& spec, int local_rank, bool is_stdout, std::string path) {
  bool on_console = !spec.local_ranks_filter || spec.local_ranks_filter->count(local_rank) > 0;
  bool tee = Shows(spec.tee.For(local_rank), is_stdout);
  bool redirect = Shows(spec.redirects.For(local_rank), is_stdout);
  if (tee && on_console) return {StreamTarget::kTee, std::move(path)};
  if (tee || redirect || !on_console) return {StreamTarget::kFile, std::move(path)};
  return {StreamTarget::kInherit, ""};
}

}  // namespace

LogLayout::LogLayout(std::string log_dir, std::string run_id)
    : log_dir_(std::move(log_dir)), run_id_(std::move(run_id)) {}

std::string LogLayout::RunDir() const { return absl::StrCat(log_dir_, "/", run_id_); }

std::string LogLayout::AttemptDir(int attempt) const {
  return absl::StrCat(RunDir(), "/attempt_", attempt);
}

std::string LogLayout::RankDir(int attempt, int local_rank) const {
  return absl::StrCat(AttemptDir(attempt), "/", local_rank);
}

std::string LogLayout::StdoutPath(int attempt, int local_rank) const {
  return RankDir(attempt, local_rank) + "/stdout.log";
}

std::string LogLayout::StderrPath(int attempt, int local_rank) const {
  return RankDir(attempt, local_rank) + "/stderr.log";
}

std::string LogLayout::ErrorFilePath(int attempt, int local_rank) const {
  return RankDir(attempt, local_rank) + "/error.json";
}

absl::Status LogLayout::PrepareRankDir(int attempt, int local_rank) const {
  absl::Status status = MakeDirs(RankDir(attempt, local_rank));
  if (!status.ok()) return status;
  std::string error_file = ErrorFilePath(attempt, local_rank);
  if (::unlink(error_file.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove stale ", error_file, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void LogLayout::RemoveEmptyDirs() const {
  // attempt_<n>/<rank> directories are numbered densely from 0; stop at the first missing one.
  for (int attempt = 0;; ++attempt) {
    std::string attempt_dir = AttemptDir(attempt);
    if (::access(attempt_dir.c_str(), F_OK) != 0) break;
    for (int rank = 0; ::rmdir(RankDir(attempt, rank).c_str()) == 0 || errno == ENOTEMPTY; ++rank) {
    }
    ::rmdir(attempt_dir.c_str());
  }
  ::rmdir(RunDir().c_str());
}

StreamRoutes RouteStreams(const JobSpec& spec, const LogLayout& layout, int attempt,
                          int local_rank) {
  return {Route(spec, local_rank, true, layout.StdoutPath(attempt, local_rank)),
          Route(spec, local_rank, false, layout.StderrPath(attempt, local_rank))};
}

std::string ConsolePrefix(const std::string& role, int local_rank) {
  return absl::StrCat("[", role, local_rank, "]:");
}

}  // namespace elrun
