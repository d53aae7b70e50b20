#include "launcher/os/guardian.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"

namespace elrun {
namespace {

// The guardian's whole life: ignore the signals meant for the launcher, read "+pgid\n",
// "-pgid\n" and "!path\n" records until EOF, then kill what is registered and unlink the paths.
[[noreturn]] void GuardianMain(int read_fd) {
  for (int signo : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2}) {
    ::signal(signo, SIG_IGN);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::prctl(PR_SET_NAME, "elrun-guardian", 0, 0, 0);
  int null_fd = ::open("/dev/null", O_RDWR);
  for (int fd = 0; fd < 3; ++fd) ::dup2(null_fd, fd);

  std::set<int> groups;
  std::set<std::string> paths;
  char buffer[4096];
  std::string pending;
  for (;;) {
    ssize_t n = ::read(read_fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buffer, static_cast<size_t>(n));
    size_t newline;
    while ((newline = pending.find('\n')) != std::string::npos) {
      std::string record = pending.substr(0, newline);
      pending.erase(0, newline + 1);
      if (record.size() < 2) continue;
      if (record[0] == '!') {
        paths.insert(record.substr(1));
        continue;
      }
      int pgid = std::atoi(record.c_str() + 1);
      if (pgid <= 1) continue;
      if (record[0] == '+') groups.insert(pgid);
      if (record[0] == '-') groups.erase(pgid);
    }
  }
  for (int pgid : groups) ::kill(-pgid, SIGKILL);
  // Reverse order: what a directory holds sorts after it, so it goes first.
  for (auto path = paths.rbegin(); path != paths.rend(); ++path) {
    if (::unlink(path->c_str()) != 0) ::rmdir(path->c_str());
  }
  ::_exit(0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Guardian>> Guardian::Start() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    ::close(fds[1]);
    GuardianMain(fds[0]);
  }
  ::close(fds[0]);
  return std::unique_ptr<Guardian>(new Guardian(pid, fds[1]));
}

Guardian::~Guardian() {
  ::close(write_fd_);
  ::waitpid(pid_, nullptr, 0);  // It exits at once on EOF.
}

void Guardian::Send(char op, int pgid) {
  std::string record = absl::StrCat(std::string(1, op), pgid, "\n");
  // Records are far below PIPE_BUF, so each write is atomic; the guardian drains continuously.
  ssize_t ignored = ::write(write_fd_, record.data(), record.size());
  (void)ignored;
}

void Guardian::Unregister(int pgid) { Send('-', pgid); }

bool Guardian::RemoveOnDeath(const std::string& path) {
  if (path.empty() || path.size() > 4000 || path.find('\n') != std::string::npos) return false;
  std::string record = absl::StrCat("!", path, "\n");  // Below PIPE_BUF: one atomic write.
  return ::write(write_fd_, record.data(), record.size()) == static_cast<ssize_t>(record.size());
}

}  // namespace elrun
