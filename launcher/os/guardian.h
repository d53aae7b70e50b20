// Kills the workers' process groups when the launcher dies, however it dies (kill -9 included).
// PR_SET_PDEATHSIG reaches only a worker itself, not the processes it started; the guardian is
// a small forked process that holds the read end of a pipe whose write end only the launcher
// has. When the launcher dies the kernel closes the pipe, the guardian reads EOF and SIGKILLs
// every process group still registered, removes the files registered for removal (the
// watchdogs' FIFOs), then exits. Thread-compatible.
#ifndef ELRUN_LAUNCHER_OS_GUARDIAN_H_
#define ELRUN_LAUNCHER_OS_GUARDIAN_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace elrun {

// Where worker process groups are registered, to be killed if the launcher dies.
class GroupRegistry {
 public:
  virtual ~GroupRegistry() = default;
  // Removes a process group from those to kill. Call while the group's leader is still
  // unreaped (a zombie at most), so that its id cannot have been reused by anyone else yet:
  // a kill -9 of the launcher right after a reap must not signal a stranger's group.
  virtual void Unregister(int pgid) = 0;
  // The write end of the registry's pipe (close-on-exec): "+<pgid>\n" registers. Each record
  // must be written with one write(2).
  virtual int fd() const = 0;
};

class Guardian : public GroupRegistry {
 public:
  // Forks the guardian. Call before creating other file descriptors, so the guardian holds none.
  static absl::StatusOr<std::unique_ptr<Guardian>> Start();
  // Closes the pipe; the guardian kills what is still registered (normally nothing) and exits.
  ~Guardian() override;
  Guardian(const Guardian&) = delete;
  Guardian& operator=(const Guardian&) = delete;

  // Workers register themselves, before exec, by writing "+<pgid>\n" to fd() (see
  // posix_process_table.cc), so that no grandchild can exist unguarded; "-<pgid>\n"
  // unregisters. The guardian reads every record before the EOF of the launcher's death.
  void Unregister(int pgid) override;
  int fd() const override { return write_fd_; }
  // `path` (a FIFO, file or directory elrun made) is removed when the launcher dies, a directory
  // after what it holds; a clean exit removes it first. False for a path the record cannot carry (empty, a newline,
  // over 4000 bytes).
  bool RemoveOnDeath(const std::string& path);

  int pid() const { return pid_; }

 private:
  Guardian(int pid, int write_fd) : pid_(pid), write_fd_(write_fd) {}
  void Send(char op, int pgid);

  const int pid_;
  const int write_fd_;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_GUARDIAN_H_
