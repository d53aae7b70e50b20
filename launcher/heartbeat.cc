#include "launcher/heartbeat.h"

#include <signal.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace elrun {
namespace {

constexpr size_t kMaxLine = 256;

double MonotonicSeconds() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) / 1e9;
}

}  // namespace

absl::StatusOr<Beat> ParseBeat(const std::string& line) {
  std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (fields.size() < 3 || fields.size() > 4) {
    return absl::InvalidArgumentError("expected '<pid> <step> <step_ms> [<stack signal>]'");
  }
  Beat beat;
  if (!absl::SimpleAtoi(fields[0], &beat.pid) || beat.pid <= 0) return absl::InvalidArgumentError("bad pid");
  if (!absl::SimpleAtoi(fields[1], &beat.step) || beat.step < 0) return absl::InvalidArgumentError("bad step");
  if (!absl::SimpleAtod(fields[2], &beat.step_ms) || !std::isfinite(beat.step_ms) || beat.step_ms < 0) {
    return absl::InvalidArgumentError("bad step_ms");
  }
  if (fields.size() == 4 &&
      (!absl::SimpleAtoi(fields[3], &beat.stack_signal) || beat.stack_signal < 1 || beat.stack_signal >= NSIG ||
       beat.stack_signal == SIGKILL || beat.stack_signal == SIGSTOP)) {
    return absl::InvalidArgumentError("bad stack signal");
  }
  return beat;
}

void HeartbeatTable::Track(const std::vector<int>& groups, double now) {
  for (auto it = workers_.begin(); it != workers_.end();) {
    it = std::find(groups.begin(), groups.end(), it->first) == groups.end() ? workers_.erase(it) : std::next(it);
  }
  for (int group : groups) {
    if (workers_.count(group) == 0) workers_[group].started = now;
  }
}

void HeartbeatTable::Record(int group, const Beat& beat, double now) {
  auto it = workers_.find(group);
  if (it == workers_.end()) return;
  it->second.last_beat = now;
  it->second.last_step = beat.step;
  it->second.last_step_ms = beat.step_ms;
  it->second.stack_signal = beat.stack_signal;
}

std::vector<Hung> HeartbeatTable::TakeHung(double now) {
  std::vector<Hung> hung;
  for (auto& [group, w] : workers_) {
    if (w.reported) continue;
    std::string why;
    if (w.last_beat && limits_.worker_timeout_s && now - *w.last_beat > *limits_.worker_timeout_s) {
      why = absl::StrFormat("no progress for %.1f s (--worker-timeout %g): its last heartbeat, step %d (%.1f ms), "
                            "came %.1f s after it started",
                            now - *w.last_beat, *limits_.worker_timeout_s, w.last_step, w.last_step_ms,
                            *w.last_beat - w.started);
    } else if (!w.last_beat && limits_.start_timeout_s && now - w.started > *limits_.start_timeout_s) {
      why = absl::StrFormat("no progress for %.1f s (--worker-start-timeout %g): no heartbeat since it started",
                            now - w.started, *limits_.start_timeout_s);
    } else {
      continue;
    }
    w.reported = true;
    hung.push_back({group, w.stack_signal, std::move(why)});
  }
  return hung;
}

absl::StatusOr<std::unique_ptr<HeartbeatServer>> HeartbeatServer::Start(const std::string& path, EventLoop* loop,
                                                                        HeartbeatLimits limits, GroupOf group_of,
                                                                        Groups groups, OnHung on_hung) {
  std::unique_ptr<HeartbeatServer> server(
      new HeartbeatServer(loop, limits, std::move(group_of), std::move(groups), std::move(on_hung)));
  HeartbeatServer* self = server.get();
  auto fifo = LineFifo::Open(path, absl::StrCat("ELRUN_HEARTBEAT_FILE ", path), loop, kMaxLine,
                             [self](const std::string& line) { self->OnLine(line); }, nullptr);
  if (!fifo.ok()) return fifo.status();
  server->fifo_ = *std::move(fifo);
  // Ticks often enough that a worker is judged within a tenth of its limit (or 1 s) late.
  const double limit = std::min(limits.worker_timeout_s.value_or(1e9), limits.start_timeout_s.value_or(1e9));
  const double tick = std::clamp(limit / 10, 0.05, 1.0);
  server->timer_fd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (server->timer_fd_ < 0) {
    return absl::FailedPreconditionError(absl::StrCat("heartbeat timer: timerfd_create: ", std::strerror(errno)));
  }
  itimerspec spec{};
  spec.it_interval.tv_sec = static_cast<time_t>(tick);
  spec.it_interval.tv_nsec = static_cast<long>((tick - std::floor(tick)) * 1e9);  // NOLINT(runtime/int)
  spec.it_value = spec.it_interval;
  ::timerfd_settime(server->timer_fd_, 0, &spec, nullptr);
  absl::Status added = loop->Add(server->timer_fd_, [self] { self->OnTick(); });
  if (!added.ok()) return added;
  return server;
}

HeartbeatServer::~HeartbeatServer() {
  if (timer_fd_ >= 0) {
    loop_->Remove(timer_fd_);
    ::close(timer_fd_);
  }
}

void HeartbeatServer::OnLine(const std::string& line) {
  auto beat = ParseBeat(line);
  std::optional<int> group = beat.ok() ? group_of_(beat->pid) : std::nullopt;
  if (!group) {
    if (dropped_++ < 10) {  // Bounded: a flood of junk must not flood the log.
      spdlog::warn("heartbeat: dropped '{}': {}", line.substr(0, 80),
                   beat.ok() ? absl::StrCat("pid ", beat->pid, " is not a worker of this job")
                             : std::string(beat.status().message()));
    }
    return;
  }
  table_.Record(*group, *beat, MonotonicSeconds());
}

void HeartbeatServer::OnTick() {
  uint64_t ticks = 0;
  ssize_t ignored = ::read(timer_fd_, &ticks, sizeof(ticks));
  (void)ignored;
  const double now = MonotonicSeconds();
  const std::vector<int> live = groups_();
  table_.Track(live, now);
  for (Hung& hung : table_.TakeHung(now)) {
    spdlog::error("worker pid {}: {}{}", hung.group, hung.why,
                  hung.stack_signal ? absl::StrCat("; asking for its stacks (signal ", hung.stack_signal,
                                                   "), then killing it")
                                    : std::string("; killing it"));
    if (hung.stack_signal) ::kill(hung.group, hung.stack_signal);
    dying_[hung.group] = {now + (hung.stack_signal ? kStackGrace : 0.0), std::move(hung.why)};
  }
  for (auto it = dying_.begin(); it != dying_.end();) {
    if (std::find(live.begin(), live.end(), it->first) == live.end()) {
      it = dying_.erase(it);  // Already gone (e.g. the stack signal ended it).
    } else if (now >= it->second.first) {
      on_hung_(it->first, it->second.second);
      it = dying_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace elrun
