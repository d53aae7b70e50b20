#include "agent/daemon/http_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/coordinator/session_auth.h"
#include "agent/net/tcp_listen.h"

namespace elrun::rdzv {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxRequestBytes = 8192;
constexpr int kMaxConnections = 64;
constexpr auto kRequestTimeout = std::chrono::seconds(5);

const char* Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 431: return "Request Header Fields Too Large";
    default: return "Error";
  }
}

std::string Serialize(const HttpResponse& response, bool head_only) {
  std::string out =
      absl::StrCat("HTTP/1.1 ", response.status, " ", Reason(response.status), "\r\n",
                   "Content-Type: ", response.content_type, "\r\n", "Content-Length: ", response.body.size(), "\r\n",
                   "Cache-Control: no-store\r\n", "X-Content-Type-Options: nosniff\r\n", "Connection: close\r\n");
  if (response.status == 401) out += "WWW-Authenticate: Bearer realm=\"elrun-rdzv\"\r\n";
  out += "\r\n";
  if (!head_only) out += response.body;
  return out;
}

HttpResponse Text(int status, const std::string& text) {
  return HttpResponse{status, "text/plain; charset=utf-8", text + "\n"};
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  c = absl::ascii_tolower(static_cast<unsigned char>(c));
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

struct Connection {
  std::string in;
  std::string out;
  size_t written = 0;
  Clock::time_point deadline;
};

}  // namespace

bool QueryValue(const std::string& query, const std::string& name, std::string* value) {
  for (absl::string_view pair : absl::StrSplit(query, '&')) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(pair, absl::MaxSplits('=', 1));
    if (kv.first != name) continue;
    std::string decoded;
    for (size_t i = 0; i < kv.second.size(); ++i) {
      if (kv.second[i] == '%' && i + 2 < kv.second.size() && HexValue(kv.second[i + 1]) >= 0 &&
          HexValue(kv.second[i + 2]) >= 0) {
        decoded += static_cast<char>(HexValue(kv.second[i + 1]) * 16 + HexValue(kv.second[i + 2]));
        i += 2;
      } else {
        decoded += kv.second[i];
      }
    }
    *value = decoded;
    return true;
  }
  return false;
}

class HttpListener::Loop {
 public:
  Loop(TcpListeners listeners, std::string token, Handler handler)
      : listeners_(std::move(listeners)), key_(token.empty() ? "" : TokenKey(token)), handler_(std::move(handler)) {}

  ~Loop() {
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_, &one, sizeof(one));
    (void)ignored;
    if (thread_.joinable()) thread_.join();
    for (auto& [fd, connection] : connections_) ::close(fd);
    for (int fd : listeners_.fds) ::close(fd);
    if (wake_ >= 0) ::close(wake_);
  }

  absl::Status Init() {
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  int port() const { return listeners_.port; }

 private:
  void Run() {
    for (;;) {
      std::vector<pollfd> fds;
      fds.push_back({wake_, POLLIN, 0});
      for (int fd : listeners_.fds) fds.push_back({fd, POLLIN, 0});
      Clock::time_point next = Clock::now() + std::chrono::hours(1);
      for (const auto& [fd, connection] : connections_) {
        fds.push_back({fd, static_cast<short>(connection.out.empty() ? POLLIN : POLLOUT), 0});
        next = std::min(next, connection.deadline);
      }
      int timeout_ms =
          static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count()) + 1;
      int ready = ::poll(fds.data(), fds.size(), std::max(timeout_ms, 0));
      if (ready < 0 && errno != EINTR) return;
      if (fds[0].revents != 0) return;  // Stopping.
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        if (i <= listeners_.fds.size()) {
          Accept(fds[i].fd);
        } else {
          Serve(fds[i].fd);
        }
      }
      Clock::time_point now = Clock::now();
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (now >= it->second.deadline) {
          ::close(it->first);
          it = connections_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  void Accept(int listener) {
    for (int i = 0; i < 16; ++i) {  // Bounded: the loop comes back while more are waiting.
      int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      if (static_cast<int>(connections_.size()) >= kMaxConnections) {
        ::close(fd);
        continue;
      }
      connections_[fd].deadline = Clock::now() + kRequestTimeout;
    }
  }

  void Serve(int fd) {
    Connection& c = connections_[fd];
    if (c.out.empty()) {
      char buffer[4096];
      ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
      if (n <= 0) {
        if (n == 0 || (errno != EAGAIN && errno != EINTR)) Close(fd);
        return;
      }
      c.in.append(buffer, static_cast<size_t>(n));
      size_t end = c.in.find("\r\n\r\n");
      if (end == std::string::npos) {
        if (c.in.size() > kMaxRequestBytes) c.out = Serialize(Text(431, "request over 8 KiB"), false);
        if (c.out.empty()) return;
      } else {
        c.out = Respond(c.in.substr(0, end));
      }
    }
    ssize_t n = ::send(fd, c.out.data() + c.written, c.out.size() - c.written, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) {
      Close(fd);
      return;
    }
    c.written += static_cast<size_t>(n);
    if (c.written == c.out.size()) Close(fd);
  }

  void Close(int fd) {
    ::close(fd);
    connections_.erase(fd);
  }

  std::string Respond(const std::string& head) {
    std::vector<std::string> lines = absl::StrSplit(head, "\r\n");
    std::vector<std::string> request = absl::StrSplit(lines[0], ' ');
    if (request.size() != 3 || !absl::StartsWith(request[2], "HTTP/1.") || request[1].empty() || request[1][0] != '/') {
      return Serialize(Text(400, "not an HTTP/1.x request"), false);
    }
    bool head_only = request[0] == "HEAD";
    if (request[0] != "GET" && !head_only) return Serialize(Text(405, "only GET"), false);
    std::string target = request[1];
    size_t question = target.find('?');
    std::string path = target.substr(0, question);
    std::string query = question == std::string::npos ? "" : target.substr(question + 1);
    if (!key_.empty()) {
      std::string presented;
      bool found = QueryValue(query, "token", &presented);
      for (size_t i = 1; i < lines.size() && !found; ++i) {
        std::pair<std::string, std::string> header = absl::StrSplit(lines[i], absl::MaxSplits(':', 1));
        if (absl::AsciiStrToLower(header.first) != "authorization") continue;
        std::string value(absl::StripAsciiWhitespace(header.second));
        if (absl::StartsWithIgnoreCase(value, "bearer ")) {
          presented = std::string(absl::StripAsciiWhitespace(value.substr(7)));
          found = true;
        }
      }
      if (!found || !ProofEquals(TokenKey(presented), key_)) {
        return Serialize(Text(401,
                              "this elrun-rdzv requires its token: Authorization: Bearer <token> "
                              "or ?token=<token>"),
                         head_only);
      }
    }
    return Serialize(handler_(path), head_only);
  }

  TcpListeners listeners_;
  const std::string key_;  // TokenKey of the token; empty: open.
  const Handler handler_;
  int wake_ = -1;
  std::map<int, Connection> connections_;  // The loop's thread only.
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<HttpListener>> HttpListener::Start(const std::string& listen, std::string token,
                                                                  Handler handler) {
  auto listeners = ListenTcp(listen, 64);
  if (!listeners.ok()) return listeners.status();
  auto loop = std::make_unique<Loop>(*std::move(listeners), std::move(token), std::move(handler));
  absl::Status started = loop->Init();
  if (!started.ok()) return started;
  return std::unique_ptr<HttpListener>(new HttpListener(std::move(loop)));
}

HttpListener::HttpListener(std::unique_ptr<Loop> loop) : loop_(std::move(loop)) {}
HttpListener::~HttpListener() = default;
int HttpListener::port() const { return loop_->port(); }

}  // namespace elrun::rdzv
