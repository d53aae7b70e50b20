#include "agent/etcd/etcd_quiet_trim.h"

#include <doctest/doctest.h>

#include <chrono>

namespace elrun::rdzv {
namespace {

using Step = EtcdQuietTrim::Step;
using std::chrono::milliseconds;
constexpr milliseconds kQuiet{1000};
const EtcdQuietTrim::Clock::time_point t0 = EtcdQuietTrim::Clock::time_point() + std::chrono::hours(1);

TEST_CASE("nothing written: nothing to trim") {
  EtcdQuietTrim trim(kQuiet);
  CHECK(trim.Due(t0) == Step::kNone);
  CHECK(!trim.NextDue().has_value());
  CHECK(trim.lease() == 0);
}

TEST_CASE("a write asks for the spare lease at once") {
  EtcdQuietTrim trim(kQuiet);
  trim.Wrote(t0);
  CHECK(trim.Due(t0) == Step::kGrant);
  CHECK(trim.NextDue() == EtcdQuietTrim::Clock::time_point::min());
}

TEST_CASE("the revocation falls due a quiet period after the last write, not before") {
  EtcdQuietTrim trim(kQuiet);
  trim.Wrote(t0);
  trim.Granted(42);
  CHECK(trim.lease() == 42);
  CHECK(trim.Due(t0 + kQuiet - milliseconds(1)) == Step::kNone);
  CHECK(trim.NextDue() == t0 + kQuiet);
  CHECK(trim.Due(t0 + kQuiet) == Step::kRevoke);
}

TEST_CASE("each write pushes the revocation back") {
  EtcdQuietTrim trim(kQuiet);
  trim.Wrote(t0);
  trim.Granted(42);
  trim.Wrote(t0 + milliseconds(700));
  CHECK(trim.Due(t0 + kQuiet) == Step::kNone);
  CHECK(trim.NextDue() == t0 + milliseconds(1700));
  CHECK(trim.Due(t0 + milliseconds(1700)) == Step::kRevoke);
}

TEST_CASE("a write reported late does not move the last write back") {
  EtcdQuietTrim trim(kQuiet);
  trim.Wrote(t0 + milliseconds(500));
  trim.Wrote(t0);
  trim.Granted(42);
  CHECK(trim.NextDue() == t0 + milliseconds(1500));
}

TEST_CASE("after the revocation it rests until the next write") {
  EtcdQuietTrim trim(kQuiet);
  trim.Wrote(t0);
  trim.Granted(42);
  trim.Revoked(t0 + kQuiet);
  CHECK(trim.lease() == 0);
  CHECK(trim.Due(t0 + 10 * kQuiet) == Step::kNone);
  CHECK(!trim.NextDue().has_value());
  trim.Wrote(t0 + 10 * kQuiet);
  CHECK(trim.Due(t0 + 10 * kQuiet) == Step::kGrant);
}

TEST_CASE("a write seen while the revocation was in flight starts the next trim") {
  EtcdQuietTrim trim(kQuiet);
  trim.Wrote(t0);
  trim.Granted(42);
  trim.Wrote(t0 + kQuiet + milliseconds(5));  // After the revocation was sent at t0 + kQuiet.
  trim.Revoked(t0 + kQuiet);
  CHECK(trim.lease() == 0);
  CHECK(trim.Due(t0 + kQuiet + milliseconds(10)) == Step::kGrant);
}

TEST_CASE("a failed grant skips this burst; the next write tries again") {
  EtcdQuietTrim trim(kQuiet);
  trim.Wrote(t0);
  trim.GrantFailed();
  CHECK(trim.Due(t0 + 5 * kQuiet) == Step::kNone);
  CHECK(!trim.NextDue().has_value());
  trim.Wrote(t0 + 5 * kQuiet);
  CHECK(trim.Due(t0 + 5 * kQuiet) == Step::kGrant);
}

}  // namespace
}  // namespace elrun::rdzv
