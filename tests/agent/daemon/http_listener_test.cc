// The status listener over real loopback sockets: routing, the token, hostile requests.
#include "agent/daemon/http_listener.h"

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace elrun::rdzv {
namespace {

// Sends `request` as is to 127.0.0.1:port and returns everything until the server closes
// (10 s at most).
std::string Exchange(int port, const std::string& request) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  for (int i = 0; i < 1000; ++i) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10000) != 1) break;
    ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return response;
}

std::unique_ptr<HttpListener> Start(const std::string& token) {
  auto listener = HttpListener::Start("127.0.0.1:0", token, [](const std::string& path) {
    if (path == "/metrics") return HttpResponse{200, "text/plain", "up 1\n"};
    return HttpResponse{404, "text/plain", "not found\n"};
  });
  REQUIRE(listener.ok());
  return *std::move(listener);
}

std::string Status(const std::string& response) { return response.substr(0, response.find("\r\n")); }

TEST_CASE("routes GET to the handler; other methods and paths are refused") {
  auto http = Start("");
  CHECK(http->port() > 0);
  std::string ok = Exchange(http->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(Status(ok) == "HTTP/1.1 200 OK");
  CHECK(ok.find("Content-Length: 5\r\n") != std::string::npos);
  CHECK(ok.substr(ok.size() - 5) == "up 1\n");
  CHECK(Status(Exchange(http->port(), "GET /nope HTTP/1.1\r\n\r\n")) == "HTTP/1.1 404 Not Found");
  CHECK(Status(Exchange(http->port(), "POST /metrics HTTP/1.1\r\n\r\n")) == "HTTP/1.1 405 Method Not Allowed");
  std::string head = Exchange(http->port(), "HEAD /metrics HTTP/1.0\r\n\r\n");
  CHECK(Status(head) == "HTTP/1.1 200 OK");
  CHECK(head.find("up 1") == std::string::npos);
}

TEST_CASE("hostile requests get an error or a closed connection, and the listener serves on") {
  auto http = Start("");
  CHECK(Status(Exchange(http->port(), "garbage\r\n\r\n")) == "HTTP/1.1 400 Bad Request");
  CHECK(Status(Exchange(http->port(), "GET metrics HTTP/1.1\r\n\r\n")) == "HTTP/1.1 400 Bad Request");
  CHECK(Status(Exchange(http->port(), "GET / SPDY/3\r\n\r\n")) == "HTTP/1.1 400 Bad Request");
  CHECK(Status(Exchange(http->port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'a'))) ==
        "HTTP/1.1 431 Request Header Fields Too Large");
  CHECK(Status(Exchange(http->port(), "GET /metrics HTTP/1.1\r\n\r\n")) == "HTTP/1.1 200 OK");
}

TEST_CASE("with a token: Bearer or ?token=, percent-decoded; anything else is 401") {
  auto http = Start("s3cret+/=");
  std::string denied = Exchange(http->port(), "GET /metrics HTTP/1.1\r\n\r\n");
  CHECK(Status(denied) == "HTTP/1.1 401 Unauthorized");
  CHECK(denied.find("WWW-Authenticate: Bearer realm=\"elrun-rdzv\"\r\n") != std::string::npos);
  CHECK(denied.find("up 1") == std::string::npos);
  CHECK(Status(Exchange(http->port(), "GET /metrics HTTP/1.1\r\nAuthorization: Bearer wrong\r\n\r\n")) ==
        "HTTP/1.1 401 Unauthorized");
  CHECK(Status(Exchange(http->port(), "GET /metrics?token=s3cret HTTP/1.1\r\n\r\n")) == "HTTP/1.1 401 Unauthorized");
  CHECK(Status(Exchange(http->port(), "GET /metrics HTTP/1.1\r\nauthorization: bearer s3cret+/=\r\n\r\n")) ==
        "HTTP/1.1 200 OK");
  CHECK(Status(Exchange(http->port(), "GET /metrics?a=1&token=s3cret%2B%2F%3D HTTP/1.1\r\n\r\n")) == "HTTP/1.1 200 OK");
  CHECK(Status(Exchange(http->port(), "GET /nope?token=s3cret%2b/= HTTP/1.1\r\n\r\n")) == "HTTP/1.1 404 Not Found");
}

TEST_CASE("query values are found and percent-decoded") {
  std::string v;
  CHECK(QueryValue("a=1&token=x%2By&b", "token", &v));
  CHECK(v == "x+y");
  CHECK(QueryValue("token=", "token", &v));
  CHECK(v.empty());
  CHECK(QueryValue("token=%zz%4", "token", &v));
  CHECK(v == "%zz%4");
  CHECK_FALSE(QueryValue("tokens=1&xtoken=2", "token", &v));
}

}  // namespace
}  // namespace elrun::rdzv
