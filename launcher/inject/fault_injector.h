// Carries out an --inject-faults plan (fault_plan.h) on this node: at each fault's time (a timer
// on the event loop) or step (the workers' beats, through OnStep) it kill -9s or SIGSTOPs a
// worker, or kill -9s this elrun. Loud: the plan is logged when it starts and every fault when
// it is injected, and each is told to the goodput report. A fault due while no worker runs (a
// group between rounds) waits for the next one. Thread-compatible: the loop's thread.
#ifndef ELRUN_LAUNCHER_INJECT_FAULT_INJECTOR_H_
#define ELRUN_LAUNCHER_INJECT_FAULT_INJECTOR_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/inject/fault_plan.h"
#include "launcher/os/event_loop.h"

namespace elrun {

class FaultInjector {
 public:
  struct Hooks {
    // The live workers: (pid, local rank).
    std::function<std::vector<std::pair<int, int>>()> workers;
    // Sends `signo` to worker `pid` alone (kill) or to its process group (stop).
    std::function<void(int pid, int signo, bool group)> signal;
    // Tells supervision why elrun is about to signal `pid` (the failure's cause).
    std::function<void(int pid, const std::string& why)> note;
    // Tells the goodput report (goodput.h) of a fault: kind, detail.
    std::function<void(const std::string& kind, const std::string& detail)> on_fault;
    // Seconds since elrun started, on the clock the plan's times count on.
    std::function<double()> now;
    // The workers' high-water step (-1 before any beat).
    std::function<int64_t()> step;
  };

  static absl::StatusOr<std::unique_ptr<FaultInjector>> Start(EventLoop* loop, FaultSchedule schedule, Hooks hooks);
  ~FaultInjector();
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  // A beat moved the high-water step: step-triggered faults may be due.
  void OnStep();

 private:
  FaultInjector(EventLoop* loop, FaultSchedule schedule, Hooks hooks)
      : loop_(loop), schedule_(std::move(schedule)), hooks_(std::move(hooks)) {}
  void OnTimer();
  void Poll();                                 // Takes what is due and injects what it can.
  void Rearm();                                // The timer to the next time-triggered fault, or soon while one waits.
  bool Inject(const FaultSchedule::Due& due);  // False: no worker to act on yet.

  EventLoop* const loop_;
  FaultSchedule schedule_;
  const Hooks hooks_;
  std::vector<FaultSchedule::Due> waiting_;
  int timer_fd_ = -1;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_INJECT_FAULT_INJECTOR_H_
