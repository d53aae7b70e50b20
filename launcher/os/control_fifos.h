// elrun's side of the control channel to its workers (--keep-survivors; the worker's side is
// trainer/runtime/control_channel.h): one FIFO per slot - a local rank, or a standby spare's
// negative slot - mode 0600 in a directory of its own, that elrun writes one-line messages to
// and the process started with it reads: a local rank's replacement too, after a restart
// (messages name their generation, so a replacement drops what its predecessor left unread). elrun holds each FIFO open
// for reading and writing, so a worker's open never blocks and a write never fails for want of a reader; writes are
// non-blocking and at most PIPE_BUF bytes, so they are whole or not at all. Removed when destroyed. Thread-compatible.
#ifndef ELRUN_LAUNCHER_OS_CONTROL_FIFOS_H_
#define ELRUN_LAUNCHER_OS_CONTROL_FIFOS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace elrun {

class ControlFifos {
 public:
  // Makes a new directory below `parent` for the FIFOs.
  static absl::StatusOr<std::unique_ptr<ControlFifos>> Create(const std::string& parent);
  ~ControlFifos();
  ControlFifos(const ControlFifos&) = delete;
  ControlFifos& operator=(const ControlFifos&) = delete;

  const std::string& dir() const { return dir_; }
  // The FIFO of `slot`, made on first use.
  absl::StatusOr<std::string> PathFor(int slot);
  // Writes `line` (a newline is added) to the FIFO at `path`. FailedPrecondition when it is not
  // one of these FIFOs; InvalidArgument for a line with a newline or over PIPE_BUF bytes;
  // Unavailable when the FIFO is full (its reader does not read).
  absl::Status Send(const std::string& path, const std::string& line);

 private:
  explicit ControlFifos(std::string dir) : dir_(std::move(dir)) {}
  const std::string dir_;
  std::map<int, std::string> paths_;  // Slot -> path.
  std::map<std::string, int> fds_;    // Path -> elrun's read-write descriptor.
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_CONTROL_FIFOS_H_
