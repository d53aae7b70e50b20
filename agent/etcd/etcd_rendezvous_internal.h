// What the two halves of EtcdRendezvous share (etcd_rendezvous.cc: opening, the session's
// messages, the renewer and the writer; etcd_log_reader.cc: reading the log, leading, applying):
// the log's clock rules, the range reads of the line, and the Sink each session's coordinator
// output goes through. Private to //agent/etcd:etcd_rendezvous.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "agent/etcd/etcd_rendezvous.h"

namespace elrun::rdzv {

// How far ahead of a reader's wall clock an entry's time may be and still move the log's clock:
// the writer's clock was read before the entry was written, so an honest one is ahead only by
// the clocks' disagreement (NTP keeps a job's hosts within milliseconds).
constexpr int64_t kMaxClockAheadMs = 10000;
// Lease-less presence keys (forged: no node writes one) a node passes over in the line.
constexpr int kMaxGhostsPassed = 64;

inline TimePoint LogTime(int64_t ms) { return TimePoint(std::chrono::milliseconds(ms)); }

// Up to `limit` keys under `prefix` in the order they were created (etcd reads every key of
// the range to sort them).
inline etcdpb::RangeRequest InCreateOrder(const std::string& prefix, etcdpb::RangeRequest::SortOrder order,
                                          int64_t limit) {
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
inline etcdpb::RangeRequest LastInLine(const std::string& nodes) {
  etcdpb::RangeRequest line = InCreateOrder(nodes, etcdpb::RangeRequest::DESCEND, 1);
  line.set_keys_only(true);
  return line;
}

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

}  // namespace elrun::rdzv
