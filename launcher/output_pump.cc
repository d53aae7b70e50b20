#include "launcher/output_pump.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

namespace elrun {

bool WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

OutputPump::OutputPump(int read_fd, int file_fd, int console_fd, std::string prefix)
    : read_fd_(read_fd), file_fd_(file_fd), console_fd_(console_fd), prefix_(std::move(prefix)) {
  ::fcntl(read_fd_, F_SETFL, ::fcntl(read_fd_, F_GETFL) | O_NONBLOCK);
}

OutputPump::~OutputPump() {
  ::close(read_fd_);
  ::close(file_fd_);
}

bool OutputPump::Pump() {
  char buffer[65536];
  for (;;) {
    ssize_t n = ::read(read_fd_, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK;
    if (n == 0) {
      WriteConsoleLines(true);
      return false;
    }
    WriteAll(file_fd_, buffer, static_cast<size_t>(n));
    partial_.append(buffer, static_cast<size_t>(n));
    WriteConsoleLines(false);
  }
}

void OutputPump::Drain() {
  Pump();
  WriteConsoleLines(true);
}

void OutputPump::WriteConsoleLines(bool flush_partial) {
  std::string out;
  size_t start = 0;
  size_t newline;
  while ((newline = partial_.find('\n', start)) != std::string::npos) {
    out.append(prefix_).append(partial_, start, newline - start + 1);
    start = newline + 1;
  }
  partial_.erase(0, start);
  if (flush_partial && !partial_.empty()) {
    out.append(prefix_).append(partial_).append("\n");
    partial_.clear();
  }
  if (!out.empty()) WriteAll(console_fd_, out.data(), out.size());
}

}  // namespace elrun
