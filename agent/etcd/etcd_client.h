// A small synchronous client of etcd's v3 gRPC API for the etcd-v3 rendezvous backend, which
// sees it as an EtcdKv (etcd_kv.h): KV ranges and transactions, leases, watch streams, over
// every member of a cluster. A call that
// finds its member unreachable (UNAVAILABLE, or no answer within the call timeout) moves on to
// the next member, so the death of one member - the leader included - costs a retry, not the
// job. With a user, the client authenticates and sends etcd's token on every call, and
// authenticates again when etcd says the token expired. TLS to etcd with TlsFiles.
// Thread-safe: any thread may call any method; a Watch belongs to one reader thread.
#ifndef ELRUN_AGENT_ETCD_ETCD_CLIENT_H_
#define ELRUN_AGENT_ETCD_ETCD_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/etcd/etcd_kv.h"
#include "agent/net/transport.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace elrun::rdzv {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // host:port of each member.
  TlsFiles tls;                        // enabled(): https to etcd.
  bool https = false;                  // https even without TlsFiles: the system's CAs.
  std::string user;                    // etcd authentication; empty: none.
  std::string password;                // Never logged.
  // One call's limit on one member before the next is tried.
  std::chrono::milliseconds call_timeout{2000};
  // How long a call keeps trying the members (all down, or electing a leader) before failing.
  std::chrono::milliseconds retry_for{10000};
};

class EtcdWatch;

class EtcdClient : public EtcdKv {
 public:
  // Makes one channel per member and authenticates when a user is set (retrying for
  // retry_for). Errors: no endpoint, unreadable TLS files, wrong user or password
  // (Unauthenticated), no member reachable (Unavailable).
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Connect(const EtcdOptions& options);
  ~EtcdClient() override;

  absl::StatusOr<etcdpb::RangeResponse> Range(const etcdpb::RangeRequest& request) override;
  absl::StatusOr<etcdpb::TxnResponse> Txn(const etcdpb::TxnRequest& request) override;
  absl::StatusOr<int64_t> GrantLease(int64_t ttl_seconds) override;
  // The lease's remaining TTL in seconds after renewing it; NotFound when it has expired.
  // Renews over one long-lived stream (as etcd's own clients do: a new stream per renewal
  // costs etcd several times more), the first one opened on the etcd leader. A stream that
  // fails or does not answer within the call timeout is dropped, and that renewal retried as
  // a call of its own on the other members in turn, each attempt short; the next stream opens
  // on the member that answered.
  absl::StatusOr<int64_t> KeepAlive(int64_t lease_id) override;
  absl::Status RevokeLease(int64_t lease_id) override;

  // Opens one watch stream on a reachable member with a watcher per range, each from
  // `start_revision`; returns once etcd has created them all.
  absl::StatusOr<std::unique_ptr<EtcdKvWatch>> Watch(const std::vector<WatchRange>& ranges,
                                                     int64_t start_revision) override;

  const EtcdOptions& options() const { return options_; }

 private:
  struct Member;
  class KeepAliveStream;
  // Where Retry starts (an index into members_, taken modulo their number) and how long each
  // attempt may take (at most the call timeout).
  struct RetryPlan {
    size_t start;
    std::chrono::milliseconds attempt;
  };
  // A renewal's attempts after its stream failed: long enough for a renewal that a live
  // leader answers, short against a lease of a few seconds.
  static constexpr std::chrono::milliseconds kFallbackAttempt{500};

  explicit EtcdClient(EtcdOptions options);
  absl::StatusOr<int64_t> KeepAliveOnce(int64_t lease_id, std::optional<RetryPlan> plan);
  // The member that is the etcd leader now (Maintenance.Status), or `fallback` when none says.
  size_t LeaderOr(size_t fallback);

  // Runs `call` on members in turn until one answers, re-authenticating once on an expired
  // token; gives up after retry_for. Without a plan: from the member that answered last, each
  // attempt given the call timeout.
  template <typename Call>
  absl::Status Retry(const char* what, Call call, std::optional<RetryPlan> plan = std::nullopt);
  absl::Status Authenticate(Member& member);
  void SetUp(grpc::ClientContext& context, bool deadline);

  const EtcdOptions options_;
  std::vector<std::unique_ptr<Member>> members_;
  absl::Mutex mu_;
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;  // The member that answered last.
  std::string token_ ABSL_GUARDED_BY(mu_);   // etcd's auth token.
  // Taken before mu_ when both are held.
  absl::Mutex keepalive_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::unique_ptr<KeepAliveStream> keepalive_ ABSL_GUARDED_BY(keepalive_mu_);
  size_t keepalive_member_ ABSL_GUARDED_BY(keepalive_mu_) = 0;    // Its member.
  bool leader_looked_up_ ABSL_GUARDED_BY(keepalive_mu_) = false;  // For the first stream.
};

// One watch stream on one member.
class EtcdWatch : public EtcdKvWatch {
 public:
  ~EtcdWatch() override;
  bool Read(etcdpb::WatchResponse* response) override;
  absl::Status Finish() override;
  void Cancel() override;

 private:
  friend class EtcdClient;
  EtcdWatch() = default;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<etcdpb::WatchRequest, etcdpb::WatchResponse>> stream_;
  std::deque<etcdpb::WatchResponse> early_;  // Events read while waiting for the creations.
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_ETCD_ETCD_CLIENT_H_
