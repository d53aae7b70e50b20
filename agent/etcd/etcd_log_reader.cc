// EtcdRendezvous's reader: it follows the job's log, applies each entry to this replica's
// coordinator, leads when this node is first in line, and delivers the outputs addressed to this
// node's session. Opening, the renewer and the writer are in etcd_rendezvous.cc.
#include "agent/etcd/etcd_rendezvous.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/etcd/etcd_rendezvous_internal.h"

namespace elrun::rdzv {

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

}  // namespace elrun::rdzv
