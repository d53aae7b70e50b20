#include "trainer/runtime/control_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

namespace elrun::trainer {
namespace {

constexpr size_t kMaxLine = 1024;

const std::set<std::string>& ContractNames() {
  static const auto* names =
      new std::set<std::string>{"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
  return *names;
}

// May be given; when not, the generation is the restart count (one node's restarts).
constexpr char kRestartCount[] = "TORCHELASTIC_RESTART_COUNT";

}  // namespace

absl::StatusOr<Regroup> ParseRegroup(const std::string& line) {
  if (line.size() > kMaxLine) return absl::InvalidArgumentError("control line longer than 1024 bytes");
  std::vector<std::string> tokens = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (tokens.empty() || tokens[0] != "regroup") {
    return absl::InvalidArgumentError(absl::StrCat("control line does not start with 'regroup': ", line.substr(0, 64)));
  }
  Regroup regroup;
  if (tokens.size() < 2 || !absl::SimpleAtoi(tokens[1], &regroup.generation) || regroup.generation < 0) {
    return absl::InvalidArgumentError("control line: the generation is not a non-negative integer");
  }
  for (size_t i = 2; i < tokens.size(); ++i) {
    const size_t eq = tokens[i].find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("control line: '", tokens[i], "' is not NAME=value"));
    }
    std::string name = tokens[i].substr(0, eq), value = tokens[i].substr(eq + 1);
    if (ContractNames().count(name) == 0 && name != kRestartCount) {
      return absl::InvalidArgumentError(absl::StrCat("control line: unexpected variable ", name));
    }
    for (unsigned char c : value) {
      if (c < 0x20 || c == 0x7f)
        return absl::InvalidArgumentError(absl::StrCat("control line: ", name, " holds a control byte"));
    }
    regroup.env[name] = value;
  }
  for (const std::string& name : ContractNames()) {
    if (regroup.env.count(name) == 0) return absl::InvalidArgumentError(absl::StrCat("control line: no ", name));
  }
  auto restarts = regroup.env.find(kRestartCount);
  if (restarts == regroup.env.end()) {
    regroup.env[kRestartCount] = std::to_string(regroup.generation);
  } else if (int32_t n = 0; !absl::SimpleAtoi(restarts->second, &n) || n < 0) {
    // Not bounded by the generation: a node that joined late has had fewer attempts than the
    // job has spent restarts.
    return absl::InvalidArgumentError(absl::StrCat("control line: ", kRestartCount, " is not a non-negative integer"));
  }
  return regroup;
}

std::unique_ptr<ControlChannel> ControlChannel::FromEnvironment(const std::map<std::string, std::string>& env,
                                                                int64_t generation) {
  auto path = env.find("ELRUN_CONTROL_FILE");
  if (path == env.end() || path->second.empty()) return nullptr;
  // Non-blocking: elrun holds the FIFO open for writing, so this never waits, and reads never
  // block the reader thread between poll()s.
  const int fd = ::open(path->second.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return nullptr;
  const int wake = ::eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<ControlChannel>(new ControlChannel(fd, wake, generation));
}

ControlChannel::ControlChannel(int fd, int wake_fd, int64_t generation)
    : fd_(fd), wake_fd_(wake_fd), generation_(generation), reader_([this] { Read(); }) {}

ControlChannel::~ControlChannel() {
  const uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd_, &one, sizeof(one));
  (void)ignored;
  reader_.join();
  ::close(fd_);
  ::close(wake_fd_);
}

int64_t ControlChannel::generation() const {
  absl::MutexLock lock(&mutex_);
  return generation_;
}

void ControlChannel::Read() {
  std::string buffer;
  char chunk[512];
  for (;;) {
    struct pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLHUP && !(fds[0].revents & POLLIN)) return;  // elrun closed it: no more lines.
    const ssize_t n = ::read(fd_, chunk, sizeof(chunk));
    if (n <= 0) {
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      return;
    }
    buffer.append(chunk, static_cast<size_t>(n));
    size_t newline;
    while ((newline = buffer.find('\n')) != std::string::npos) {
      OnLine(buffer.substr(0, newline));
      buffer.erase(0, newline + 1);
    }
    if (buffer.size() > kMaxLine) buffer.clear();  // No newline in sight: not elrun's.
  }
}

void ControlChannel::OnLine(const std::string& line) {
  absl::StatusOr<Regroup> regroup = ParseRegroup(line);
  if (!regroup.ok()) return;  // Only elrun writes here; anything else is dropped.
  absl::MutexLock lock(&mutex_);
  if (regroup->generation <= generation_ || (next_ && regroup->generation <= next_->generation)) return;
  next_ = std::move(*regroup);
  pending_.store(true, std::memory_order_release);
  arrived_.Signal();
}

std::optional<Regroup> ControlChannel::Wait(std::chrono::milliseconds timeout) {
  absl::MutexLock lock(&mutex_);
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  while (!next_ && !arrived_.WaitWithDeadline(&mutex_, deadline)) {
  }
  if (!next_) return std::nullopt;
  std::optional<Regroup> taken = std::move(next_);
  next_.reset();
  generation_ = taken->generation;
  pending_.store(false, std::memory_order_release);
  return taken;
}

}  // namespace elrun::trainer
