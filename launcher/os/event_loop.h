// A minimal epoll loop: file descriptors with a callback each, and a wait bounded by an optional
// deadline. Nothing polls: the loop sleeps in epoll_wait until an fd is readable or the deadline
// passes. Thread-compatible: one thread owns the loop and runs every callback.
#ifndef ELRUN_LAUNCHER_OS_EVENT_LOOP_H_
#define ELRUN_LAUNCHER_OS_EVENT_LOOP_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"

namespace elrun {

class EventLoop {
 public:
  using Callback = std::function<void()>;

  static absl::StatusOr<std::unique_ptr<EventLoop>> Create();
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Calls `on_readable` whenever `fd` is readable (or hung up) until Remove(fd). The caller
  // keeps owning fd and must Remove it before closing it.
  absl::Status Add(int fd, Callback on_readable);
  void Remove(int fd);

  // Waits until at least one fd is ready or `deadline` passes, then runs the ready callbacks.
  // Callbacks may Add and Remove fds. Returns an error only when epoll itself fails.
  absl::Status RunOnce(std::optional<std::chrono::steady_clock::time_point> deadline);

 private:
  explicit EventLoop(int epoll_fd) : epoll_fd_(epoll_fd) {}

  const int epoll_fd_;
  std::map<int, std::shared_ptr<Callback>> callbacks_;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_EVENT_LOOP_H_
