#include "launcher/watchdog/heartbeat.h"

#include <signal.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "launcher/os/clock.h"
#include "launcher/os/host_info.h"

namespace elrun {
namespace {

constexpr size_t kMaxLine = 256;

// True when `pid` is stopped (SIGSTOP, or a tracer holds it): a stopped process cannot act on
// the stack signal, so there is nothing to wait for.
bool IsStopped(int pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && (line[close + 2] == 'T' || line[close + 2] == 't');
}

}  // namespace

absl::StatusOr<Beat> ParseBeat(const std::string& line) {
  std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (fields.size() == 3 && fields[1] == "ready") {
    Beat ready;
    int64_t generation = 0;
    if (!absl::SimpleAtoi(fields[0], &ready.pid) || ready.pid <= 0) return absl::InvalidArgumentError("bad pid");
    if (!absl::SimpleAtoi(fields[2], &generation) || generation < 0)
      return absl::InvalidArgumentError("bad generation");
    ready.ready_generation = generation;
    return ready;
  }
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
  it->second.rearmed.reset();
  it->second.last_step = beat.step;
  it->second.last_step_ms = beat.step_ms;
  it->second.stack_signal = beat.stack_signal;
  if (beat.step_ms > 0) {  // A first beat has no duration yet.
    Worker& w = it->second;
    if (w.recent_ms.size() < kPaceWindow) {
      w.recent_ms.push_back(beat.step_ms);
    } else {
      w.recent_ms[w.next] = beat.step_ms;
    }
    w.next = (w.next + 1) % kPaceWindow;
  }
}

namespace {

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

}  // namespace

std::vector<Pace> HeartbeatTable::Paces() const {
  std::vector<Pace> paces;
  for (const auto& [group, w] : workers_) {
    if (w.recent_ms.size() >= kPaceWindow / 2) paces.push_back({group, Median(w.recent_ms), w.recent_ms.size()});
  }
  std::sort(paces.begin(), paces.end(), [](const Pace& a, const Pace& b) { return a.median_ms > b.median_ms; });
  return paces;
}

std::vector<Straggler> HeartbeatTable::TakeStragglers(std::optional<double> job_median_ms) {
  std::vector<Straggler> stragglers;
  const std::vector<Pace> paces = Paces();
  if (!limits_.straggler_factor || paces.size() < (job_median_ms ? 1u : 2u)) return stragglers;
  std::vector<double> medians;
  for (const Pace& pace : paces) medians.push_back(pace.median_ms);
  const double job = job_median_ms.value_or(Median(medians));
  for (const Pace& pace : paces) {
    Worker& w = workers_[pace.group];
    const bool slow = pace.median_ms > *limits_.straggler_factor * job;
    if (slow && !w.straggling) stragglers.push_back({pace, job});
    w.straggling = slow;
  }
  return stragglers;
}

void HeartbeatTable::Rearm(int group, double now) {
  auto it = workers_.find(group);
  if (it == workers_.end()) return;
  it->second.reported = false;
  it->second.rearmed = now;
}

std::vector<Hung> HeartbeatTable::TakeHung(double now) {
  std::vector<Hung> hung;
  for (auto& [group, w] : workers_) {
    if (w.reported) continue;
    // Its limit runs from its last beat (or start), or from a later Rearm; what it is told runs
    // from the last beat.
    const double clock = std::max(w.last_beat.value_or(w.started), w.rearmed.value_or(w.started));
    std::string why;
    if (w.last_beat && limits_.worker_timeout_s && now - clock > *limits_.worker_timeout_s) {
      why = absl::StrFormat(
          "no progress for %.1f s (--worker-timeout %g): its last heartbeat, step %d (%.1f ms), "
          "came %.1f s after it started",
          now - *w.last_beat, *limits_.worker_timeout_s, w.last_step, w.last_step_ms, *w.last_beat - w.started);
    } else if (!w.last_beat && limits_.start_timeout_s && now - clock > *limits_.start_timeout_s) {
      why = absl::StrFormat("no progress for %.1f s (--worker-start-timeout %g): no heartbeat since it started",
                            now - w.started, *limits_.start_timeout_s);
    } else {
      continue;
    }
    w.reported = true;
    hung.push_back({group, w.stack_signal, std::move(why), w.last_beat.value_or(w.started), w.rearmed.has_value()});
  }
  return hung;
}

absl::StatusOr<std::unique_ptr<HeartbeatServer>> HeartbeatServer::Start(const std::string& path, EventLoop* loop,
                                                                        HeartbeatLimits limits, GroupOf group_of,
                                                                        Groups groups, OnHung on_hung) {
  std::unique_ptr<HeartbeatServer> server(
      new HeartbeatServer(loop, limits, std::move(group_of), std::move(groups), std::move(on_hung)));
  HeartbeatServer* self = server.get();
  auto fifo = LineFifo::Open(
      path, absl::StrCat("ELRUN_HEARTBEAT_FILE ", path), loop, kMaxLine,
      [self](const std::string& line) { self->OnLine(line); }, nullptr);
  if (!fifo.ok()) return fifo.status();
  server->fifo_ = *std::move(fifo);
  server->host_ = HostName();
  // Ticks often enough that a worker is judged within a tenth of its limit (or 1 s) late.
  const double limit = std::min(limits.worker_timeout_s.value_or(10), limits.start_timeout_s.value_or(10));
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

std::string HeartbeatServer::Name(int group) const {
  auto it = known_.find(group);
  if (it == known_.end()) return absl::StrCat("worker pid ", group);
  return absl::StrCat("rank ", it->second.rank, " (local_rank ", it->second.local_rank, ", host ", host_, ", pid ",
                      group, ")");
}

std::vector<std::pair<int, double>> HeartbeatServer::RankPaces() const {
  std::vector<std::pair<int, double>> paces;
  for (const Pace& pace : table_.Paces()) {
    auto it = known_.find(pace.group);
    if (it != known_.end()) paces.emplace_back(it->second.rank, pace.median_ms);
  }
  return paces;
}

void HeartbeatServer::SetJobPace(double median_ms, int ranks, std::vector<RemotePace> slowest) {
  job_median_ms_ = median_ms;
  job_ranks_ = ranks;
  job_slowest_ = std::move(slowest);
}

std::string HeartbeatServer::PaceSummary() const {
  if (!job_slowest_.empty()) {
    std::string line = absl::StrCat("slowest ranks of the job (", job_ranks_, " ranks) by median step time:");
    for (size_t i = 0; i < job_slowest_.size(); ++i) {
      absl::StrAppend(&line, i ? ", " : " ", "rank ", job_slowest_[i].rank, " (host ", job_slowest_[i].host, ")",
                      absl::StrFormat(" %.1f ms", job_slowest_[i].median_ms));
    }
    return line;
  }
  std::vector<std::pair<double, int>> slowest;
  for (const auto& [group, ms] : last_pace_ms_) slowest.emplace_back(ms, group);
  if (slowest.empty()) return "";
  std::sort(slowest.rbegin(), slowest.rend());
  std::string line = "slowest ranks by median step time:";
  for (size_t i = 0; i < slowest.size() && i < 3; ++i) {
    absl::StrAppend(&line, i ? ", " : " ", Name(slowest[i].second), absl::StrFormat(" %.1f ms", slowest[i].first));
  }
  return line;
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
  if (beat->ready_generation) {
    ready_.insert(*group);
    if (on_ready_) on_ready_(beat->pid, *beat->ready_generation);
    return;
  }
  table_.Record(*group, *beat, MonotonicSeconds());
  if (on_beat_) on_beat_(beat->step, *group);
}

void HeartbeatServer::OnTick() {
  uint64_t ticks = 0;
  ssize_t ignored = ::read(timer_fd_, &ticks, sizeof(ticks));
  (void)ignored;
  const double now = MonotonicSeconds();
  std::vector<int> live;
  for (const Worker& worker : groups_()) {
    live.push_back(worker.group);
    known_[worker.group] = worker;
  }
  table_.Track(live, now);
  for (const Pace& pace : table_.Paces()) last_pace_ms_[pace.group] = pace.median_ms;
  for (const Straggler& s : table_.TakeStragglers(job_median_ms_)) {
    saw_stragglers_ = true;
    spdlog::warn(
        "{} is a straggler: median step {:.1f} ms over its last {} beats, {:.2f}x the job's median of "
        "{:.1f} ms{} (--straggler-factor {:g})",
        Name(s.pace.group), s.pace.median_ms, s.pace.beats, s.pace.median_ms / s.job_median_ms, s.job_median_ms,
        job_median_ms_ ? absl::StrCat(" over ", job_ranks_, " ranks") : std::string(), *limits_.straggler_factor);
  }
  for (auto it = ready_.begin(); it != ready_.end();) {  // Only live workers stay.
    it = std::find(live.begin(), live.end(), *it) == live.end() ? ready_.erase(it) : std::next(it);
  }
  std::set<int> stopped;  // Live workers that are stopped (/proc state T): their peers wait for them.
  for (int group : live) {
    if (IsStopped(group)) stopped.insert(group);
  }
  for (Hung& hung : table_.TakeHung(now)) {
    if (!stopped.empty() && stopped.count(hung.group) == 0) {
      // It waits in a collective for the stopped one, which is killed instead (now or when its
      // own timeout is due): it gets another --worker-timeout, so that with --keep-survivors it
      // can regroup in place rather than be killed too.
      spdlog::warn("{}: {}; a peer, {}, is stopped: killing only that one", Name(hung.group), hung.why,
                   Name(*stopped.begin()));
      table_.Rearm(hung.group, now);
      continue;
    }
    if (spare_for_peers_elsewhere_ && !hung.rearmed && stopped.count(hung.group) == 0 && ready_.count(hung.group) > 0) {
      spdlog::warn(
          "{}: {}; it can regroup in place and may wait on a worker of another node: one more --worker-timeout "
          "before it is killed",
          Name(hung.group), hung.why);
      table_.Rearm(hung.group, now);
      continue;
    }
    if (stopped.count(hung.group) > 0) {
      // SIGSTOP (or a debugger): no stacks will come; the grace would only add to the cost.
      hung.stack_signal = 0;
      absl::StrAppend(&hung.why, "; it is stopped (SIGSTOP or a tracer), so no stacks");
      // Its peers wait on it in a collective. Those whose own timeout falls due in a later scan
      // (their last beat came a little after its) would find no peer stopped any more and be
      // killed too: each gets another --worker-timeout from now, to regroup once it is gone.
      for (int group : live) {
        if (group != hung.group && stopped.count(group) == 0) table_.Rearm(group, now);
      }
    }
    spdlog::error("{}: {}{}", Name(hung.group), hung.why,
                  hung.stack_signal
                      ? absl::StrCat("; asking for its stacks (signal ", hung.stack_signal, "), then killing it")
                      : std::string("; killing it"));
    if (on_hang_found_) on_hang_found_(absl::StrCat(Name(hung.group), ": ", hung.why), hung.since);
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
