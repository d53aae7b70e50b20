// The real process table with real processes: the order of unregistering and reaping.
#include "launcher/os/posix_process_table.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <memory>
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

// A real table on its own loop, recording exits and unregistrations.
struct Running {
  std::unique_ptr<EventLoop> loop = [] {
    auto created = EventLoop::Create();
    REQUIRE(created.ok());
    return *std::move(created);
  }();
  RecordingRegistry registry;
  std::optional<Exit> exited;
  PosixProcessTable table{loop.get(), &registry, {SIGTERM}, [this](int pid, ExitStatus status) {
                            exited = Exit{pid, status};
                          }};

  // Runs the loop until the worker's exit was reported (20 s at most).
  void WaitExit() {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!exited && std::chrono::steady_clock::now() < deadline) REQUIRE(loop->RunOnce(deadline).ok());
    REQUIRE(exited.has_value());
  }
};

TEST_CASE("a worker's group is unregistered while its leader is still a zombie, then reaped") {
  Running r;
  WorkerLaunch launch;
  launch.argv = {"/bin/sh", "-c", "exit 3"};
  launch.env = {"PATH=/usr/bin:/bin"};
  auto pid = r.table.Spawn(launch);
  REQUIRE(pid.ok());
  r.WaitExit();
  CHECK(r.exited->pid == *pid);
  CHECK(r.registry.Registered() == "+" + std::to_string(*pid) + "\n");
  REQUIRE(r.registry.states.size() == 1);
  CHECK(r.registry.states[0].first == *pid);
  CHECK(r.registry.states[0].second == 'Z');  // Not yet reaped: the id is still ours.
  CHECK(ProcessState(*pid) == '?');           // Reaped afterwards.
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

// Runs `launch` to its end; returns what it wrote to stdout.
std::string RunToEnd(WorkerLaunch launch, const std::string& name) {
  Running r;
  const char* tmp = std::getenv("TEST_TMPDIR");
  launch.out.target = StreamTarget::kFile;
  launch.out.path = std::string(tmp ? tmp : "/tmp") + "/" + name;
  REQUIRE(r.table.Spawn(launch).ok());
  r.WaitExit();
  CHECK(r.exited->status.code == 0);
  CHECK(r.exited->status.signal == 0);
  std::ifstream in(launch.out.path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST_CASE("--numa-binding: a worker starts on its CPUs with its preferred memory node") {
  cpu_set_t mine;
  REQUIRE(::sched_getaffinity(0, sizeof(mine), &mine) == 0);
  int last = -1;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &mine)) last = cpu;
  }
  REQUIRE(last >= 0);
  WorkerLaunch launch;
  launch.argv = {"/bin/sh", "-c", "grep Cpus_allowed_list /proc/self/status; cat /proc/self/numa_maps"};
  launch.env = {"PATH=/usr/bin:/bin"};
  launch.cpus = {last};
  launch.memory_node = 0;
  std::string out = RunToEnd(launch, "bound.out");
  CHECK(out.find("Cpus_allowed_list:\t" + std::to_string(last) + "\n") != std::string::npos);
  CHECK(out.find(" prefer:0 ") != std::string::npos);  // Every mapping's policy.
  CHECK(out.find(" default ") == std::string::npos);

  launch.cpus = {};
  launch.memory_node = -1;
  out = RunToEnd(launch, "unbound.out");
  CHECK(out.find(" prefer:0 ") == std::string::npos);  // Nothing asked, nothing bound.
}

TEST_CASE("--numa-binding: a binding the kernel refuses fails the spawn, naming it") {
  auto loop = EventLoop::Create();
  REQUIRE(loop.ok());
  RecordingRegistry registry;
  PosixProcessTable table(loop->get(), &registry, {SIGTERM}, [](int, ExitStatus) {});
  WorkerLaunch launch;
  launch.local_rank = 3;
  launch.argv = {"/bin/true"};
  launch.cpus = {4000, 4001};  // No such CPUs.
  auto pid = table.Spawn(launch);
  REQUIRE_FALSE(pid.ok());
  CHECK(std::string(pid.status().message()) ==
        "--numa-binding: cannot bind local rank 3 to CPUs 4000-4001 and NUMA node -1: Invalid argument");
}

}  // namespace
}  // namespace elrun
