// The client side of elrun's forkserver (launcher/python/elrun_forkserver.py, which documents
// the protocol): a Python process, elrun's child, that has imported torch and --preload's
// modules once, and forks each worker of --start-method forkserver from there. Its workers are
// re-parented to elrun, which must be a child subreaper (PR_SET_CHILD_SUBREAPER) before
// Spawn, so that they are elrun's children like exec'd ones. Thread-compatible.
#ifndef ELRUN_LAUNCHER_OS_FORK_SERVER_H_
#define ELRUN_LAUNCHER_OS_FORK_SERVER_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launcher/spec/worker_launch.h"

namespace elrun {

struct ForkServerOptions {
  std::string python;                // The interpreter, as the workers' argv[0].
  std::string script;                // elrun_forkserver.py.
  std::vector<std::string> preload;  // Modules imported once: torch first, then --preload's.
  std::vector<std::string> env;      // The server's environment ("K=V"): the first worker's.
  int guardian_fd = -1;              // Where its process group is registered ("+<pgid>\n").
  std::chrono::seconds ready_timeout{300};
};

class ForkServer {
 public:
  // Starts the server in its own process group (so a terminal's ^C reaches only elrun), without
  // waiting for it: it imports its modules while elrun goes on (the rendezvous, say).
  static absl::StatusOr<std::unique_ptr<ForkServer>> Launch(const ForkServerOptions& options);
  // Waits until the server has imported its modules and found forking safe (at once when it
  // already said so). An error (one line) when it did not get ready within the options'
  // ready_timeout or refused (CUDA initialised, threads running).
  absl::Status WaitReady();
  // SIGKILLs the server and reaps it. Its workers live on (they are elrun's).
  ~ForkServer();
  ForkServer(const ForkServer&) = delete;
  ForkServer& operator=(const ForkServer&) = delete;

  // Forks a worker of `launch` (its argv, environment, CPU binding) with these standard streams
  // (-1: elrun's own), in elrun's working directory. Returns its pid, elrun's child by then.
  // Unavailable when the server is gone (start another); FailedPrecondition when it refused.
  absl::StatusOr<int> Spawn(const WorkerLaunch& launch, const std::vector<int>& reset_signals, int out_fd, int err_fd);
  int pid() const { return pid_; }

 private:
  ForkServer() = default;
  // One JSON line from the server, or an error after `timeout`.
  absl::StatusOr<std::string> ReadLine(std::chrono::milliseconds timeout);

  std::chrono::seconds ready_timeout_{300};
  bool ready_ = false;
  int pid_ = -1;
  int socket_ = -1;
  int guardian_fd_ = -1;
  std::string pending_;  // Bytes read past the last line.
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_FORK_SERVER_H_
