#include "launcher/os/output_pump.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

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

OutputPump::OutputPump(int read_fd, int file_fd, int console_fd, std::string prefix, int filtered_fd,
                       std::vector<std::string> filters)
    : read_fd_(read_fd),
      file_fd_(file_fd),
      console_fd_(console_fd),
      prefix_(std::move(prefix)),
      filtered_fd_(filtered_fd),
      filters_(std::move(filters)) {
  ::fcntl(read_fd_, F_SETFL, ::fcntl(read_fd_, F_GETFL) | O_NONBLOCK);
}

OutputPump::~OutputPump() {
  ::close(read_fd_);
  ::close(file_fd_);
  if (filtered_fd_ >= 0) ::close(filtered_fd_);
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
  std::string filtered;
  auto emit = [&](absl::string_view line) {  // `line` ends with its newline.
    out.append(prefix_).append(line.data(), line.size());
    for (const std::string& filter : filters_) {
      if (absl::StrContains(line, filter)) {
        filtered.append(prefix_).append(line.data(), line.size());
        break;
      }
    }
  };
  size_t start = 0;
  size_t newline;
  while ((newline = partial_.find('\n', start)) != std::string::npos) {
    emit(absl::string_view(partial_).substr(start, newline - start + 1));
    start = newline + 1;
  }
  partial_.erase(0, start);
  if (flush_partial && !partial_.empty()) {
    partial_.append("\n");
    emit(partial_);
    partial_.clear();
  }
  if (!out.empty()) WriteAll(console_fd_, out.data(), out.size());
  // One write per batch of whole lines: O_APPEND keeps the workers' lines apart in the file.
  if (filtered_fd_ >= 0 && !filtered.empty()) WriteAll(filtered_fd_, filtered.data(), filtered.size());
}

}  // namespace elrun
