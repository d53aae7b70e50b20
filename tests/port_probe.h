// Probes of a TCP port on this host for tests: can a socket bind it, with or without
// SO_REUSEADDR, and listen? Header-only; each probe closes what it opened.
#ifndef ELRUN_TESTS_PORT_PROBE_H_
#define ELRUN_TESTS_PORT_PROBE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace elrun::testing {

// Binds 0.0.0.0:`port` (port 0: any) and listens when `listen` is set; returns the bound port,
// or -1 when bind or listen failed.
inline int BindIPv4(int port, bool reuse_address, bool listen) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int on = 1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  int bound = -1;
  if ((!reuse_address || ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) == 0) &&
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 && (!listen || ::listen(fd, 1) == 0) &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    bound = ntohs(addr.sin_port);
  }
  ::close(fd);
  return bound;
}

// True when a plain bind (no SO_REUSEADDR) of `port` fails: something on the host holds it.
inline bool PortHeld(int port) { return BindIPv4(port, false, false) < 0; }

}  // namespace elrun::testing

#endif  // ELRUN_TESTS_PORT_PROBE_H_
