// A TCP port this process keeps for a worker: bound with SO_REUSEADDR on every interface and never
// listened on, so the kernel hands it to no port-0 bind and no outgoing connection while it is
// held, yet a listener that sets SO_REUSEADDR (PyTorch's TCPStore, libuv and the classic backend
// alike) binds and listens on it. Closing it on a fresh pick, not before the worker binds, closes
// the window in which another socket on the host could take MASTER_PORT. Move-only;
// thread-compatible.
#ifndef ELRUN_LAUNCHER_OS_PORT_RESERVATION_H_
#define ELRUN_LAUNCHER_OS_PORT_RESERVATION_H_

#include "absl/status/statusor.h"

namespace elrun {

class PortReservation {
 public:
  // Binds port 0 (dual-stack IPv6, else IPv4) and keeps the socket. An error names the failing
  // call; nothing stays open then.
  [[nodiscard]] static absl::StatusOr<PortReservation> Take();

  PortReservation(PortReservation&& other) noexcept;
  PortReservation& operator=(PortReservation&& other) noexcept;
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;
  ~PortReservation();  // Gives the port back.

  int port() const { return port_; }

 private:
  PortReservation(int fd, int port) : fd_(fd), port_(port) {}
  void Release();

  int fd_ = -1;
  int port_ = 0;
};

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_PORT_RESERVATION_H_
