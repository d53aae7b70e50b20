#include "launcher/os/host_info.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace elrun {

DeviceCounts DetectDevices(const std::map<std::string, std::string>& env) {
  DeviceCounts counts;
  long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  counts.cpus = cpus > 0 ? static_cast<int>(cpus) : 1;
  if (DIR* dir = ::opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] != '.') ++counts.gpus;
    }
    ::closedir(dir);
  }
  auto visible = env.find("CUDA_VISIBLE_DEVICES");
  if (visible != env.end()) {
    std::vector<std::string> ids = absl::StrSplit(visible->second, ',', absl::SkipWhitespace());
    counts.gpus = std::min<int>(counts.gpus, static_cast<int>(ids.size()));
  }
  return counts;
}

std::string RandomRunId() {
  unsigned char bytes[8] = {};
  ssize_t ignored = ::getrandom(bytes, sizeof(bytes), 0);
  (void)ignored;
  std::string id;
  for (unsigned char b : bytes) absl::StrAppend(&id, absl::Hex(b, absl::kZeroPad2));
  return id;
}

namespace {

// Parses a numeric IPv4 or IPv6 address.
bool ParseAddress(const std::string& host, sockaddr_storage* addr, socklen_t* len) {
  std::memset(addr, 0, sizeof(*addr));
  auto* a4 = reinterpret_cast<sockaddr_in*>(addr);
  if (::inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    *len = sizeof(sockaddr_in);
    return true;
  }
  auto* a6 = reinterpret_cast<sockaddr_in6*>(addr);
  if (::inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    *len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

std::string AddressText(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, text, sizeof(text));
  } else if (addr->sa_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, text, sizeof(text));
  }
  return text;
}

}  // namespace

namespace {

// A loopback address or one of this machine's interfaces.
bool IsLocalAddress(const sockaddr* addr) {
  if (addr->sa_family == AF_INET && (ntohl(reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr) >> 24) == 127) {
    return true;
  }
  std::string canonical = AddressText(addr);
  if (canonical.empty()) return false;
  if (canonical == "::1") return true;
  ifaddrs* interfaces = nullptr;
  if (::getifaddrs(&interfaces) != 0) return false;
  bool local = false;
  for (ifaddrs* it = interfaces; it != nullptr && !local; it = it->ifa_next) {
    if (it->ifa_addr != nullptr && AddressText(it->ifa_addr) == canonical) local = true;
  }
  ::freeifaddrs(interfaces);
  return local;
}

}  // namespace

bool IsLocalHost(const std::string& host) {
  if (host == "localhost" || host == HostName()) return true;
  sockaddr_storage addr;
  socklen_t len;
  if (ParseAddress(host, &addr, &len)) return IsLocalAddress(reinterpret_cast<sockaddr*>(&addr));
  // A name (a Slurm node name, an /etc/hosts alias): local when every address it resolves to
  // is, as torchrun matches the endpoint against this machine.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool local = found != nullptr;
  for (addrinfo* it = found; it != nullptr && local; it = it->ai_next) local = IsLocalAddress(it->ai_addr);
  ::freeaddrinfo(found);
  return local;
}

std::optional<std::string> LocalAddressToward(const std::string& host, int port) {
  sockaddr_storage addr;
  socklen_t len;
  if (!ParseAddress(host, &addr, &len)) return std::nullopt;
  if (addr.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(static_cast<uint16_t>(port));
  }
  int fd = ::socket(addr.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  std::optional<std::string> result;
  sockaddr_storage local;
  socklen_t local_len = sizeof(local);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) == 0) {
    result = AddressText(reinterpret_cast<sockaddr*>(&local));
  }
  ::close(fd);
  return result;
}

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

}  // namespace elrun
