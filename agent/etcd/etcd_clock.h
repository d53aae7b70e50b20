// Time for the etcd-v3 backend, behind an interface so that its lease renewals, ticks and
// timeouts are tested with a clock the test moves (tests/agent/etcd/fake_clock.h): the steady
// clock its timers run on, the wall clock its log entries carry, and its threads' timed waits,
// which a fake clock ends when it moves past their deadline. Thread-safe.
#ifndef ELRUN_AGENT_ETCD_ETCD_CLOCK_H_
#define ELRUN_AGENT_ETCD_ETCD_CLOCK_H_

#include <chrono>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace elrun::rdzv {

class EtcdClock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  virtual ~EtcdClock() = default;
  virtual TimePoint SteadyNow() const = 0;
  // Milliseconds since the Unix epoch: the time of a log entry.
  virtual int64_t WallMs() const = 0;
  // Waits on `cv` (`mu` held) until it is signalled or this clock reaches `deadline`. May
  // return early: callers wait in a loop on their condition and the time.
  virtual void WaitUntil(absl::CondVar* cv, absl::Mutex* mu, TimePoint deadline) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
};

class RealEtcdClock : public EtcdClock {
 public:
  TimePoint SteadyNow() const override { return std::chrono::steady_clock::now(); }
  int64_t WallMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  void WaitUntil(absl::CondVar* cv, absl::Mutex* mu, TimePoint deadline) const override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const TimePoint now = SteadyNow();
    if (now < deadline) cv->WaitWithTimeout(mu, absl::FromChrono(deadline - now));
  }
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_ETCD_ETCD_CLOCK_H_
