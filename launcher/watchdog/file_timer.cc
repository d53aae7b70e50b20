#include "launcher/watchdog/file_timer.h"

#include <signal.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "launcher/os/line_fifo.h"
#include "launcher/spec/value_parsers.h"

namespace elrun {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

constexpr size_t kMaxLine = 4096;  // FileTimerClient refuses requests over PIPE_BUF.
constexpr size_t kMaxScope = 1024;
constexpr double kMaxEpoch = 1e11;  // Year 5138: far enough, and exact as a double.

absl::StatusOr<double> Number(const Struct& object, const char* name) {
  auto it = object.fields().find(name);
  if (it == object.fields().end() || it->second.kind_case() != Value::kNumberValue) {
    return absl::InvalidArgumentError(absl::StrCat("no number \"", name, "\""));
  }
  double value = it->second.number_value();
  if (!std::isfinite(value)) return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" is not finite"));
  return value;
}

// An integer field within [lo, hi].
absl::StatusOr<int> Integer(const Struct& object, const char* name, int lo, int hi) {
  auto value = Number(object, name);
  if (!value.ok()) return value.status();
  if (*value != std::floor(*value) || *value < lo || *value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", name, "\" is ", *value, ", not an integer in [", lo, ", ", hi, "]"));
  }
  return static_cast<int>(*value);
}

}  // namespace

absl::Status FileTimerTable::Apply(const std::string& line) {
  if (line.size() > kMaxLine) return absl::InvalidArgumentError("request over 4096 bytes");
  Struct request;
  if (!google::protobuf::util::JsonStringToMessage(line, &request).ok()) {
    return absl::InvalidArgumentError("not a JSON object");
  }
  auto version = Integer(request, "version", 1, 1);
  if (!version.ok()) return version.status();
  auto pid = Integer(request, "pid", 1, 1 << 30);
  if (!pid.ok()) return pid.status();
  // FileTimerClient sends 0 to mean "do not kill"; a negative signal means the same in torch.
  auto signal = Integer(request, "signal", -1024, SIGRTMAX);
  if (!signal.ok()) return signal.status();
  auto expiration = Number(request, "expiration_time");
  if (!expiration.ok()) return expiration.status();
  if (*expiration > kMaxEpoch) return absl::InvalidArgumentError("\"expiration_time\" is out of range");
  auto scope = request.fields().find("scope_id");
  if (scope == request.fields().end() || scope->second.kind_case() != Value::kStringValue ||
      scope->second.string_value().size() > kMaxScope) {
    return absl::InvalidArgumentError("no string \"scope_id\" of at most 1024 bytes");
  }
  auto key = std::make_pair(*pid, scope->second.string_value());
  if (*expiration < 0) {  // A release.
    timers_.erase(key);
    return absl::OkStatus();
  }
  if (timers_.size() >= kMaxTimers && timers_.count(key) == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("more than ", kMaxTimers, " timers"));
  }
  timers_[key] = Timer{*expiration, std::max(*signal, 0)};
  return absl::OkStatus();
}

std::vector<TimerReap> FileTimerTable::TakeExpired(double now) {
  std::map<int, std::vector<std::pair<double, std::pair<std::string, int>>>> expired;  // pid -> timers.
  for (const auto& [key, timer] : timers_) {
    if (timer.expiration <= now) expired[key.first].push_back({timer.expiration, {key.second, timer.signal}});
  }
  std::vector<TimerReap> reaps;
  for (auto& [pid, timers] : expired) {
    std::sort(timers.begin(), timers.end());
    TimerReap reap{pid, 0, {}};
    for (const auto& [expiration, scope_and_signal] : timers) {
      reap.scopes.push_back(scope_and_signal.first);
      if (reap.signal == 0) reap.signal = scope_and_signal.second;
    }
    Forget(pid);
    if (reap.signal > 0) reaps.push_back(std::move(reap));
  }
  return reaps;
}

void FileTimerTable::Forget(int pid) {
  auto it = timers_.lower_bound({pid, ""});
  while (it != timers_.end() && it->first.first == pid) it = timers_.erase(it);
}

std::optional<double> FileTimerTable::NextExpiry() const {
  std::optional<double> next;
  for (const auto& [key, timer] : timers_) {
    if (!next || timer.expiration < *next) next = timer.expiration;
  }
  return next;
}

absl::StatusOr<std::unique_ptr<FileTimerServer>> FileTimerServer::Start(const std::string& path, EventLoop* loop,
                                                                        GroupOf group_of, OnReap on_reap) {
  std::unique_ptr<FileTimerServer> server(new FileTimerServer(path, loop, std::move(group_of), std::move(on_reap)));
  FileTimerServer* self = server.get();
  auto fifo = LineFifo::Open(
      path, absl::StrCat("TORCHELASTIC_TIMER_FILE ", path), loop, kMaxLine,
      [self](const std::string& line) {
        absl::Status applied = self->table_.Apply(line);
        if (!applied.ok()) spdlog::warn("FileTimer watchdog: dropped a request: {}", std::string(applied.message()));
      },
      [self] { self->Arm(); });
  if (!fifo.ok()) return fifo.status();
  server->fifo_ = *std::move(fifo);
  server->timer_fd_ = ::timerfd_create(CLOCK_REALTIME, TFD_NONBLOCK | TFD_CLOEXEC);
  if (server->timer_fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("TORCHELASTIC_TIMER_FILE ", path, ": timerfd_create: ", std::strerror(errno)));
  }
  absl::Status added = loop->Add(server->timer_fd_, [self] { self->OnTimer(); });
  if (!added.ok()) return added;
  spdlog::info("FileTimer watchdog at {} (TORCHELASTIC_ENABLE_FILE_TIMER=1)", path);
  return server;
}

FileTimerServer::~FileTimerServer() {
  if (timer_fd_ >= 0) {
    loop_->Remove(timer_fd_);
    ::close(timer_fd_);
  }
}

void FileTimerServer::OnTimer() {
  uint64_t expirations = 0;
  ssize_t ignored = ::read(timer_fd_, &expirations, sizeof(expirations));
  (void)ignored;
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  for (const TimerReap& reap : table_.TakeExpired(now.tv_sec + now.tv_nsec / 1e9)) {
    std::optional<int> group = group_of_(reap.pid);
    std::string scopes = absl::StrJoin(reap.scopes, ", ");
    if (!group) {
      spdlog::warn(
          "FileTimer watchdog: timer {} of pid {} expired, but pid {} is not in a worker's process "
          "group of this job: not signalled",
          scopes, reap.pid, reap.pid);
      continue;
    }
    std::string why = absl::StrCat("FileTimer watchdog: timer ", scopes, " of pid ", reap.pid, " expired; sent ",
                                   SignalName(reap.signal));
    spdlog::error("{}", why);
    on_reap_(*group, why);
    ::kill(reap.pid, reap.signal);
  }
  Arm();
}

void FileTimerServer::Arm() {
  itimerspec spec{};
  if (std::optional<double> next = table_.NextExpiry()) {
    double at = std::max(*next, 1e-9);  // it_value zero would disarm: the epoch's first instant.
    spec.it_value.tv_sec = static_cast<time_t>(at);
    spec.it_value.tv_nsec = static_cast<long>((at - std::floor(at)) * 1e9);  // NOLINT(runtime/int)
  }
  ::timerfd_settime(timer_fd_, TFD_TIMER_ABSTIME, &spec, nullptr);
}

}  // namespace elrun
