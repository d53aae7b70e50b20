// ThreadTimes: parsing the kernel's schedstat line, and the two thread clocks agreeing on burnt CPU.
#include "trainer/runtime/thread_times.h"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <string>

namespace elrun::trainer {
namespace {

// Burns this thread's CPU until `cpu_seconds` of its CPU time have passed (bounded by wall time).
void Spin(double cpu_seconds) {
  const double start = ThreadCpuSeconds();
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  volatile double sink = 0;
  while (ThreadCpuSeconds() - start < cpu_seconds && std::chrono::steady_clock::now() < give_up) {
    for (int i = 0; i < 10000; ++i) sink = sink + std::sqrt(static_cast<double>(i));
  }
}

TEST_CASE("a schedstat line gives seconds on a CPU and on the run queue") {
  auto times = ParseSchedstat("1500000000 250000 42\n");
  REQUIRE(times.ok());
  CHECK(times->cpu_s == doctest::Approx(1.5));
  CHECK(times->runqueue_s == doctest::Approx(0.00025));
}

TEST_CASE("a malformed schedstat line is an error that quotes it") {
  for (const char* text : {"", "12", "x 1 2", "1 -2 3"}) {
    auto times = ParseSchedstat(text);
    REQUIRE_FALSE(times.ok());
    CHECK(std::string(times.status().message()).find(std::string("got \"") + text) != std::string::npos);
  }
}

TEST_CASE("this thread's times grow by the CPU it burns") {
  auto before = CurrentThreadTimes();
  REQUIRE(before.ok());  // Linux with schedstat, as on every machine this project supports.
  const double cpu_before = ThreadCpuSeconds();
  Spin(0.1);
  const double burnt = ThreadCpuSeconds() - cpu_before;
  auto after = CurrentThreadTimes();
  REQUIRE(after.ok());
  CHECK(burnt >= 0.1);
  // The two clocks count the same thing; schedstat may lag by up to a scheduler tick (ms).
  CHECK(after->cpu_s - before->cpu_s == doctest::Approx(burnt).epsilon(0.2));
  CHECK(after->runqueue_s >= before->runqueue_s);
}

}  // namespace
}  // namespace elrun::trainer
