#include "launcher/report/failure_report.h"

#include <doctest/doctest.h>

#include <csignal>

namespace elrun {
namespace {

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST_CASE("parse torchrun's error file format") {
  auto error = ParseErrorFile(
      R"({"message": {"message": "ValueError: boom",)"
      R"( "extraInfo": {"py_callstack": "Traceback\n  line 3\nValueError: boom", "timestamp": "1700000123"}}})");
  REQUIRE(error.ok());
  CHECK(error->message == "ValueError: boom");
  CHECK(error->traceback == "Traceback\n  line 3\nValueError: boom");
  CHECK(error->timestamp == 1700000123);
}

TEST_CASE("parse an error file whose message is a plain string") {
  auto error = ParseErrorFile(R"({"message": "segfault in kernel"})");
  REQUIRE(error.ok());
  CHECK(error->message == "segfault in kernel");
  CHECK(error->traceback.empty());
  CHECK_FALSE(error->timestamp.has_value());
}

TEST_CASE("bad error files are InvalidArgument, missing ones NotFound") {
  CHECK(ParseErrorFile("not json").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(ParseErrorFile(R"({"other": 1})").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(ParseErrorFile(R"({"message": 5})").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(ReadErrorFile("/nonexistent/error.json").status().code() == absl::StatusCode::kNotFound);
}

JobSummary Job() { return JobSummary{"train.py", "node7", "job1", 0, 2, 1}; }

WorkerFailure Failure(int local_rank, ExitStatus status, bool stopped) {
  WorkerFailure f;
  f.local_rank = local_rank;
  f.rank = 4 + local_rank;
  f.pid = 1000 + local_rank;
  f.status = status;
  f.stopped_by_elrun = stopped;
  f.time = std::chrono::system_clock::time_point(std::chrono::seconds(1700000000));
  return f;
}

TEST_CASE("report names the root cause with rank, exit code, pid, host and time") {
  std::string report = FormatFailureReport(
      Job(), {Failure(1, ExitStatus::Exited(3), false), Failure(0, ExitStatus::Signaled(SIGTERM), true)});
  CHECK(Contains(report, "train.py FAILED (run_id job1, 2 attempts, max_restarts 1)"));
  auto root = report.find("Root Cause");
  auto others = report.find("Other Failures");
  REQUIRE(root != std::string::npos);
  REQUIRE(others != std::string::npos);
  std::string root_block = report.substr(root, others - root);
  CHECK(Contains(root_block, "rank      : 5 (local_rank: 1, group_rank: 0)"));
  CHECK(Contains(root_block, "exitcode  : 3"));
  CHECK(Contains(root_block, "pid       : 1001"));
  CHECK(Contains(root_block, "host      : node7"));
  CHECK(Contains(root_block, "time      : 2023-11-14T22:13:20Z"));
  CHECK(Contains(root_block, "error_file: none written"));
  CHECK(Contains(report.substr(others), "exitcode  : -15 (SIGTERM), sent by elrun to stop the group"));
}

TEST_CASE("the root cause is the first failure not caused by elrun") {
  std::string report = FormatFailureReport(
      Job(), {Failure(0, ExitStatus::Signaled(SIGTERM), true), Failure(1, ExitStatus::Exited(9), false)});
  auto root = report.find("Root Cause");
  auto others = report.find("Other Failures");
  CHECK(Contains(report.substr(root, others - root), "exitcode  : 9"));
}

TEST_CASE("a SIGKILL elrun did not send is explained") {
  std::string report = FormatFailureReport(Job(), {Failure(0, ExitStatus::Signaled(SIGKILL), false)});
  CHECK(Contains(report, "exitcode  : -9 (SIGKILL), not sent by elrun: the kernel's OOM killer"));
  CHECK_FALSE(Contains(report, "Other Failures"));
}

TEST_CASE("the worker's own error message and the end of its traceback are shown") {
  WorkerFailure f = Failure(0, ExitStatus::Exited(1), false);
  std::string traceback;
  for (int i = 0; i < 30; ++i) traceback += "frame " + std::to_string(i) + "\n";
  f.error = WorkerError{"ValueError: boom", traceback, 1700000000};
  f.error_file = "/l/r/attempt_0/0/error.json";
  f.stderr_log = "/l/r/attempt_0/0/stderr.log";
  std::string report = FormatFailureReport(Job(), {f});
  CHECK(Contains(report, "error     : ValueError: boom"));
  CHECK(Contains(report, "traceback : (last lines)"));
  CHECK(Contains(report, "frame 29"));
  CHECK_FALSE(Contains(report, "frame 17\n"));
  CHECK(Contains(report, "frame 18"));
  CHECK(Contains(report, "error_file: /l/r/attempt_0/0/error.json"));
  CHECK(Contains(report, "stderr    : /l/r/attempt_0/0/stderr.log"));
}

TEST_CASE("a worker that could not start") {
  WorkerFailure f = Failure(2, ExitStatus::Exited(127), false);
  f.pid = 0;
  f.start_error = "cannot execute /x: Permission denied";
  std::string report = FormatFailureReport(Job(), {f});
  CHECK(Contains(report, "could not start: cannot execute /x: Permission denied"));
  CHECK_FALSE(Contains(report, "pid       :"));
}

}  // namespace
}  // namespace elrun

namespace elrun {
namespace {

TEST_CASE("the launcher's error file: the worker's, with its exit code, as torch's dump_error_file") {
  std::string worker = R"({"message": {"message": "ValueError: boom", "extraInfo": )"
                       R"({"py_callstack": "Traceback ...", "timestamp": "1700000000"}}})";
  auto json = RootCauseErrorJson(worker, -11);
  REQUIRE(json.ok());
  auto parsed = ParseErrorFile(*json);
  REQUIRE(parsed.ok());
  CHECK(parsed->message == "ValueError: boom");
  CHECK(parsed->traceback == "Traceback ...");
  CHECK(json->find("\"errorCode\":-11") != std::string::npos);
  // The string form is kept as it is; so is a zero code.
  CHECK(*RootCauseErrorJson(R"({"message": "plain"})", 3) == R"({"message":"plain"})");
  CHECK(RootCauseErrorJson(worker, 0)->find("errorCode") == std::string::npos);
  CHECK(RootCauseErrorJson("not json", 1).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("the launcher's error file without a worker's: a record in torch's format") {
  auto time = std::chrono::system_clock::time_point(std::chrono::seconds(1700000000));
  std::string json = ErrorRecordJson("ChildFailedError: local_rank 0 (rank 0) exited with code 3",
                                     "report \"quoted\"\nline 2", time, 3);
  auto parsed = ParseErrorFile(json);
  REQUIRE(parsed.ok());
  CHECK(parsed->message == "ChildFailedError: local_rank 0 (rank 0) exited with code 3");
  CHECK(parsed->traceback == "report \"quoted\"\nline 2");
  CHECK(parsed->timestamp == 1700000000);
  CHECK(json.find("\"errorCode\":3") != std::string::npos);

  WorkerFailure killed;
  killed.status.signal = SIGKILL;
  CHECK(ParseErrorFile(ParentErrorJson({killed}, "r", time))->message ==
        "ChildFailedError: local_rank 0 (rank 0) was killed by SIGKILL");
  CHECK(TorchExitCode(killed) == -9);
}

}  // namespace
}  // namespace elrun
