// A clock the test moves, for the etcd-v3 backend's unit tests: it stands still until Advance,
// which ends every wait whose deadline it passes. Thread-safe.
#ifndef ELRUN_TESTS_AGENT_ETCD_FAKE_CLOCK_H_
#define ELRUN_TESTS_AGENT_ETCD_FAKE_CLOCK_H_

#include <chrono>
#include <cstdint>
#include <list>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "agent/etcd/etcd_clock.h"

namespace elrun::rdzv {

class FakeClock : public EtcdClock {
 public:
  TimePoint SteadyNow() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  int64_t WallMs() const override {
    absl::MutexLock lock(&mu_);
    return kWallStartMs + std::chrono::duration_cast<std::chrono::milliseconds>(now_ - kStart).count();
  }
  // Waits for a signal on `cv` only: the clock moves under the test's hand, and Advance signals
  // `cv` once it reaches `deadline`. (Advance takes `mu` to signal, so no wake-up is lost
  // between the check here and the wait.)
  void WaitUntil(absl::CondVar* cv, absl::Mutex* mu, TimePoint deadline) const override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::list<Waiter>::iterator waiter;
    {
      absl::MutexLock lock(&mu_);
      if (now_ >= deadline) return;
      waiter = waiters_.insert(waiters_.end(), Waiter{cv, mu, deadline});
    }
    cv->Wait(mu);
    absl::MutexLock lock(&mu_);
    waiters_.erase(waiter);
  }

  // Waits, up to `limit` of real time, until at least `waits` waits are on this clock (a thread
  // the test started has reached its timed wait); false when they are not.
  bool AwaitWaiting(size_t waits, std::chrono::milliseconds limit) const {
    absl::MutexLock lock(&mu_);
    auto waiting = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiters_.size() >= waits; };
    return mu_.AwaitWithTimeout(absl::Condition(&waiting), absl::FromChrono(limit));
  }

  // Moves the clock on and wakes the waits it passed the deadline of.
  void Advance(std::chrono::milliseconds by) {
    std::list<Waiter> due;
    {
      absl::MutexLock lock(&mu_);
      now_ += by;
      for (const Waiter& waiter : waiters_) {
        if (waiter.deadline <= now_) due.push_back(waiter);
      }
    }
    // Not under mu_: a waiter holds its own mutex while it takes mu_.
    for (const Waiter& waiter : due) {
      absl::MutexLock lock(waiter.mu);
      waiter.cv->SignalAll();
    }
  }

 private:
  struct Waiter {
    absl::CondVar* cv;
    absl::Mutex* mu;
    TimePoint deadline;
  };
  static constexpr TimePoint kStart{std::chrono::hours(1)};
  static constexpr int64_t kWallStartMs = 1'800'000'000'000;  // 2027-01-15, UTC.

  mutable absl::Mutex mu_;
  TimePoint now_ ABSL_GUARDED_BY(mu_) = kStart;
  mutable std::list<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace elrun::rdzv

#endif  // ELRUN_TESTS_AGENT_ETCD_FAKE_CLOCK_H_
