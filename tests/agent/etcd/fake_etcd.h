// An etcd v3 in memory, for the etcd-v3 backend's unit tests: the parts of etcd's semantics
// the backend relies on, after etcd 3.4's server (etcdserver/apply.go, mvcc/): one revision
// per writing transaction, create and mod revisions and versions per key, reads at a past
// revision (OutOfRange once compacted), Range's sort, limit, keys-only, count-only and
// create/mod revision filters, transaction compares over a key or a range (VALUE fails on an
// absent key), nested transactions whose compares see the state before the transaction,
// etcd's refusal of a put and a delete of the same key in one transaction, leases that take
// their keys with them when revoked or when their TTL runs out on the clock, and watches from
// a revision (refused below the compacted one). Each client is named: Cut makes its calls fail
// with Unavailable after the retry time, as EtcdClient does with every member unreachable, and
// ends its watches. Thread-safe.
#ifndef ELRUN_TESTS_AGENT_ETCD_FAKE_ETCD_H_
#define ELRUN_TESTS_AGENT_ETCD_FAKE_ETCD_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/etcd/etcd_kv.h"
#include "tests/agent/etcd/fake_clock.h"

namespace elrun::rdzv {

class FakeEtcd {
 public:
  // `retry_for`: how long (on the clock) a cut client's call waits before it fails.
  FakeEtcd(std::shared_ptr<FakeClock> clock, std::chrono::milliseconds retry_for);
  ~FakeEtcd();

  // A client named `name` (names may repeat: Cut reaches every client of that name).
  std::unique_ptr<EtcdKv> Connect(const std::string& name);
  // Cuts every client named `name` off until Restore: its calls wait for the retry time, then
  // fail with Unavailable; its watches end with Unavailable.
  void Cut(const std::string& name);
  void Restore(const std::string& name);

  // Revokes every lease whose TTL ran out on the clock, as etcd's lessor does by itself (here
  // every call does it first, and a test may too after moving the clock).
  void ExpireDue();
  // Forgets the history before `revision`: reads and watches from before it are refused.
  void Compact(int64_t revision);
  int64_t revision() const;
  // The number of live leases, and the keys in [key, range_end) at the current revision, as
  // a client of no name would read them.
  size_t leases() const;
  std::vector<mvccpb::KeyValue> Keys(const std::string& key, const std::string& range_end) const;
  // Waits, up to `limit` of real time, until the first lease a client named `name` granted
  // (an agent's own, which holds its presence) was granted or renewed at or after `since` on
  // the clock; false when it was not, or is gone.
  bool AwaitRenewal(const std::string& name, EtcdClock::TimePoint since, std::chrono::milliseconds limit) const;

 private:
  class Client;
  class Watch;
  struct Version {  // A key's value as of a revision; deleted: a tombstone.
    mvccpb::KeyValue kv;
    bool deleted = false;
  };
  struct Lease {
    int64_t ttl_s = 0;
    EtcdClock::TimePoint deadline;
    EtcdClock::TimePoint renewed;  // Granted or last renewed.
    std::set<std::string> keys;
  };
  struct Change {  // One event of the history, at its revision.
    int64_t revision;
    mvccpb::Event event;
  };

  // Waits while `name` is cut, for the retry time at most: Unavailable when it still is.
  absl::Status Reach(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireDueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<etcdpb::RangeResponse> RangeLocked(const etcdpb::RangeRequest& request, int64_t pending) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<etcdpb::TxnResponse> TxnLocked(const etcdpb::TxnRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int64_t> GrantLocked(const std::string& name, int64_t ttl_s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int64_t> KeepAliveLocked(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RevokeLocked(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The live keys of [key, range_end) as of `revision`, in key order.
  std::vector<mvccpb::KeyValue> At(const std::string& key, const std::string& range_end, int64_t revision) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Compares(const etcdpb::Compare& compare) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the branches of `request` and of its nested transactions against the state before
  // any of them writes, as etcd does; `path` gets one choice per transaction, in order.
  void ChooseBranches(const etcdpb::TxnRequest& request, std::vector<bool>* path) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckOps(const etcdpb::TxnRequest& request, const std::vector<bool>& path, size_t* at) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunOps(const etcdpb::TxnRequest& request, const std::vector<bool>& path, size_t* at, int64_t revision,
              bool* wrote, etcdpb::TxnResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PutLocked(const etcdpb::PutRequest& put, int64_t revision) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t DeleteLocked(const std::string& key, const std::string& range_end, int64_t revision)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Header(etcdpb::ResponseHeader* header) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<FakeClock> clock_;
  const std::chrono::milliseconds retry_for_;
  mutable absl::Mutex mu_;
  // Signalled on every change: a write, a cut, a restore, a cancelled watch.
  mutable absl::CondVar changed_;
  int64_t revision_ ABSL_GUARDED_BY(mu_) = 1;  // etcd's first revision.
  int64_t compacted_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::vector<Version>> keys_ ABSL_GUARDED_BY(mu_);
  std::vector<Change> history_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  int64_t next_lease_ ABSL_GUARDED_BY(mu_) = 0x694d7b0000000001;
  std::set<std::string> cut_ ABSL_GUARDED_BY(mu_);
  // The first lease a client of each name granted.
  std::map<std::string, int64_t> first_lease_ ABSL_GUARDED_BY(mu_);
  int64_t next_watch_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace elrun::rdzv

#endif  // ELRUN_TESTS_AGENT_ETCD_FAKE_ETCD_H_
