// When the etcd-v3 backend's leader makes etcd drop the read buffer a burst of the job's
// writes left behind. etcd 3.4 copies that whole buffer - every bucket written since the last
// backend commit that left it out, at the largest size it grew to - into each read
// transaction, and it opens one for every response header it fills: each lease renewal of
// every agent pays for it (mvcc/backend's ConcurrentReadTx; etcd 3.5 reuses an unchanged copy).
// A bucket leaves the buffer only at a backend commit whose batch did not write it, so after a
// round forms the buffer stays until something else is written: a delete-only commit clears
// it. The leader makes one: it grants a spare lease (no keys) when the job writes, and revokes
// it once the job has written nothing for `quiet`, longer than etcd's backend batch interval
// (100 ms by default), so that the job's last writes went out in an earlier batch. A pure
// state machine: time comes in as an argument. Not thread-safe: its owner's lock guards it.
#ifndef ELRUN_AGENT_ETCD_ETCD_QUIET_TRIM_H_
#define ELRUN_AGENT_ETCD_ETCD_QUIET_TRIM_H_

#include <chrono>
#include <cstdint>
#include <optional>

namespace elrun::rdzv {

class EtcdQuietTrim {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Step {
    kNone,    // Nothing to do now.
    kGrant,   // Grant the spare lease, then report Granted or GrantFailed.
    kRevoke,  // Revoke lease(), then report Revoked.
  };

  explicit EtcdQuietTrim(Clock::duration quiet) : quiet_(quiet) {}

  // The job wrote to etcd at `now` (an entry seen, an output written).
  void Wrote(Clock::time_point now);
  // What the owner should do at `now`.
  Step Due(Clock::time_point now) const;
  // When Due next returns a step other than kNone without another Wrote; nullopt: never.
  std::optional<Clock::time_point> NextDue() const;

  void Granted(int64_t lease);
  // This burst is not trimmed; the next write tries again.
  void GrantFailed();
  // The spare lease is gone (revoked, or expired: the same for etcd). `issued`: when the
  // revocation was sent; a write seen since then starts the next trim at once.
  void Revoked(Clock::time_point issued);

  // The spare lease held now; 0: none. Its owner revokes it when it leaves.
  int64_t lease() const { return lease_; }

 private:
  const Clock::duration quiet_;
  bool wrote_ = false;  // Written since the last trim (or since the start).
  Clock::time_point last_write_{};
  int64_t lease_ = 0;
};

}  // namespace elrun::rdzv

#endif  // ELRUN_AGENT_ETCD_ETCD_QUIET_TRIM_H_
