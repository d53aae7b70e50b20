#include "launcher/os/fork_server.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "launcher/spec/json_value.h"

namespace elrun {
namespace {

using google::protobuf::Struct;
using json::Number;
using json::NumberList;
using json::Text;
using json::TextList;

constexpr std::chrono::milliseconds kSpawnTimeout{30000};
constexpr size_t kMaxLine = 64 * 1024;

// Sends all of `data` with `fds` attached to its first bytes.
absl::Status SendWithFds(int socket, const std::string& data, const std::vector<int>& fds) {
  size_t sent = 0;
  while (sent < data.size()) {
    iovec iov{const_cast<char*>(data.data() + sent), data.size() - sent};
    msghdr message{};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
    if (sent == 0 && !fds.empty()) {
      message.msg_control = control;
      message.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* header = CMSG_FIRSTHDR(&message);
      header->cmsg_level = SOL_SOCKET;
      header->cmsg_type = SCM_RIGHTS;
      header->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(header), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t n = ::sendmsg(socket, &message, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return absl::UnavailableError(absl::StrCat("the forkserver is gone (send: ", std::strerror(errno), ")"));
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<Struct> ParseAnswer(const std::string& line) {
  Struct answer;
  if (!google::protobuf::util::JsonStringToMessage(line, &answer).ok()) {
    return absl::InternalError(absl::StrCat("the forkserver answered '", line.substr(0, 200), "'"));
  }
  return answer;
}

std::string Field(const Struct& answer, const std::string& name) {
  auto it = answer.fields().find(name);
  return it == answer.fields().end() ? "" : it->second.string_value();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ForkServer>> ForkServer::Launch(const ForkServerOptions& options) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::InternalError(absl::StrCat("socketpair: ", std::strerror(errno)));
  }
  std::unique_ptr<ForkServer> server(new ForkServer());
  server->socket_ = fds[0];
  constexpr int kServerFd = 3;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);  // Its notes go to elrun's stderr.
  posix_spawn_file_actions_adddup2(&actions, fds[1], kServerFd);             // Clears close-on-exec.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
  std::vector<std::string> argv = {options.python, "-u", options.script, std::to_string(kServerFd),
                                   absl::StrJoin(options.preload, ",")};
  std::vector<char*> cargv, cenv;
  for (std::string& arg : argv) cargv.push_back(arg.data());
  cargv.push_back(nullptr);
  std::vector<std::string> env = options.env;
  for (std::string& entry : env) cenv.push_back(entry.data());
  cenv.push_back(nullptr);
  pid_t pid = -1;
  int error = ::posix_spawn(&pid, options.python.c_str(), &actions, &attr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (error != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--start-method forkserver: cannot start ", options.python, ": ", std::strerror(error)));
  }
  server->pid_ = pid;
  server->guardian_fd_ = options.guardian_fd;
  server->ready_timeout_ = options.ready_timeout;
  // Killed with the workers if elrun dies; the server also leaves at its socket's EOF.
  std::string record = absl::StrCat("+", pid, "\n");
  ssize_t ignored = ::write(options.guardian_fd, record.data(), record.size());
  (void)ignored;
  return server;
}

absl::Status ForkServer::WaitReady() {
  if (ready_) return absl::OkStatus();
  auto line = ReadLine(ready_timeout_);
  if (!line.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--start-method forkserver: the server did not get ready: ", line.status().message()));
  }
  auto answer = ParseAnswer(*line);
  if (!answer.ok()) return answer.status();
  if (!Field(*answer, "error").empty()) {
    return absl::FailedPreconditionError(absl::StrCat("--start-method forkserver: ", Field(*answer, "error")));
  }
  ready_ = true;
  return absl::OkStatus();
}

ForkServer::~ForkServer() {
  if (socket_ >= 0) ::close(socket_);
  if (pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    siginfo_t info{};
    ::waitid(P_PID, pid_, &info, WEXITED | WNOWAIT);
    // Unregistered while the zombie still holds the group id, as workers are (guardian.h).
    std::string record = absl::StrCat("-", pid_, "\n");
    ssize_t ignored = ::write(guardian_fd_, record.data(), record.size());
    (void)ignored;
    ::waitpid(pid_, nullptr, 0);
  }
}

absl::StatusOr<std::string> ForkServer::ReadLine(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    size_t newline = pending_.find('\n');
    if (newline != std::string::npos) {
      std::string line = pending_.substr(0, newline);
      pending_.erase(0, newline + 1);
      return line;
    }
    if (pending_.size() > kMaxLine) return absl::InternalError("the forkserver sent an overlong line");
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError(absl::StrCat("no answer within ", timeout.count() / 1000.0, " s"));
    }
    pollfd waiting{socket_, POLLIN, 0};
    int ready = ::poll(&waiting, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buffer[4096];
    ssize_t n = ::read(socket_, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError("the forkserver is gone (it closed its socket)");
    pending_.append(buffer, static_cast<size_t>(n));
  }
}

absl::StatusOr<int> ForkServer::Spawn(const WorkerLaunch& launch, const std::vector<int>& reset_signals, int out_fd,
                                      int err_fd) {
  char cwd[4096];
  if (::getcwd(cwd, sizeof(cwd)) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("getcwd: ", std::strerror(errno)));
  }
  Struct request;
  auto& fields = *request.mutable_fields();
  fields["argv"] = TextList(launch.argv);
  fields["env"] = TextList(launch.env);
  fields["cwd"] = Text(cwd);
  fields["elrun_pid"] = Number(::getpid());
  fields["reset_signals"] = NumberList(reset_signals);
  fields["cpus"] = NumberList(launch.cpus);
  fields["memory_node"] = Number(launch.memory_node);
  std::string body;
  if (!google::protobuf::util::MessageToJsonString(request, &body).ok()) {
    return absl::InternalError("cannot encode the forkserver request");
  }
  const uint32_t size = static_cast<uint32_t>(body.size());
  std::string data = {static_cast<char>(size >> 24), static_cast<char>(size >> 16), static_cast<char>(size >> 8),
                      static_cast<char>(size)};
  data += body;
  std::vector<int> fds = {STDIN_FILENO, out_fd >= 0 ? out_fd : STDOUT_FILENO, err_fd >= 0 ? err_fd : STDERR_FILENO,
                          guardian_fd_};
  if (absl::Status sent = SendWithFds(socket_, data, fds); !sent.ok()) return sent;
  auto line = ReadLine(kSpawnTimeout);
  if (!line.ok()) {
    if (line.status().code() == absl::StatusCode::kUnavailable) return line.status();
    return absl::UnavailableError(absl::StrCat("the forkserver did not answer: ", line.status().message()));
  }
  auto answer = ParseAnswer(*line);
  if (!answer.ok()) return answer.status();
  if (!Field(*answer, "error").empty()) {
    return absl::FailedPreconditionError(absl::StrCat("--start-method forkserver: ", Field(*answer, "error")));
  }
  auto pid = answer->fields().find("pid");
  if (pid == answer->fields().end() || pid->second.number_value() < 2) {
    return absl::InternalError(absl::StrCat("the forkserver answered '", line->substr(0, 200), "'"));
  }
  const int worker = static_cast<int>(pid->second.number_value());
  siginfo_t info{};
  if (::waitid(P_PID, worker, &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
    // Not elrun's child: elrun is not a subreaper, or the pid is not what the server says.
    return absl::InternalError(absl::StrCat("forked worker ", worker, " is not elrun's child: ", std::strerror(errno)));
  }
  return worker;
}

}  // namespace elrun
