#include "launcher/os/port_reservation.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace elrun {

absl::StatusOr<PortReservation> PortReservation::Take() {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool v6 = fd >= 0;
  if (!v6) fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_storage addr{};
  socklen_t len;
  if (v6) {
    auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
    a6->sin6_family = AF_INET6;
    a6->sin6_addr = in6addr_any;  // Dual-stack: held for IPv4 and IPv6 alike.
    len = sizeof(sockaddr_in6);
  } else {
    auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
    a4->sin_family = AF_INET;
    a4->sin_addr.s_addr = htonl(INADDR_ANY);
    len = sizeof(sockaddr_in);
  }
  // SO_REUSEADDR on both sides lets the worker's listener share the port with this bound, idle
  // socket; it does not let a port-0 bind or a connect's ephemeral choice land on it.
  int on = 1;
  if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) != 0 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int error = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("reserving a TCP port (bind to port 0): ", std::strerror(error)));
  }
  int port = v6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return PortReservation(fd, port);
}

PortReservation::PortReservation(PortReservation&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), port_(other.port_) {}

PortReservation& PortReservation::operator=(PortReservation&& other) noexcept {
  if (this != &other) {
    Release();
    fd_ = std::exchange(other.fd_, -1);
    port_ = other.port_;
  }
  return *this;
}

PortReservation::~PortReservation() { Release(); }

void PortReservation::Release() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace elrun
