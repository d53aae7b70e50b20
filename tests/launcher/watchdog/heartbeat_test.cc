#include "launcher/watchdog/heartbeat.h"

#include <doctest/doctest.h>

#include <signal.h>

#include <string>
#include <vector>

namespace elrun {
namespace {

Beat B(int pid, int64_t step, int stack_signal = 0) {
  Beat beat;
  beat.pid = pid;
  beat.step = step;
  beat.step_ms = 12.5;
  beat.stack_signal = stack_signal;
  return beat;
}

TEST_CASE("ParseBeat reads a worker's ready line, which is not a beat") {
  auto ready = ParseBeat("77 ready 3");
  REQUIRE(ready.ok());
  CHECK(ready->pid == 77);
  REQUIRE(ready->ready_generation.has_value());
  CHECK(*ready->ready_generation == 3);
  CHECK(!ParseBeat("77 12 35.250 10")->ready_generation.has_value());
  for (const char* bad : {"77 ready", "77 ready -1", "77 ready x", "0 ready 1", "77 ready 1 2"}) {
    CAPTURE(bad);
    CHECK(!ParseBeat(bad).ok());
  }
}

TEST_CASE("ParseBeat reads '<pid> <step> <step_ms> [<stack signal>]' and refuses the rest") {
  auto beat = ParseBeat("77 12 35.250 10");
  REQUIRE(beat.ok());
  CHECK(beat->pid == 77);
  CHECK(beat->step == 12);
  CHECK(beat->step_ms == doctest::Approx(35.25));
  CHECK(beat->stack_signal == SIGUSR1);
  auto plain = ParseBeat("5 0 0");
  REQUIRE(plain.ok());
  CHECK(plain->stack_signal == 0);
  for (const char* bad : {"", "77", "77 1", "77 1 2 10 11", "0 1 2", "-3 1 2", "77 -1 2", "77 1 -2", "77 1 nan",
                          "77 1 inf", "x 1 2", "77 1 2 9", "77 1 2 19", "77 1 2 0", "77 1 2 999"}) {
    CAPTURE(bad);
    CHECK_FALSE(ParseBeat(bad).ok());
  }
}

TEST_CASE("after its first beat a worker is hung once --worker-timeout passes without another") {
  HeartbeatTable table({/*worker_timeout_s=*/2.0, std::nullopt, std::nullopt});
  table.Track({100, 200}, 0.0);
  table.Record(100, B(100, 0, SIGUSR1), 1.0);
  table.Record(200, B(200, 0), 1.0);
  CHECK(table.TakeHung(2.9).empty());
  table.Record(200, B(200, 1), 2.9);  // 200 keeps beating.
  auto hung = table.TakeHung(3.5);
  REQUIRE(hung.size() == 1);
  CHECK(hung[0].group == 100);
  CHECK(hung[0].stack_signal == SIGUSR1);
  CHECK(
      hung[0].why ==
      "no progress for 2.5 s (--worker-timeout 2): its last heartbeat, step 0 (12.5 ms), came 1.0 s after it started");
  CHECK(table.TakeHung(10.0).size() == 1);  // 200 now; 100 is not reported twice.
  CHECK(table.TakeHung(20.0).empty());
}

TEST_CASE("a rearmed worker gets its whole limit again from then") {
  HeartbeatTable table({/*worker_timeout_s=*/2.0, /*start_timeout_s=*/5.5, std::nullopt});
  table.Track({100, 200}, 0.0);
  table.Record(100, B(100, 0), 1.0);
  auto first = table.TakeHung(3.5);
  REQUIRE(first.size() == 1);
  CHECK_FALSE(first[0].rearmed);
  table.Rearm(100, 3.5);  // It only waited for a stopped peer.
  CHECK(table.TakeHung(5.4).empty());
  auto again = table.TakeHung(5.6);
  REQUIRE(again.size() == 2);  // 100 once more, 200 by its start timeout.
  CHECK(again[0].group == 100);
  CHECK(again[0].since == 1.0);  // Still told from its last beat.
  CHECK(again[0].why.find("no progress for 4.6 s") == 0);
  CHECK(again[0].rearmed);  // Given another timeout already: the watchdog spares it once only.
  CHECK_FALSE(again[1].rearmed);
  table.Rearm(200, 5.6);  // Never beat: its start clock restarts.
  CHECK(table.TakeHung(11.0).empty());
  CHECK(table.TakeHung(11.2).size() == 1);
  table.Rearm(300, 1.0);  // Unknown: nothing.
  table.Rearm(100, 11.2);
  table.Record(100, B(100, 1), 11.5);  // Progress: a later hang is a new one.
  auto later = table.TakeHung(14.0);
  REQUIRE(later.size() == 1);
  CHECK_FALSE(later[0].rearmed);
}

TEST_CASE("a worker that never beats is judged by --worker-start-timeout only") {
  HeartbeatTable patient({/*worker_timeout_s=*/1.0, std::nullopt, std::nullopt});
  patient.Track({100}, 0.0);
  CHECK(patient.TakeHung(1000.0).empty());

  HeartbeatTable strict({std::nullopt, /*start_timeout_s=*/5.0, std::nullopt});
  strict.Track({100}, 0.0);
  strict.Track({100, 200}, 3.0);  // 200 starts later: its own clock.
  auto hung = strict.TakeHung(6.0);
  REQUIRE(hung.size() == 1);
  CHECK(hung[0].group == 100);
  CHECK(hung[0].why == "no progress for 6.0 s (--worker-start-timeout 5): no heartbeat since it started");
  strict.Record(200, B(200, 0), 7.0);  // Beating now: the start timeout no longer applies.
  CHECK(strict.TakeHung(100.0).empty());
}

TEST_CASE("workers that ended are forgotten, and beats for unknown groups change nothing") {
  HeartbeatTable table({/*worker_timeout_s=*/1.0, /*start_timeout_s=*/1.0, std::nullopt});
  table.Track({100}, 0.0);
  table.Record(300, B(300, 0), 0.5);
  table.Track({}, 0.5);  // 100 ended.
  CHECK(table.TakeHung(10.0).empty());
  table.Track({100}, 10.0);  // A new worker with a reused pid starts afresh.
  CHECK(table.TakeHung(10.5).empty());
  CHECK(table.TakeHung(11.5).size() == 1);
}

Beat Timed(int pid, int64_t step, double step_ms) {
  Beat beat = B(pid, step);
  beat.step_ms = step_ms;
  return beat;
}

TEST_CASE("a worker slower than --straggler-factor times the job's median step is reported once per episode") {
  HeartbeatLimits limits;
  limits.straggler_factor = 1.5;
  HeartbeatTable table(limits);
  table.Track({1, 2, 3}, 0.0);
  auto beat_all = [&](int steps, double slow_ms) {
    for (int i = 0; i < steps; ++i) {
      table.Record(1, Timed(1, i, 50), i);
      table.Record(2, Timed(2, i, 52), i);
      table.Record(3, Timed(3, i, slow_ms), i);
    }
  };
  beat_all(kPaceWindow / 2 - 1, 150);
  CHECK(table.Paces().empty());  // Too few beats to judge anyone.
  CHECK(table.TakeStragglers().empty());
  beat_all(1, 150);
  auto paces = table.Paces();
  REQUIRE(paces.size() == 3);
  CHECK(paces[0].group == 3);  // Slowest first.
  CHECK(paces[0].median_ms == doctest::Approx(150));
  auto stragglers = table.TakeStragglers();
  REQUIRE(stragglers.size() == 1);
  CHECK(stragglers[0].pace.group == 3);
  CHECK(stragglers[0].job_median_ms == doctest::Approx(52));
  beat_all(3, 150);
  CHECK(table.TakeStragglers().empty());  // Still slow: not again.
  beat_all(kPaceWindow, 51);              // Caught up over a whole window.
  CHECK(table.TakeStragglers().empty());
  beat_all(kPaceWindow, 200);  // Slow again: a new episode.
  CHECK(table.TakeStragglers().size() == 1);
}

TEST_CASE("no straggler without the factor or without a second worker to compare with") {
  HeartbeatTable off({/*worker_timeout_s=*/5.0, std::nullopt, std::nullopt});
  off.Track({1, 2}, 0.0);
  for (size_t i = 0; i < kPaceWindow; ++i) {
    off.Record(1, Timed(1, i, 10), i);
    off.Record(2, Timed(2, i, 1000), i);
  }
  CHECK(off.Paces().size() == 2);
  CHECK(off.TakeStragglers().empty());

  HeartbeatLimits limits;
  limits.straggler_factor = 1.5;
  HeartbeatTable alone(limits);
  alone.Track({1}, 0.0);
  for (size_t i = 0; i < kPaceWindow; ++i) alone.Record(1, Timed(1, i, 1000), i);
  CHECK(alone.TakeStragglers().empty());
  // With the whole job's median from the rendezvous, one worker is judged against it.
  auto judged = alone.TakeStragglers(400.0);
  REQUIRE(judged.size() == 1);
  CHECK(judged[0].pace.group == 1);
  CHECK(judged[0].job_median_ms == doctest::Approx(400));
  CHECK(alone.TakeStragglers(400.0).empty());  // The same episode: once.
}

}  // namespace
}  // namespace elrun
