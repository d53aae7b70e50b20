#include "agent/etcd_rendezvous.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "agent/session_auth.h"

namespace elrun::rdzv {
namespace {

int64_t WallMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

TimePoint LogTime(int64_t ms) { return TimePoint(std::chrono::milliseconds(ms)); }

void Signal(int fd) {
  uint64_t one = 1;
  (void)!::write(fd, &one, sizeof(one));
}

// A put of `key` only if it does not exist yet: every entry is written once, however often a
// lost reply makes the writer retry or however many agents log the same disconnect or tick.
etcdpb::TxnRequest CreateOnce(const std::string& key, const std::string& value) {
  etcdpb::TxnRequest txn;
  auto* compare = txn.add_compare();
  compare->set_key(key);
  compare->set_target(etcdpb::Compare::CREATE);
  compare->set_result(etcdpb::Compare::EQUAL);
  compare->set_create_revision(0);
  auto* put = txn.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  return txn;
}

// True when no key in [key, range_end) exists (etcd compares every key of a range; none: the
// comparison of an absent key's create revision, 0).
etcdpb::Compare NoneIn(const std::string& key, const std::string& range_end) {
  etcdpb::Compare compare;
  compare.set_key(key);
  compare.set_range_end(range_end);
  compare.set_target(etcdpb::Compare::CREATE);
  compare.set_result(etcdpb::Compare::EQUAL);
  compare.set_create_revision(0);
  return compare;
}

}  // namespace

// Where the replica's coordinator sends to one session: this node's own messages are
// delivered; the others' are theirs to deliver (their replica sends the same).
class EtcdRendezvous::Sink : public SessionSink {
 public:
  Sink(EtcdRendezvous* owner, uint64_t session) : owner_(owner), session_(session) {}
  void Send(const v1::CoordinatorMessage& message) override {
    if (session_ == owner_->session_) owner_->Deliver(message);
  }
  void Close(const absl::Status& status) override { owner_->closing_.push_back({session_, status}); }

 private:
  EtcdRendezvous* const owner_;
  const uint64_t session_;
};

absl::StatusOr<std::unique_ptr<EtcdRendezvous>> EtcdRendezvous::Open(const EtcdRendezvousOptions& options) {
  // The run id is a part of every key: a '/' would reach into another run's keys (the Join's
  // own checks, which refuse it too, come only after the keys exist).
  if (options.run_id.empty() || options.run_id.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("run id '", options.run_id, "' must be non-empty, without '/'"));
  }
  auto client = EtcdClient::Connect(options.etcd);
  if (!client.ok()) return client.status();
  int64_t ttl_s = std::max<int64_t>(2, (options.lease_ttl.count() + 999) / 1000);
  auto lease = (*client)->GrantLease(ttl_s);
  if (!lease.ok()) return lease.status();
  // On a failure below, this node's presence goes at once rather than after the lease's TTL.
  auto fail = [&](const absl::Status& status) {
    (void)(*client)->RevokeLease(*lease);
    return status;
  };

  const std::string base = options.prefix + options.run_id + "/";
  const std::string nodes = base + "nodes/";
  v1::LogEntry connect;
  connect.set_time_ms(WallMs());
  connect.set_connect(options.node_id);
  etcdpb::TxnRequest txn;
  *txn.add_compare() = NoneIn(nodes, PrefixEnd(nodes));
  // No live node: whatever log is there is a dead job's, and this node starts the run afresh.
  auto* clear = txn.add_success()->mutable_request_delete_range();
  clear->set_key(base + "log/");
  clear->set_range_end(PrefixEnd(base + "log/"));
  for (auto* ops : {txn.mutable_success(), txn.mutable_failure()}) {
    auto* presence = ops->Add()->mutable_request_put();
    presence->set_key(nodes + options.node_id);
    presence->set_lease(*lease);
  }
  auto present = (*client)->Txn(txn);
  if (!present.ok()) return fail(present.status());
  // (A transaction may not delete a range and put a key inside it: the entry comes second.)
  auto joined = (*client)->Txn(CreateOnce(base + "log/c/" + options.node_id, connect.SerializeAsString()));
  if (!joined.ok()) return fail(joined.status());
  // The connect entry's create revision is the session id every replica gives this node.
  etcdpb::RangeRequest own;
  own.set_key(base + "log/c/" + options.node_id);
  auto read = (*client)->Range(own);
  if (!read.ok()) return fail(read.status());
  if (read->kvs_size() != 1) return fail(absl::InternalError("etcd lost this node's connect entry"));
  uint64_t session = static_cast<uint64_t>(read->kvs(0).create_revision());

  int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) return fail(absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno))));
  std::unique_ptr<EtcdRendezvous> rendezvous(
      new EtcdRendezvous(options, *std::move(client), fd, *lease, session));
  rendezvous->reader_ = std::thread([r = rendezvous.get()] { r->ReadLoop(); });
  rendezvous->writer_ = std::thread([r = rendezvous.get()] { r->WriteLoop(); });
  return rendezvous;
}

EtcdRendezvous::EtcdRendezvous(EtcdRendezvousOptions options, std::unique_ptr<EtcdClient> client, int event_fd,
                               int64_t lease, uint64_t session)
    : options_(std::move(options)),
      base_(options_.prefix + options_.run_id + "/"),
      client_(std::move(client)),
      event_fd_(event_fd),
      lease_(lease),
      session_(session),
      coordinator_(Coordinator::Options{
          options_.first_join_timeout, options_.token,
          // Every replica must give each session the same Challenge: a count, not a random.
          [this] {
            std::string nonce(kNonceBytes, '\0');
            uint64_t n = ++nonces_;
            std::memcpy(nonce.data(), &n, sizeof(n));
            return nonce;
          },
          /*heartbeats=*/false}) {}

EtcdRendezvous::~EtcdRendezvous() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (watch_) watch_->Cancel();
  }
  wake_.notify_all();
  reader_.join();
  writer_.join();
  // Leave: the lease's keys go at once; the last node of the job removes the rest.
  (void)client_->RevokeLease(lease_);
  etcdpb::TxnRequest cleanup;
  *cleanup.add_compare() = NoneIn(base_ + "nodes/", PrefixEnd(base_ + "nodes/"));
  auto* erase = cleanup.add_success()->mutable_request_delete_range();
  erase->set_key(base_);
  erase->set_range_end(PrefixEnd(base_));
  (void)client_->Txn(cleanup);
  ::close(event_fd_);
}

bool EtcdRendezvous::Write(const v1::AgentMessage& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ended_) return false;
  if (message.has_heartbeat()) return true;
  v1::LogEntry entry;
  entry.set_time_ms(WallMs());
  entry.set_session(session_);
  *entry.mutable_message() = message;
  outbox_.push_back({LogKey(absl::StrCat("m/", session_, "/", next_seq_++)), std::move(entry)});
  wake_.notify_all();
  return true;
}

std::deque<v1::CoordinatorMessage> EtcdRendezvous::Take() {
  uint64_t drained;
  (void)!::read(event_fd_, &drained, sizeof(drained));
  std::lock_guard<std::mutex> lock(mu_);
  std::deque<v1::CoordinatorMessage> out;
  out.swap(inbox_);
  if (ended_) Signal(event_fd_);  // Stays readable: the end is still to be seen.
  return out;
}

std::optional<absl::Status> EtcdRendezvous::ended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_;
}

void EtcdRendezvous::Deliver(const v1::CoordinatorMessage& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ended_) return;
  inbox_.push_back(message);
  Signal(event_fd_);
}

void EtcdRendezvous::End(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ended_) return;
  ended_ = status;
  Signal(event_fd_);
  wake_.notify_all();
}

// ------------------------------------------------------------------------- the reader

void EtcdRendezvous::ReadLoop() {
  auto lost_since = std::chrono::steady_clock::now();
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    auto revision = CatchUp();
    std::unique_ptr<EtcdWatch> watch;
    if (revision.ok()) {
      auto opened = client_->Watch(base_, PrefixEnd(base_), *revision + 1);
      if (opened.ok()) {
        watch = *std::move(opened);
      } else {
        revision = opened.status();
      }
    }
    if (!revision.ok()) {
      // Every member was tried for retry_for; a lease that outlives this is not likely.
      if (std::chrono::steady_clock::now() - lost_since > options_.lease_ttl + options_.etcd.retry_for) {
        End(absl::UnavailableError(absl::StrCat("lost the etcd cluster: ", revision.status().message())));
        return;
      }
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      watch_ = std::move(watch);
    }
    etcdpb::WatchResponse response;
    while (watch_->Read(&response)) {
      if (response.canceled() || response.compact_revision() > 0) break;  // Read the keys again.
      for (const mvccpb::Event& event : response.events()) {
        const std::string& key = event.kv().key();
        if (event.type() == mvccpb::Event::PUT && absl::StartsWith(key, base_ + "log/")) {
          Apply(event.kv());
        } else if (event.type() == mvccpb::Event::DELETE && absl::StartsWith(key, base_ + "nodes/")) {
          OnPresenceGone(key.substr(base_.size() + 6));
        }
      }
      Applied();
    }
    std::lock_guard<std::mutex> lock(mu_);
    watch_->Cancel();
    (void)watch_->Finish();
    watch_.reset();
    lost_since = std::chrono::steady_clock::now();
  }
}

absl::StatusOr<int64_t> EtcdRendezvous::CatchUp() {
  const std::string log = base_ + "log/";
  int64_t at = 0;  // Every page is read at the first page's revision.
  while (true) {
    etcdpb::RangeRequest page;
    page.set_key(log);
    page.set_range_end(PrefixEnd(log));
    page.set_sort_target(etcdpb::RangeRequest::CREATE);
    page.set_sort_order(etcdpb::RangeRequest::ASCEND);
    page.set_min_create_revision(applied_ + 1);
    page.set_limit(1000);
    page.set_revision(at);
    auto read = client_->Range(page);
    if (!read.ok()) return read.status();
    if (at == 0) at = read->header().revision();
    for (const mvccpb::KeyValue& kv : read->kvs()) Apply(kv);
    Applied();
    if (!read->more()) break;
  }
  // Nodes whose lease ended while this replica was not watching.
  etcdpb::RangeRequest nodes;
  nodes.set_key(base_ + "nodes/");
  nodes.set_range_end(PrefixEnd(base_ + "nodes/"));
  nodes.set_keys_only(true);
  nodes.set_revision(at);
  auto present = client_->Range(nodes);
  if (!present.ok()) return present.status();
  std::set<std::string> alive;
  for (const mvccpb::KeyValue& kv : present->kvs()) alive.insert(kv.key().substr(base_.size() + 6));
  std::vector<std::string> gone;
  for (const auto& [node_id, session] : live_) {
    if (!alive.count(node_id)) gone.push_back(node_id);
  }
  for (const std::string& node_id : gone) OnPresenceGone(node_id);
  return at;
}

void EtcdRendezvous::OnPresenceGone(const std::string& node_id) {
  auto it = live_.find(node_id);
  if (it == live_.end()) return;
  uint64_t session = it->second;
  // One agent logs it at once, the lowest live session but the lost one; the others only as
  // staggered backups, so that a loss costs one write, not one per survivor.
  const int place = Place(session);
  v1::LogEntry entry;
  entry.set_time_ms(WallMs());
  entry.set_session(session);
  entry.set_disconnect("its etcd lease ended (the agent left, died or stalled)");
  std::lock_guard<std::mutex> lock(mu_);
  if (!disconnects_asked_.insert(session).second) return;
  Write_ write{LogKey(absl::StrCat("d/", session)), std::move(entry)};
  if (place == 0) {
    outbox_.push_back(std::move(write));
  } else {
    write.not_before = std::chrono::steady_clock::now() + place * options_.backup_delay;
    backups_.push_back(std::move(write));
  }
  wake_.notify_all();
}

int EtcdRendezvous::Place(uint64_t excluding) const {
  int place = 0;
  for (const auto& [id, node] : sessions_) {
    if (id == session_ || place >= 10) break;
    if (id != excluding) ++place;
  }
  return place;
}

void EtcdRendezvous::Applied() {
  const int place = Place(0);  // Sessions are etcd revisions, never 0.
  std::lock_guard<std::mutex> lock(mu_);
  applied_time_ms_ = log_time_ms_;
  place_ = place;
  replica_changed_ = true;
  wake_.notify_all();
}

bool EtcdRendezvous::StillNeeded(const Write_& write) const {
  if (write.entry.has_disconnect()) return closed_.count(write.entry.session()) == 0;
  if (write.entry.has_tick()) return applied_time_ms_ < write.entry.time_ms();
  return true;
}

void EtcdRendezvous::CloseSession(uint64_t session, const absl::Status& status) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  live_.erase(it->second);
  sessions_.erase(it);
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_.insert(session);
  }
  coordinator_.OnDisconnect(session, LogTime(log_time_ms_), std::string(status.message()));
  if (session == session_) End(status);
}

void EtcdRendezvous::Apply(const mvccpb::KeyValue& kv) {
  // A key is an entry once, when it is created; later puts on it (a retried write) are not.
  if (kv.create_revision() != kv.mod_revision() || kv.create_revision() <= applied_) return;
  applied_ = kv.create_revision();
  v1::LogEntry entry;
  if (!entry.ParseFromString(kv.value())) return;  // Skipped by every replica alike.
  log_time_ms_ = std::max(log_time_ms_, entry.time_ms());
  TimePoint now = LogTime(log_time_ms_);
  uint64_t session = entry.session();
  bool live = sessions_.count(session) > 0;
  switch (entry.body_case()) {
    case v1::LogEntry::kConnect: {
      session = static_cast<uint64_t>(kv.create_revision());
      if (entry.connect().empty() || live_.count(entry.connect())) break;
      live_[entry.connect()] = session;
      sessions_[session] = entry.connect();
      auto& sink = sinks_[session] = std::make_unique<Sink>(this, session);
      coordinator_.OnConnect(session, sink.get(), now);
      break;
    }
    case v1::LogEntry::kMessage:
      if (live && !entry.message().has_heartbeat()) {
        absl::Status status = coordinator_.OnMessage(session, entry.message(), now);
        if (!status.ok()) closing_.push_back({session, status});
      }
      break;
    case v1::LogEntry::kDisconnect:
      if (live) {
        closing_.push_back({session, absl::UnavailableError(entry.disconnect())});
      }
      break;
    default:  // A tick, or an entry of a later version: time moves on.
      break;
  }
  // Timeouts due by this entry's time, in the same place on every replica.
  if (std::optional<TimePoint> due = coordinator_.NextDeadline(); due && *due <= now) coordinator_.Tick(now);
  while (!closing_.empty()) {
    auto [id, status] = closing_.front();
    closing_.erase(closing_.begin());
    CloseSession(id, status);  // Once: a session already closed is no longer known.
  }
}

// ------------------------------------------------------------------------- the writer

absl::Status EtcdRendezvous::Append(const std::string& key, const v1::LogEntry& entry) {
  auto written = client_->Txn(CreateOnce(key, entry.SerializeAsString()));
  return written.status();
}

void EtcdRendezvous::WriteLoop() {
  const auto renew_every = std::max(std::chrono::milliseconds(200), options_.lease_ttl / 3);
  auto next_renewal = std::chrono::steady_clock::now() + renew_every;
  auto renewed_at = std::chrono::steady_clock::now();
  int64_t ticked_for = -1;  // The deadline last logged (or backed up), not again.
  std::unique_lock<std::mutex> lock(mu_);
  // Renews the lease when due (mu_ held; released around the call). A busy or electing cluster
  // fails a renewal now and then: only a lease that expired, or one not renewed for its whole
  // TTL, ends the session.
  auto renew_if_due = [&] {
    if (std::chrono::steady_clock::now() < next_renewal) return false;
    lock.unlock();
    auto renewed = client_->KeepAlive(lease_);
    lock.lock();
    next_renewal = std::chrono::steady_clock::now() + renew_every;
    if (renewed.ok()) renewed_at = std::chrono::steady_clock::now();
    if (!renewed.ok() && !stop_ &&
        (renewed.status().code() == absl::StatusCode::kNotFound ||
         std::chrono::steady_clock::now() - renewed_at >= options_.lease_ttl)) {
      lock.unlock();
      End(absl::UnavailableError(
          renewed.status().code() == absl::StatusCode::kNotFound
              ? absl::StrCat("this node's etcd lease expired (stalled or cut off for longer than the ",
                             options_.lease_ttl.count() / 1000.0, " s heartbeat_timeout)")
              : absl::StrCat("cannot renew the etcd lease: ", renewed.status().message())));
      lock.lock();
    }
    return true;
  };
  // An entry is retried until it is written, the lease is lost (renewals go on meanwhile) or
  // the node leaves: a busy cluster only delays the job.
  auto append = [&](const Write_& write) {
    absl::Status status;
    while (!stop_ && !ended_) {
      lock.unlock();
      status = Append(write.key, write.entry);
      lock.lock();
      if (status.ok()) return;
      if (status.code() != absl::StatusCode::kUnavailable && status.code() != absl::StatusCode::kDeadlineExceeded) {
        break;  // Refused (permissions, a bad request): no retry will do.
      }
      renew_if_due();
    }
    if (!status.ok() && !stop_ && !ended_) {
      lock.unlock();
      End(absl::UnavailableError(absl::StrCat("cannot write to etcd: ", status.message())));
      lock.lock();
    }
  };
  while (!stop_) {
    auto now = std::chrono::steady_clock::now();
    // The lease first: renewals must not queue behind a burst of entries.
    if (renew_if_due()) continue;
    if (!outbox_.empty()) {
      Write_ next = std::move(outbox_.front());
      outbox_.pop_front();
      append(next);
      continue;
    }
    auto wait_until = next_renewal;
    // Backups of another agent's write that has not appeared in time.
    bool wrote = false;
    for (auto it = backups_.begin(); it != backups_.end();) {
      if (!StillNeeded(*it)) {
        it = backups_.erase(it);
      } else if (it->not_before <= now) {
        Write_ next = std::move(*it);
        backups_.erase(it);
        append(next);
        wrote = true;
        break;
      } else {
        wait_until = std::min(wait_until, it->not_before);
        ++it;
      }
    }
    if (wrote) continue;
    // A timeout due in log time: log a tick so that every replica applies it at that time.
    // (The coordinator's lock is taken without mu_: the reader holds it while delivering.)
    replica_changed_ = false;
    lock.unlock();
    std::optional<TimePoint> deadline = coordinator_.NextDeadline();
    lock.lock();
    if (deadline) {
      int64_t due = std::chrono::duration_cast<std::chrono::milliseconds>(deadline->time_since_epoch()).count();
      int64_t wall = WallMs();
      if (due <= wall && due != ticked_for) {
        ticked_for = due;
        v1::LogEntry tick;
        tick.set_time_ms(due);
        tick.set_tick(true);
        Write_ write{LogKey(absl::StrCat("t/", due)), std::move(tick)};
        if (place_ == 0) {
          outbox_.push_back(std::move(write));
        } else {
          write.not_before = now + place_ * options_.backup_delay;
          backups_.push_back(std::move(write));
        }
        continue;
      }
      if (due > wall) wait_until = std::min(wait_until, now + std::chrono::milliseconds(due - wall));
    }
    wake_.wait_until(lock, wait_until, [this] { return stop_ || !outbox_.empty() || replica_changed_; });
  }
}

}  // namespace elrun::rdzv
