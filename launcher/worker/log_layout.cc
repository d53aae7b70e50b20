#include "launcher/worker/log_layout.h"

#include <cctype>
#include <vector>

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

std::string LogLayout::AttemptDir(int attempt) const { return absl::StrCat(RunDir(), "/attempt_", attempt); }

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
  std::vector<std::string> stale = {ErrorFilePath(attempt, local_rank)};
  if (local_rank == 0) {  // Once per attempt: the attempt's filtered logs start empty.
    stale.push_back(FilteredPath(attempt, true));
    stale.push_back(FilteredPath(attempt, false));
  }
  for (const std::string& file : stale) {
    if (::unlink(file.c_str()) != 0 && errno != ENOENT) {
      return absl::FailedPreconditionError(absl::StrCat("cannot remove stale ", file, ": ", std::strerror(errno)));
    }
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

std::string LogLayout::FilteredPath(int attempt, bool stdout_stream) const {
  return AttemptDir(attempt) + (stdout_stream ? "/filtered_stdout.log" : "/filtered_stderr.log");
}

StreamRoutes RouteStreams(const JobSpec& spec, const LogLayout& layout, int attempt, int local_rank) {
  StreamRoutes routes{Route(spec, local_rank, true, layout.StdoutPath(attempt, local_rank)),
                      Route(spec, local_rank, false, layout.StderrPath(attempt, local_rank))};
  if (routes.out.target == StreamTarget::kTee && !spec.duplicate_stdout_filters.empty()) {
    routes.out.filtered_path = layout.FilteredPath(attempt, true);
    routes.out.filters = spec.duplicate_stdout_filters;
  }
  if (routes.err.target == StreamTarget::kTee && !spec.duplicate_stderr_filters.empty()) {
    routes.err.filtered_path = layout.FilteredPath(attempt, false);
    routes.err.filters = spec.duplicate_stderr_filters;
  }
  return routes;
}

std::string SafeSubstitute(const std::string& text, const std::map<std::string, std::string>& values) {
  auto ident_start = [](char c) { return c == '_' || std::isalpha(static_cast<unsigned char>(c)); };
  auto ident_char = [](char c) { return c == '_' || std::isalnum(static_cast<unsigned char>(c)); };
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (text[i] != '$' || i + 1 >= text.size()) {
      out += text[i++];
      continue;
    }
    if (text[i + 1] == '$') {
      out += '$';
      i += 2;
      continue;
    }
    bool braced = text[i + 1] == '{';
    size_t start = i + (braced ? 2 : 1);
    size_t end = start;
    if (end < text.size() && ident_start(text[end])) {
      ++end;
      while (end < text.size() && ident_char(text[end])) ++end;
    }
    bool closed = !braced || (end < text.size() && text[end] == '}');
    auto value = values.find(text.substr(start, end - start));
    if (end > start && closed && value != values.end()) {
      out += value->second;
      i = end + (braced ? 1 : 0);
    } else {
      out += text[i++];
    }
  }
  return out;
}

std::string ConsolePrefix(const JobSpec& spec, int rank, int local_rank) {
  if (!spec.log_line_prefix_template) return absl::StrCat("[", spec.role, local_rank, "]:");
  return SafeSubstitute(
      *spec.log_line_prefix_template,
      {{"role_name", spec.role}, {"rank", std::to_string(rank)}, {"local_rank", std::to_string(local_rank)}});
}

}  // namespace elrun
