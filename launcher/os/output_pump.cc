#include "launcher/os/output_pump.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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
  auto emit = [&](absl::string_view line) {  // `line` ends with its terminator.
    out.append(prefix_).append(line.data(), line.size());
    for (const std::string& filter : filters_) {
      if (absl::StrContains(line, filter)) {
        filtered.append(prefix_).append(line.data(), line.size());
        break;
      }
    }
  };
  const absl::string_view text(partial_);
  size_t start = 0;
  size_t end;
  while ((end = text.find_first_of("\r\n", start)) != absl::string_view::npos) {
    if (text[end] == '\r') {
      if (end + 1 == text.size() && !flush_partial) break;  // A "\r\n" may be on its way.
      if (end + 1 < text.size() && text[end + 1] == '\n') {
        ++end;  // "\r\n" ends one line.
      } else if (end == start) {
        start = end + 1;  // A bare "\r" before a progress bar's next state: nothing to show.
        continue;
      }
    }
    emit(text.substr(start, end - start + 1));
    start = end + 1;
  }
  if (flush_partial || text.size() - start >= kMaxConsoleLine) {
    // At EOF, or a line too long to hold: relayed as it is, ended by a newline.
    if (start < text.size()) emit(absl::StrCat(text.substr(start), "\n"));
    start = text.size();
  }
  partial_.erase(0, start);
  if (!out.empty()) WriteAll(console_fd_, out.data(), out.size());
  // One write per batch of whole lines: O_APPEND keeps the workers' lines apart in the file.
  if (filtered_fd_ >= 0 && !filtered.empty()) WriteAll(filtered_fd_, filtered.data(), filtered.size());
}

}  // namespace elrun
