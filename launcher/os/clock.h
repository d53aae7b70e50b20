// Time, behind an interface so that the supervisor's and the elastic agent's deadlines are tested
// with a clock the test sets (tests/launcher/job). RealClock reads the system's clocks; both are
// thread-safe.
#ifndef ELRUN_LAUNCHER_OS_CLOCK_H_
#define ELRUN_LAUNCHER_OS_CLOCK_H_

#include <chrono>

namespace elrun {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual std::chrono::steady_clock::time_point SteadyNow() const = 0;
  virtual std::chrono::system_clock::time_point WallNow() const = 0;
};

class RealClock : public Clock {
 public:
  std::chrono::steady_clock::time_point SteadyNow() const override { return std::chrono::steady_clock::now(); }
  std::chrono::system_clock::time_point WallNow() const override { return std::chrono::system_clock::now(); }
};

// Seconds of CLOCK_MONOTONIC, the clock of heartbeats and the goodput report (std::steady_clock
// is CLOCK_MONOTONIC on Linux).
inline double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_CLOCK_H_
