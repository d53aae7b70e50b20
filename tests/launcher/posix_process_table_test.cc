// The real process table with real processes: the order of unregistering and reaping.
#include "launcher/posix_process_table.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace elrun {
namespace {

// The state letter of /proc/PID/stat ('Z' for a zombie), or '?' when PID no longer exists.
char ProcessState(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
}

// Records, at each Unregister, what the group leader was at that moment. Workers register
// through a real pipe, drained by the test.
class RecordingRegistry : public GroupRegistry {
 public:
  RecordingRegistry() { REQUIRE(::pipe2(fds_, O_CLOEXEC | O_NONBLOCK) == 0); }
  ~RecordingRegistry() override {
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  void Unregister(int pgid) override { states.push_back({pgid, ProcessState(pgid)}); }
  int fd() const override { return fds_[1]; }
  std::string Registered() {
    char buffer[256];
    ssize_t n = ::read(fds_[0], buffer, sizeof(buffer));
    return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
  }
  std::vector<std::pair<int, char>> states;

 private:
  int fds_[2];
};

struct Exit {
  int pid;
  ExitStatus status;
};

TEST_CASE("a worker's group is unregistered while its leader is still a zombie, then reaped") {
  auto loop = EventLoop::Create();
  REQUIRE(loop.ok());
  RecordingRegistry registry;
  std::optional<Exit> exited;
  PosixProcessTable table(loop->get(), &registry, {SIGTERM},
                          [&](int pid, ExitStatus status) { exited = Exit{pid, status}; });
  WorkerLaunch launch;
  launch.argv = {"/bin/sh", "-c", "exit 3"};
  launch.env = {"PATH=/usr/bin:/bin"};
  auto pid = table.Spawn(launch);
  REQUIRE(pid.ok());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!exited && std::chrono::steady_clock::now() < deadline) {
    REQUIRE((*loop)->RunOnce(deadline).ok());
  }
  REQUIRE(exited.has_value());
  CHECK(exited->pid == *pid);
  CHECK(registry.Registered() == "+" + std::to_string(*pid) + "\n");
  REQUIRE(registry.states.size() == 1);
  CHECK(registry.states[0].first == *pid);
  CHECK(registry.states[0].second == 'Z');  // Not yet reaped: the id is still ours.
  CHECK(ProcessState(*pid) == '?');        // Reaped afterwards.
}

TEST_CASE("workers killed by the table's end are unregistered before they are reaped") {
  auto loop = EventLoop::Create();
  REQUIRE(loop.ok());
  RecordingRegistry registry;
  int pid = 0;
  {
    PosixProcessTable table(loop->get(), &registry, {SIGTERM}, [](int, ExitStatus) {});
    WorkerLaunch launch;
    launch.argv = {"/bin/sleep", "1000"};
    launch.env = {"PATH=/usr/bin:/bin"};
    auto spawned = table.Spawn(launch);
    REQUIRE(spawned.ok());
    pid = *spawned;
  }
  REQUIRE(registry.states.size() == 1);
  CHECK(registry.states[0] == std::make_pair(pid, 'Z'));
  CHECK(ProcessState(pid) == '?');
}

}  // namespace
}  // namespace elrun
