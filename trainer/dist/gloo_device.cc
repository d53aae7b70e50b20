#include "trainer/dist/gloo_device.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace elrun::trainer {

absl::StatusOr<std::string> LocalAddressToward(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found); rc != 0 || found == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot resolve MASTER_ADDR ", host, ": ", ::gai_strerror(rc)));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    char text[NI_MAXHOST] = {};
    // connect() on a UDP socket only picks the route and the source address; nothing is sent.
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&local), length, text, sizeof(text), nullptr, 0, NI_NUMERICHOST) ==
            0) {
      ::close(fd);
      ::freeaddrinfo(found);
      return std::string(text);
    }
    error = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return absl::UnavailableError(absl::StrCat("no route to MASTER_ADDR ", host, ": ", error));
}

absl::StatusOr<GlooDevice> ChooseGlooDevice(const std::string& socket_ifname, const std::string& master_addr) {
  GlooDevice device;
  for (absl::string_view name : absl::StrSplit(socket_ifname, ',', absl::SkipEmpty())) {
    device.interfaces.emplace_back(name);
  }
  if (!device.interfaces.empty()) return device;
  absl::StatusOr<std::string> address = LocalAddressToward(master_addr);
  if (!address.ok()) return address.status();
  device.address = *address;
  return device;
}

}  // namespace elrun::trainer
