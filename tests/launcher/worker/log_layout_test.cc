#include "launcher/worker/log_layout.h"
#include "tests/temp_dir.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

namespace elrun {
namespace {

bool IsDir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

TEST_CASE("paths follow <log_dir>/<run_id>/attempt_<n>/<local_rank>/") {
  LogLayout layout("/logs", "job1");
  CHECK(layout.RunDir() == "/logs/job1");
  CHECK(layout.AttemptDir(2) == "/logs/job1/attempt_2");
  CHECK(layout.StdoutPath(2, 3) == "/logs/job1/attempt_2/3/stdout.log");
  CHECK(layout.StderrPath(0, 0) == "/logs/job1/attempt_0/0/stderr.log");
  CHECK(layout.ErrorFilePath(1, 0) == "/logs/job1/attempt_1/0/error.json");
}

TEST_CASE("PrepareRankDir makes the directories and removes a stale error file") {
  std::string dir = testing::MakeTempDir("layout");
  LogLayout layout(dir + "/nested/logs", "r");
  REQUIRE(layout.PrepareRankDir(0, 1).ok());
  CHECK(IsDir(layout.RankDir(0, 1)));
  std::ofstream(layout.ErrorFilePath(0, 1)) << "{}";
  REQUIRE(layout.PrepareRankDir(0, 1).ok());
  CHECK(::access(layout.ErrorFilePath(0, 1).c_str(), F_OK) != 0);
}

TEST_CASE("PrepareRankDir reports a directory it cannot create") {
  std::string dir = testing::MakeTempDir("layout");
  std::ofstream(dir + "/file") << "x";
  LogLayout layout(dir + "/file", "r");
  absl::Status status = layout.PrepareRankDir(0, 0);
  CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(status.message()).find(dir + "/file/r") != std::string::npos);
}

TEST_CASE("RemoveEmptyDirs keeps files and removes empty directories") {
  std::string dir = testing::MakeTempDir("layout");
  LogLayout layout(dir, "r");
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (int rank = 0; rank < 2; ++rank) REQUIRE(layout.PrepareRankDir(attempt, rank).ok());
  }
  std::ofstream(layout.StdoutPath(1, 1)) << "kept";
  layout.RemoveEmptyDirs();
  CHECK_FALSE(IsDir(layout.AttemptDir(0)));
  CHECK_FALSE(IsDir(layout.RankDir(1, 0)));
  CHECK(::access(layout.StdoutPath(1, 1).c_str(), F_OK) == 0);
}

JobSpec WithStd(const char* redirects, const char* tee) {
  JobSpec spec;
  auto parse = [](const char* text) {
    StdSetting s;
    s.all = static_cast<StdStreams>(text[0] - '0');
    return s;
  };
  spec.redirects = parse(redirects);
  spec.tee = parse(tee);
  return spec;
}

TEST_CASE("stream routes") {
  LogLayout layout("/l", "r");
  SUBCASE("default: both streams inherit the console") {
    auto routes = RouteStreams(WithStd("0", "0"), layout, 0, 0);
    CHECK(routes.out.target == StreamTarget::kInherit);
    CHECK(routes.err.target == StreamTarget::kInherit);
  }
  SUBCASE("redirect 1: stdout to its file only") {
    auto routes = RouteStreams(WithStd("1", "0"), layout, 3, 1);
    CHECK(routes.out.target == StreamTarget::kFile);
    CHECK(routes.out.path == "/l/r/attempt_3/1/stdout.log");
    CHECK(routes.err.target == StreamTarget::kInherit);
  }
  SUBCASE("tee 2: stderr to file and console") {
    auto routes = RouteStreams(WithStd("0", "2"), layout, 0, 0);
    CHECK(routes.out.target == StreamTarget::kInherit);
    CHECK(routes.err.target == StreamTarget::kTee);
    CHECK(routes.err.path == "/l/r/attempt_0/0/stderr.log");
  }
  SUBCASE("tee wins over redirect") {
    auto routes = RouteStreams(WithStd("3", "3"), layout, 0, 0);
    CHECK(routes.out.target == StreamTarget::kTee);
    CHECK(routes.err.target == StreamTarget::kTee);
  }
  SUBCASE("ranks outside the console filter go to their files") {
    JobSpec spec = WithStd("0", "3");
    spec.local_ranks_filter = std::set<int>{0};
    CHECK(RouteStreams(spec, layout, 0, 0).out.target == StreamTarget::kTee);
    CHECK(RouteStreams(spec, layout, 0, 1).out.target == StreamTarget::kFile);
    JobSpec plain = WithStd("0", "0");
    plain.local_ranks_filter = std::set<int>{1};
    CHECK(RouteStreams(plain, layout, 0, 0).err.target == StreamTarget::kFile);
    CHECK(RouteStreams(plain, layout, 0, 1).err.target == StreamTarget::kInherit);
  }
  SUBCASE("per-rank settings") {
    JobSpec spec;
    spec.tee.per_rank[1] = StdStreams::kOut;
    CHECK(RouteStreams(spec, layout, 0, 0).out.target == StreamTarget::kInherit);
    CHECK(RouteStreams(spec, layout, 0, 1).out.target == StreamTarget::kTee);
    CHECK(RouteStreams(spec, layout, 0, 1).err.target == StreamTarget::kInherit);
  }
}

TEST_CASE("console prefix is role and local rank") {
  JobSpec spec;
  CHECK(ConsolePrefix(spec, 5, 0) == "[default0]:");
  spec.role = "trainer";
  CHECK(ConsolePrefix(spec, 17, 12) == "[trainer12]:");
}

TEST_CASE("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, substituted as Python's safe_substitute") {
  JobSpec spec;
  spec.role = "trainer";
  spec.log_line_prefix_template = "[${role_name}|${rank}|$local_rank]:";
  CHECK(ConsolePrefix(spec, 17, 1) == "[trainer|17|1]:");
  std::map<std::string, std::string> values = {{"rank", "3"}};
  CHECK(SafeSubstitute("$rank $$rank ${rank}x $other ${other} ${rank $ ${", values) ==
        "3 $rank 3x $other ${other} ${rank $ ${");
  CHECK(SafeSubstitute("$ranks", values) == "$ranks");  // Another identifier.
}

TEST_CASE("tee'd streams with --duplicate-*-filters also go to the attempt's filtered log") {
  LogLayout layout("/logs", "run");
  JobSpec spec;
  spec.tee.all = StdStreams::kOut;
  spec.duplicate_stdout_filters = {"loss", "acc"};
  spec.duplicate_stderr_filters = {"warn"};
  StreamRoutes routes = RouteStreams(spec, layout, 2, 1);
  CHECK(routes.out.filtered_path == "/logs/run/attempt_2/filtered_stdout.log");
  CHECK(routes.out.filters == std::vector<std::string>{"loss", "acc"});
  CHECK(routes.err.filters.empty());  // stderr is not tee'd: nothing to filter, as in torch.
}

}  // namespace
}  // namespace elrun
