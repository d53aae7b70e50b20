#include "agent/grpc/connection_gate.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "agent/net/tcp_listen.h"

namespace elrun::rdzv {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kBufferBytes = 16 * 1024;
constexpr int kReservedFds = 256;
constexpr int kFdsPerConnection = 3;  // Ours: client and backend; gRPC's: the backend's peer.
constexpr int kMaxConnections = 4096;
// How fast an address's count of recent admissions fades, and how many addresses it is kept for.
constexpr std::chrono::duration<double> kRecentHalfLife{10.0};
constexpr size_t kMaxRecentPeers = 65536;
constexpr std::chrono::milliseconds kBusiestFresh{100};

// One direction of a relayed connection: bytes read from `from`, not yet written to `to`.
struct Direction {
  std::vector<char> buffer = std::vector<char>(kBufferBytes);
  size_t begin = 0;
  size_t end = 0;
  bool eof = false;   // `from` has no more to send.
  bool shut = false;  // ... and everything was passed on: `to` got SHUT_WR.
  bool pending() const { return end > begin; }
};

struct Connection {
  int client = -1;
  int backend = -1;
  std::string peer;
  std::string name;            // The abstract unix address its backend socket is bound to.
  Direction up;                // client -> backend
  Direction down;              // backend -> client
  bool heard = false;          // The client sent its first bytes.
  bool authenticated = false;  // The server said its session proved the token.
  Clock::time_point accepted;
};

using Deadlines = std::deque<std::pair<Clock::time_point, std::weak_ptr<Connection>>>;

constexpr char kNamePrefix[] = "elrun-gate/";

// Binds `fd` (AF_UNIX) to the abstract address `name`; false when it cannot.
bool BindAbstract(int fd, const std::string& name) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(address.sun_path)) return false;
  std::memcpy(address.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract.
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return ::bind(fd, reinterpret_cast<sockaddr*>(&address), length) == 0;
}

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

std::string PeerAddress(const sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (address.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(address).sin_addr, text, sizeof(text));
  } else if (address.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(address).sin6_addr, text, sizeof(text));
  }
  return text;
}

}  // namespace

class ConnectionGate::Relay {
 public:
  Relay(std::vector<int> listeners, int port, std::string backend, int max_connections, GateLimits limits)
      : listeners_(std::move(listeners)),
        port_(port),
        backend_(std::move(backend)),
        max_connections_(max_connections),
        max_per_peer_(limits.max_per_peer > 0 ? limits.max_per_peer : std::max(64, max_connections / 8)),
        limits_(limits) {}

  absl::Status Init() {
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    reserve_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (epoll_ < 0 || wake_ < 0 || reserve_ < 0) return Errno("connection gate");
    for (int fd : listeners_) Watch(fd, EPOLLIN, EPOLL_CTL_ADD);
    Watch(wake_, EPOLLIN, EPOLL_CTL_ADD);
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  void Authenticated(const std::string& peer) {
    const size_t at = peer.find(kNamePrefix);
    if (at == std::string::npos) return;
    {
      absl::MutexLock lock(&mu_);
      if (authenticated_.size() >= 4096) return;  // The relay thread is far behind; it is only a hint.
      authenticated_.push_back(peer.substr(at));
    }
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_, &one, sizeof(one));
    (void)ignored;
  }

  ~Relay() {
    if (thread_.joinable()) {
      stop_ = true;
      uint64_t one = 1;
      ssize_t ignored = ::write(wake_, &one, sizeof(one));
      (void)ignored;
      thread_.join();
    }
    std::vector<std::shared_ptr<Connection>> all;
    for (auto& [fd, connection] : connections_) all.push_back(connection);
    for (auto& connection : all) Close(connection);
    for (int fd : listeners_) ::close(fd);
    for (int fd : {epoll_, wake_, reserve_}) {
      if (fd >= 0) ::close(fd);
    }
  }

  int port() const { return port_; }
  int max_connections() const { return max_connections_; }
  int max_per_peer() const { return max_per_peer_; }
  GateCounts counts() const {
    absl::MutexLock lock(&mu_);
    return counts_;
  }

 private:
  void Watch(int fd, uint32_t events, int op) {
    epoll_event event{};
    event.events = events;
    event.data.fd = fd;
    ::epoll_ctl(epoll_, op, fd, &event);
  }

  void Run() {
    std::vector<epoll_event> events(256);
    while (!stop_) {
      std::optional<Clock::time_point> next;
      for (const Deadlines* deadlines : {&silent_, &unauthenticated_}) {
        if (!deadlines->empty() && (!next || deadlines->front().first < *next)) next = deadlines->front().first;
      }
      int timeout_ms = -1;
      if (next) {
        auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(*next - Clock::now());
        timeout_ms = static_cast<int>(std::max<int64_t>(0, wait.count() + 1));
      }
      int n = ::epoll_wait(epoll_, events.data(), static_cast<int>(events.size()), timeout_ms);
      if (n < 0 && errno != EINTR) break;
      for (int i = 0; i < n; ++i) {
        int fd = events[i].data.fd;
        if (fd == wake_) {
          TakeAuthenticated();
          continue;
        }
        if (std::find(listeners_.begin(), listeners_.end(), fd) != listeners_.end()) {
          AcceptAll(fd);
          continue;
        }
        auto it = connections_.find(fd);
        if (it != connections_.end()) Pump(std::shared_ptr<Connection>(it->second));
      }
      CloseDue(silent_, &Connection::heard, &GateCounts::silent_closed);
      CloseDue(unauthenticated_, &Connection::authenticated, &GateCounts::unauthenticated_closed);
      PruneOrder();
    }
  }

  // Marks the connections the server named since the last call.
  void TakeAuthenticated() {
    uint64_t count = 0;
    ssize_t ignored = ::read(wake_, &count, sizeof(count));
    (void)ignored;
    std::vector<std::string> names;
    {
      absl::MutexLock lock(&mu_);
      names.swap(authenticated_);
    }
    for (const std::string& name : names) {
      auto it = by_name_.find(name);
      if (it == by_name_.end()) continue;
      std::shared_ptr<Connection> c = it->second.lock();
      if (c && !c->authenticated) {
        c->authenticated = true;
        Count([](GateCounts& counts) { ++counts.authenticated; });
      }
    }
  }

  // Drops the leading entries of order_ that can no longer make room (closed or authenticated).
  void PruneOrder() {
    while (!order_.empty()) {
      std::shared_ptr<Connection> c = order_.front().lock();
      if (c && c->client >= 0 && !c->authenticated) break;
      order_.pop_front();
    }
  }

  // How many connections `peer` has been admitted recently: each admission adds 1, halved every
  // kRecentHalfLife.
  double RecentAdmissions(const std::string& peer, Clock::time_point now) const {
    auto it = recent_.find(peer);
    if (it == recent_.end()) return 0;
    const double age_s = std::chrono::duration<double>(now - it->second.at).count();
    return it->second.score * std::exp2(-age_s / kRecentHalfLife.count());
  }

  void CountAdmission(const std::string& peer, Clock::time_point now) {
    const double score = RecentAdmissions(peer, now) + 1;
    recent_[peer] = {score, now};
    if (recent_.size() > kMaxRecentPeers) {  // A spray of addresses: forget the quiet ones.
      for (auto it = recent_.begin(); it != recent_.end();) {
        it = RecentAdmissions(it->first, now) < 0.5 ? recent_.erase(it) : std::next(it);
      }
    }
  }

  // At the total limit: the unauthenticated connection whose address was admitted most often
  // lately (the oldest of those), when that is clearly more often than `newcomer`'s. A flood
  // that reconnects as fast as it is closed then makes room only for quieter addresses - a
  // job's agents - and not for itself. nullptr when none.
  std::shared_ptr<Connection> BusiestUnauthenticated(const std::string& newcomer) {
    const Clock::time_point now = Clock::now();
    const double bar = RecentAdmissions(newcomer, now) + 0.5;
    // A flood's own newcomers are refused without a scan while the last one's busiest address
    // is fresh (counts only fade between scans; one admitted since may be missed for so long):
    // scanning for each of them kept the relay thread too busy to accept a job's agents.
    if (now - busiest_.at < kBusiestFresh && bar >= busiest_.score) return nullptr;
    PruneOrder();
    std::shared_ptr<Connection> victim;
    double busiest = 0;
    std::map<std::string, double> scores;  // Of each address met in this scan.
    for (const auto& entry : order_) {
      std::shared_ptr<Connection> c = entry.lock();
      if (!c || c->client < 0 || c->authenticated) continue;
      auto [it, added] = scores.try_emplace(c->peer, 0.0);
      if (added) it->second = RecentAdmissions(c->peer, now);
      if (it->second > busiest) {  // Strictly: the oldest of equals stays chosen.
        busiest = it->second;
        victim = c;
      }
    }
    busiest_ = {busiest, now};
    return busiest > bar ? victim : nullptr;
  }

  // At `peer`'s own limit: its oldest unauthenticated connection that has had min_auth_window to
  // authenticate. nullptr when none.
  std::shared_ptr<Connection> OldestUnauthenticatedOf(const std::string& peer) {
    PruneOrder();
    const Clock::time_point cutoff = Clock::now() - limits_.min_auth_window;
    for (const auto& entry : order_) {
      std::shared_ptr<Connection> c = entry.lock();
      if (!c || c->client < 0 || c->authenticated) continue;
      if (c->accepted > cutoff) return nullptr;  // In admission order: every later one is younger.
      if (c->peer == peer) return c;
    }
    return nullptr;
  }

  void AcceptAll(int listener) {
    for (int i = 0; i < 1024; ++i) {  // Bounded, so the relay keeps serving during a flood.
      sockaddr_storage address{};
      socklen_t length = sizeof(address);
      int fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&address), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // No descriptor left: give up the reserve to take the connection off the queue and
          // close it, instead of leaving it there to wake us for ever.
          ::close(reserve_);
          int dropped = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
          Count([](GateCounts& c) { ++c.refused; });
          if (dropped >= 0) ::close(dropped);
          reserve_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
          continue;
        }
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // EAGAIN: the queue is empty.
      }
      Admit(fd, PeerAddress(address));
    }
  }

  void Admit(int client, const std::string& peer) {
    int open = static_cast<int>(connections_.size() / 2);
    auto found = per_peer_.find(peer);
    const bool peer_full = found != per_peer_.end() && found->second >= max_per_peer_;
    if (open >= max_connections_ || peer_full) {
      // Room from an unauthenticated connection (of this peer when its own limit is the one
      // reached), or none: the new one is closed.
      std::shared_ptr<Connection> victim;
      if (limits_.auth_timeout.count() > 0) {
        victim = peer_full ? OldestUnauthenticatedOf(peer) : BusiestUnauthenticated(peer);
      }
      if (victim == nullptr) {
        // Counted before the close, so that a peer that sees its end also sees the count.
        Count([](GateCounts& c) { ++c.refused; });
        ::close(client);
        return;
      }
      Count([](GateCounts& c) { ++c.evicted; });
      Close(victim);
    }
    int backend = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, backend_.c_str(), sizeof(address.sun_path) - 1);
    // Named, so that the server can say which connection authenticated (gRPC reports the name as
    // the call's peer). Unique while bound: this process, this gate, a sequence number.
    const std::string name =
        absl::StrCat(kNamePrefix, ::getpid(), "/", reinterpret_cast<uintptr_t>(this), "/", next_connection_++);
    if (backend < 0 || !BindAbstract(backend, name) ||
        ::connect(backend, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      Count([](GateCounts& c) { ++c.refused; });
      if (backend >= 0) ::close(backend);
      ::close(client);
      return;
    }
    auto connection = std::make_shared<Connection>();
    connection->client = client;
    connection->backend = backend;
    connection->peer = peer;
    connection->name = name;
    connection->accepted = Clock::now();
    CountAdmission(peer, connection->accepted);
    connections_[client] = connection;
    connections_[backend] = connection;
    by_name_[name] = connection;
    ++per_peer_[peer];
    silent_.emplace_back(connection->accepted + limits_.first_bytes_timeout, connection);
    if (limits_.auth_timeout.count() > 0) {
      unauthenticated_.emplace_back(connection->accepted + limits_.auth_timeout, connection);
      order_.push_back(connection);
    }
    Watch(client, EPOLLIN, EPOLL_CTL_ADD);
    Watch(backend, EPOLLIN, EPOLL_CTL_ADD);
    Count([](GateCounts& c) {
      ++c.admitted;
      ++c.open;
    });
  }

  // Moves what can be moved in both directions; closes the connection when either side failed
  // or the server's side is done (gRPC ended the connection: nothing the client sends matters
  // any more, and a client that never closes must not keep its place).
  void Pump(std::shared_ptr<Connection> c) {
    bool ok = Transfer(c->client, c->up, c->backend, &c->heard) && Transfer(c->backend, c->down, c->client, nullptr);
    if (!ok || c->down.shut) {
      Close(c);
      return;
    }
    auto interest = [](const Direction& in, const Direction& out) {
      uint32_t events = 0;
      if (!in.eof && in.end < in.buffer.size()) events |= EPOLLIN;
      if (out.pending()) events |= EPOLLOUT;
      return events;
    };
    Watch(c->client, interest(c->up, c->down), EPOLL_CTL_MOD);
    Watch(c->backend, interest(c->down, c->up), EPOLL_CTL_MOD);
  }

  // Reads from `from` into `d` while there is room, writes what is pending to `to`; sets *heard
  // when bytes came. False on an error of either socket.
  static bool Transfer(int from, Direction& d, int to, bool* heard) {
    while (!d.eof && d.end < d.buffer.size()) {
      ssize_t n = ::recv(from, d.buffer.data() + d.end, d.buffer.size() - d.end, 0);
      if (n > 0) {
        d.end += static_cast<size_t>(n);
        if (heard != nullptr) *heard = true;
      } else if (n == 0) {
        d.eof = true;
      } else if (errno == EINTR) {
        continue;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        break;
      } else {
        return false;
      }
    }
    while (d.pending()) {
      ssize_t n = ::send(to, d.buffer.data() + d.begin, d.end - d.begin, MSG_NOSIGNAL);
      if (n > 0) {
        d.begin += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        return false;
      }
    }
    if (!d.pending()) d.begin = d.end = 0;
    if (d.eof && !d.pending() && !d.shut) {
      ::shutdown(to, SHUT_WR);
      d.shut = true;
    }
    return true;
  }

  // By value: closing erases the map's own references to the connection.
  void Close(std::shared_ptr<Connection> c) {
    if (c->client < 0) return;
    for (int fd : {c->client, c->backend}) {
      ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
      connections_.erase(fd);
      ::close(fd);
    }
    c->client = c->backend = -1;
    by_name_.erase(c->name);
    if (--per_peer_[c->peer] <= 0) per_peer_.erase(c->peer);
    Count([](GateCounts& counts) { --counts.open; });
  }

  // Closes the connections of `deadlines` that are due and not yet `done` (their first bytes,
  // their authentication), counting each in `counter`.
  void CloseDue(Deadlines& deadlines, bool Connection::*done, uint64_t GateCounts::*counter) {
    auto now = Clock::now();
    while (!deadlines.empty() && deadlines.front().first <= now) {
      std::shared_ptr<Connection> c = deadlines.front().second.lock();
      deadlines.pop_front();
      if (c && !((*c).*done) && c->client >= 0) {
        Count([counter](GateCounts& counts) { ++(counts.*counter); });
        Close(c);
      }
    }
  }

  template <typename F>
  void Count(F update) {
    absl::MutexLock lock(&mu_);
    update(counts_);
  }

  const std::vector<int> listeners_;
  const int port_;
  const std::string backend_;
  const int max_connections_;
  const int max_per_peer_;
  const GateLimits limits_;
  int epoll_ = -1;
  int wake_ = -1;
  int reserve_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  // Owned by the relay thread (and the destructor once it has stopped):
  std::map<int, std::shared_ptr<Connection>> connections_;  // By client and by backend fd.
  std::map<std::string, int> per_peer_;
  std::map<std::string, std::weak_ptr<Connection>> by_name_;
  Deadlines silent_;                             // First bytes, by deadline.
  Deadlines unauthenticated_;                    // Authentication, by deadline.
  std::deque<std::weak_ptr<Connection>> order_;  // Unauthenticated ones, in admission order.
  struct Recent {
    double score = 0;  // Admissions, decayed to `at`.
    Clock::time_point at;
  };
  std::map<std::string, Recent> recent_;  // By peer address.
  Recent busiest_;                        // The busiest unauthenticated address at the last scan.
  uint64_t next_connection_ = 0;
  mutable absl::Mutex mu_;
  GateCounts counts_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> authenticated_ ABSL_GUARDED_BY(mu_);  // Named by the server, not yet taken.
};

absl::StatusOr<std::unique_ptr<ConnectionGate>> ConnectionGate::Start(const std::string& listen,
                                                                      const std::string& backend_path,
                                                                      GateLimits limits) {
  auto bound = ListenTcp(listen, 1024);
  if (!bound.ok()) return bound.status();
  std::vector<int> listeners = std::move(bound->fds);
  int port = bound->port;
  int max_connections = limits.max_connections;
  if (max_connections <= 0) {
    rlimit limit{};
    ::getrlimit(RLIMIT_NOFILE, &limit);
    int64_t budget = (static_cast<int64_t>(limit.rlim_cur) - kReservedFds) / kFdsPerConnection;
    max_connections = static_cast<int>(std::clamp<int64_t>(budget, 8, kMaxConnections));
  }
  auto relay = std::make_unique<Relay>(std::move(listeners), port, backend_path, max_connections, limits);
  absl::Status started = relay->Init();
  if (!started.ok()) return started;
  return std::unique_ptr<ConnectionGate>(new ConnectionGate(std::move(relay)));
}

ConnectionGate::ConnectionGate(std::unique_ptr<Relay> relay) : relay_(std::move(relay)) {}
ConnectionGate::~ConnectionGate() = default;
int ConnectionGate::port() const { return relay_->port(); }
int ConnectionGate::max_connections() const { return relay_->max_connections(); }
int ConnectionGate::max_per_peer() const { return relay_->max_per_peer(); }
GateCounts ConnectionGate::counts() const { return relay_->counts(); }
void ConnectionGate::Authenticated(const std::string& peer) { relay_->Authenticated(peer); }

int RaiseOpenFileLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return static_cast<int>(std::min<rlim_t>(limit.rlim_cur, 1 << 30));
}

}  // namespace elrun::rdzv
