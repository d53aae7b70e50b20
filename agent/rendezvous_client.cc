#include "agent/rendezvous_client.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
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
  std::mutex write_mu;
  // Guarded by write_mu: the stream once open, and what was written before.
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMessage, v1::CoordinatorMessage>> rw;
  std::vector<v1::AgentMessage> unsent;
  bool broken = false;
};

absl::StatusOr<std::unique_ptr<RendezvousClient>> RendezvousClient::Open(
    const ClientOptions& options) {
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
  args.SetMaxReceiveMessageSize(64 * 1024);
  args.SetMaxSendMessageSize(64 * 1024);
  stream->channel = grpc::CreateCustomChannel(options.endpoint, credentials, args);
  stream->stub = v1::Rendezvous::NewStub(stream->channel);
  if (!options.token.empty()) stream->context.AddMetadata(kTokenMetadata, options.token);
  stream->endpoint = options.endpoint;
  stream->connect_timeout = options.connect_timeout;

  std::unique_ptr<RendezvousClient> client(new RendezvousClient(fd, std::move(stream)));
  client->reader_ = std::thread([raw = client.get()] { raw->ReadLoop(); });
  return client;
}

RendezvousClient::RendezvousClient(int event_fd, std::unique_ptr<Stream> stream)
    : event_fd_(event_fd), stream_(std::move(stream)) {}

RendezvousClient::~RendezvousClient() {
  stream_->cancelled = true;
  stream_->context.TryCancel();
  if (reader_.joinable()) reader_.join();
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
      return End(absl::UnavailableError(absl::StrCat(
          "could not connect within ", stream_->connect_timeout.count() / 1000.0,
          " s (is the coordinator running there, and do the TLS settings match?)")));
    }
    // Bounded waits so that the destructor's cancel is noticed promptly.
    auto step = std::min(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    if (stream_->channel->WaitForStateChange(state, step)) {
      state = stream_->channel->GetState(/*try_to_connect=*/true);
    }
  }
  {
    std::lock_guard<std::mutex> lock(stream_->write_mu);
    stream_->rw = stream_->stub->Session(&stream_->context);
    for (const v1::AgentMessage& m : stream_->unsent) {
      if (!stream_->rw->Write(m)) stream_->broken = true;
    }
    stream_->unsent.clear();
  }
  v1::CoordinatorMessage message;
  while (stream_->rw->Read(&message)) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      inbox_.push_back(message);
    }
    uint64_t one = 1;
    ssize_t ignored = ::write(event_fd_, &one, sizeof(one));
    (void)ignored;
  }
  grpc::Status status = stream_->rw->Finish();
  End(absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message()));
}

void RendezvousClient::End(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = status;
  }
  {
    std::lock_guard<std::mutex> lock(stream_->write_mu);
    stream_->broken = true;
  }
  uint64_t one = 1;
  ssize_t ignored = ::write(event_fd_, &one, sizeof(one));
  (void)ignored;
}

bool RendezvousClient::Write(const v1::AgentMessage& message) {
  std::lock_guard<std::mutex> lock(stream_->write_mu);
  if (stream_->broken) return false;
  if (!stream_->rw) {
    stream_->unsent.push_back(message);
    return true;
  }
  return stream_->rw->Write(message);
}

std::deque<v1::CoordinatorMessage> RendezvousClient::Take() {
  uint64_t count;
  ssize_t ignored = ::read(event_fd_, &count, sizeof(count));
  (void)ignored;
  std::lock_guard<std::mutex> lock(mu_);
  std::deque<v1::CoordinatorMessage> out;
  out.swap(inbox_);
  if (ended_) {  // Stay readable so the loop sees the end.
    uint64_t one = 1;
    ignored = ::write(event_fd_, &one, sizeof(one));
  }
  return out;
}

std::optional<absl::Status> RendezvousClient::ended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_;
}

}  // namespace elrun::rdzv
