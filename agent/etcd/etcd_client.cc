#include "agent/etcd/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace elrun::rdzv {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// A member that cannot answer now: try the next one.
bool Unreachable(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

bool TokenExpired(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAUTHENTICATED &&
         status.error_message().find("invalid auth token") != std::string::npos;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const TlsFiles& tls, bool https) {
  if (!tls.enabled() && !https) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  if (!tls.ca.empty()) {
    auto ca = ReadFileToString(tls.ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (!tls.cert.empty()) {
    auto cert = ReadFileToString(tls.cert);
    if (!cert.ok()) return cert.status();
    auto key = ReadFileToString(tls.key);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

struct EtcdClient::Member {
  std::string endpoint;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdpb::KV::Stub> kv;
  std::unique_ptr<etcdpb::Lease::Stub> lease;
  std::unique_ptr<etcdpb::Watch::Stub> watch;
  std::unique_ptr<etcdpb::Auth::Stub> auth;
  std::unique_ptr<etcdpb::Maintenance::Stub> maintenance;
};

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(const EtcdOptions& options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("no etcd endpoint");
  auto credentials = Credentials(options.tls, options.https);
  if (!credentials.ok()) return credentials.status();
  std::unique_ptr<EtcdClient> client(new EtcdClient(options));
  // Agents start on different members, so that a big job does not load one member alone.
  {
    absl::MutexLock lock(&client->mu_);
    client->current_ = static_cast<size_t>(std::random_device{}()) % options.endpoints.size();
  }
  for (const std::string& endpoint : options.endpoints) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);  // A page of a big job's log.
    // A member that comes back is used again within a second.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // A member that stops answering (SIGSTOP, a dead host without a RST) must end the watch
    // streams on it, or an agent would wait on it forever: HTTP/2 pings while a call is open,
    // every 5 s, the least etcd accepts (--grpc-keepalive-min-time).
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    auto member = std::make_unique<Member>();
    member->endpoint = endpoint;
    member->channel = grpc::CreateCustomChannel(endpoint, *credentials, args);
    member->kv = etcdpb::KV::NewStub(member->channel);
    member->lease = etcdpb::Lease::NewStub(member->channel);
    member->watch = etcdpb::Watch::NewStub(member->channel);
    member->auth = etcdpb::Auth::NewStub(member->channel);
    member->maintenance = etcdpb::Maintenance::NewStub(member->channel);
    client->members_.push_back(std::move(member));
  }
  if (!options.user.empty()) {
    // Any member will do; Retry moves on from unreachable ones.
    absl::Status status = client->Retry("authenticate", [&](Member& member, grpc::ClientContext&) {
      absl::Status s = client->Authenticate(member);
      return s.ok() ? grpc::Status::OK
                    : grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
    });
    if (!status.ok()) return status;
  }
  return client;
}

absl::Status EtcdClient::Authenticate(Member& member) {
  etcdpb::AuthenticateRequest request;
  request.set_name(options_.user);
  request.set_password(options_.password);
  etcdpb::AuthenticateResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options_.call_timeout);
  grpc::Status status = member.auth->Authenticate(&context, request, &response);
  if (!status.ok()) {
    if (Unreachable(status)) return FromGrpc(status);
    return absl::UnauthenticatedError(
        absl::StrCat("etcd refused user '", options_.user, "': ", status.error_message()));
  }
  absl::MutexLock lock(&mu_);
  token_ = response.token();
  return absl::OkStatus();
}

void EtcdClient::SetUp(grpc::ClientContext& context, bool deadline) {
  if (deadline) context.set_deadline(std::chrono::system_clock::now() + options_.call_timeout);
  absl::MutexLock lock(&mu_);
  if (!token_.empty()) context.AddMetadata("token", token_);
}

template <typename Call>
absl::Status EtcdClient::Retry(const char* what, Call call, std::optional<RetryPlan> plan) {
  auto give_up = std::chrono::steady_clock::now() + options_.retry_for;
  size_t index;
  {
    absl::MutexLock lock(&mu_);
    index = plan ? plan->start % members_.size() : current_;
  }
  bool reauthenticated = false;
  grpc::Status last;
  for (size_t tries = 0;; ++tries) {
    Member& member = *members_[index];
    grpc::ClientContext context;
    SetUp(context, true);
    if (plan) context.set_deadline(std::chrono::system_clock::now() + std::min(plan->attempt, options_.call_timeout));
    last = call(member, context);
    if (last.ok()) {
      absl::MutexLock lock(&mu_);
      current_ = index;
      return absl::OkStatus();
    }
    if (TokenExpired(last) && !options_.user.empty() && !reauthenticated) {
      reauthenticated = true;
      if (Authenticate(member).ok()) continue;
    }
    if (!Unreachable(last) && last.error_message().find("leader changed") == std::string::npos &&
        last.error_message().find("no leader") == std::string::npos) {
      break;
    }
    if (std::chrono::steady_clock::now() >= give_up) break;
    index = (index + 1) % members_.size();
    // A whole turn of the members found none: give an election or a restart a moment.
    if ((tries + 1) % members_.size() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::string where = members_.size() == 1 ? members_[0]->endpoint : absl::StrCat(members_.size(), " members");
  return absl::Status(static_cast<absl::StatusCode>(last.error_code()),
                      absl::StrCat("etcd ", what, " (", where, "): ", last.error_message()));
}

absl::StatusOr<etcdpb::RangeResponse> EtcdClient::Range(const etcdpb::RangeRequest& request) {
  etcdpb::RangeResponse response;
  absl::Status status = Retry("range", [&](Member& member, grpc::ClientContext& context) {
    return member.kv->Range(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<etcdpb::TxnResponse> EtcdClient::Txn(const etcdpb::TxnRequest& request) {
  etcdpb::TxnResponse response;
  absl::Status status = Retry("txn", [&](Member& member, grpc::ClientContext& context) {
    return member.kv->Txn(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(int64_t ttl_seconds) {
  etcdpb::LeaseGrantRequest request;
  request.set_ttl(ttl_seconds);
  etcdpb::LeaseGrantResponse response;
  absl::Status status = Retry("lease grant", [&](Member& member, grpc::ClientContext& context) {
    return member.lease->LeaseGrant(&context, request, &response);
  });
  if (!status.ok()) return status;
  if (!response.error().empty()) return absl::InternalError(absl::StrCat("etcd lease grant: ", response.error()));
  return response.id();
}

// A lease keepalive stream driven from the caller's thread through its own completion queue,
// so that every wait is bounded.
class EtcdClient::KeepAliveStream {
 public:
  KeepAliveStream(etcdpb::Lease::Stub& stub, std::unique_ptr<grpc::ClientContext> context)
      : context_(std::move(context)), stream_(stub.PrepareAsyncLeaseKeepAlive(context_.get(), &cq_)) {}
  ~KeepAliveStream() {
    context_->TryCancel();
    while (pending_ > 0) {  // Cancelled: they complete at once.
      void* tag;
      bool ok;
      if (!cq_.Next(&tag, &ok)) break;
      --pending_;
    }
    if (started_) {
      grpc::Status status;
      stream_->Finish(&status, this);
      void* tag;
      bool ok;
      (void)cq_.Next(&tag, &ok);
    }
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  bool Start(std::chrono::milliseconds timeout) {
    stream_->StartCall(this);
    ++pending_;
    started_ = Await(timeout);
    return started_;
  }

  // One renewal; false when the stream failed or did not answer within `timeout`.
  bool Renew(int64_t lease_id, std::chrono::milliseconds timeout, etcdpb::LeaseKeepAliveResponse* response) {
    etcdpb::LeaseKeepAliveRequest request;
    request.set_id(lease_id);
    stream_->Write(request, this);
    ++pending_;
    if (!Await(timeout)) return false;
    stream_->Read(response, this);
    ++pending_;
    return Await(timeout) && response->id() == lease_id;
  }

 private:
  // Waits for the one operation in flight.
  bool Await(std::chrono::milliseconds timeout) {
    void* tag;
    bool ok;
    auto deadline = std::chrono::system_clock::now() + timeout;
    if (cq_.AsyncNext(&tag, &ok, deadline) != grpc::CompletionQueue::GOT_EVENT) return false;
    --pending_;
    return ok;
  }

  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientAsyncReaderWriterInterface<etcdpb::LeaseKeepAliveRequest, etcdpb::LeaseKeepAliveResponse>>
      stream_;
  int pending_ = 0;
  bool started_ = false;
};

EtcdClient::~EtcdClient() = default;  // (KeepAliveStream is complete here.)

absl::StatusOr<int64_t> EtcdClient::KeepAlive(int64_t lease_id) {
  absl::MutexLock lock(&keepalive_mu_);
  if (!keepalive_) {
    size_t index;
    {
      absl::MutexLock guard(&mu_);
      index = current_;
    }
    // The first stream goes to the etcd leader: a follower forwards each renewal to the leader
    // as an HTTP request of its own, several times the cost of the renewal. A stream opened
    // after a failure goes to the member that answered instead, unprobed: a stalled member
    // would hold a probe as long as it held the renewal.
    if (!leader_looked_up_) {
      leader_looked_up_ = true;
      index = LeaderOr(index);
    }
    auto context = std::make_unique<grpc::ClientContext>();
    SetUp(*context, false);
    auto stream = std::make_unique<KeepAliveStream>(*members_[index]->lease, std::move(context));
    keepalive_member_ = index;
    if (stream->Start(options_.call_timeout)) keepalive_ = std::move(stream);
  }
  if (keepalive_) {
    etcdpb::LeaseKeepAliveResponse response;
    if (keepalive_->Renew(lease_id, options_.call_timeout, &response)) {
      if (response.ttl() <= 0) return absl::NotFoundError("etcd lease expired");
      return response.ttl();
    }
    keepalive_.reset();
  }
  // Dead, stalled or refused: calls of their own on the other members, from the next one,
  // each given a short while. (A stalled member already took a call timeout. A follower that
  // has not yet seen its leader stall forwards the renewal there and holds it: the next
  // member is tried meanwhile, and the first that knows the new leader renews the lease, which
  // that leader has extended by an election timeout.)
  return KeepAliveOnce(lease_id, RetryPlan{keepalive_member_ + 1, kFallbackAttempt});
}

size_t EtcdClient::LeaderOr(size_t fallback) {
  if (members_.size() == 1) return fallback;
  // Each member names the leader's id and its own (its answer's header): at most one call per
  // member, each short, and none to the last one when every other answered as a follower of
  // the same leader (an endpoint per member, as etcd's clients are given).
  uint64_t leader = 0;
  size_t followers = 0;
  for (size_t k = 0; k < members_.size(); ++k) {
    size_t index = (fallback + k) % members_.size();
    if (followers == members_.size() - 1) return index;
    grpc::ClientContext context;
    SetUp(context, true);
    context.set_deadline(std::chrono::system_clock::now() + std::min(kFallbackAttempt, options_.call_timeout));
    etcdpb::StatusResponse status;
    if (!members_[index]->maintenance->Status(&context, etcdpb::StatusRequest(), &status).ok()) continue;
    if (status.leader() == 0) continue;  // Electing: it does not know.
    if (leader == 0) leader = status.leader();
    if (status.leader() != leader) return fallback;  // An election in between: no guess.
    if (status.header().member_id() == leader) return index;
    ++followers;
  }
  return fallback;
}

absl::StatusOr<int64_t> EtcdClient::KeepAliveOnce(int64_t lease_id, std::optional<RetryPlan> plan) {
  etcdpb::LeaseKeepAliveResponse response;
  absl::Status status = Retry(
      "lease keepalive",
      [&](Member& member, grpc::ClientContext& context) {
        auto stream = member.lease->LeaseKeepAlive(&context);
        etcdpb::LeaseKeepAliveRequest request;
        request.set_id(lease_id);
        if (stream->Write(request)) stream->WritesDone();
        bool got = stream->Read(&response);
        grpc::Status finished = stream->Finish();
        if (got) return grpc::Status::OK;
        return finished.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "keepalive stream ended") : finished;
      },
      plan);
  if (!status.ok()) return status;
  if (response.ttl() <= 0) return absl::NotFoundError("etcd lease expired");
  return response.ttl();
}

absl::Status EtcdClient::RevokeLease(int64_t lease_id) {
  etcdpb::LeaseRevokeRequest request;
  request.set_id(lease_id);
  etcdpb::LeaseRevokeResponse response;
  return Retry("lease revoke", [&](Member& member, grpc::ClientContext& context) {
    return member.lease->LeaseRevoke(&context, request, &response);
  });
}

absl::StatusOr<std::unique_ptr<EtcdKvWatch>> EtcdClient::Watch(const std::vector<WatchRange>& ranges,
                                                               int64_t start_revision) {
  std::unique_ptr<EtcdKvWatch> watch;
  absl::Status status = Retry("watch", [&](Member& member, grpc::ClientContext& unused) {
    (void)unused;
    auto opened = std::unique_ptr<EtcdWatch>(new EtcdWatch());
    opened->context_ = std::make_unique<grpc::ClientContext>();
    SetUp(*opened->context_, false);
    opened->stream_ = member.watch->Watch(opened->context_.get());
    auto fail = [&](grpc::Status why) {
      opened->context_->TryCancel();
      grpc::Status finished = opened->stream_->Finish();
      if (!why.ok()) return why;
      return finished.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch stream ended") : finished;
    };
    for (const WatchRange& range : ranges) {
      etcdpb::WatchRequest request;
      auto* create = request.mutable_create_request();
      create->set_key(range.key);
      create->set_range_end(range.range_end);
      create->set_start_revision(start_revision);
      if (!opened->stream_->Write(request)) return fail(grpc::Status::OK);
    }
    // etcd creates the watchers in order; a watcher's first events may come before the next
    // one's creation: they are kept for Read.
    size_t created = 0;
    while (created < ranges.size()) {
      etcdpb::WatchResponse response;
      if (!opened->stream_->Read(&response)) return fail(grpc::Status::OK);
      if (response.canceled()) {
        return fail(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                 absl::StrCat("watch refused: ", response.cancel_reason(),
                                              response.compact_revision() > 0 ? " (history compacted)" : "")));
      }
      if (response.created()) {
        ++created;
        if (response.events_size() == 0) continue;
      }
      opened->early_.push_back(std::move(response));
    }
    watch = std::move(opened);
    return grpc::Status::OK;
  });
  if (!status.ok()) return status;
  return watch;
}

EtcdWatch::~EtcdWatch() {
  if (context_) {
    context_->TryCancel();
    stream_->Finish();
  }
}

bool EtcdWatch::Read(etcdpb::WatchResponse* response) {
  if (!early_.empty()) {
    *response = std::move(early_.front());
    early_.pop_front();
    return true;
  }
  return stream_->Read(response);
}

absl::Status EtcdWatch::Finish() {
  grpc::Status status = stream_->Finish();
  context_.reset();
  return FromGrpc(status);
}

void EtcdWatch::Cancel() { context_->TryCancel(); }

}  // namespace elrun::rdzv
