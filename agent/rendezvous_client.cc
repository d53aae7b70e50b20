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
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMessage, v1::CoordinatorMessage>> rw;
  std::mutex write_mu;
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
  // Wait for a coordinator that is not up yet, but not forever.
  stream->context.set_wait_for_ready(true);
  stream->context.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(24 * 365));
  stream->rw = stream->stub->Session(&stream->context);

  std::unique_ptr<RendezvousClient> client(new RendezvousClient(fd, std::move(stream)));
  client->reader_ = std::thread([raw = client.get()] { raw->ReadLoop(); });
  return client;
}

RendezvousClient::RendezvousClient(int event_fd, std::unique_ptr<Stream> stream)
    : event_fd_(event_fd), stream_(std::move(stream)) {}

RendezvousClient::~RendezvousClient() {
  stream_->context.TryCancel();
  if (reader_.joinable()) reader_.join();
  ::close(event_fd_);
}

void RendezvousClient::ReadLoop() {
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  uint64_t one = 1;
  ssize_t ignored = ::write(event_fd_, &one, sizeof(one));
  (void)ignored;
}

bool RendezvousClient::Write(const v1::AgentMessage& message) {
  std::lock_guard<std::mutex> lock(stream_->write_mu);
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
