// A named pipe that workers write one-line messages to, read on the event loop: the transport
// of the FileTimer watchdog (file_timer.h) and of progress heartbeats (heartbeat.h).
//
// Writes of at most PIPE_BUF bytes are atomic, so lines from many workers never interleave.
// The FIFO is created mode 0600, replacing an old FIFO at the path; any other file there is an
// error, since elrun never deletes what it did not make. A line longer than the limit is
// dropped up to its newline (one warning). elrun keeps a writer of its own open, so the FIFO
// never reads EOF while no worker holds it. Removed when destroyed. Thread-compatible: the
// loop's thread.
#ifndef ELRUN_LAUNCHER_OS_LINE_FIFO_H_
#define ELRUN_LAUNCHER_OS_LINE_FIFO_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "launcher/os/event_loop.h"

namespace elrun {

class LineFifo {
 public:
  using OnLine = std::function<void(const std::string& line)>;

  // `name` opens error and warning messages (e.g. "TORCHELASTIC_TIMER_FILE /tmp/x"). `on_line`
  // gets each complete, non-empty line without its newline; `after_read` runs once after each
  // batch of reads.
  static absl::StatusOr<std::unique_ptr<LineFifo>> Open(const std::string& path, std::string name, EventLoop* loop,
                                                        size_t max_line, OnLine on_line,
                                                        std::function<void()> after_read);
  ~LineFifo();
  LineFifo(const LineFifo&) = delete;
  LineFifo& operator=(const LineFifo&) = delete;

  const std::string& path() const { return path_; }

 private:
  LineFifo(std::string path, std::string name, EventLoop* loop, size_t max_line, OnLine on_line,
           std::function<void()> after_read);
  void OnReadable();

  const std::string path_;
  const std::string name_;
  EventLoop* const loop_;
  const size_t max_line_;
  const OnLine on_line_;
  const std::function<void()> after_read_;
  int read_fd_ = -1;
  int keep_open_fd_ = -1;
  std::string partial_;    // The start of a line not yet ended.
  bool skipping_ = false;  // Inside an over-long line: dropped up to its newline.
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_LINE_FIFO_H_
