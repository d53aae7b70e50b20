// Copies one worker stream (the read end of a pipe) to its log file and to the launcher's
// console, prefixing each console line ("[default0]:") and writing whole lines only, so that
// the lines of different workers never interleave mid-line, however the worker split its writes
// (Python's print writes a line's text and its newline separately). A console line ends at
// "\n", "\r\n", or a "\r" that a progress bar (tqdm) redraws itself with, so that the bar shows
// as it moves; a line that grows past kMaxConsoleLine without an end is relayed as it stands,
// ended by a newline (the log file keeps it whole), so a stream never holds more than that
// (plus one read). Thread-compatible.
#ifndef ELRUN_LAUNCHER_OS_OUTPUT_PUMP_H_
#define ELRUN_LAUNCHER_OS_OUTPUT_PUMP_H_

#include <string>
#include <vector>

namespace elrun {

class OutputPump {
 public:
  // The longest console line held back for its end: 1 MiB per stream.
  static constexpr size_t kMaxConsoleLine = size_t{1} << 20;

  // Takes ownership of read_fd (made non-blocking), file_fd and filtered_fd (-1: none);
  // console_fd is borrowed. Console lines holding any of `filters` also go to filtered_fd.
  OutputPump(int read_fd, int file_fd, int console_fd, std::string prefix, int filtered_fd = -1,
             std::vector<std::string> filters = {});
  ~OutputPump();
  OutputPump(const OutputPump&) = delete;
  OutputPump& operator=(const OutputPump&) = delete;

  int fd() const { return read_fd_; }

  // Copies what can be read now. Returns false once the pipe reached EOF (or a read failed).
  bool Pump();
  // Copies everything readable now, then flushes a trailing partial line to the console.
  void Drain();

 private:
  void WriteConsoleLines(bool flush_partial);

  const int read_fd_;
  const int file_fd_;
  const int console_fd_;
  const std::string prefix_;
  const int filtered_fd_;
  const std::vector<std::string> filters_;
  std::string partial_;  // Console bytes after the last line's end.
};

// write(2) until done or a hard error; returns false on error.
bool WriteAll(int fd, const char* data, size_t size);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_OUTPUT_PUMP_H_
