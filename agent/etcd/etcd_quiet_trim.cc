#include "agent/etcd/etcd_quiet_trim.h"

namespace elrun::rdzv {

void EtcdQuietTrim::Wrote(Clock::time_point now) {
  wrote_ = true;
  if (now > last_write_) last_write_ = now;
}

EtcdQuietTrim::Step EtcdQuietTrim::Due(Clock::time_point now) const {
  if (!wrote_) return Step::kNone;
  if (lease_ == 0) return Step::kGrant;
  return now >= last_write_ + quiet_ ? Step::kRevoke : Step::kNone;
}

std::optional<EtcdQuietTrim::Clock::time_point> EtcdQuietTrim::NextDue() const {
  if (!wrote_) return std::nullopt;
  if (lease_ == 0) return Clock::time_point::min();
  return last_write_ + quiet_;
}

void EtcdQuietTrim::Granted(int64_t lease) { lease_ = lease; }

void EtcdQuietTrim::GrantFailed() { wrote_ = false; }

void EtcdQuietTrim::Revoked(Clock::time_point issued) {
  lease_ = 0;
  if (last_write_ < issued) wrote_ = false;
}

}  // namespace elrun::rdzv
