#include "tests/agent/etcd/fake_etcd.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace elrun::rdzv {
namespace {

// Whether `key` lies in etcd's interval [from, range_end): the key alone for an empty
// range_end, every key from `from` on for "\0".
bool InRange(const std::string& key, const std::string& from, const std::string& range_end) {
  if (range_end.empty()) return key == from;
  if (range_end == std::string(1, '\0')) return key >= from;
  return key >= from && key < range_end;
}

template <typename T>
bool Holds(etcdpb::Compare::CompareResult result, const T& have, const T& want) {
  switch (result) {
    case etcdpb::Compare::EQUAL: return have == want;
    case etcdpb::Compare::GREATER: return have > want;
    case etcdpb::Compare::LESS: return have < want;
    case etcdpb::Compare::NOT_EQUAL: return have != want;
    default: return false;
  }
}

bool CompareKv(const etcdpb::Compare& compare, const mvccpb::KeyValue& kv) {
  switch (compare.target()) {
    case etcdpb::Compare::VERSION: return Holds(compare.result(), kv.version(), compare.version());
    case etcdpb::Compare::CREATE: return Holds(compare.result(), kv.create_revision(), compare.create_revision());
    case etcdpb::Compare::MOD: return Holds(compare.result(), kv.mod_revision(), compare.mod_revision());
    case etcdpb::Compare::VALUE: return Holds(compare.result(), kv.value(), compare.value());
    case etcdpb::Compare::LEASE: return Holds(compare.result(), kv.lease(), compare.lease());
    default: return false;
  }
}

int64_t SortKey(const mvccpb::KeyValue& kv, etcdpb::RangeRequest::SortTarget target) {
  switch (target) {
    case etcdpb::RangeRequest::VERSION: return kv.version();
    case etcdpb::RangeRequest::CREATE: return kv.create_revision();
    case etcdpb::RangeRequest::MOD: return kv.mod_revision();
    default: return 0;
  }
}

}  // namespace

// ------------------------------------------------------------------------- a client

class FakeEtcd::Watch : public EtcdKvWatch {
 public:
  Watch(FakeEtcd* etcd, std::string name, std::vector<EtcdKv::WatchRange> ranges, size_t next)
      : etcd_(etcd), name_(std::move(name)), ranges_(std::move(ranges)), next_(next) {}

  bool Read(etcdpb::WatchResponse* response) override {
    absl::MutexLock lock(&etcd_->mu_);
    while (true) {
      if (cancelled_) {
        ended_ = absl::CancelledError("watch cancelled");
        return false;
      }
      if (etcd_->cut_.count(name_)) {
        ended_ = absl::UnavailableError("etcd watch: the member is unreachable");
        return false;
      }
      // The events of the next revision that holds one of this stream's.
      response->Clear();
      while (next_ < etcd_->history_.size()) {
        const Change& change = etcd_->history_[next_];
        if (response->events_size() > 0 && change.revision != response->header().revision()) break;
        ++next_;
        for (const EtcdKv::WatchRange& range : ranges_) {
          if (InRange(change.event.kv().key(), range.key, range.range_end)) {
            response->mutable_header()->set_revision(change.revision);
            *response->add_events() = change.event;
            break;
          }
        }
      }
      if (response->events_size() > 0) return true;
      etcd_->changed_.Wait(&etcd_->mu_);
    }
  }

  absl::Status Finish() override {
    absl::MutexLock lock(&etcd_->mu_);
    return ended_;
  }

  void Cancel() override {
    absl::MutexLock lock(&etcd_->mu_);
    cancelled_ = true;
    etcd_->changed_.SignalAll();
  }

 private:
  FakeEtcd* const etcd_;
  const std::string name_;
  const std::vector<EtcdKv::WatchRange> ranges_;
  size_t next_;  // Into history_; under the fake's lock.
  bool cancelled_ = false;
  absl::Status ended_;
};

class FakeEtcd::Client : public EtcdKv {
 public:
  Client(FakeEtcd* etcd, std::string name) : etcd_(etcd), name_(std::move(name)) {}

  absl::StatusOr<etcdpb::RangeResponse> Range(const etcdpb::RangeRequest& request) override {
    absl::MutexLock lock(&etcd_->mu_);
    if (absl::Status reached = Reach(); !reached.ok()) return reached;
    return etcd_->RangeLocked(request, 0);
  }
  absl::StatusOr<etcdpb::TxnResponse> Txn(const etcdpb::TxnRequest& request) override {
    absl::MutexLock lock(&etcd_->mu_);
    if (absl::Status reached = Reach(); !reached.ok()) return reached;
    return etcd_->TxnLocked(request);
  }
  absl::StatusOr<int64_t> GrantLease(int64_t ttl_seconds) override {
    absl::MutexLock lock(&etcd_->mu_);
    if (absl::Status reached = Reach(); !reached.ok()) return reached;
    return etcd_->GrantLocked(name_, ttl_seconds);
  }
  absl::StatusOr<int64_t> KeepAlive(int64_t lease_id) override {
    absl::MutexLock lock(&etcd_->mu_);
    if (absl::Status reached = Reach(); !reached.ok()) return reached;
    return etcd_->KeepAliveLocked(lease_id);
  }
  absl::Status RevokeLease(int64_t lease_id) override {
    absl::MutexLock lock(&etcd_->mu_);
    if (absl::Status reached = Reach(); !reached.ok()) return reached;
    return etcd_->RevokeLocked(lease_id);
  }
  absl::StatusOr<std::unique_ptr<EtcdKvWatch>> Watch(const std::vector<WatchRange>& ranges,
                                                     int64_t start_revision) override {
    absl::MutexLock lock(&etcd_->mu_);
    if (absl::Status reached = Reach(); !reached.ok()) return reached;
    if (start_revision > 0 && start_revision < etcd_->compacted_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "watch refused: mvcc: required revision has been compacted (history compacted at ", etcd_->compacted_, ")"));
    }
    const int64_t from = start_revision > 0 ? start_revision : etcd_->revision_ + 1;
    size_t next = 0;
    while (next < etcd_->history_.size() && etcd_->history_[next].revision < from) ++next;
    return std::unique_ptr<EtcdKvWatch>(new FakeEtcd::Watch(etcd_, name_, ranges, next));
  }

 private:
  absl::Status Reach() ABSL_EXCLUSIVE_LOCKS_REQUIRED(etcd_->mu_) {
    absl::Status reached = etcd_->Reach(name_);
    if (reached.ok()) etcd_->ExpireDueLocked();
    return reached;
  }

  FakeEtcd* const etcd_;
  const std::string name_;
};

// ------------------------------------------------------------------------- the store

FakeEtcd::FakeEtcd(std::shared_ptr<FakeClock> clock, std::chrono::milliseconds retry_for)
    : clock_(std::move(clock)), retry_for_(retry_for) {}

FakeEtcd::~FakeEtcd() = default;

std::unique_ptr<EtcdKv> FakeEtcd::Connect(const std::string& name) { return std::make_unique<Client>(this, name); }

void FakeEtcd::Cut(const std::string& name) {
  absl::MutexLock lock(&mu_);
  cut_.insert(name);
  changed_.SignalAll();
}

void FakeEtcd::Restore(const std::string& name) {
  absl::MutexLock lock(&mu_);
  cut_.erase(name);
  changed_.SignalAll();
}

absl::Status FakeEtcd::Reach(const std::string& name) {
  const EtcdClock::TimePoint give_up = clock_->SteadyNow() + retry_for_;
  while (cut_.count(name) && clock_->SteadyNow() < give_up) clock_->WaitUntil(&changed_, &mu_, give_up);
  if (cut_.count(name)) return absl::UnavailableError(absl::StrCat("etcd: ", name, " reaches no member"));
  return absl::OkStatus();
}

void FakeEtcd::ExpireDue() {
  absl::MutexLock lock(&mu_);
  ExpireDueLocked();
}

void FakeEtcd::ExpireDueLocked() {
  const EtcdClock::TimePoint now = clock_->SteadyNow();
  std::vector<int64_t> due;
  for (const auto& [id, lease] : leases_) {
    if (lease.deadline <= now) due.push_back(id);
  }
  for (int64_t id : due) (void)RevokeLocked(id);
}

void FakeEtcd::Compact(int64_t revision) {
  absl::MutexLock lock(&mu_);
  compacted_ = std::max(compacted_, std::min(revision, revision_));
}

int64_t FakeEtcd::revision() const {
  absl::MutexLock lock(&mu_);
  return revision_;
}

size_t FakeEtcd::leases() const {
  absl::MutexLock lock(&mu_);
  return leases_.size();
}

std::vector<mvccpb::KeyValue> FakeEtcd::Keys(const std::string& key, const std::string& range_end) const {
  absl::MutexLock lock(&mu_);
  return At(key, range_end, revision_);
}

bool FakeEtcd::AwaitRenewal(const std::string& name, EtcdClock::TimePoint since,
                            std::chrono::milliseconds limit) const {
  absl::MutexLock lock(&mu_);
  auto renewed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto first = first_lease_.find(name);
    if (first == first_lease_.end()) return false;
    auto lease = leases_.find(first->second);
    return lease != leases_.end() && lease->second.renewed >= since;
  };
  const absl::Time give_up = absl::Now() + absl::FromChrono(limit);
  while (!renewed()) {
    if (changed_.WaitWithDeadline(&mu_, give_up)) return renewed();
  }
  return true;
}

void FakeEtcd::Header(etcdpb::ResponseHeader* header) const {
  header->set_cluster_id(1);
  header->set_member_id(1);
  header->set_revision(revision_);
  header->set_raft_term(2);
}

std::vector<mvccpb::KeyValue> FakeEtcd::At(const std::string& key, const std::string& range_end,
                                           int64_t revision) const {
  std::vector<mvccpb::KeyValue> kvs;
  auto first = range_end.empty() ? keys_.find(key) : keys_.lower_bound(key);
  for (auto it = first; it != keys_.end() && InRange(it->first, key, range_end); ++it) {
    // The last version at or before `revision`.
    const Version* seen = nullptr;
    for (const Version& version : it->second) {
      if (version.kv.mod_revision() > revision) break;
      seen = &version;
    }
    if (seen && !seen->deleted) kvs.push_back(seen->kv);
  }
  return kvs;
}

absl::StatusOr<etcdpb::RangeResponse> FakeEtcd::RangeLocked(const etcdpb::RangeRequest& request,
                                                            int64_t pending) const {
  // `pending`: a transaction's own revision while it writes, which its later reads see.
  const int64_t current = std::max(revision_, pending);
  const int64_t at = request.revision() > 0 ? request.revision() : current;
  if (at > current) return absl::OutOfRangeError("etcdserver: mvcc: required revision is a future revision");
  if (at < compacted_) return absl::OutOfRangeError("etcdserver: mvcc: required revision has been compacted");
  std::vector<mvccpb::KeyValue> kvs = At(request.key(), request.range_end(), at);
  etcdpb::RangeResponse response;
  Header(response.mutable_header());
  response.set_count(static_cast<int64_t>(kvs.size()));
  auto prune = [&](auto drop) { kvs.erase(std::remove_if(kvs.begin(), kvs.end(), drop), kvs.end()); };
  if (request.max_mod_revision() != 0) {
    prune([&](const mvccpb::KeyValue& kv) { return kv.mod_revision() > request.max_mod_revision(); });
  }
  if (request.min_mod_revision() != 0) {
    prune([&](const mvccpb::KeyValue& kv) { return kv.mod_revision() < request.min_mod_revision(); });
  }
  if (request.max_create_revision() != 0) {
    prune([&](const mvccpb::KeyValue& kv) { return kv.create_revision() > request.max_create_revision(); });
  }
  if (request.min_create_revision() != 0) {
    prune([&](const mvccpb::KeyValue& kv) { return kv.create_revision() < request.min_create_revision(); });
  }
  // Keys come in key order; any other target sorts ascending unless told otherwise.
  auto order = request.sort_order();
  const auto target = request.sort_target();
  if (target != etcdpb::RangeRequest::KEY && order == etcdpb::RangeRequest::NONE) order = etcdpb::RangeRequest::ASCEND;
  if (target == etcdpb::RangeRequest::KEY && order == etcdpb::RangeRequest::ASCEND) order = etcdpb::RangeRequest::NONE;
  if (order != etcdpb::RangeRequest::NONE) {
    auto less = [&](const mvccpb::KeyValue& a, const mvccpb::KeyValue& b) {
      if (target == etcdpb::RangeRequest::KEY) return a.key() < b.key();
      if (target == etcdpb::RangeRequest::VALUE) return a.value() < b.value();
      return SortKey(a, target) < SortKey(b, target);
    };
    std::stable_sort(kvs.begin(), kvs.end(), less);
    if (order == etcdpb::RangeRequest::DESCEND) std::reverse(kvs.begin(), kvs.end());
  }
  if (request.limit() > 0 && static_cast<int64_t>(kvs.size()) > request.limit()) {
    kvs.resize(static_cast<size_t>(request.limit()));
    response.set_more(true);
  }
  if (request.count_only()) return response;
  for (mvccpb::KeyValue& kv : kvs) {
    if (request.keys_only()) kv.clear_value();
    *response.add_kvs() = std::move(kv);
  }
  return response;
}

bool FakeEtcd::Compares(const etcdpb::Compare& compare) const {
  std::vector<mvccpb::KeyValue> kvs = At(compare.key(), compare.range_end(), revision_);
  if (kvs.empty()) {
    // A missing key's value compares with nothing; its revisions and version are 0.
    return compare.target() != etcdpb::Compare::VALUE && CompareKv(compare, mvccpb::KeyValue());
  }
  return std::all_of(kvs.begin(), kvs.end(), [&](const mvccpb::KeyValue& kv) { return CompareKv(compare, kv); });
}

void FakeEtcd::ChooseBranches(const etcdpb::TxnRequest& request, std::vector<bool>* path) const {
  bool success = true;
  for (const etcdpb::Compare& compare : request.compare()) success = success && Compares(compare);
  path->push_back(success);
  for (const etcdpb::RequestOp& op : success ? request.success() : request.failure()) {
    if (op.has_request_txn()) ChooseBranches(op.request_txn(), path);
  }
}

absl::Status FakeEtcd::CheckOps(const etcdpb::TxnRequest& request, const std::vector<bool>& path, size_t* at) const {
  const bool success = path[(*at)++];
  std::set<std::string> puts;
  std::vector<std::pair<std::string, std::string>> deletes;
  for (const etcdpb::RequestOp& op : success ? request.success() : request.failure()) {
    if (op.has_request_put()) {
      const etcdpb::PutRequest& put = op.request_put();
      if (!puts.insert(put.key()).second) {
        return absl::InvalidArgumentError("etcdserver: duplicate key given in txn request");
      }
      if (put.lease() != 0 && !leases_.count(put.lease())) {
        return absl::NotFoundError("etcdserver: requested lease not found");
      }
    } else if (op.has_request_delete_range()) {
      deletes.emplace_back(op.request_delete_range().key(), op.request_delete_range().range_end());
    } else if (op.has_request_txn()) {
      if (absl::Status nested = CheckOps(op.request_txn(), path, at); !nested.ok()) return nested;
    }
  }
  for (const std::string& key : puts) {
    for (const auto& [from, to] : deletes) {
      if (InRange(key, from, to)) return absl::InvalidArgumentError("etcdserver: duplicate key given in txn request");
    }
  }
  return absl::OkStatus();
}

void FakeEtcd::PutLocked(const etcdpb::PutRequest& put, int64_t revision) {
  std::vector<Version>& versions = keys_[put.key()];
  const Version* last = versions.empty() || versions.back().deleted ? nullptr : &versions.back();
  Version next;
  next.kv.set_key(put.key());
  next.kv.set_value(put.value());
  next.kv.set_create_revision(last ? last->kv.create_revision() : revision);
  next.kv.set_mod_revision(revision);
  next.kv.set_version(last ? last->kv.version() + 1 : 1);
  next.kv.set_lease(put.lease());
  if (last && last->kv.lease() != 0 && leases_.count(last->kv.lease())) {
    leases_[last->kv.lease()].keys.erase(put.key());
  }
  if (put.lease() != 0) leases_[put.lease()].keys.insert(put.key());
  mvccpb::Event event;
  event.set_type(mvccpb::Event::PUT);
  *event.mutable_kv() = next.kv;
  history_.push_back({revision, std::move(event)});
  versions.push_back(std::move(next));
}

int64_t FakeEtcd::DeleteLocked(const std::string& key, const std::string& range_end, int64_t revision) {
  int64_t deleted = 0;
  // Every live key, this transaction's earlier puts included.
  for (const mvccpb::KeyValue& kv : At(key, range_end, revision)) {
    if (kv.lease() != 0 && leases_.count(kv.lease())) leases_[kv.lease()].keys.erase(kv.key());
    Version tombstone;
    tombstone.kv.set_key(kv.key());
    tombstone.kv.set_mod_revision(revision);
    tombstone.deleted = true;
    mvccpb::Event event;
    event.set_type(mvccpb::Event::DELETE);
    *event.mutable_kv() = tombstone.kv;
    history_.push_back({revision, std::move(event)});
    keys_[kv.key()].push_back(std::move(tombstone));
    ++deleted;
  }
  return deleted;
}

void FakeEtcd::RunOps(const etcdpb::TxnRequest& request, const std::vector<bool>& path, size_t* at, int64_t revision,
                      bool* wrote, etcdpb::TxnResponse* response) {
  const bool success = path[(*at)++];
  response->set_succeeded(success);
  for (const etcdpb::RequestOp& op : success ? request.success() : request.failure()) {
    etcdpb::ResponseOp* out = response->add_responses();
    if (op.has_request_range()) {
      // Checked: a read inside a transaction is at its revision.
      auto read = RangeLocked(op.request_range(), *wrote ? revision : 0);
      if (read.ok()) *out->mutable_response_range() = *std::move(read);
    } else if (op.has_request_put()) {
      PutLocked(op.request_put(), revision);
      *wrote = true;
      out->mutable_response_put();
    } else if (op.has_request_delete_range()) {
      const etcdpb::DeleteRangeRequest& erase = op.request_delete_range();
      int64_t deleted = DeleteLocked(erase.key(), erase.range_end(), revision);
      if (deleted > 0) *wrote = true;
      out->mutable_response_delete_range()->set_deleted(deleted);
    } else if (op.has_request_txn()) {
      RunOps(op.request_txn(), path, at, revision, wrote, out->mutable_response_txn());
    }
  }
}

absl::StatusOr<etcdpb::TxnResponse> FakeEtcd::TxnLocked(const etcdpb::TxnRequest& request) {
  std::vector<bool> path;
  ChooseBranches(request, &path);
  size_t at = 0;
  if (absl::Status checked = CheckOps(request, path, &at); !checked.ok()) return checked;
  etcdpb::TxnResponse response;
  bool wrote = false;
  at = 0;
  RunOps(request, path, &at, revision_ + 1, &wrote, &response);
  if (wrote) {
    ++revision_;
    changed_.SignalAll();
  }
  Header(response.mutable_header());
  return response;
}

absl::StatusOr<int64_t> FakeEtcd::GrantLocked(const std::string& name, int64_t ttl_s) {
  if (ttl_s <= 0) return absl::InvalidArgumentError("etcdserver: lease TTL must be positive");
  const int64_t id = next_lease_++;
  const EtcdClock::TimePoint now = clock_->SteadyNow();
  leases_[id] = Lease{ttl_s, now + std::chrono::seconds(ttl_s), now, {}};
  first_lease_.insert({name, id});  // Only the first.
  return id;
}

absl::StatusOr<int64_t> FakeEtcd::KeepAliveLocked(int64_t id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return absl::NotFoundError("etcd lease expired");
  const EtcdClock::TimePoint now = clock_->SteadyNow();
  it->second.deadline = now + std::chrono::seconds(it->second.ttl_s);
  it->second.renewed = now;
  changed_.SignalAll();
  return it->second.ttl_s;
}

absl::Status FakeEtcd::RevokeLocked(int64_t id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return absl::NotFoundError("etcdserver: requested lease not found");
  const std::set<std::string> keys = std::move(it->second.keys);
  leases_.erase(it);
  if (keys.empty()) return absl::OkStatus();
  // Every key of the lease goes in one revision.
  const int64_t revision = revision_ + 1;
  for (const std::string& key : keys) DeleteLocked(key, "", revision);
  revision_ = revision;
  changed_.SignalAll();
  return absl::OkStatus();
}

}  // namespace elrun::rdzv
