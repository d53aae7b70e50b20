#include "agent/net/tcp_listen.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace elrun::rdzv {
namespace {

// HOST and PORT of "HOST:PORT" or "[V6]:PORT".
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& listen) {
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon + 1 == listen.size()) {
    return absl::InvalidArgumentError(absl::StrCat("listen address ", listen, " is not HOST:PORT"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::make_pair(host, listen.substr(colon + 1));
}

}  // namespace

absl::StatusOr<TcpListeners> ListenTcp(const std::string& listen, int backlog) {
  auto host_port = SplitHostPort(listen);
  if (!host_port.ok()) return host_port.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string& host = host_port->first;
  int rc =
      ::getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), host_port->second.c_str(), &hints, &found);
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot listen on ", listen, ": ", gai_strerror(rc)));
  }
  std::vector<int> listeners;
  int port = 0;
  absl::Status failed = absl::OkStatus();
  for (addrinfo* a = found; a != nullptr && failed.ok(); a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // Not SO_REUSEPORT.
    if (a->ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    sockaddr_storage address{};
    std::memcpy(&address, a->ai_addr, a->ai_addrlen);
    if (port != 0) {  // Every address on the port the first one got.
      if (a->ai_family == AF_INET) reinterpret_cast<sockaddr_in&>(address).sin_port = htons(port);
      if (a->ai_family == AF_INET6) reinterpret_cast<sockaddr_in6&>(address).sin6_port = htons(port);
    }
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), a->ai_addrlen) != 0 || ::listen(fd, backlog) != 0) {
      int error = errno;
      ::close(fd);
      failed = absl::AlreadyExistsError(
          absl::StrCat("cannot listen on ", listen, " (", std::strerror(error), ": address in use or not local)"));
      break;
    }
    socklen_t length = sizeof(address);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
    port = ntohs(address.ss_family == AF_INET ? reinterpret_cast<sockaddr_in&>(address).sin_port
                                              : reinterpret_cast<sockaddr_in6&>(address).sin6_port);
    listeners.push_back(fd);
  }
  ::freeaddrinfo(found);
  if (failed.ok() && listeners.empty()) {
    failed = absl::AlreadyExistsError(absl::StrCat("cannot listen on ", listen, " (no usable address)"));
  }
  if (!failed.ok()) {
    for (int fd : listeners) ::close(fd);
    return failed;
  }
  return TcpListeners{std::move(listeners), port};
}

}  // namespace elrun::rdzv
