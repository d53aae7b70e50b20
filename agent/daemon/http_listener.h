// A small HTTP/1.1 server for elrun-rdzv's status page and metrics: GET (and HEAD) only, one
// request per connection, answered from a handler on the listener's own thread. Anything from
// the network is hostile: a request over 8 KiB is answered 431, and connections that send
// nothing whole within 5 s, or beyond 64 open at once, are closed. With a token, every request
// must carry it, as "Authorization: Bearer <token>" or "?token=<token>" (percent-encoded), or
// gets 401.
// Thread-safe; the destructor stops the thread and closes every socket.
#ifndef ELRUN_AGENT_DAEMON_HTTP_LISTENER_H_
#define ELRUN_AGENT_DAEMON_HTTP_LISTENER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace elrun::rdzv {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

class HttpListener {
 public:
  // `path` is the request target without its query ("/metrics").
  using Handler = std::function<HttpResponse(const std::string& path)>;

  // Binds `listen` (HOST:PORT; port 0 picks a free one) and serves until destroyed.
  static absl::StatusOr<std::unique_ptr<HttpListener>> Start(const std::string& listen, std::string token,
                                                             Handler handler);
  ~HttpListener();
  HttpListener(const HttpListener&) = delete;
  HttpListener& operator=(const HttpListener&) = delete;

  int port() const;

  class Loop;

 private:
  explicit HttpListener(std::unique_ptr<Loop> loop);
  std::unique_ptr<Loop> loop_;
};

// Finds `name` in a URL query and percent-decodes its value into `value` ("a=1&token=x%2By"
// gives "x+y" for "token"); false when absent. A '+' stays a '+'.
bool QueryValue(const std::string& query, const std::string& name, std::string* value);

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_DAEMON_HTTP_LISTENER_H_
