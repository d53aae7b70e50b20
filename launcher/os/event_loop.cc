#include "launcher/os/event_loop.h"

#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace elrun {

absl::StatusOr<std::unique_ptr<EventLoop>> EventLoop::Create() {
  int fd = ::epoll_create1(EPOLL_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("epoll_create1: ", std::strerror(errno)));
  return std::unique_ptr<EventLoop>(new EventLoop(fd));
}

EventLoop::~EventLoop() { ::close(epoll_fd_); }

absl::Status EventLoop::Add(int fd, Callback on_readable) {
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.fd = fd;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl(ADD, ", fd, "): ", std::strerror(errno)));
  }
  callbacks_[fd] = std::make_shared<Callback>(std::move(on_readable));
  return absl::OkStatus();
}

void EventLoop::Remove(int fd) {
  if (callbacks_.erase(fd) > 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
}

absl::Status EventLoop::RunOnce(std::optional<std::chrono::steady_clock::time_point> deadline) {
  int timeout_ms = -1;
  if (deadline) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now());
    timeout_ms = left.count() < 0 ? 0 : static_cast<int>(std::min<long long>(left.count(), 1 << 30));
  }
  epoll_event events[16];
  int n = ::epoll_wait(epoll_fd_, events, 16, timeout_ms);
  if (n < 0) {
    if (errno == EINTR) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("epoll_wait: ", std::strerror(errno)));
  }
  for (int i = 0; i < n; ++i) {
    auto it = callbacks_.find(events[i].data.fd);
    if (it == callbacks_.end()) continue;             // Removed by an earlier callback of this batch.
    std::shared_ptr<Callback> callback = it->second;  // Survives a Remove inside the call.
    (*callback)();
  }
  return absl::OkStatus();
}

}  // namespace elrun
