#include "launcher/os/control_fifos.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace elrun {

absl::StatusOr<std::unique_ptr<ControlFifos>> ControlFifos::Create(const std::string& parent) {
  std::string pattern = parent + "/elrun_control_XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot make a directory in ", parent, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<ControlFifos>(new ControlFifos(pattern));
}

ControlFifos::~ControlFifos() {
  for (const auto& [path, fd] : fds_) {
    ::close(fd);
    ::unlink(path.c_str());
  }
  ::rmdir(dir_.c_str());
}

absl::StatusOr<std::string> ControlFifos::PathFor(int slot) {
  auto it = paths_.find(slot);
  if (it != paths_.end()) return it->second;
  const std::string path = absl::StrCat(dir_, "/", slot);
  if (::mkfifo(path.c_str(), 0600) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot make the FIFO ", path, ": ", std::strerror(errno)));
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    ::unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("cannot open the FIFO ", path, ": ", std::strerror(error)));
  }
  paths_[slot] = path;
  fds_[path] = fd;
  return path;
}

absl::Status ControlFifos::Send(const std::string& path, const std::string& line) {
  auto it = fds_.find(path);
  if (it == fds_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not one of elrun's control FIFOs"));
  }
  if (line.find('\n') != std::string::npos || line.size() + 1 > PIPE_BUF) {
    return absl::InvalidArgumentError("a control line holds a newline or is longer than PIPE_BUF");
  }
  const std::string message = line + "\n";
  for (;;) {
    const ssize_t n = ::write(it->second, message.data(), message.size());
    if (n == static_cast<ssize_t>(message.size())) return absl::OkStatus();
    if (n < 0 && errno == EINTR) continue;
    return absl::UnavailableError(
        absl::StrCat("control FIFO ", path, ": ", n < 0 ? std::strerror(errno) : "short write"));
  }
}

}  // namespace elrun
