#include "trainer/runtime/heartbeat_client.h"

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "absl/strings/str_format.h"

namespace elrun::trainer {
namespace {

// Async-signal-safe apart from backtrace()'s first call, which may load libgcc: made at
// install time instead.
void PrintStack(int) {
  static const char kHeader[] = "elrun-train: stack of the thread that got SIGUSR1 (elrun: no progress):\n";
  ssize_t ignored = ::write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1);
  (void)ignored;
  void* frames[64];
  int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
}

}  // namespace

std::unique_ptr<HeartbeatClient> HeartbeatClient::FromEnvironment(const std::map<std::string, std::string>& env) {
  auto path = env.find("ELRUN_HEARTBEAT_FILE");
  if (path == env.end() || path->second.empty()) return nullptr;
  int fd = ::open(path->second.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return nullptr;
  void* warm[1];
  ::backtrace(warm, 1);
  struct sigaction action {};
  action.sa_handler = PrintStack;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &action, nullptr);
  return std::unique_ptr<HeartbeatClient>(new HeartbeatClient(fd));
}

HeartbeatClient::~HeartbeatClient() { ::close(fd_); }

void HeartbeatClient::Beat(int64_t step, double step_ms) {
  const std::string line = absl::StrFormat("%d %d %.3f %d\n", ::getpid(), step, step_ms, SIGUSR1);
  ssize_t ignored = ::write(fd_, line.data(), line.size());
  (void)ignored;
}

void HeartbeatClient::Ready(int64_t generation) {
  const std::string line = absl::StrFormat("%d ready %d\n", ::getpid(), generation);
  ssize_t ignored = ::write(fd_, line.data(), line.size());
  (void)ignored;
}

}  // namespace elrun::trainer
