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

namespace elrun::rdzv {
namespace {

// The spare lease of EtcdQuietTrim: outlives any burst of writes; a leader that dies holding
// one leaves it to expire, which is a delete-only commit too.
constexpr std::chrono::seconds kSpareLeaseTtl{60};

// How far ahead of a reader's wall clock an entry's time may be and still move the log's clock:
// the writer's clock was read before the entry was written, so an honest one is ahead only by
// the clocks' disagreement (NTP keeps a job's hosts within milliseconds).
constexpr int64_t kMaxClockAheadMs = 10000;
// Lease-less presence keys (forged: no node writes one) a node passes over in the line.
constexpr int kMaxGhostsPassed = 64;

TimePoint LogTime(int64_t ms) { return TimePoint(std::chrono::milliseconds(ms)); }

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

// Up to `limit` keys under `prefix` in the order they were created (etcd reads every key of
// the range to sort them).
etcdpb::RangeRequest InCreateOrder(const std::string& prefix, etcdpb::RangeRequest::SortOrder order, int64_t limit) {
  etcdpb::RangeRequest range;
  range.set_key(prefix);
  range.set_range_end(PrefixEnd(prefix));
  range.set_sort_target(etcdpb::RangeRequest::CREATE);
  range.set_sort_order(order);
  range.set_limit(limit);
  return range;
}

// The last key of the line under `nodes` (the newest presence), keys only: O(N) for etcd in
// a job of N nodes.
etcdpb::RangeRequest LastInLine(const std::string& nodes) {
  etcdpb::RangeRequest line = InCreateOrder(nodes, etcdpb::RangeRequest::DESCEND, 1);
  line.set_keys_only(true);
  return line;
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

// Where the replica's coordinator sends to one session: outputs, in order, counted per session.
class EtcdRendezvous::Sink : public SessionSink {
 public:
  Sink(EtcdRendezvous* owner, uint64_t session) : owner_(owner), session_(session) {}
  void Send(const v1::CoordinatorMessage& message) override {
    v1::OutEntry entry;
    *entry.mutable_message() = message;
    owner_->Output(session_, std::move(entry));
  }
  void Close(const absl::Status& status) override {
    v1::OutEntry entry;
    entry.mutable_closed()->set_code(static_cast<int32_t>(status.code()));
    entry.mutable_closed()->set_message(std::string(status.message()));
    owner_->Output(session_, std::move(entry));
    owner_->closing_.push_back({session_, status});
  }

 private:
  EtcdRendezvous* const owner_;
  const uint64_t session_;
};

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

// ------------------------------------------------------------------------- the reader

void EtcdRendezvous::ReadLoop() {
  auto lost_since = clock_->SteadyNow();
  while (true) {
    bool leading;
    {
      absl::MutexLock lock(&mu_);
      // A leader whose own session ended still leads until it leaves: the others' outputs.
      if (stop_ || (ended_ && !leading_)) return;
      leading = leading_;
    }
    absl::Status status = leading ? Lead() : Follow();
    if (status.ok()) {
      lost_since = clock_->SteadyNow();
      continue;
    }
    // Every member was tried for retry_for; a lease that outlives this is not likely.
    if (clock_->SteadyNow() - lost_since > options_.lease_ttl + options_.etcd.retry_for) {
      End(absl::UnavailableError(absl::StrCat("lost the etcd cluster: ", status.message())));
      return;
    }
  }
}

absl::Status EtcdRendezvous::LookAround(std::string* ahead, int64_t* at) {
  const std::string mine = OutPrefix(session_);
  const std::string nodes = base_ + "nodes/";
  etcdpb::RangeRequest page = InCreateOrder(mine, etcdpb::RangeRequest::ASCEND, 1000);
  // The live node just before this one: the last of the line up to this node's place.
  etcdpb::RangeRequest line = LastInLine(nodes);
  line.set_max_create_revision(presence_revision_ - 1);
  etcdpb::RangeRequest known;  // Still there, and not another node's under the same id.
  known.set_key(*ahead);
  known.set_keys_only(true);
  known.set_max_create_revision(presence_revision_ - 1);
  const bool hint = !ahead->empty();
  etcdpb::TxnRequest both;  // One snapshot: the outputs since the last seen, and the node ahead.
  page.set_min_create_revision(outputs_seen_ + 1);
  *both.add_success()->mutable_request_range() = page;
  *both.add_success()->mutable_request_range() = hint ? known : line;
  auto read = client_->Txn(both);
  if (!read.ok()) return read.status();
  if (read->responses_size() != 2) return absl::InternalError("etcd answered a read with the wrong shape");
  *at = read->header().revision();
  const etcdpb::RangeResponse* predecessor = &read->responses(1).response_range();
  etcdpb::RangeResponse looked;
  // Gone: read the line at the same revision. A presence without a lease is no node's (each
  // puts its own under its lease) and would never go: passed over, a bounded number of times.
  for (int ghosts = 0; ghosts < kMaxGhostsPassed; ++ghosts) {
    const bool gone = hint && ghosts == 0 && predecessor->kvs_size() == 0;
    const bool ghost = predecessor->kvs_size() > 0 && predecessor->kvs(0).lease() == 0;
    if (!gone && !ghost) break;
    if (ghost) line.set_max_create_revision(predecessor->kvs(0).create_revision() - 1);
    line.set_revision(*at);
    auto read_line = client_->Range(line);
    if (!read_line.ok()) return read_line.status();
    looked = *std::move(read_line);
    predecessor = &looked;
  }
  if (predecessor->kvs_size() > 0 && predecessor->kvs(0).lease() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("more than ", kMaxGhostsPassed, " presence keys without a lease ahead of this node in ", nodes));
  }
  *ahead = predecessor->kvs_size() > 0 ? predecessor->kvs(0).key() : "";
  const etcdpb::RangeResponse* outputs = &read->responses(0).response_range();
  etcdpb::RangeResponse next;
  while (true) {
    for (const mvccpb::KeyValue& kv : outputs->kvs()) OnOutput(kv);
    if (!outputs->more()) return absl::OkStatus();
    page.set_min_create_revision(outputs_seen_ + 1);
    page.set_revision(*at);
    auto more = client_->Range(page);
    if (!more.ok()) return more.status();
    next = *std::move(more);
    outputs = &next;
  }
}

absl::Status EtcdRendezvous::Follow() {
  const std::string mine = OutPrefix(session_);
  int64_t at = 0;  // Every read at the first one's revision.
  if (first_look_) {
    // Open's transaction read it; no output can be older than this node's session.
    ahead_ = first_look_->ahead;
    at = first_look_->revision;
    first_look_.reset();
  } else {
    absl::Status looked = LookAround(&ahead_, &at);
    if (!looked.ok()) return looked;
  }
  const std::string ahead = ahead_;
  if (ahead.empty()) {
    absl::MutexLock lock(&mu_);
    if (!ended_) leading_ = true;  // Every node before this one is gone.
    return absl::OkStatus();
  }
  auto opened = client_->Watch({{mine, PrefixEnd(mine)}, {ahead, ""}}, at + 1);
  if (!opened.ok()) return opened.status();
  EtcdKvWatch* watch;  // Only this thread resets watch_: it reads through it without the lock.
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return absl::OkStatus();
    watch_ = *std::move(opened);
    watch = watch_.get();
  }
  bool gone = false;  // The predecessor.
  etcdpb::WatchResponse response;
  while (!gone && watch->Read(&response)) {
    if (response.canceled() || response.compact_revision() > 0) break;  // Read the keys again.
    for (const mvccpb::Event& event : response.events()) {
      if (event.type() == mvccpb::Event::PUT && absl::StartsWith(event.kv().key(), mine)) {
        OnOutput(event.kv());
      } else if (event.type() == mvccpb::Event::DELETE && event.kv().key() == ahead) {
        gone = true;
      }
    }
  }
  if (gone) ahead_.clear();  // The next look reads the line.
  // The watch ran, and ended (its member died, or the predecessor went): look again. Only
  // reads and watches that cannot be opened count against the cluster.
  absl::MutexLock lock(&mu_);
  watch_->Cancel();
  (void)watch_->Finish();
  watch_.reset();
  return absl::OkStatus();
}

void EtcdRendezvous::OnOutput(const mvccpb::KeyValue& kv) {
  outputs_seen_ = std::max(outputs_seen_, kv.create_revision());
  uint64_t seq;
  const std::string mine = OutPrefix(session_);
  if (!absl::SimpleAtoi(absl::string_view(kv.key()).substr(mine.size()), &seq)) return;
  v1::OutEntry entry;
  if (!entry.ParseFromString(kv.value())) {
    End(absl::DataLossError(absl::StrCat("an unreadable output of the coordinator in etcd at ", kv.key())));
    return;
  }
  TakeOutput(seq, entry);
}

void EtcdRendezvous::TakeOutput(uint64_t seq, const v1::OutEntry& entry) {
  uint64_t next;
  {
    absl::MutexLock lock(&mu_);
    next = delivered_;
  }
  if (seq < next) return;  // Taken already (written again by a new leader, or read twice).
  early_[seq] = entry;
  for (auto it = early_.begin(); it != early_.end() && it->first == next; it = early_.erase(it), ++next) {
    if (it->second.has_closed()) {
      // An ending is never OK, whatever code the entry carries (it is read from etcd).
      int code = it->second.closed().code();
      End(absl::Status(code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated)
                           ? static_cast<absl::StatusCode>(code)
                           : absl::StatusCode::kUnavailable,
                       it->second.closed().message()));
    } else {
      Deliver(it->second.message());
    }
  }
  absl::MutexLock lock(&mu_);
  delivered_ = next;
}

absl::Status EtcdRendezvous::Lead() {
  auto revision = CatchUp();
  if (!revision.ok()) return revision.status();
  const std::string log = base_ + "log/";
  const std::string nodes = base_ + "nodes/";
  auto opened = client_->Watch({{log, PrefixEnd(log)}, {nodes, PrefixEnd(nodes)}}, *revision + 1);
  if (!opened.ok()) return opened.status();
  EtcdKvWatch* watch;  // Only this thread resets watch_: it reads through it without the lock.
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return absl::OkStatus();
    watch_ = *std::move(opened);
    watch = watch_.get();
  }
  etcdpb::WatchResponse response;
  while (watch->Read(&response)) {
    if (response.canceled() || response.compact_revision() > 0) break;  // Read the keys again.
    for (const mvccpb::Event& event : response.events()) {
      const std::string& key = event.kv().key();
      if (event.type() == mvccpb::Event::PUT && absl::StartsWith(key, log)) {
        Apply(event.kv());
      } else if (event.type() == mvccpb::Event::DELETE && absl::StartsWith(key, nodes)) {
        OnPresenceGone(key.substr(nodes.size()));
      }
    }
    Applied();
  }
  // The watch ran, and ended (its member died, or the predecessor went): look again. Only
  // reads and watches that cannot be opened count against the cluster.
  absl::MutexLock lock(&mu_);
  watch_->Cancel();
  (void)watch_->Finish();
  watch_.reset();
  return absl::OkStatus();
}

absl::Status EtcdRendezvous::ReadWritten(int64_t revision) {
  const std::string out = base_ + "out/";
  std::string from = out;
  while (true) {
    etcdpb::RangeRequest page;
    page.set_key(from);
    page.set_range_end(PrefixEnd(out));
    page.set_keys_only(true);
    page.set_limit(1000);
    page.set_revision(revision);
    auto read = client_->Range(page);
    if (!read.ok()) return read.status();
    for (const mvccpb::KeyValue& kv : read->kvs()) {
      std::vector<absl::string_view> parts = absl::StrSplit(absl::string_view(kv.key()).substr(out.size()), '/');
      uint64_t session, seq;
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &session) || !absl::SimpleAtoi(parts[1], &seq)) continue;
      uint64_t& count = written_[session];
      count = std::max(count, seq + 1);
    }
    if (!read->more() || read->kvs_size() == 0) break;
    from = read->kvs(read->kvs_size() - 1).key() + std::string(1, '\0');
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> EtcdRendezvous::CatchUp() {
  const std::string log = base_ + "log/";
  int64_t at = 0;  // Every page is read at the first page's revision.
  if (!replica_ready_) {
    // Taking the lead: what the previous leaders wrote is not written again, and the fence
    // and the leader key go first.
    etcdpb::RangeRequest probe;
    probe.set_key(base_ + "nodes/");
    probe.set_range_end(PrefixEnd(base_ + "nodes/"));
    probe.set_count_only(true);
    auto read = client_->Range(probe);
    if (!read.ok()) return read.status();
    at = read->header().revision();
    absl::Status written = ReadWritten(at);
    if (!written.ok()) return written;
    replica_ready_ = true;
    absl::MutexLock lock(&mu_);
    outputs_.push_front({base_ + "leader", options_.node_id});
    wake_.SignalAll();
  }
  while (true) {
    etcdpb::RangeRequest page = InCreateOrder(log, etcdpb::RangeRequest::ASCEND, 1000);
    page.set_min_create_revision(applied_ + 1);
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
  v1::LogEntry entry;
  entry.set_time_ms(clock_->WallMs());
  entry.set_session(session);
  entry.set_disconnect("its etcd lease ended (the agent left, died or stalled)");
  absl::MutexLock lock(&mu_);
  if (!disconnects_asked_.insert(session).second) return;
  outbox_.push_back({LogKey(absl::StrCat("d/", session)), entry.SerializeAsString()});
  wake_.SignalAll();
}

void EtcdRendezvous::Output(uint64_t session, v1::OutEntry entry) {
  const uint64_t seq = made_[session]++;
  if (session == session_) {
    // This node's own: taken here, once (those taken while following are not again).
    TakeOutput(seq, entry);
    return;
  }
  // Made by the agent itself when it opened the session (Open), never written.
  if (seq == 0 && entry.has_message() && entry.message().has_challenge()) return;
  auto written = written_.find(session);
  if (written != written_.end() && seq < written->second) return;
  absl::MutexLock lock(&mu_);
  outputs_.push_back({absl::StrCat(OutPrefix(session), seq), entry.SerializeAsString()});
  wake_.SignalAll();
}

void EtcdRendezvous::Applied() {
  absl::MutexLock lock(&mu_);
  trim_.Wrote(clock_->SteadyNow());
  replica_changed_ = true;
  wake_.SignalAll();
}

void EtcdRendezvous::CloseSession(uint64_t session, const absl::Status& status) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  live_.erase(it->second);
  sessions_.erase(it);
  coordinator_.OnDisconnect(session, LogTime(log_time_ms_), std::string(status.message()));
  if (session == session_) End(status);
}

void EtcdRendezvous::Apply(const mvccpb::KeyValue& kv) {
  // A key is an entry once, when it is created; later puts on it (a retried write) are not.
  if (kv.create_revision() != kv.mod_revision() || kv.create_revision() <= applied_) return;
  applied_ = kv.create_revision();
  v1::LogEntry entry;
  if (!entry.ParseFromString(kv.value())) return;  // Skipped by every replica alike.
  // A time from etcd is checked before it drives a decision: one far ahead of this reader's
  // clock (a forged entry: INT64_MAX, or a tick 30 days ahead, made every timeout fall due at
  // once) moves nothing; the entry itself still applies at the log's time. (A replica reading it
  // much later, its clock past the entry's, would take it: only a writer whose clock ran ahead
  // by more than kMaxClockAheadMs makes replicas disagree.)
  if (entry.time_ms() <= clock_->WallMs() + kMaxClockAheadMs) log_time_ms_ = std::max(log_time_ms_, entry.time_ms());
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
        if (!status.ok()) {
          // What the grpc backend's stream would end with: the agent hears why.
          Sink(this, session).Close(status);
        }
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
