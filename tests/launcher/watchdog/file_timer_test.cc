// The FileTimer watchdog's table: torch's FileTimerClient requests in, expired timers out.
#include "launcher/watchdog/file_timer.h"

#include <doctest/doctest.h>

#include <string>

namespace elrun {
namespace {

std::string Request(int pid, const std::string& scope, double expiration, int signal = 9) {
  return "{\"version\": 1, \"pid\": " + std::to_string(pid) + ", \"scope_id\": \"" + scope +
         "\", \"expiration_time\": " + std::to_string(expiration) + ", \"signal\": " + std::to_string(signal) + "}";
}

TEST_CASE("acquire, release and expiry as FileTimerServer does them") {
  FileTimerTable table;
  REQUIRE(table.Apply(Request(100, "step", 50.0)).ok());
  REQUIRE(table.Apply(Request(100, "data", 40.0, 15)).ok());
  REQUIRE(table.Apply(Request(200, "step", 60.0)).ok());
  REQUIRE(table.Apply(Request(300, "step", 45.0)).ok());
  REQUIRE(table.Apply(Request(300, "step", -1.0, 0)).ok());  // Released.
  CHECK(table.size() == 3);
  CHECK(*table.NextExpiry() == 40.0);
  CHECK(table.TakeExpired(39.9).empty());
  std::vector<TimerReap> reaps = table.TakeExpired(55.0);
  REQUIRE(reaps.size() == 1);
  CHECK(reaps[0].pid == 100);
  CHECK(reaps[0].scopes == std::vector<std::string>{"data", "step"});  // Earliest first.
  CHECK(reaps[0].signal == 15);                                        // The earliest expired timer's signal.
  CHECK(table.size() == 1);                                            // Every timer of a reaped pid goes.
  CHECK(*table.NextExpiry() == 60.0);
}

TEST_CASE("timers without a signal expire without a reap") {
  FileTimerTable table;
  REQUIRE(table.Apply(Request(100, "quiet", 10.0, 0)).ok());
  REQUIRE(table.Apply(Request(101, "negative", 10.0, -9)).ok());
  CHECK(table.TakeExpired(11.0).empty());
  CHECK(table.size() == 0);
}

TEST_CASE("a process that ended is forgotten") {
  FileTimerTable table;
  REQUIRE(table.Apply(Request(100, "a", 10.0)).ok());
  REQUIRE(table.Apply(Request(100, "b", 10.0)).ok());
  REQUIRE(table.Apply(Request(101, "a", 10.0)).ok());
  table.Forget(100);
  CHECK(table.size() == 1);
}

TEST_CASE("malformed requests are refused and change nothing") {
  FileTimerTable table;
  for (const std::string& bad : {
           std::string("not json"),
           std::string("[1, 2]"),
           std::string("{\"version\": 2, \"pid\": 5, \"scope_id\": \"s\", \"expiration_time\": 1, \"signal\": 9}"),
           std::string("{\"version\": 1, \"pid\": 0, \"scope_id\": \"s\", \"expiration_time\": 1, \"signal\": 9}"),
           std::string("{\"version\": 1, \"pid\": 1.5, \"scope_id\": \"s\", \"expiration_time\": 1, \"signal\": 9}"),
           std::string("{\"version\": 1, \"pid\": \"5\", \"scope_id\": \"s\", \"expiration_time\": 1, \"signal\": 9}"),
           std::string("{\"version\": 1, \"pid\": 5, \"scope_id\": 7, \"expiration_time\": 1, \"signal\": 9}"),
           std::string("{\"version\": 1, \"pid\": 5, \"scope_id\": \"s\", \"signal\": 9}"),
           std::string("{\"version\": 1, \"pid\": 5, \"scope_id\": \"s\", \"expiration_time\": 1e300, \"signal\": 9}"),
           std::string("{\"version\": 1, \"pid\": 5, \"scope_id\": \"s\", \"expiration_time\": 1, \"signal\": 999}"),
           "{\"version\": 1, \"pid\": 5, \"scope_id\": \"" + std::string(2000, 'x') +
               "\", \"expiration_time\": 1, \"signal\": 9}",
           std::string(5000, '{'),
       }) {
    CHECK_MESSAGE(table.Apply(bad).code() == absl::StatusCode::kInvalidArgument, bad.substr(0, 80));
  }
  CHECK(table.size() == 0);
}

TEST_CASE("the number of timers is bounded") {
  FileTimerTable table;
  for (size_t i = 0; i < FileTimerTable::kMaxTimers; ++i) {
    REQUIRE(table.Apply(Request(100, std::to_string(i), 10.0)).ok());
  }
  CHECK(table.Apply(Request(100, "one more", 10.0)).code() == absl::StatusCode::kResourceExhausted);
  CHECK(table.Apply(Request(100, "0", 20.0)).ok());  // Renewing an existing timer still works.
  CHECK(table.size() == FileTimerTable::kMaxTimers);
}

}  // namespace
}  // namespace elrun
