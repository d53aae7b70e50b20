#include "agent/etcd/etcd_rendezvous.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "agent/coordinator/session_auth.h"
#include "agent/etcd/etcd_rendezvous_internal.h"

namespace elrun::rdzv {

namespace {

// The spare lease of EtcdQuietTrim: outlives any burst of writes; a leader that dies holding
// one leaves it to expire, which is a delete-only commit too.
constexpr std::chrono::seconds kSpareLeaseTtl{60};

// A session's Challenge nonce, the same on every replica and known to the agent itself as soon
// as it has its session id: the session id's bytes, zero-padded. (etcd's readers see every
// key anyway; what a token proves does not rest on the nonce being secret.)
std::string SessionNonce(uint64_t session) {
  std::string nonce(kNonceBytes, '\0');
  std::memcpy(nonce.data(), &session, sizeof(session));
  return nonce;
}

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

absl::Status CheckRunId(const std::string& run_id) {
  // The run id is a part of every key: a '/' would reach into another run's keys (the Join's
  // own checks, which refuse it too, come only after the keys exist).
  if (run_id.empty() || run_id.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("run id '", run_id, "' must be non-empty, without '/'"));
  }
  return absl::OkStatus();
}

}  // namespace

// What a node writes to join its job's line: its presence (nodes/<node id>) and tail under its
// lease, and its connect entry in the log.
struct EtcdRendezvous::Registration {
  Registration(const EtcdRendezvousOptions& options, int64_t lease, int64_t now_ms)
      : base(options.prefix + options.run_id + "/"),
        nodes(base + "nodes/"),
        presence_key(nodes + options.node_id),
        connect_key(base + "log/c/" + options.node_id),
        // The last node to join holds tail (its presence key), under its own lease: tail exists
        // while that node lives, and then it is the node just before the next one in line.
        tail_key(base + "tail"),
        lease(lease) {
    v1::LogEntry entry;
    entry.set_time_ms(now_ms);
    entry.set_connect(options.node_id);
    connect = entry.SerializeAsString();
  }

  // Puts this node's presence and tail, both under its lease.
  void PutPresence(google::protobuf::RepeatedPtrField<etcdpb::RequestOp>* ops) const {
    auto* presence = ops->Add()->mutable_request_put();
    presence->set_key(presence_key);
    presence->set_lease(lease);
    auto* tail = ops->Add()->mutable_request_put();
    tail->set_key(tail_key);
    tail->set_value(presence_key);
    tail->set_lease(lease);
  }

  const std::string base, nodes, presence_key, connect_key, tail_key;
  const int64_t lease;
  std::string connect;  // The connect entry, serialized.
};

absl::StatusOr<std::optional<EtcdRendezvous::FirstLook>> EtcdRendezvous::Register(EtcdKv& client,
                                                                                  const Registration& r) {
  // A joining node's one transaction while the last node to join lives (every node of a
  // forming job): it reads tail and takes its place, in O(1) for etcd. Reading the line from
  // nodes/ (below) is O(N) for etcd, each time: O(N^2) for a job of N nodes.
  etcdpb::TxnRequest join;
  auto* last_lives = join.add_compare();
  last_lives->set_key(r.tail_key);
  last_lives->set_target(etcdpb::Compare::CREATE);
  last_lives->set_result(etcdpb::Compare::GREATER);
  last_lives->set_create_revision(0);
  join.add_success()->mutable_request_range()->set_key(r.tail_key);
  r.PutPresence(join.mutable_success());
  *join.add_success()->mutable_request_txn() = CreateOnce(r.connect_key, r.connect);
  auto joined_fast = client.Txn(join);
  if (!joined_fast.ok()) return joined_fast.status();
  if (joined_fast->succeeded()) {
    FirstLook seen{"", joined_fast->header().revision()};
    const auto& responses = joined_fast->responses();
    // A tail without a lease was not written by a node (they write it under theirs): a forged
    // one could name a key that never goes, and this node would wait for it for ever. Not a
    // hint then; the line is read instead.
    if (responses.size() == 4 && responses[3].response_txn().succeeded() &&
        responses[0].response_range().kvs_size() == 1 && responses[0].response_range().kvs(0).lease() != 0) {
      seen.ahead = responses[0].response_range().kvs(0).value();
    }
    return seen;
  }
  // No live last node: the job's first node, or its last node to join is gone. One
  // transaction: the node just before this one in line (read before this node's presence is
  // put), its presence and its connect entry (the create revision of both: the transaction's
  // revision).
  etcdpb::TxnRequest txn;
  *txn.add_compare() = NoneIn(r.nodes, PrefixEnd(r.nodes));
  // No live node: whatever log and outputs are there are a dead job's, and this node starts
  // the run afresh. (A transaction may not delete a range and put a key inside it: the
  // connect entry comes second.)
  for (const char* part : {"log/", "out/"}) {
    auto* clear = txn.add_success()->mutable_request_delete_range();
    clear->set_key(r.base + part);
    clear->set_range_end(PrefixEnd(r.base + part));
  }
  *txn.add_failure()->mutable_request_range() = LastInLine(r.nodes);
  r.PutPresence(txn.mutable_success());
  r.PutPresence(txn.mutable_failure());
  *txn.add_failure()->mutable_request_txn() = CreateOnce(r.connect_key, r.connect);
  auto present = client.Txn(txn);
  if (!present.ok()) return present.status();
  const auto& responses = present->responses();
  if (!present->succeeded() && responses.size() == 4 && responses[3].response_txn().succeeded() &&
      responses[0].response_range().kvs_size() == 1 && responses[0].response_range().kvs(0).lease() != 0) {
    return FirstLook{responses[0].response_range().kvs(0).key(), present->header().revision()};
  }
  return std::nullopt;
}

absl::StatusOr<EtcdRendezvous::Place> EtcdRendezvous::ReadPlace(EtcdKv& client, const Registration& r) {
  auto joined = client.Txn(CreateOnce(r.connect_key, r.connect));
  if (!joined.ok()) return joined.status();
  etcdpb::TxnRequest both;
  for (const std::string& key : {r.connect_key, r.presence_key}) {
    both.add_success()->mutable_request_range()->set_key(key);
  }
  auto read = client.Txn(both);
  if (!read.ok()) return read.status();
  if (read->responses_size() != 2 || read->responses(0).response_range().kvs_size() != 1 ||
      read->responses(1).response_range().kvs_size() != 1) {
    return absl::InternalError("etcd lost this node's connect entry or its presence");
  }
  return Place{static_cast<uint64_t>(read->responses(0).response_range().kvs(0).create_revision()),
               read->responses(1).response_range().kvs(0).create_revision()};
}

absl::StatusOr<std::unique_ptr<EtcdRendezvous>> EtcdRendezvous::Open(const EtcdRendezvousOptions& options) {
  if (absl::Status run_id = CheckRunId(options.run_id); !run_id.ok()) return run_id;
  auto client = EtcdClient::Connect(options.etcd);
  if (!client.ok()) return client.status();
  return Open(options, *std::move(client), std::make_shared<RealEtcdClock>());
}

absl::StatusOr<std::unique_ptr<EtcdRendezvous>> EtcdRendezvous::Open(const EtcdRendezvousOptions& options,
                                                                     std::unique_ptr<EtcdKv> etcd,
                                                                     std::shared_ptr<const EtcdClock> clock) {
  if (absl::Status run_id = CheckRunId(options.run_id); !run_id.ok()) return run_id;
  int64_t ttl_s = std::max<int64_t>(2, (options.lease_ttl.count() + 999) / 1000);
  const EtcdClock::TimePoint granted_at = clock->SteadyNow();
  auto lease = etcd->GrantLease(ttl_s);
  if (!lease.ok()) return lease.status();
  // On a failure below, this node's presence goes at once rather than after the lease's TTL.
  auto fail = [&](const absl::Status& status) {
    (void)etcd->RevokeLease(*lease);
    return status;
  };

  const Registration registration(options, *lease, clock->WallMs());
  // What this node's transaction saw: the node ahead (empty if it does not know) and the
  // transaction's revision, or nothing: the job has no live last node.
  absl::StatusOr<std::optional<FirstLook>> seen = Register(*etcd, registration);
  if (!seen.ok()) return fail(seen.status());
  std::optional<FirstLook> first;
  Place place;
  if (*seen && absl::StartsWith((*seen)->ahead, registration.nodes) && (*seen)->ahead != registration.presence_key) {
    // The usual case, at once. (Otherwise a retry after a lost reply, or the job's first node:
    // read back.)
    place = Place{static_cast<uint64_t>((*seen)->revision), (*seen)->revision};
    first = std::move(*seen);
  } else {
    absl::StatusOr<Place> read = ReadPlace(*etcd, registration);
    if (!read.ok()) return fail(read.status());
    place = *read;
  }

  int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) return fail(absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno))));
  std::unique_ptr<EtcdRendezvous> rendezvous(new EtcdRendezvous(options, std::move(etcd), std::move(clock), fd, *lease,
                                                                place.session, place.presence_revision));
  rendezvous->first_look_ = std::move(first);
  rendezvous->granted_at_ = granted_at;
  // A session's first output is its Challenge, which depends on nothing but its id: this node
  // takes it now and answers without waiting for the leader, who does not write it.
  v1::OutEntry challenge;
  challenge.mutable_message()->mutable_challenge()->set_nonce(SessionNonce(place.session));
  rendezvous->TakeOutput(0, challenge);
  rendezvous->reader_ = std::thread([r = rendezvous.get()] { r->ReadLoop(); });
  rendezvous->writer_ = std::thread([r = rendezvous.get()] { r->WriteLoop(); });
  rendezvous->renewer_ = std::thread([r = rendezvous.get()] { r->RenewLoop(); });
  return rendezvous;
}

EtcdRendezvous::EtcdRendezvous(EtcdRendezvousOptions options, std::unique_ptr<EtcdKv> client,
                               std::shared_ptr<const EtcdClock> clock, int event_fd, int64_t lease, uint64_t session,
                               int64_t presence_revision)
    : options_(std::move(options)),
      base_(options_.prefix + options_.run_id + "/"),
      client_(std::move(client)),
      clock_(std::move(clock)),
      event_fd_(event_fd),
      lease_(lease),
      session_(session),
      presence_revision_(presence_revision),
      coordinator_(Coordinator::Options{options_.first_join_timeout, options_.token,
                                        // Every replica must give each session the same Challenge, and the agent makes
                                        // its own (see Output).
                                        SessionNonce,
                                        /*heartbeats=*/false}) {}

EtcdRendezvous::~EtcdRendezvous() {
  {
    absl::MutexLock lock(&mu_);
    // A leader leaving hands over what its replica made: the others would otherwise wait for
    // the next in line to replay the log and write it.
    if (leading_) {
      const auto until = clock_->SteadyNow() + 2 * options_.etcd.call_timeout;
      while (!(outputs_.empty() && outbox_.empty() && !writing_)) {
        const auto now = clock_->SteadyNow();
        if (now >= until) break;
        clock_->WaitUntil(&flushed_, &mu_, until);
      }
    }
    stop_ = true;
    if (watch_) watch_->Cancel();
  }
  wake_.SignalAll();
  renew_wake_.SignalAll();
  reader_.join();
  writer_.join();
  renewer_.join();
  // Leave: the lease's keys go at once; the last node of the job removes the rest.
  (void)client_->RevokeLease(lease_);
  if (trim_.lease() != 0) (void)client_->RevokeLease(trim_.lease());
  etcdpb::TxnRequest cleanup;
  *cleanup.add_compare() = NoneIn(base_ + "nodes/", PrefixEnd(base_ + "nodes/"));
  auto* erase = cleanup.add_success()->mutable_request_delete_range();
  erase->set_key(base_);
  erase->set_range_end(PrefixEnd(base_));
  (void)client_->Txn(cleanup);
  ::close(event_fd_);
}

std::string EtcdRendezvous::OutPrefix(uint64_t session) const { return absl::StrCat(base_, "out/", session, "/"); }

bool EtcdRendezvous::Write(const v1::AgentMessage& message) {
  absl::MutexLock lock(&mu_);
  if (ended_) return false;
  if (message.has_heartbeat()) return true;
  v1::LogEntry entry;
  entry.set_time_ms(clock_->WallMs());
  entry.set_session(session_);
  *entry.mutable_message() = message;
  outbox_.push_back({LogKey(absl::StrCat("m/", session_, "/", next_seq_++)), entry.SerializeAsString()});
  wake_.SignalAll();
  return true;
}

std::deque<v1::CoordinatorMessage> EtcdRendezvous::Take() {
  uint64_t drained;
  (void)!::read(event_fd_, &drained, sizeof(drained));
  absl::MutexLock lock(&mu_);
  std::deque<v1::CoordinatorMessage> out;
  out.swap(inbox_);
  if (ended_) Signal(event_fd_);  // Stays readable: the end is still to be seen.
  return out;
}

std::optional<absl::Status> EtcdRendezvous::ended() const {
  absl::MutexLock lock(&mu_);
  return ended_;
}

void EtcdRendezvous::Deliver(const v1::CoordinatorMessage& message) {
  absl::MutexLock lock(&mu_);
  if (ended_) return;
  inbox_.push_back(message);
  Signal(event_fd_);
}

void EtcdRendezvous::End(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (ended_) return;
  ended_ = status;
  Signal(event_fd_);
  wake_.SignalAll();
}

// ------------------------------------------------------------------------- the renewer

void EtcdRendezvous::RenewLoop() {
  const auto renew_every = std::max(std::chrono::milliseconds(200), options_.lease_ttl / 3);
  // Renewals a period apart from the start of the one before (or the grant), however long
  // each took: a slow renewal does not push the next one towards the lease's end.
  EtcdClock::TimePoint attempt = granted_at_;
  EtcdClock::TimePoint renewed_at = granted_at_;  // The start of the last renewal that held.
  absl::MutexLock lock(&mu_);
  while (true) {
    const EtcdClock::TimePoint next = attempt + renew_every;
    while (!stop_ && clock_->SteadyNow() < next) clock_->WaitUntil(&renew_wake_, &mu_, next);
    if (stop_) return;
    attempt = clock_->SteadyNow();
    // While this node may write: a follower whose session ended has left the line (the writer
    // revoked its lease); a leader whose own session ended still fences its writes with it.
    if (ended_ && !leading_) continue;
    mu_.Unlock();
    auto renewed = client_->KeepAlive(lease_);
    mu_.Lock();
    if (renewed.ok()) {
      renewed_at = attempt;
      continue;
    }
    // A busy or electing cluster fails a renewal now and then: only a lease that expired, or
    // one not renewed for its whole TTL, ends the session.
    if (stop_ || (renewed.status().code() != absl::StatusCode::kNotFound &&
                  clock_->SteadyNow() - renewed_at < options_.lease_ttl)) {
      continue;
    }
    mu_.Unlock();
    End(absl::UnavailableError(
        renewed.status().code() == absl::StatusCode::kNotFound
            ? absl::StrCat("this node's etcd lease expired (stalled or cut off for longer than the ",
                           options_.lease_ttl.count() / 1000.0, " s heartbeat_timeout)")
            : absl::StrCat("cannot renew the etcd lease: ", renewed.status().message())));
    mu_.Lock();
  }
}

// ------------------------------------------------------------------------- the writer

absl::Status EtcdRendezvous::WriteFenced(const std::vector<Put>& batch) {
  etcdpb::TxnRequest txn;
  auto* fence = txn.add_compare();
  fence->set_key(base_ + "nodes/" + options_.node_id);
  fence->set_target(etcdpb::Compare::CREATE);
  fence->set_result(etcdpb::Compare::EQUAL);
  fence->set_create_revision(presence_revision_);
  for (const Put& put : batch) {
    auto* request = txn.add_success()->mutable_request_put();
    request->set_key(put.key);
    request->set_value(put.value);
    if (put.key == base_ + "leader") request->set_lease(lease_);
  }
  auto written = client_->Txn(txn);
  if (!written.ok()) return written.status();
  if (!written->succeeded()) return absl::NotFoundError("this node's presence in etcd is gone");
  return absl::OkStatus();
}

bool EtcdRendezvous::MayWrite() const { return !ended_ || leading_; }

void EtcdRendezvous::WriteRetried(const std::function<absl::Status()>& write) {
  absl::Status status;
  writing_ = true;
  while (!stop_ && MayWrite()) {
    mu_.Unlock();
    status = write();
    mu_.Lock();
    if (status.code() != absl::StatusCode::kUnavailable && status.code() != absl::StatusCode::kDeadlineExceeded) {
      break;  // Refused (permissions, a bad request, the lead lost): no retry will do.
    }
  }
  writing_ = false;
  if (status.code() == absl::StatusCode::kNotFound && leading_) {
    // Deposed: this node's lease ended and another leads. It writes nothing more and leaves.
    outputs_.clear();
    outbox_.clear();
    leading_ = false;
    if (watch_) watch_->Cancel();
  }
  if (outputs_.empty() && outbox_.empty()) flushed_.SignalAll();
  if (!status.ok() && !stop_ && !ended_) {
    mu_.Unlock();
    End(absl::UnavailableError(status.code() == absl::StatusCode::kNotFound
                                   ? absl::StrCat("lost the lead of the job's rendezvous: ", status.message())
                                   : absl::StrCat("cannot write to etcd: ", status.message())));
    mu_.Lock();
  }
}

std::vector<EtcdRendezvous::Put> EtcdRendezvous::TakeOutputBatch() {
  // etcd takes at most 128 operations (--max-txn-ops) and 1.5 MiB in one request.
  constexpr size_t kBatchPuts = 100;
  constexpr size_t kBatchBytes = 512 << 10;
  std::vector<Put> batch;
  size_t bytes = 0;
  while (!outputs_.empty() && batch.size() < kBatchPuts &&
         (batch.empty() || bytes + outputs_.front().value.size() <= kBatchBytes)) {
    bytes += outputs_.front().key.size() + outputs_.front().value.size();
    batch.push_back(std::move(outputs_.front()));
    outputs_.pop_front();
  }
  return batch;
}

bool EtcdRendezvous::QueueDueTick(std::chrono::steady_clock::time_point now, int64_t* ticked_for,
                                  std::chrono::steady_clock::time_point* wait_until) {
  // (The coordinator's lock is taken without mu_: the reader holds it while delivering.)
  mu_.Unlock();
  std::optional<TimePoint> deadline = coordinator_.NextDeadline();
  mu_.Lock();
  if (!deadline) return false;
  int64_t due = std::chrono::duration_cast<std::chrono::milliseconds>(deadline->time_since_epoch()).count();
  int64_t wall = clock_->WallMs();
  if (due <= wall && due != *ticked_for) {
    *ticked_for = due;
    v1::LogEntry tick;
    tick.set_time_ms(due);
    tick.set_tick(true);
    outbox_.push_back({LogKey(absl::StrCat("t/", due)), tick.SerializeAsString()});
    return true;
  }
  if (due > wall) *wait_until = std::min(*wait_until, now + std::chrono::milliseconds(due - wall));
  return false;
}

bool EtcdRendezvous::StepQuietTrim(std::chrono::steady_clock::time_point now,
                                   std::chrono::steady_clock::time_point* wait_until) {
  switch (trim_.Due(now)) {
    case EtcdQuietTrim::Step::kGrant: {
      mu_.Unlock();
      auto spare = client_->GrantLease(kSpareLeaseTtl.count());
      mu_.Lock();
      if (spare.ok()) {
        trim_.Granted(*spare);
      } else {
        trim_.GrantFailed();
      }
      return true;
    }
    case EtcdQuietTrim::Step::kRevoke: {
      const int64_t spare = trim_.lease();
      mu_.Unlock();
      (void)client_->RevokeLease(spare);  // Or it expires: a delete-only commit as well.
      mu_.Lock();
      trim_.Revoked(now);
      return true;
    }
    case EtcdQuietTrim::Step::kNone: break;
  }
  if (std::optional<std::chrono::steady_clock::time_point> trim_due = trim_.NextDue()) {
    *wait_until = std::min(*wait_until, *trim_due);
  }
  return false;
}

void EtcdRendezvous::WriteLoop() {
  // How long the writer waits when nothing falls due (it is woken for any work).
  constexpr std::chrono::seconds kIdle{60};
  int64_t ticked_for = -1;  // The deadline last logged, not again.
  bool left = false;
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    auto now = clock_->SteadyNow();
    if (!MayWrite()) {
      // A follower whose session ended leaves the line at once: the node behind it must not
      // wait for this one to take a lead it would not take.
      if (!left) {
        left = true;
        mu_.Unlock();
        (void)client_->RevokeLease(lease_);
        mu_.Lock();
      }
      while (!stop_) wake_.Wait(&mu_);
      continue;
    }
    if (!outbox_.empty()) {
      Put next = std::move(outbox_.front());
      outbox_.pop_front();
      WriteRetried([&] { return client_->Txn(CreateOnce(next.key, next.value)).status(); });
      continue;
    }
    if (!outputs_.empty()) {
      std::vector<Put> batch = TakeOutputBatch();
      WriteRetried([&] { return WriteFenced(batch); });
      trim_.Wrote(clock_->SteadyNow());
      continue;
    }
    auto wait_until = now + kIdle;
    replica_changed_ = false;
    if (leading_) {
      // A timeout due in log time: the leader logs a tick so that the replica (and any that
      // takes over) applies it at that time.
      if (QueueDueTick(now, &ticked_for, &wait_until)) continue;
      // After a burst of writes, etcd's read buffer goes with the spare lease (etcd_quiet_trim.h).
      if (StepQuietTrim(now, &wait_until)) continue;
    }
    for (now = clock_->SteadyNow();
         !(stop_ || (MayWrite() && (!outbox_.empty() || !outputs_.empty())) || replica_changed_) && now < wait_until;
         now = clock_->SteadyNow()) {
      clock_->WaitUntil(&wake_, &mu_, wait_until);
    }
  }
}

}  // namespace elrun::rdzv
