#include "agent/grpc/coordinator_server.h"

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "agent/coordinator/session_auth.h"
#include "proto/rendezvous.grpc.pb.h"

namespace elrun::rdzv {
namespace {

grpc::Status ToGrpc(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

// The wire form of a coordinator message.
grpc::ByteBuffer Serialize(const v1::CoordinatorMessage& message) {
  std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// Parses an agent's message; InvalidArgument when the bytes are not one (truncated, garbage).
// gRPC's own parsing would end the stream as if the agent had closed it, with status OK.
absl::Status Parse(const grpc::ByteBuffer& buffer, v1::AgentMessage* message) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (buffer.Dump(&slices).ok()) {
    for (const grpc::Slice& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    if (message->ParseFromString(bytes)) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unparsable message (", buffer.Length(), " bytes): not an AgentMessage of protocol version ", kProtocolVersion));
}

// Wakes the timer thread whenever the coordinator's next deadline may have moved.
class Ticker {
 public:
  explicit Ticker(Coordinator* coordinator) : coordinator_(coordinator), thread_([this] { Run(); }) {}
  ~Ticker() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    thread_.join();
  }
  void Wake() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      ++generation_;
    }
    cv_.SignalAll();
  }

 private:
  // Sleeps until the coordinator's next deadline, recomputed after every wake (a message
  // may have brought one closer); Tick runs only when a deadline is due. Both walk every node,
  // so wakes that come while they run are served by one pass, not one each.
  void Run() ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    while (!stop_) {
      uint64_t seen = generation_;
      mu_.Unlock();
      std::optional<TimePoint> next = coordinator_->NextDeadline();
      mu_.Lock();
      while (!stop_ && generation_ == seen) {
        if (!next) {
          cv_.Wait(&mu_);
        } else if (TimePoint now = std::chrono::steady_clock::now(); now < *next) {
          cv_.WaitWithTimeout(&mu_, absl::FromChrono(*next - now));
        } else {
          break;
        }
      }
      if (stop_) break;
      if (!next || std::chrono::steady_clock::now() < *next) continue;
      mu_.Unlock();
      coordinator_->Tick(std::chrono::steady_clock::now());
      mu_.Lock();
    }
    mu_.Unlock();
  }

  Coordinator* const coordinator_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Tells the gate which connections authenticated. The gate starts after the server and stops
// before it, so it is attached and detached under a lock.
class GateLink {
 public:
  void Attach(ConnectionGate* gate) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    gate_ = gate;
  }
  void Authenticated(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (gate_ != nullptr) gate_->Authenticated(peer);
  }

 private:
  absl::Mutex mu_;
  ConnectionGate* gate_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// One agent's stream, in raw bytes so that a message that does not parse is told apart from
// the agent's end. Reads feed the coordinator; the coordinator's sends are queued and written
// one at a time. Deletes itself when gRPC is done with it.
class SessionReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>, public SessionSink {
 public:
  SessionReactor(Coordinator* coordinator, Ticker* ticker, GateLink* link, std::string peer, SessionId id)
      : coordinator_(coordinator), ticker_(ticker), link_(link), peer_(std::move(peer)), id_(id) {
    connected_ = true;
    coordinator_->OnConnect(id_, this, std::chrono::steady_clock::now());
    ticker_->Wake();  // Its first-Join deadline may be the earliest.
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // The agent closed its side or is gone.
      Disconnect();
      Close(absl::OkStatus());
      return;
    }
    v1::AgentMessage message;
    absl::Status status = Parse(incoming_, &message);
    if (status.ok()) {
      status = coordinator_->OnMessage(id_, message, std::chrono::steady_clock::now());
      // A heartbeat only moves its node's deadline later: no need to recompute the next one.
      if (!message.has_heartbeat()) ticker_->Wake();
    }
    if (!status.ok()) {
      Disconnect();
      Close(status);
      return;
    }
    StartRead(&incoming_);
  }

  void Send(const v1::CoordinatorMessage& message) override {
    // A Welcome answers a Join the coordinator accepted (its proof of the token, when there is
    // one): the connection keeps its place at the gate.
    if (message.has_welcome() && !welcomed_.exchange(true)) link_->Authenticated(peer_);
    absl::MutexLock lock(&mu_);
    if (finish_requested_) return;
    outbox_.push_back(Serialize(message));
    if (!writing_) {
      writing_ = true;
      StartWrite(&outbox_.front());
    }
  }

  void Close(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    if (finish_requested_) return;
    finish_requested_ = true;
    final_status_ = ToGrpc(status);
    if (!writing_) Finish(final_status_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    outbox_.pop_front();
    if (ok && !outbox_.empty()) {
      StartWrite(&outbox_.front());
      return;
    }
    writing_ = false;
    if (!ok) outbox_.clear();
    if (finish_requested_) Finish(final_status_);
  }

  void OnCancel() override {}  // The failed read that follows does the work.

  void OnDone() override {
    Disconnect();
    delete this;
  }

 private:
  void Disconnect() {
    if (connected_.exchange(false)) {
      coordinator_->OnDisconnect(id_, std::chrono::steady_clock::now());
      ticker_->Wake();
    }
  }

  Coordinator* const coordinator_;
  Ticker* const ticker_;
  GateLink* const link_;
  const std::string peer_;  // The call's peer: the gate's name for the connection.
  const SessionId id_;
  std::atomic<bool> connected_{false};
  std::atomic<bool> welcomed_{false};
  grpc::ByteBuffer incoming_;  // Only touched by the read chain.
  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> outbox_ ABSL_GUARDED_BY(mu_);  // front() is being written.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_status_ ABSL_GUARDED_BY(mu_);
};

class Service final : public v1::Rendezvous::WithRawCallbackMethod_Session<v1::Rendezvous::Service> {
 public:
  Service(Coordinator* coordinator, Ticker* ticker, GateLink* link)
      : coordinator_(coordinator), ticker_(ticker), link_(link) {}

  // The token is proven inside the session (Challenge, Join, Welcome), never sent.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Session(grpc::CallbackServerContext* context) override {
    return new SessionReactor(coordinator_, ticker_, link_, context->peer(), next_id_++);
  }

 private:
  Coordinator* const coordinator_;
  Ticker* const ticker_;
  GateLink* const link_;
  std::atomic<SessionId> next_id_{1};
};

}  // namespace

class CoordinatorServer::Impl {
 public:
  explicit Impl(Coordinator::Options options) : coordinator(std::move(options)) {}
  ~Impl() {
    if (!socket_dir.empty()) {
      ::unlink(socket_path.c_str());
      ::rmdir(socket_dir.c_str());
    }
  }
  Coordinator coordinator;
  GateLink link;
  std::unique_ptr<Ticker> ticker;
  std::unique_ptr<Service> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<ConnectionGate> gate;
  std::string socket_dir;  // Private (0700), holding gRPC's unix socket.
  std::string socket_path;
  std::once_flag shutdown_once;
};

namespace {

constexpr char kSocketDirPrefix[] = "elrun-rdzv-";
constexpr char kSocketName[] = "/coordinator.sock";

// Removes what coordinators of this user that died without cleaning up (kill -9) left in
// `base`: directories named elrun-rdzv-<pid>-XXXXXX whose process no longer exists.
void RemoveStaleSocketDirs(const std::string& base) {
  DIR* dir = ::opendir(base.c_str());
  if (dir == nullptr) return;
  while (dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (name.rfind(kSocketDirPrefix, 0) != 0) continue;
    int pid = std::atoi(name.c_str() + std::strlen(kSocketDirPrefix));
    std::string path = base + "/" + name;
    struct stat info {};
    if (pid <= 0 || ::lstat(path.c_str(), &info) != 0 || !S_ISDIR(info.st_mode) || info.st_uid != ::getuid()) {
      continue;
    }
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    ::unlink((path + kSocketName).c_str());
    ::rmdir(path.c_str());
  }
  ::closedir(dir);
}

// A fresh private directory (0700) for gRPC's unix socket, under $TMPDIR or /tmp, named with
// this process's id so that a later coordinator can remove it if this one is killed.
absl::StatusOr<std::string> MakeSocketDir() {
  // A unix socket path must fit in 108 bytes: a long $TMPDIR (Bazel's) falls back to /tmp.
  const char* tmp = std::getenv("TMPDIR");
  std::string base = tmp != nullptr && *tmp != '\0' && std::strlen(tmp) < 64 ? tmp : "/tmp";
  RemoveStaleSocketDirs(base);
  std::string pattern = absl::StrCat(base, "/", kSocketDirPrefix, ::getpid(), "-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, ": ", std::strerror(errno)));
  }
  return pattern;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(const ServerOptions& options) {
  RaiseOpenFileLimit();
  Coordinator::Options coordinator_options{options.first_join_timeout, options.token, nullptr};
  coordinator_options.require_run_token = options.require_run_token;
  coordinator_options.incarnation = RandomNonce();  // This process's state: gone with it.
  auto impl = std::make_unique<Impl>(std::move(coordinator_options));
  auto dir = MakeSocketDir();
  if (!dir.ok()) return dir.status();
  impl->socket_dir = *dir;
  impl->socket_path = *dir + kSocketName;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (options.tls.enabled()) {
    auto cert = ReadFileToString(options.tls.cert);
    auto key = ReadFileToString(options.tls.key);
    if (!cert.ok()) return cert.status();
    if (!key.ok()) return key.status();
    grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    if (!options.tls.ca.empty()) {
      auto ca = ReadFileToString(options.tls.ca);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    credentials = grpc::SslServerCredentials(ssl);
  }
  impl->ticker = std::make_unique<Ticker>(&impl->coordinator);
  impl->service = std::make_unique<Service>(&impl->coordinator, impl->ticker.get(), &impl->link);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort("unix:" + impl->socket_path, credentials, &bound);
  builder.RegisterService(impl->service.get());
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, static_cast<int>(options.handshake_timeout.count()));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(options.idle_connection_timeout.count()));
  // Agents ping once a second at most (kMinKeepalivePing) to notice a silent coordinator;
  // accept that, while a client pinging faster still collects strikes and is cut off.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             static_cast<int>(kMinKeepalivePing.count() / 2));
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || bound == 0) {
    return absl::InternalError(absl::StrCat("cannot serve gRPC on unix:", impl->socket_path));
  }
  auto gate = ConnectionGate::Start(options.listen, impl->socket_path, options.gate);
  if (!gate.ok()) {
    impl->server->Shutdown(std::chrono::system_clock::now());
    impl->server->Wait();
    impl->ticker.reset();
    return gate.status();
  }
  impl->gate = *std::move(gate);
  impl->link.Attach(impl->gate.get());
  return std::unique_ptr<CoordinatorServer>(new CoordinatorServer(std::move(impl)));
}

CoordinatorServer::CoordinatorServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

int CoordinatorServer::port() const { return impl_->gate->port(); }

GateCounts CoordinatorServer::gate_counts() const { return impl_->gate->counts(); }

Coordinator& CoordinatorServer::coordinator() { return impl_->coordinator; }

void CoordinatorServer::Shutdown() {
  std::call_once(impl_->shutdown_once, [this] {
    impl_->link.Attach(nullptr);
    impl_->gate.reset();  // No new connections; the relayed ones end, so gRPC sees them go.
    impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    impl_->server->Wait();
    impl_->ticker.reset();
  });
}

}  // namespace elrun::rdzv
