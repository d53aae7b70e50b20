#include "launcher/inject/fault_injector.h"

#include <signal.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace elrun {
namespace {

constexpr double kWaitingRetry = 0.05;  // Seconds between tries while a fault waits for a worker.

}  // namespace

absl::StatusOr<std::unique_ptr<FaultInjector>> FaultInjector::Start(EventLoop* loop, FaultSchedule schedule,
                                                                    Hooks hooks) {
  std::unique_ptr<FaultInjector> injector(new FaultInjector(loop, std::move(schedule), std::move(hooks)));
  injector->timer_fd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (injector->timer_fd_ < 0) {
    return absl::FailedPreconditionError(absl::StrCat("--inject-faults: timerfd_create: ", std::strerror(errno)));
  }
  FaultInjector* self = injector.get();
  absl::Status added = loop->Add(injector->timer_fd_, [self] { self->OnTimer(); });
  if (!added.ok()) return added;
  spdlog::warn("FAULT INJECTION IS ON: elrun will kill or stop its own workers on purpose: {}",
               injector->schedule_.Describe());
  injector->Rearm();
  return injector;
}

FaultInjector::~FaultInjector() {
  if (timer_fd_ >= 0) {
    loop_->Remove(timer_fd_);
    ::close(timer_fd_);
  }
}

void FaultInjector::OnStep() { Poll(); }

void FaultInjector::OnTimer() {
  uint64_t ticks = 0;
  ssize_t ignored = ::read(timer_fd_, &ticks, sizeof(ticks));
  (void)ignored;
  Poll();
}

void FaultInjector::Poll() {
  for (FaultSchedule::Due& due : schedule_.TakeDue(hooks_.now(), hooks_.step())) waiting_.push_back(std::move(due));
  std::vector<FaultSchedule::Due> still;
  for (FaultSchedule::Due& due : waiting_) {
    if (!Inject(due)) still.push_back(std::move(due));
  }
  waiting_ = std::move(still);
  Rearm();
}

void FaultInjector::Rearm() {
  std::optional<double> next = schedule_.NextTime();
  double delay = 0;
  if (next) delay = std::max(*next - hooks_.now(), 0.001);
  if (!waiting_.empty()) delay = next ? std::min(delay, kWaitingRetry) : kWaitingRetry;
  itimerspec spec{};  // Zero: disarmed.
  if (next || !waiting_.empty()) {
    spec.it_value.tv_sec = static_cast<time_t>(delay);
    spec.it_value.tv_nsec = static_cast<long>((delay - std::floor(delay)) * 1e9);  // NOLINT(runtime/int)
    if (spec.it_value.tv_sec == 0 && spec.it_value.tv_nsec == 0) spec.it_value.tv_nsec = 1;
  }
  ::timerfd_settime(timer_fd_, 0, &spec, nullptr);
}

bool FaultInjector::Inject(const FaultSchedule::Due& due) {
  const double at = hooks_.now();
  const std::string kind = absl::StrCat(FaultKindName(due.kind), " (injected)");
  if (due.kind == FaultKind::kKillAgent) {
    spdlog::error("fault injection ({}): kill -9 of this elrun at {:.1f} s; its workers die with it", due.text, at);
    spdlog::default_logger()->flush();
    ::kill(::getpid(), SIGKILL);
    return true;
  }
  std::vector<std::pair<int, int>> workers = hooks_.workers();
  if (workers.empty()) return false;
  std::sort(workers.begin(), workers.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  const std::pair<int, int>* target = nullptr;
  if (due.local_rank) {
    for (const auto& worker : workers) {
      if (worker.second == *due.local_rank) target = &worker;
    }
    if (target == nullptr) return false;  // That rank is not running (yet): wait for it.
  } else {
    target = &workers[schedule_.DrawRank(static_cast<int>(workers.size()))];
  }
  const auto [pid, local_rank] = *target;
  const bool stop = due.kind == FaultKind::kStopWorker;
  const std::string what = absl::StrFormat("%s of local rank %d (pid %d) at %.1f s (--inject-faults %s)",
                                           stop ? "SIGSTOP" : "kill -9", local_rank, pid, at, due.text);
  spdlog::warn("fault injection: {}", what);
  hooks_.on_fault(kind, what);
  hooks_.note(pid, absl::StrCat("injected: ", what));
  hooks_.signal(pid, stop ? SIGSTOP : SIGKILL, stop);
  return true;
}

}  // namespace elrun
