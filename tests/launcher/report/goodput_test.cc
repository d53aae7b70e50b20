#include "launcher/report/goodput.h"

#include <doctest/doctest.h>

#include <string>

namespace elrun {
namespace {

// Beats steps [from, to] one per `dt` seconds starting at `t`; returns the time after the last.
double BeatSteps(GoodputTracker& tracker, int64_t from, int64_t to, double t, double dt, int worker = 1) {
  for (int64_t step = from; step <= to; ++step, t += dt) tracker.OnBeat(step, t, worker);
  return t;
}

TEST_CASE("a job without faults: goodput is the wall time after the first step") {
  GoodputTracker tracker(100.0);
  BeatSteps(tracker, 0, 99, 102.0, 0.1);  // First step 2 s after the start.
  GoodputReport report = tracker.Report(112.0);
  CHECK(report.wall_s == doctest::Approx(12.0));
  REQUIRE(report.first_beat_s);
  CHECK(*report.first_beat_s == doctest::Approx(2.0));
  CHECK(report.lost_s == 0);
  CHECK(report.step == 99);
  CHECK(report.beats == 100);
  CHECK(*report.goodput() == doctest::Approx(10.0 / 12.0));
  CHECK(report.Summary() == "goodput 83.3% of 12.0 s (first step after 2.00 s; no faults)");
}

TEST_CASE("a fault costs the time to the first beat past the step it found, and the steps redone") {
  GoodputTracker tracker(0.0);
  double t = BeatSteps(tracker, 0, 17, 1.0, 0.1);  // Steps 0..17, the last at 2.7 s.
  tracker.OnFault("kill-worker (injected)", "kill -9 of local rank 1", 2.75);
  CHECK(tracker.fault_open());
  // The group restarts and resumes from the checkpoint of step 9: steps 10..17 are redone.
  tracker.OnFault("worker failed", "local rank 1 exited with SIGKILL", 2.76);  // Part of it.
  tracker.OnBeat(17, 2.8, 1);                   // A survivor finishing its step is not stepping again.
  t = BeatSteps(tracker, 10, 17, 3.5, 0.1, 2);  // The restarted worker: stepping again at 3.5 s.
  CHECK(tracker.fault_open());
  tracker.OnBeat(18, t, 2);  // 4.3 s: past step 17.
  CHECK_FALSE(tracker.fault_open());
  GoodputReport report = tracker.Report(5.0);
  REQUIRE(report.faults.size() == 1);
  const FaultCost& fault = report.faults[0];
  CHECK(fault.kind == "kill-worker (injected)");
  CHECK(fault.detail == "kill -9 of local rank 1; then worker failed: local rank 1 exited with SIGKILL");
  CHECK(fault.at_s == doctest::Approx(2.75));
  CHECK(fault.step_before == 17);
  CHECK(*fault.recovered_at_s == doctest::Approx(4.3));
  CHECK(*fault.resumed_at_s == doctest::Approx(3.5));
  CHECK(fault.lost_s() == doctest::Approx(1.55));
  CHECK(fault.steps_redone == 8);
  CHECK(report.lost_s == doctest::Approx(1.55));
  CHECK(*report.goodput() == doctest::Approx((5.0 - 1.0 - 1.55) / 5.0));
  CHECK(report.Summary() ==
        "goodput 49.0% of 5.0 s (first step after 1.00 s; 1 fault cost 1.55 s: kill-worker (injected) at 2.8 s: "
        "1.55 s, 8 steps redone)");
}

TEST_CASE("two faults in turn add up; a fault never recovered counts to the end") {
  GoodputTracker tracker(0.0);
  tracker.OnBeat(0, 1.0, 1);
  tracker.OnBeat(1, 2.0, 1);
  tracker.OnFault("hang", "rank 0 no progress", 2.0);
  tracker.OnBeat(2, 4.0, 1);  // Recovered without redoing a step.
  tracker.OnFault("new round", "a node was lost", 5.0);
  GoodputReport report = tracker.Report(10.0);
  REQUIRE(report.faults.size() == 2);
  CHECK(report.faults[0].steps_redone == 0);
  CHECK(report.faults[0].lost_s() == doctest::Approx(2.0));
  CHECK_FALSE(report.faults[1].recovered_at_s);
  CHECK(report.faults[1].lost_s() == doctest::Approx(5.0));
  CHECK(report.lost_s == doctest::Approx(7.0));
  CHECK(*report.goodput() == doctest::Approx(0.2));
  CHECK(report.Summary().find("new round at 5.0 s: not recovered") != std::string::npos);
}

TEST_CASE("a fault before the first beat is startup, not lost time") {
  GoodputTracker tracker(0.0);
  tracker.OnFault("worker failed", "exit 1", 0.5);
  tracker.OnBeat(0, 3.0, 1);  // Past step -1: recovered.
  GoodputReport report = tracker.Report(4.0);
  REQUIRE(report.faults.size() == 1);
  CHECK(report.faults[0].step_before == -1);
  CHECK(report.faults[0].lost_s() == doctest::Approx(2.5));
  CHECK(report.lost_s == 0);
  CHECK(*report.goodput() == doctest::Approx(0.25));
}

TEST_CASE("without beats there is no goodput, and the summary says how to get one") {
  GoodputTracker tracker(0.0);
  tracker.OnFault("worker failed", "exit 1", 1.0);
  GoodputReport report = tracker.Report(3.0);
  CHECK_FALSE(report.goodput());
  CHECK(report.Summary().find("goodput: unknown, no worker heartbeat in 3.0 s") == 0);
}

TEST_CASE("the JSON report holds every fault, and escapes what it quotes") {
  GoodputTracker tracker(0.0);
  tracker.OnBeat(0, 1.0, 1);
  tracker.OnFault("worker failed", "said \"boom\"\n", 1.5);
  tracker.OnBeat(1, 2.0, 1);
  std::string json = tracker.Report(4.0).Json("host-a", "run\"1");
  CHECK(json.find("\"goodput\": 0.625") != std::string::npos);
  CHECK(json.find("\"run_id\": \"run\\\"1\"") != std::string::npos);
  CHECK(json.find("\"detail\": \"said \\\"boom\\\"\\n\"") != std::string::npos);
  CHECK(json.find("\"recovery_s\": 0.5") != std::string::npos);
  CHECK(json.find("\"resume_s\": 0.5") != std::string::npos);
  CHECK(json.find("\"steps_redone\": 0") != std::string::npos);
}

}  // namespace
}  // namespace elrun
