#include "launcher/os/posix_process_table.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/mempolicy.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "launcher/os/numa_binding.h"

namespace elrun {
namespace {

// A file descriptor closed when it goes out of scope unless released.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    reset(other.release());
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// The worker's side and the launcher's side of one redirected stream.
struct StreamFds {
  Fd child;     // Becomes the worker's fd 1 or 2; empty for kInherit.
  Fd pump_in;   // kTee: the pipe's read end.
  Fd pump_log;  // kTee: the log file.
  Fd filtered;  // kTee with filters: the attempt's filtered log, opened for appending.
};

absl::StatusOr<Fd> OpenLog(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::FailedPreconditionError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  return Fd(fd);
}

absl::StatusOr<StreamFds> OpenStream(const StreamRoute& route) {
  StreamFds fds;
  if (route.target == StreamTarget::kInherit) return fds;
  auto log = OpenLog(route.path);
  if (!log.ok()) return log.status();
  if (route.target == StreamTarget::kFile) {
    fds.child = std::move(*log);
    return fds;
  }
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  fds.pump_in.reset(pipe_fds[0]);
  fds.child.reset(pipe_fds[1]);
  fds.pump_log = std::move(*log);
  if (!route.filters.empty()) {
    int fd = ::open(route.filtered_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
      return absl::FailedPreconditionError(absl::StrCat("open ", route.filtered_path, ": ", std::strerror(errno)));
    }
    fds.filtered.reset(fd);
  }
  return fds;
}

std::vector<char*> CStrings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const std::string& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// What the launcher hands the child; the child runs in the launcher's memory (CLONE_VM) until
// execve, so it writes `exec_errno` straight back.
struct ChildArgs {
  pid_t launcher;
  char* const* argv;
  char* const* envp;
  int out_fd;
  int err_fd;
  int guardian_fd;
  const int* reset_signals;  // Handled by elrun and forwarded: default disposition in workers.
  size_t reset_signal_count;
  // --numa-binding, prepared by the launcher: CPU affinity (null: inherit) and the preferred
  // memory node's mask (null: inherit).
  const cpu_set_t* cpus;
  size_t cpus_size;
  const unsigned long* node_mask;  // NOLINT(runtime/int): the kernel's type.
  unsigned long node_mask_bits;    // NOLINT(runtime/int)
  int exec_errno;
  int bind_errno;
};

// "+<pid>\n" for the guardian, built without allocating (we are in the cloned child).
void RegisterSelf(int guardian_fd) {
  char record[32];
  char digits[16];
  int n = 0;
  for (pid_t pid = ::getpid(); pid > 0; pid /= 10) digits[n++] = static_cast<char>('0' + pid % 10);
  int len = 0;
  record[len++] = '+';
  while (n > 0) record[len++] = digits[--n];
  record[len++] = '\n';
  ssize_t ignored = ::write(guardian_fd, record, static_cast<size_t>(len));
  (void)ignored;
}

// Runs in the cloned child on its own stack: only async-signal-safe calls until execve.
int ExecWorker(void* raw) {
  auto* args = static_cast<ChildArgs*>(raw);
  sigset_t none;
  sigemptyset(&none);
  // The child has its own copy of the dispositions (no CLONE_SIGHAND). Signals elrun forwards
  // must act on the worker even when elrun's parent left them ignored (nohup, background jobs).
  ::signal(SIGPIPE, SIG_DFL);
  for (size_t i = 0; i < args->reset_signal_count; ++i) ::signal(args->reset_signals[i], SIG_DFL);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::setpgid(0, 0);
  // Die with the launcher. If it already died between clone and prctl, the signal will never
  // come: getppid() then names the reaper that adopted us, so give up now.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
  if (::getppid() != args->launcher) ::_exit(127);
  // Registered before exec, so no grandchild can exist unguarded.
  RegisterSelf(args->guardian_fd);
  // Set before exec, so that every thread the worker ever starts inherits them.
  if (args->cpus != nullptr && ::sched_setaffinity(0, args->cpus_size, args->cpus) != 0) {
    args->bind_errno = errno;
    ::_exit(127);
  }
  if (args->node_mask != nullptr &&
      ::syscall(SYS_set_mempolicy, MPOL_PREFERRED, args->node_mask, args->node_mask_bits + 1) != 0) {
    args->bind_errno = errno;
    ::_exit(127);
  }
  if (args->out_fd >= 0) ::dup2(args->out_fd, STDOUT_FILENO);
  if (args->err_fd >= 0) ::dup2(args->err_fd, STDERR_FILENO);
  ::execve(args->argv[0], args->argv, args->envp);
  args->exec_errno = errno;
  ::_exit(127);
}

#if defined(__SANITIZE_ADDRESS__)
void UnpoisonStack(void* stack, size_t size) { __asan_unpoison_memory_region(stack, size); }
#else
void UnpoisonStack(void*, size_t) {}
#endif

// Starts a child like posix_spawn does: clone(CLONE_VM | CLONE_VFORK) suspends the launcher
// until the child has exec'd (or failed to), without copying the launcher's page tables.
// Returns the pid, or -1 with errno set.
pid_t CloneAndExec(ChildArgs* args) {
  constexpr size_t kStackSize = 64 * 1024;
  void* stack = ::mmap(nullptr, kStackSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) return -1;
  pid_t pid = ::clone(ExecWorker, static_cast<char*>(stack) + kStackSize, CLONE_VM | CLONE_VFORK | SIGCHLD, args);
  int saved = errno;
  // The child's frames end in execve or _exit, never by returning, so their ASan poison stays
  // in the shadow (shared through CLONE_VM) and would fault the next child mapped here.
  UnpoisonStack(stack, kStackSize);
  ::munmap(stack, kStackSize);
  errno = saved;
  return pid;
}

ExitStatus StatusFrom(const siginfo_t& info) {
  if (info.si_code == CLD_EXITED) return ExitStatus::Exited(info.si_status);
  return ExitStatus::Signaled(info.si_status);
}

}  // namespace

PosixProcessTable::PosixProcessTable(EventLoop* loop, GroupRegistry* guardian, std::vector<int> forwarded_signals,
                                     ExitCallback on_exit)
    : loop_(loop),
      guardian_(guardian),
      forwarded_signals_(std::move(forwarded_signals)),
      on_exit_(std::move(on_exit)) {}

PosixProcessTable::~PosixProcessTable() {
  for (auto& [pid, worker] : workers_) {
    KillAndReap(pid);
    Forget(worker);
  }
}

siginfo_t PosixProcessTable::Reap(int pid) {
  siginfo_t info{};
  ::waitid(P_PID, pid, &info, WEXITED | WNOWAIT);
  // The leader is a zombie now: its pid and group id stay reserved until the reap below, so
  // nothing else can have them yet.
  guardian_->Unregister(pid);
  RemoveSharedMemoryOf(pid);
  ::waitid(P_PID, pid, &info, WEXITED);
  return info;
}

siginfo_t PosixProcessTable::KillAndReap(int pid) {
  ::kill(-pid, SIGKILL);
  return Reap(pid);
}

absl::StatusOr<int> PosixProcessTable::CloneWorker(const WorkerLaunch& launch, int out_fd, int err_fd) {
  std::vector<char*> argv = CStrings(launch.argv);
  std::vector<char*> envp = CStrings(launch.env);

  ChildArgs args{::getpid(),
                 argv.data(),
                 envp.data(),
                 out_fd,
                 err_fd,
                 guardian_->fd(),
                 forwarded_signals_.data(),
                 forwarded_signals_.size(),
                 nullptr,
                 0,
                 nullptr,
                 0,
                 0,
                 0};
  // The binding's masks, built here: the child may not allocate.
  std::unique_ptr<cpu_set_t, void (*)(cpu_set_t*)> cpus(nullptr, [](cpu_set_t* set) { CPU_FREE(set); });
  std::vector<unsigned long> node_mask;  // NOLINT(runtime/int)
  if (!launch.cpus.empty()) {
    int count = launch.cpus.back() + 1;
    cpus.reset(CPU_ALLOC(count));
    if (!cpus) return absl::ResourceExhaustedError("CPU_ALLOC failed");
    args.cpus_size = CPU_ALLOC_SIZE(count);
    CPU_ZERO_S(args.cpus_size, cpus.get());
    for (int cpu : launch.cpus) CPU_SET_S(cpu, args.cpus_size, cpus.get());
    args.cpus = cpus.get();
  }
  if (launch.memory_node >= 0) {
    constexpr int kBits = 8 * sizeof(unsigned long);  // NOLINT(runtime/int)
    node_mask.assign(launch.memory_node / kBits + 1, 0);
    node_mask[launch.memory_node / kBits] |= 1UL << (launch.memory_node % kBits);
    args.node_mask = node_mask.data();
    args.node_mask_bits = node_mask.size() * kBits;
  }
  pid_t pid = CloneAndExec(&args);
  if (pid < 0) return absl::ResourceExhaustedError(absl::StrCat("clone: ", std::strerror(errno)));
  // The child has exec'd or exited by now. Its own setpgid ran first; this one is a no-op
  // unless that failed.
  ::setpgid(pid, pid);
  if (args.exec_errno != 0 || args.bind_errno != 0) {
    Reap(pid);  // It exited before exec.
    if (args.bind_errno != 0) {
      return absl::FailedPreconditionError(absl::StrCat("--numa-binding: cannot bind local rank ", launch.local_rank,
                                                        " to CPUs ", FormatCpuList(launch.cpus), " and NUMA node ",
                                                        launch.memory_node, ": ", std::strerror(args.bind_errno)));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot execute ", launch.argv[0], ": ", std::strerror(args.exec_errno)));
  }
  return pid;
}

absl::Status PosixProcessTable::EnableForkServer(ForkServerOptions options) {
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--start-method forkserver: PR_SET_CHILD_SUBREAPER: ", std::strerror(errno)));
  }
  fork_server_options_ = std::move(options);
  return absl::OkStatus();
}

absl::Status PosixProcessTable::PrestartForkServer(const WorkerLaunch& like) {
  if (!fork_server_options_ || fork_server_) return absl::OkStatus();
  ForkServerOptions options = *fork_server_options_;
  options.python = like.argv[0];
  options.env = like.env;
  options.guardian_fd = guardian_->fd();
  auto launched = ForkServer::Launch(options);
  if (!launched.ok()) return launched.status();
  fork_server_ = *std::move(launched);
  return absl::OkStatus();
}

absl::StatusOr<int> PosixProcessTable::ForkFromServer(const WorkerLaunch& launch, int out_fd, int err_fd) {
  for (int tries = 0;; ++tries) {
    if (absl::Status started = PrestartForkServer(launch); !started.ok()) return started;
    if (absl::Status ready = fork_server_->WaitReady(); !ready.ok()) {
      fork_server_.reset();
      return ready;
    }
    auto pid = fork_server_->Spawn(launch, forwarded_signals_, out_fd, err_fd);
    if (pid.ok() || pid.status().code() != absl::StatusCode::kUnavailable || tries > 0) return pid;
    spdlog::warn("{}; starting the forkserver again", std::string(pid.status().message()));
    fork_server_.reset();
    ReapStrays();
  }
}

void PosixProcessTable::ReapStrays() {
  // Orphans re-parented to elrun (a subreaper with --start-method forkserver): a worker's
  // children, a forkserver's middle process. Workers are reaped by OnExit.
  DIR* tasks = ::opendir("/proc/self/task");
  if (tasks == nullptr) return;
  std::vector<int> children;
  while (const dirent* task = ::readdir(tasks)) {
    if (task->d_name[0] == '.') continue;
    std::ifstream list(absl::StrCat("/proc/self/task/", task->d_name, "/children"));
    for (int pid = 0; list >> pid;) children.push_back(pid);
  }
  ::closedir(tasks);
  for (int pid : children) {
    if (workers_.count(pid) > 0 || (fork_server_ && pid == fork_server_->pid())) continue;
    siginfo_t info{};
    ::waitid(P_PID, pid, &info, WEXITED | WNOHANG);
  }
}

absl::StatusOr<int> PosixProcessTable::Spawn(const WorkerLaunch& launch) {
  auto out = OpenStream(launch.out);
  if (!out.ok()) return out.status();
  auto err = OpenStream(launch.err);
  if (!err.ok()) return err.status();
  pid_t pid = -1;
  if (launch.fork_from_server && fork_server_options_) {
    ReapStrays();
    auto forked = ForkFromServer(launch, out->child.get(), err->child.get());
    if (!forked.ok()) return forked.status();
    pid = *forked;
    ::setpgid(pid, pid);  // The worker does it first thing too; whichever runs first wins.
  } else {
    auto started = CloneWorker(launch, out->child.get(), err->child.get());
    if (!started.ok()) return started.status();
    pid = *started;
  }
  out->child.reset();  // The worker holds its own copies now.
  err->child.reset();

  Worker worker;
  worker.pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (worker.pidfd < 0) {
    int error = errno;
    KillAndReap(pid);
    return absl::InternalError(absl::StrCat("pidfd_open: ", std::strerror(error), " (elrun needs Linux >= 5.3)"));
  }
  ::fcntl(worker.pidfd, F_SETFD, FD_CLOEXEC);
  for (StreamFds* stream : {&*out, &*err}) {
    if (stream->pump_in.get() < 0) continue;
    int console = stream == &*out ? STDOUT_FILENO : STDERR_FILENO;
    const StreamRoute& route = stream == &*out ? launch.out : launch.err;
    worker.pumps.push_back(std::make_unique<OutputPump>(stream->pump_in.release(), stream->pump_log.release(), console,
                                                        launch.console_prefix, stream->filtered.release(),
                                                        route.filters));
  }
  for (auto& pump : worker.pumps) {
    OutputPump* raw = pump.get();
    absl::Status added = loop_->Add(raw->fd(), [this, raw] {
      if (!raw->Pump()) loop_->Remove(raw->fd());
    });
    if (!added.ok()) return added;
  }
  int pidfd = worker.pidfd;
  worker.local_rank = launch.local_rank;
  worker.rank = launch.rank;
  workers_.emplace(pid, std::move(worker));
  absl::Status added = loop_->Add(pidfd, [this, pid] { OnExit(pid); });
  if (!added.ok()) return added;
  return pid;
}

void PosixProcessTable::SignalGroup(int pid, int signo) {
  if (workers_.count(pid) > 0) ::kill(-pid, signo);
}

void PosixProcessTable::OnExit(int pid) {
  auto it = workers_.find(pid);
  if (it == workers_.end()) return;
  siginfo_t info{};
  if (::waitid(P_PID, pid, &info, WEXITED | WNOWAIT | WNOHANG) != 0 || info.si_pid != pid) {
    return;  // Spurious wake-up; the pidfd stays readable until the exit.
  }
  // The leader is a zombie: its group id is still reserved, so this reaches only its group.
  ::kill(-pid, SIGKILL);
  for (auto& pump : it->second.pumps) pump->Drain();
  info = Reap(pid);
  Forget(it->second);
  workers_.erase(it);
  if (fork_server_options_) ReapStrays();
  on_exit_(pid, StatusFrom(info));
}

void RemoveSharedMemoryOf(int pid) {
  // Names are elrun-<what>-<pid>-<suffix> (elrun-train's shared-memory all-reduce); a worker
  // killed between creating one and unlinking it would leave it in /dev/shm for good.
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const std::string middle = absl::StrCat("-", pid, "-");
  while (const dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (name.rfind("elrun-", 0) != 0) continue;
    size_t what_end = name.find('-', 6);
    if (what_end == std::string::npos || name.compare(what_end, middle.size(), middle) != 0) continue;
    ::unlinkat(::dirfd(dir), name.c_str(), 0);
  }
  ::closedir(dir);
}

void PosixProcessTable::Forget(Worker& worker) {
  for (auto& pump : worker.pumps) loop_->Remove(pump->fd());
  worker.pumps.clear();
  loop_->Remove(worker.pidfd);
  ::close(worker.pidfd);
}

}  // namespace elrun
