#include "launcher/os/line_fifo.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace elrun {

LineFifo::LineFifo(std::string path, std::string name, EventLoop* loop, size_t max_line, OnLine on_line,
                   std::function<void()> after_read)
    : path_(std::move(path)),
      name_(std::move(name)),
      loop_(loop),
      max_line_(max_line),
      on_line_(std::move(on_line)),
      after_read_(std::move(after_read)) {}

absl::StatusOr<std::unique_ptr<LineFifo>> LineFifo::Open(const std::string& path, std::string name, EventLoop* loop,
                                                         size_t max_line, OnLine on_line,
                                                         std::function<void()> after_read) {
  auto fail = [&](const char* what) {
    return absl::FailedPreconditionError(absl::StrCat(name, ": ", what, ": ", std::strerror(errno)));
  };
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISFIFO(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(name, " exists and is not a FIFO; elrun will not replace it"));
    }
    if (::unlink(path.c_str()) != 0) return fail("cannot remove the old FIFO");
  }
  if (::mkfifo(path.c_str(), 0600) != 0) return fail("mkfifo");
  std::unique_ptr<LineFifo> fifo(
      new LineFifo(path, std::move(name), loop, max_line, std::move(on_line), std::move(after_read)));
  fifo->read_fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fifo->read_fd_ < 0) return fail("open");
  fifo->keep_open_fd_ = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fifo->keep_open_fd_ < 0) return fail("open");
  LineFifo* self = fifo.get();
  absl::Status added = loop->Add(fifo->read_fd_, [self] { self->OnReadable(); });
  if (!added.ok()) return added;
  return fifo;
}

LineFifo::~LineFifo() {
  if (read_fd_ >= 0) {
    loop_->Remove(read_fd_);
    ::close(read_fd_);
  }
  if (keep_open_fd_ >= 0) ::close(keep_open_fd_);
  ::unlink(path_.c_str());
}

void LineFifo::OnReadable() {
  char buffer[65536];
  for (int round = 0; round < 64; ++round) {  // Bounded: the loop comes back while more waits.
    ssize_t n = ::read(read_fd_, buffer, sizeof(buffer));
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; ++i) {
      char c = buffer[i];
      if (c != '\n') {
        if (skipping_) continue;
        partial_ += c;
        if (partial_.size() > max_line_) {
          spdlog::warn("{}: dropped a line over {} bytes", name_, max_line_);
          partial_.clear();
          skipping_ = true;
        }
        continue;
      }
      if (!skipping_ && !partial_.empty()) on_line_(partial_);
      partial_.clear();
      skipping_ = false;
    }
  }
  if (after_read_) after_read_();
}

}  // namespace elrun
