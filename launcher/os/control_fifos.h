// elrun's side of the control channel to its workers (--keep-survivors; the worker's side is
// trainer/runtime/control_channel.h): one FIFO per local rank, mode 0600 in a directory of its
// own, that elrun writes one-line messages to and the worker of that local rank reads - its
// replacement too, after a restart (messages name their generation, so a replacement drops what
// its predecessor left unread). elrun holds each FIFO open for reading and writing, so a worker's
// open never blocks and a write never fails for want of a reader; writes are non-blocking and
// at most PIPE_BUF bytes, so they are whole or not at all. Removed when destroyed.
// Thread-compatible.
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
  // The FIFO of `local_rank`, made on first use.
  absl::StatusOr<std::string> PathFor(int local_rank);
  // Writes `line` (a newline is added) to the FIFO of `local_rank`. FailedPrecondition when it
  // was never made; InvalidArgument for a line with a newline or over PIPE_BUF bytes;
  // Unavailable when the FIFO is full (its worker does not read).
  absl::Status Send(int local_rank, const std::string& line);

 private:
  explicit ControlFifos(std::string dir) : dir_(std::move(dir)) {}
  const std::string dir_;
  std::map<int, std::pair<std::string, int>> fifos_;  // Local rank -> (path, fd).
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_CONTROL_FIFOS_H_
