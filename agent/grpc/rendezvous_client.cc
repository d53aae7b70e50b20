#include "agent/grpc/rendezvous_client.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/rendezvous.grpc.pb.h"

namespace elrun::rdzv {

class RendezvousClient::Stream {
 public:
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Rendezvous::Stub> stub;
  grpc::ClientContext context;
  std::string endpoint;
  std::chrono::milliseconds connect_timeout{0};
  std::atomic<bool> cancelled{false};
  absl::Mutex write_mu;
  absl::CondVar write_cv;
  // The stream once open, the messages not sent yet, whether the writer thread is inside a
  // Write, and whether the stream is over.
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMessage, v1::CoordinatorMessage>> rw ABSL_GUARDED_BY(write_mu);
  std::deque<v1::AgentMessage> unsent ABSL_GUARDED_BY(write_mu);
  bool writing ABSL_GUARDED_BY(write_mu) = false;
  bool broken ABSL_GUARDED_BY(write_mu) = false;
};

std::chrono::milliseconds KeepaliveInterval(std::chrono::milliseconds silence_timeout) {
  return std::max(kMinKeepalivePing, silence_timeout / 2);
}

std::chrono::milliseconds KeepaliveTimeout(std::chrono::milliseconds silence_timeout) {
  return std::max(kMinKeepalivePing, silence_timeout);
}

absl::StatusOr<std::unique_ptr<RendezvousClient>> RendezvousClient::Open(const ClientOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls.enabled()) {
    grpc::SslCredentialsOptions ssl;
    if (!options.tls.ca.empty()) {
      auto ca = ReadFileToString(options.tls.ca);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    if (!options.tls.cert.empty()) {
      auto cert = ReadFileToString(options.tls.cert);
      auto key = ReadFileToString(options.tls.key);
      if (!cert.ok()) return cert.status();
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    credentials = grpc::SslCredentials(ssl);
  }
  int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));

  auto stream = std::make_unique<Stream>();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // A coordinator that stops answering (SIGSTOP, a dead host without a RST) is noticed by
  // its missing ping acks (and unacknowledged data: TCP_USER_TIMEOUT), not by TCP's
  // retransmission timeout of many minutes; a shorter silence is waited out.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(KeepaliveInterval(options.silence_timeout).count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(KeepaliveTimeout(options.silence_timeout).count()));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Retry a refused or failed connection within a second (a coordinator that starts later, or
  // whose gate was full during a flood), not after gRPC's default backoff of up to 2 minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  stream->channel = grpc::CreateCustomChannel(options.endpoint, credentials, args);
  stream->stub = v1::Rendezvous::NewStub(stream->channel);
  stream->endpoint = options.endpoint;
  stream->connect_timeout = options.connect_timeout;

  std::unique_ptr<RendezvousClient> client(new RendezvousClient(fd, std::move(stream)));
  client->reader_ = std::thread([raw = client.get()] { raw->ReadLoop(); });
  client->writer_ = std::thread([raw = client.get()] { raw->WriteLoop(); });
  return client;
}

RendezvousClient::RendezvousClient(int event_fd, std::unique_ptr<Stream> stream)
    : event_fd_(event_fd), stream_(std::move(stream)) {}

RendezvousClient::~RendezvousClient() {
  {
    absl::MutexLock lock(&stream_->write_mu);
    stream_->cancelled = true;
  }
  stream_->write_cv.SignalAll();
  stream_->context.TryCancel();
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
  ::close(event_fd_);
}

void RendezvousClient::ReadLoop() {
  // Connect first, so that a coordinator that starts later is waited for, while a stream that
  // breaks afterwards fails at once instead of waiting for a new coordinator.
  auto deadline = std::chrono::system_clock::now() + stream_->connect_timeout;
  grpc_connectivity_state state = stream_->channel->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    if (stream_->cancelled) return End(absl::CancelledError("closed"));
    if (std::chrono::system_clock::now() >= deadline) {
      return End(absl::UnavailableError(
          absl::StrCat("could not connect within ", stream_->connect_timeout.count() / 1000.0,
                       " s (is the coordinator running there, and do the TLS settings match?)")));
    }
    // Bounded waits so that the destructor's cancel is noticed promptly.
    auto step = std::min(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    if (stream_->channel->WaitForStateChange(state, step)) {
      state = stream_->channel->GetState(/*try_to_connect=*/true);
    }
  }
  // Set once, here: this thread reads and finishes it without the lock.
  grpc::ClientReaderWriter<v1::AgentMessage, v1::CoordinatorMessage>* rw;
  {
    absl::MutexLock lock(&stream_->write_mu);
    stream_->rw = stream_->stub->Session(&stream_->context);
    rw = stream_->rw.get();
  }
  stream_->write_cv.SignalAll();
  v1::CoordinatorMessage message;
  while (rw->Read(&message)) {
    {
      absl::MutexLock lock(&mu_);
      inbox_.push_back(message);
    }
    uint64_t one = 1;
    ssize_t ignored = ::write(event_fd_, &one, sizeof(one));
    (void)ignored;
  }
  {
    // The call is over, so a Write in progress returns at once; Finish must not overlap it.
    absl::MutexLock lock(&stream_->write_mu);
    stream_->broken = true;
    stream_->write_cv.SignalAll();
    while (stream_->writing) stream_->write_cv.Wait(&stream_->write_mu);
  }
  grpc::Status status = rw->Finish();
  End(absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message()));
}

void RendezvousClient::WriteLoop() {
  absl::MutexLock lock(&stream_->write_mu);
  for (;;) {
    while (!(stream_->cancelled || stream_->broken || (stream_->rw && !stream_->unsent.empty()))) {
      stream_->write_cv.Wait(&stream_->write_mu);
    }
    if (stream_->cancelled || stream_->broken) return;
    v1::AgentMessage message = std::move(stream_->unsent.front());
    stream_->unsent.pop_front();
    stream_->writing = true;
    auto* rw = stream_->rw.get();
    stream_->write_mu.Unlock();
    bool ok = rw->Write(message);
    stream_->write_mu.Lock();
    stream_->writing = false;
    stream_->write_cv.SignalAll();
    if (!ok) {
      stream_->broken = true;
      return;
    }
  }
}

void RendezvousClient::End(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    ended_ = status;
  }
  {
    absl::MutexLock lock(&stream_->write_mu);
    stream_->broken = true;
  }
  stream_->write_cv.SignalAll();
  uint64_t one = 1;
  ssize_t ignored = ::write(event_fd_, &one, sizeof(one));
  (void)ignored;
}

bool RendezvousClient::Write(const v1::AgentMessage& message) {
  {
    absl::MutexLock lock(&stream_->write_mu);
    if (stream_->broken) return false;
    stream_->unsent.push_back(message);
  }
  stream_->write_cv.SignalAll();
  return true;
}

std::deque<v1::CoordinatorMessage> RendezvousClient::Take() {
  uint64_t count;
  ssize_t ignored = ::read(event_fd_, &count, sizeof(count));
  (void)ignored;
  absl::MutexLock lock(&mu_);
  std::deque<v1::CoordinatorMessage> out;
  out.swap(inbox_);
  if (ended_) {  // Stay readable so the loop sees the end.
    uint64_t one = 1;
    ignored = ::write(event_fd_, &one, sizeof(one));
  }
  return out;
}

std::optional<absl::Status> RendezvousClient::ended() const {
  absl::MutexLock lock(&mu_);
  return ended_;
}

}  // namespace elrun::rdzv
