// What the etcd-v3 rendezvous backend needs of etcd: KV ranges and transactions, leases and
// watch streams, in etcd's own v3 messages. EtcdClient (etcd_client.h) serves it from a real
// cluster; tests serve it from a fake (tests/agent/etcd/fake_etcd.h). Implementations are
// thread-safe; a watch belongs to one reader thread, and Cancel may come from any.
#ifndef ELRUN_AGENT_ETCD_ETCD_KV_H_
#define ELRUN_AGENT_ETCD_ETCD_KV_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "etcd/etcdserver/etcdserverpb/rpc.pb.h"

namespace elrun::rdzv {

namespace etcdpb = ::etcdserverpb;

// The key just past every key that starts with `prefix` (etcd's range_end for a prefix).
std::string PrefixEnd(const std::string& prefix);

// One watch stream. Read blocks for the next response (events of any of its watchers); Cancel
// (any thread) makes it return.
class EtcdKvWatch {
 public:
  virtual ~EtcdKvWatch() = default;
  // False when the stream ended (its member died, or Cancel); then Finish gives why.
  virtual bool Read(etcdpb::WatchResponse* response) = 0;
  virtual absl::Status Finish() = 0;
  virtual void Cancel() = 0;
};

class EtcdKv {
 public:
  virtual ~EtcdKv() = default;

  // Errors: Unavailable or DeadlineExceeded when no member answered for the implementation's
  // retry time; etcd's own refusals with etcd's code (a lease not found: NotFound; a revision
  // compacted: OutOfRange).
  virtual absl::StatusOr<etcdpb::RangeResponse> Range(const etcdpb::RangeRequest& request) = 0;
  virtual absl::StatusOr<etcdpb::TxnResponse> Txn(const etcdpb::TxnRequest& request) = 0;
  virtual absl::StatusOr<int64_t> GrantLease(int64_t ttl_seconds) = 0;
  // The lease's remaining TTL in seconds after renewing it; NotFound when it has expired.
  virtual absl::StatusOr<int64_t> KeepAlive(int64_t lease_id) = 0;
  virtual absl::Status RevokeLease(int64_t lease_id) = 0;

  // One watched range: [key, range_end), or the key alone when range_end is empty.
  struct WatchRange {
    std::string key;
    std::string range_end;
  };
  // Opens one watch stream with a watcher per range, each from `start_revision`; returns once
  // they all exist. FailedPrecondition when etcd refuses one (its history compacted).
  virtual absl::StatusOr<std::unique_ptr<EtcdKvWatch>> Watch(const std::vector<WatchRange>& ranges,
                                                             int64_t start_revision) = 0;
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_ETCD_ETCD_KV_H_
