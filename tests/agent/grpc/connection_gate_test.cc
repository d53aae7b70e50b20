// The coordinator's connection gate with real sockets: relaying, the per-peer and total limits,
// silent connections.
#include "agent/grpc/connection_gate.h"

#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace elrun::rdzv {
namespace {

// A unix-socket backend that echoes every connection's bytes back, one thread.
class EchoBackend {
 public:
  explicit EchoBackend(const std::string& path) : path_(path) {
    listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    REQUIRE(::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
    REQUIRE(::listen(listener_, 512) == 0);
    thread_ = std::thread([this] { Run(); });
  }
  ~EchoBackend() {
    stop_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    thread_.join();
    ::close(listener_);
    for (int fd : accepted_) ::close(fd);
  }

 private:
  void Run() {
    std::vector<pollfd> fds{{listener_, POLLIN, 0}};
    while (!stop_) {
      if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        char buffer[4096];
        ssize_t n = ::recv(fds[i].fd, buffer, sizeof(buffer), 0);
        if (n > 0) {
          ssize_t ignored = ::send(fds[i].fd, buffer, static_cast<size_t>(n), MSG_NOSIGNAL);
          (void)ignored;
        } else {
          ::shutdown(fds[i].fd, SHUT_WR);  // As gRPC does: the peer's end ends ours.
          fds[i].events = 0;
        }
      }
      if (fds[0].revents & POLLIN) {
        int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) {
          accepted_.push_back(fd);
          fds.push_back({fd, POLLIN, 0});
        }
      }
    }
  }
  std::string path_;
  int listener_ = -1;
  std::atomic<bool> stop_{false};
  std::vector<int> accepted_;  // Owned by the thread until it stops.
  std::thread thread_;
};

// A TCP connection to 127.0.0.1:port from `source` (another loopback address).
int Connect(int port, const char* source = "127.0.0.1") {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source, &from.sin_addr);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) == 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) == 0);
  return fd;
}

// What the peer sends next, up to `want` bytes; "" when it closed the connection. 10 s at most.
std::string Receive(int fd, size_t want) {
  std::string got;
  while (got.size() < want) {
    pollfd p{fd, POLLIN, 0};
    REQUIRE(::poll(&p, 1, 10000) == 1);
    char buffer[4096];
    ssize_t n = ::recv(fd, buffer, std::min(sizeof(buffer), want - got.size()), 0);
    if (n <= 0) break;
    got.append(buffer, static_cast<size_t>(n));
  }
  return got;
}

// A private directory under /tmp (unix socket paths must stay under 108 bytes, which Bazel's
// TEST_TMPDIR may not), removed with its socket at the end.
struct SocketDir {
  std::string path = [] {
    std::string pattern = "/tmp/elrun-gate-testXXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    return pattern;
  }();
  ~SocketDir() {
    ::unlink((path + "/backend.sock").c_str());
    ::rmdir(path.c_str());
  }
};

struct Fixture {
  SocketDir dir;
  std::string path = dir.path + "/backend.sock";
  EchoBackend backend{path};
  std::unique_ptr<ConnectionGate> Start(GateLimits limits) {
    auto gate = ConnectionGate::Start("127.0.0.1:0", path, limits);
    REQUIRE_MESSAGE(gate.ok(), gate.status().ToString());
    return *std::move(gate);
  }
};

TEST_CASE("admitted connections are relayed both ways, large messages included") {
  Fixture f;
  auto gate = f.Start({});
  CHECK(gate->port() > 0);
  int fd = Connect(gate->port());
  std::string message(200 * 1024, 'm');  // Larger than the gate's buffers.
  for (size_t i = 0; i < message.size(); ++i) message[i] = static_cast<char>('a' + i % 26);
  std::thread sender([&] {
    REQUIRE(::send(fd, message.data(), message.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(message.size()));
  });
  CHECK(Receive(fd, message.size()) == message);
  sender.join();
  ::close(fd);
  CHECK(gate->counts().admitted == 1);
}

TEST_CASE("one address gets max_per_peer connections; others still get in") {
  Fixture f;
  GateLimits limits;
  limits.max_per_peer = 4;
  auto gate = f.Start(limits);
  std::vector<int> fds;
  for (int i = 0; i < 7; ++i) fds.push_back(Connect(gate->port(), "127.0.0.9"));
  int closed = 0;
  for (int fd : fds) {
    ::send(fd, "x", 1, MSG_NOSIGNAL);
    closed += Receive(fd, 1).empty() ? 1 : 0;
  }
  CHECK(closed == 3);
  int other = Connect(gate->port(), "127.0.0.1");
  ::send(other, "y", 1, MSG_NOSIGNAL);
  CHECK(Receive(other, 1) == "y");
  CHECK(gate->counts().refused == 3);
  CHECK(gate->counts().open == 5);
  for (int fd : fds) ::close(fd);
  ::close(other);
}

TEST_CASE("the per-address default scales with max_connections, at least 64") {
  Fixture f;
  GateLimits limits;
  limits.max_connections = 4096;
  CHECK(f.Start(limits)->max_per_peer() == 512);
  limits.max_connections = 100;
  CHECK(f.Start(limits)->max_per_peer() == 64);
  limits.max_per_peer = 7;
  CHECK(f.Start(limits)->max_per_peer() == 7);
}

TEST_CASE("beyond max_connections in all, a connection is closed at once") {
  Fixture f;
  GateLimits limits;
  limits.max_connections = 3;
  auto gate = f.Start(limits);
  CHECK(gate->max_connections() == 3);
  std::vector<int> fds;
  for (const char* source : {"127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"}) {
    fds.push_back(Connect(gate->port(), source));
  }
  for (size_t i = 0; i < fds.size(); ++i) {
    ::send(fds[i], "z", 1, MSG_NOSIGNAL);
    CHECK(Receive(fds[i], 1) == (i < 3 ? "z" : ""));
  }
  ::close(fds[0]);  // A place frees up.
  int late = -1;
  for (int attempt = 0; attempt < 100 && late < 0; ++attempt) {  // The gate sees the close soon.
    int fd = Connect(gate->port(), "127.0.0.15");
    ::send(fd, "w", 1, MSG_NOSIGNAL);
    if (Receive(fd, 1) == "w") {
      late = fd;
    } else {
      ::close(fd);
    }
  }
  CHECK(late >= 0);
  for (size_t i = 1; i < fds.size(); ++i) ::close(fds[i]);
  if (late >= 0) ::close(late);
}

TEST_CASE("a connection that sends nothing is closed after first_bytes_timeout") {
  Fixture f;
  GateLimits limits;
  limits.first_bytes_timeout = std::chrono::milliseconds(200);
  auto gate = f.Start(limits);
  int silent = Connect(gate->port());
  int talker = Connect(gate->port());
  ::send(talker, "t", 1, MSG_NOSIGNAL);
  CHECK(Receive(talker, 1) == "t");
  auto started = std::chrono::steady_clock::now();
  CHECK(Receive(silent, 1).empty());  // Closed by the gate.
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(5));
  CHECK(gate->counts().silent_closed == 1);
  ::send(talker, "u", 1, MSG_NOSIGNAL);
  CHECK(Receive(talker, 1) == "u");  // The one that spoke is kept.
  ::close(silent);
  ::close(talker);
}

TEST_CASE("a port in use is kAlreadyExists, a malformed address InvalidArgument") {
  Fixture f;
  auto gate = f.Start({});
  auto second = ConnectionGate::Start("127.0.0.1:" + std::to_string(gate->port()), f.path, {});
  CHECK(second.status().code() == absl::StatusCode::kAlreadyExists);
  CHECK(ConnectionGate::Start("no-port", f.path, {}).status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace elrun::rdzv
