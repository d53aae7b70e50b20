// The coordinator's connection gate with real sockets: relaying, the per-peer and total limits,
// silent connections, connections that never authenticate, room made from unauthenticated ones
// at a limit (for quieter addresses), and a connection the server ended closed whatever its client
// does.
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
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace elrun::rdzv {
namespace {

// A unix-socket backend that echoes every connection's bytes back, one thread. "bye" closes the
// connection from its side (as gRPC does when it ends one). It records the name each accepted
// connection's peer is bound to (the gate's name for it), in order.
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
  // The gate's name of the n-th connection accepted (0-based), as gRPC reports a peer; waits up
  // to 10 s for it.
  std::string PeerName(size_t n) {
    absl::MutexLock lock(&mu_);
    auto ready = [&] { return names_.size() > n; };
    mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(10));
    return names_.size() > n ? "unix-abstract:" + names_[n] : "";
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
        if (n == 3 && std::string(buffer, 3) == "bye") {
          ::close(fds[i].fd);
          accepted_.erase(std::find(accepted_.begin(), accepted_.end(), fds[i].fd));
          fds[i].fd = -1;  // poll skips it.
        } else if (n > 0) {
          ssize_t ignored = ::send(fds[i].fd, buffer, static_cast<size_t>(n), MSG_NOSIGNAL);
          (void)ignored;
        } else {
          ::shutdown(fds[i].fd, SHUT_WR);  // As gRPC does: the peer's end ends ours.
          fds[i].events = 0;
        }
      }
      if (fds[0].revents & POLLIN) {
        sockaddr_un peer{};
        socklen_t length = sizeof(peer);
        int fd = ::accept4(listener_, reinterpret_cast<sockaddr*>(&peer), &length, SOCK_CLOEXEC);
        if (fd >= 0) {
          accepted_.push_back(fd);
          fds.push_back({fd, POLLIN, 0});
          const size_t offset = offsetof(sockaddr_un, sun_path) + 1;  // Abstract: sun_path[0] is 0.
          absl::MutexLock lock(&mu_);
          names_.push_back(length > offset && peer.sun_path[0] == '\0' ? std::string(peer.sun_path + 1, length - offset)
                                                                       : std::string());
        }
      }
    }
  }
  std::string path_;
  int listener_ = -1;
  std::atomic<bool> stop_{false};
  std::vector<int> accepted_;  // Owned by the thread until it stops.
  absl::Mutex mu_;
  std::vector<std::string> names_ ABSL_GUARDED_BY(mu_);
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
  // Without auth_timeout given, the gate's authentication is off: the echo backend proves
  // nothing.
  std::unique_ptr<ConnectionGate> Start(GateLimits limits, bool authenticate = false) {
    if (!authenticate) limits.auth_timeout = std::chrono::milliseconds(0);
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

// True once `gate` shows `done`, polled for up to 10 s (the relay thread counts asynchronously).
template <typename F>
bool Eventually(const ConnectionGate& gate, F done) {
  for (int i = 0; i < 1000; ++i) {
    if (done(gate.counts())) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done(gate.counts());
}

TEST_CASE("a connection that does not authenticate within auth_timeout is closed; a named one stays") {
  Fixture f;
  GateLimits limits;
  limits.auth_timeout = std::chrono::milliseconds(300);
  auto gate = f.Start(limits, /*authenticate=*/true);
  // Both speak (the first-bytes deadline is not what closes them): issue 31's idle connections
  // sent their bytes, then waited for ever.
  int proven = Connect(gate->port());
  ::send(proven, "p", 1, MSG_NOSIGNAL);
  CHECK(Receive(proven, 1) == "p");
  int idle = Connect(gate->port());
  ::send(idle, "i", 1, MSG_NOSIGNAL);
  CHECK(Receive(idle, 1) == "i");
  const std::string name = f.backend.PeerName(0);
  CHECK(name.rfind("unix-abstract:elrun-gate/", 0) == 0);
  CHECK(f.backend.PeerName(1) != name);
  gate->Authenticated(name);
  gate->Authenticated("unix-abstract:elrun-gate/no/such/connection");  // Ignored.
  gate->Authenticated("ipv4:127.0.0.1:1");                             // Ignored.
  auto started = std::chrono::steady_clock::now();
  CHECK(Receive(idle, 1).empty());  // Closed by the gate.
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(5));
  CHECK(Eventually(*gate, [](const GateCounts& c) { return c.unauthenticated_closed == 1; }));
  CHECK(gate->counts().authenticated == 1);
  CHECK(gate->counts().silent_closed == 0);
  ::send(proven, "q", 1, MSG_NOSIGNAL);
  CHECK(Receive(proven, 1) == "q");  // The authenticated one is kept.
  ::close(idle);
  ::close(proven);
}

TEST_CASE("at the total limit a quieter address's newcomer takes the place of the busiest one's") {
  Fixture f;
  GateLimits limits;
  limits.max_connections = 3;
  limits.auth_timeout = std::chrono::seconds(30);
  auto gate = f.Start(limits, /*authenticate=*/true);
  auto echoes = [](int fd, const char* byte) {
    ::send(fd, byte, 1, MSG_NOSIGNAL);
    return Receive(fd, 1) == byte;
  };
  int a = Connect(gate->port(), "127.0.0.21");
  REQUIRE(echoes(a, "a"));
  gate->Authenticated(f.backend.PeerName(0));
  // A flooder's address, admitted twice: the table is full.
  int b = Connect(gate->port(), "127.0.0.22");
  REQUIRE(echoes(b, "b"));
  int c = Connect(gate->port(), "127.0.0.22");
  REQUIRE(echoes(c, "c"));
  REQUIRE(Eventually(*gate, [](const GateCounts& counts) { return counts.authenticated == 1; }));
  // A newcomer from a quiet address takes the place of the flooder's oldest.
  int d = Connect(gate->port(), "127.0.0.23");
  CHECK(echoes(d, "d"));
  CHECK(Receive(b, 1).empty());
  CHECK(gate->counts().evicted == 1);
  // The flooder's own newcomer makes no room: no address was admitted clearly more often.
  int e = Connect(gate->port(), "127.0.0.22");
  CHECK_FALSE(echoes(e, "e"));
  CHECK(gate->counts().refused == 1);
  // Another quiet newcomer: the flooder's remaining connection goes, not d's nor a's.
  int g = Connect(gate->port(), "127.0.0.24");
  CHECK(echoes(g, "g"));
  CHECK(Receive(c, 1).empty());
  CHECK(echoes(d, "D"));
  CHECK(echoes(a, "A"));  // Authenticated: never made to room.
  CHECK(gate->counts().evicted == 2);
  for (int fd : {a, b, c, d, e, g}) ::close(fd);
}

TEST_CASE("at the per-address limit only that address's unauthenticated connections make room") {
  Fixture f;
  GateLimits limits;
  limits.max_per_peer = 2;
  limits.auth_timeout = std::chrono::seconds(30);
  limits.min_auth_window = std::chrono::milliseconds(0);
  auto gate = f.Start(limits, /*authenticate=*/true);
  int other = Connect(gate->port(), "127.0.0.31");  // The oldest, of another address.
  ::send(other, "o", 1, MSG_NOSIGNAL);
  REQUIRE(Receive(other, 1) == "o");
  int first = Connect(gate->port(), "127.0.0.32");
  ::send(first, "1", 1, MSG_NOSIGNAL);
  REQUIRE(Receive(first, 1) == "1");
  int second = Connect(gate->port(), "127.0.0.32");
  ::send(second, "2", 1, MSG_NOSIGNAL);
  REQUIRE(Receive(second, 1) == "2");
  int third = Connect(gate->port(), "127.0.0.32");
  ::send(third, "3", 1, MSG_NOSIGNAL);
  CHECK(Receive(third, 1) == "3");
  CHECK(Receive(first, 1).empty());  // Its own oldest, not the other address's.
  ::send(other, "p", 1, MSG_NOSIGNAL);
  CHECK(Receive(other, 1) == "p");
  CHECK(gate->counts().evicted == 1);
  for (int fd : {other, first, second, third}) ::close(fd);
}

TEST_CASE("a connection the server ended is closed, though its client never closes") {
  Fixture f;
  auto gate = f.Start({});
  int fd = Connect(gate->port());
  ::send(fd, "bye", 3, MSG_NOSIGNAL);
  CHECK(Receive(fd, 1).empty());
  // The gate let go of it: before, it kept the connection until the client closed its side too.
  CHECK(Eventually(*gate, [](const GateCounts& c) { return c.open == 0; }));
  ::close(fd);
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
