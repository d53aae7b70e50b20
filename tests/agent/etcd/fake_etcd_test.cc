// The fake etcd behaves as etcd does where the etcd-v3 backend relies on it: the backend's
// unit tests (etcd_rendezvous_test.cc) are only as good as this.
#include "tests/agent/etcd/fake_etcd.h"

#include <doctest/doctest.h>

#include <thread>

namespace elrun::rdzv {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

struct Fixture {
  std::shared_ptr<FakeClock> clock = std::make_shared<FakeClock>();
  FakeEtcd etcd{clock, milliseconds(2000)};
  std::unique_ptr<EtcdKv> kv = etcd.Connect("a");

  etcdpb::TxnResponse Put(const std::string& key, const std::string& value, int64_t lease = 0) {
    etcdpb::TxnRequest txn;
    auto* put = txn.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value(value);
    put->set_lease(lease);
    auto done = kv->Txn(txn);
    REQUIRE(done.ok());
    return *done;
  }
  etcdpb::RangeResponse Range(etcdpb::RangeRequest request) {
    auto read = kv->Range(request);
    REQUIRE(read.ok());
    return *read;
  }
  etcdpb::RangeResponse Prefix(const std::string& prefix) {
    etcdpb::RangeRequest request;
    request.set_key(prefix);
    request.set_range_end(PrefixEnd(prefix));
    return Range(request);
  }
};

TEST_CASE("one revision per writing transaction; create and mod revisions and versions per key") {
  Fixture f;
  CHECK(f.etcd.revision() == 1);
  CHECK(f.Put("/k", "1").header().revision() == 2);
  CHECK(f.Put("/k", "2").header().revision() == 3);
  etcdpb::TxnRequest two;
  for (const char* key : {"/a", "/b"}) {
    auto* put = two.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value("x");
  }
  CHECK(f.kv->Txn(two)->header().revision() == 4);
  etcdpb::RangeResponse all = f.Prefix("/");
  REQUIRE(all.kvs_size() == 3);
  CHECK(all.kvs(0).key() == "/a");  // Key order.
  CHECK(all.kvs(0).create_revision() == 4);
  CHECK(all.kvs(1).create_revision() == 4);
  CHECK(all.kvs(2).key() == "/k");
  CHECK(all.kvs(2).create_revision() == 2);
  CHECK(all.kvs(2).mod_revision() == 3);
  CHECK(all.kvs(2).version() == 2);
  CHECK(all.kvs(2).value() == "2");
  // A read-only transaction writes no revision.
  etcdpb::TxnRequest read;
  read.add_success()->mutable_request_range()->set_key("/k");
  CHECK(f.kv->Txn(read)->header().revision() == 4);
  // A key put again after its deletion starts afresh.
  etcdpb::TxnRequest erase;
  erase.add_success()->mutable_request_delete_range()->set_key("/k");
  CHECK(f.kv->Txn(erase)->responses(0).response_delete_range().deleted() == 1);
  f.Put("/k", "3");
  etcdpb::RangeRequest k;
  k.set_key("/k");
  etcdpb::RangeResponse again = f.Range(k);
  REQUIRE(again.kvs_size() == 1);
  CHECK(again.kvs(0).create_revision() == 6);
  CHECK(again.kvs(0).version() == 1);
}

TEST_CASE("Range: past revisions, sort, limit, filters, keys and count only, compaction") {
  Fixture f;
  f.Put("/p/b", "1");  // 2
  f.Put("/p/a", "2");  // 3
  f.Put("/p/c", "3");  // 4
  f.Put("/p/b", "4");  // 5: mod, not create

  etcdpb::RangeRequest request;
  request.set_key("/p/");
  request.set_range_end(PrefixEnd("/p/"));
  request.set_sort_target(etcdpb::RangeRequest::CREATE);
  request.set_sort_order(etcdpb::RangeRequest::DESCEND);
  request.set_limit(2);
  etcdpb::RangeResponse newest = f.Range(request);
  REQUIRE(newest.kvs_size() == 2);
  CHECK(newest.kvs(0).key() == "/p/c");
  CHECK(newest.kvs(1).key() == "/p/a");
  CHECK(newest.more());
  CHECK(newest.count() == 3);
  CHECK(newest.header().revision() == 5);

  // A target other than KEY sorts ascending when no order is given.
  request.set_sort_order(etcdpb::RangeRequest::NONE);
  request.set_limit(0);
  request.set_min_create_revision(3);
  request.set_keys_only(true);
  etcdpb::RangeResponse since = f.Range(request);
  REQUIRE(since.kvs_size() == 2);
  CHECK(since.kvs(0).key() == "/p/a");
  CHECK(since.kvs(0).value().empty());
  CHECK(since.kvs(1).key() == "/p/c");
  CHECK_FALSE(since.more());

  etcdpb::RangeRequest old;
  old.set_key("/p/b");
  old.set_revision(4);
  etcdpb::RangeResponse was = f.Range(old);
  REQUIRE(was.kvs_size() == 1);
  CHECK(was.kvs(0).value() == "1");
  old.set_revision(1);
  CHECK(f.Range(old).kvs_size() == 0);  // Not created yet.

  etcdpb::RangeRequest count;
  count.set_key("/p/");
  count.set_range_end(PrefixEnd("/p/"));
  count.set_count_only(true);
  etcdpb::RangeResponse counted = f.Range(count);
  CHECK(counted.count() == 3);
  CHECK(counted.kvs_size() == 0);

  old.set_revision(99);
  CHECK(f.kv->Range(old).status().code() == absl::StatusCode::kOutOfRange);
  f.etcd.Compact(4);
  old.set_revision(3);
  CHECK(f.kv->Range(old).status().code() == absl::StatusCode::kOutOfRange);
  old.set_revision(4);
  CHECK(f.kv->Range(old).ok());
}

TEST_CASE("Txn: compares over keys and ranges; nested transactions decide on the state before") {
  Fixture f;
  f.Put("/n/x", "v");
  auto compare = [](etcdpb::TxnRequest* txn, const std::string& key, const std::string& range_end,
                    etcdpb::Compare::CompareTarget target, etcdpb::Compare::CompareResult result) {
    auto* c = txn->add_compare();
    c->set_key(key);
    c->set_range_end(range_end);
    c->set_target(target);
    c->set_result(result);
    return c;
  };
  {
    etcdpb::TxnRequest absent;  // An absent key's create revision is 0...
    compare(&absent, "/none", "", etcdpb::Compare::CREATE, etcdpb::Compare::EQUAL)->set_create_revision(0);
    CHECK(f.kv->Txn(absent)->succeeded());
  }
  {
    etcdpb::TxnRequest value;  // ...but its value compares with nothing.
    compare(&value, "/none", "", etcdpb::Compare::VALUE, etcdpb::Compare::EQUAL)->set_value("");
    CHECK_FALSE(f.kv->Txn(value)->succeeded());
  }
  {
    etcdpb::TxnRequest none;  // Over a range: every key must hold it.
    compare(&none, "/n/", PrefixEnd("/n/"), etcdpb::Compare::CREATE, etcdpb::Compare::EQUAL)->set_create_revision(0);
    CHECK_FALSE(f.kv->Txn(none)->succeeded());
    f.Put("/n/y", "w");
    etcdpb::TxnRequest live;
    compare(&live, "/n/", PrefixEnd("/n/"), etcdpb::Compare::CREATE, etcdpb::Compare::GREATER)->set_create_revision(0);
    CHECK(f.kv->Txn(live)->succeeded());
  }
  {
    // The nested compare sees /z absent although the outer transaction put it first.
    etcdpb::TxnRequest outer;
    auto* put = outer.add_success()->mutable_request_put();
    put->set_key("/z");
    put->set_value("1");
    auto* inner = outer.add_success()->mutable_request_txn();
    compare(inner, "/z", "", etcdpb::Compare::CREATE, etcdpb::Compare::EQUAL)->set_create_revision(0);
    inner->add_success()->mutable_request_range()->set_key("/z");
    auto done = f.kv->Txn(outer);
    REQUIRE(done.ok());
    REQUIRE(done->responses_size() == 2);
    CHECK(done->responses(1).response_txn().succeeded());
    // A read after a write in the same transaction sees it.
    CHECK(done->responses(1).response_txn().responses(0).response_range().kvs_size() == 1);
  }
}

TEST_CASE("Txn: refused whole - a put and a delete of one key, a put under a lease that is not there") {
  Fixture f;
  const int64_t before = f.etcd.revision();
  etcdpb::TxnRequest both;
  auto* erase = both.add_success()->mutable_request_delete_range();
  erase->set_key("/j/");
  erase->set_range_end(PrefixEnd("/j/"));
  both.add_success()->mutable_request_put()->set_key("/j/k");
  CHECK(f.kv->Txn(both).status().code() == absl::StatusCode::kInvalidArgument);
  etcdpb::TxnRequest twice;
  twice.add_success()->mutable_request_put()->set_key("/j/k");
  twice.add_success()->mutable_request_put()->set_key("/j/k");
  CHECK(f.kv->Txn(twice).status().code() == absl::StatusCode::kInvalidArgument);
  etcdpb::TxnRequest leased;
  leased.add_success()->mutable_request_put()->set_key("/j/a");
  auto* put = leased.add_success()->mutable_request_put();
  put->set_key("/j/b");
  put->set_lease(12345);
  CHECK(f.kv->Txn(leased).status().code() == absl::StatusCode::kNotFound);
  CHECK(f.etcd.revision() == before);
  CHECK(f.etcd.Keys("/j/", PrefixEnd("/j/")).empty());
}

TEST_CASE("leases: their keys go in one revision when revoked, or when the TTL runs out on the clock") {
  Fixture f;
  auto lease = f.kv->GrantLease(3);
  REQUIRE(lease.ok());
  f.Put("/l/a", "1", *lease);
  f.Put("/l/b", "2", *lease);
  f.Put("/l/c", "3");
  const int64_t before = f.etcd.revision();
  auto watch = f.kv->Watch({{"/l/", PrefixEnd("/l/")}}, before + 1);
  REQUIRE(watch.ok());

  f.clock->Advance(milliseconds(2500));
  CHECK(*f.kv->KeepAlive(*lease) == 3);  // Renewed: 3 s from now.
  f.clock->Advance(milliseconds(2500));
  f.etcd.ExpireDue();
  CHECK(f.etcd.Keys("/l/", PrefixEnd("/l/")).size() == 3);
  f.clock->Advance(milliseconds(600));
  f.etcd.ExpireDue();
  CHECK(f.etcd.Keys("/l/", PrefixEnd("/l/")).size() == 1);
  CHECK(f.etcd.revision() == before + 1);
  CHECK(f.kv->KeepAlive(*lease).status().code() == absl::StatusCode::kNotFound);
  CHECK(f.etcd.leases() == 0);

  etcdpb::WatchResponse events;
  REQUIRE((*watch)->Read(&events));
  REQUIRE(events.events_size() == 2);
  CHECK(events.events(0).type() == mvccpb::Event::DELETE);
  CHECK(events.events(0).kv().key() == "/l/a");
  CHECK(events.events(1).kv().key() == "/l/b");
  CHECK(events.header().revision() == before + 1);

  auto other = f.kv->GrantLease(10);
  REQUIRE(other.ok());
  f.Put("/l/d", "4", *other);
  CHECK(f.kv->RevokeLease(*other).ok());
  CHECK(f.etcd.Keys("/l/d", "").empty());
  CHECK(f.kv->RevokeLease(*other).code() == absl::StatusCode::kNotFound);
}

TEST_CASE("watches: history from a revision, then live events; Cancel and a cut end them") {
  Fixture f;
  f.Put("/w/1", "a");  // 2
  f.Put("/x", "b");    // 3
  f.Put("/w/2", "c");  // 4
  auto watch = f.kv->Watch({{"/w/", PrefixEnd("/w/")}, {"/y", ""}}, 3);
  REQUIRE(watch.ok());
  etcdpb::WatchResponse response;
  REQUIRE((*watch)->Read(&response));
  REQUIRE(response.events_size() == 1);
  CHECK(response.events(0).kv().key() == "/w/2");

  std::thread writer([&] {
    f.Put("/x", "not watched");
    f.Put("/y", "d");
  });
  REQUIRE((*watch)->Read(&response));
  REQUIRE(response.events_size() == 1);
  CHECK(response.events(0).kv().key() == "/y");
  CHECK(response.events(0).kv().value() == "d");
  writer.join();

  std::thread cancel([&] { (*watch)->Cancel(); });
  CHECK_FALSE((*watch)->Read(&response));
  cancel.join();
  CHECK((*watch)->Finish().code() == absl::StatusCode::kCancelled);

  auto cut = f.kv->Watch({{"/w/", PrefixEnd("/w/")}}, 0);
  REQUIRE(cut.ok());
  f.etcd.Cut("a");
  CHECK_FALSE((*cut)->Read(&response));
  CHECK((*cut)->Finish().code() == absl::StatusCode::kUnavailable);
  f.etcd.Restore("a");

  f.etcd.Compact(4);
  CHECK(f.kv->Watch({{"/w/", ""}}, 2).status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a cut client's calls fail after the retry time on the clock, and succeed once restored") {
  Fixture f;
  std::unique_ptr<EtcdKv> other = f.etcd.Connect("b");
  f.etcd.Cut("a");
  absl::Status status;
  const EtcdClock::TimePoint start = f.clock->SteadyNow();
  std::thread call([&] { status = f.kv->GrantLease(5).status(); });
  // The call waits on the clock: it ends only once the clock has moved the retry time on.
  REQUIRE(f.clock->AwaitWaiting(1, milliseconds(10000)));
  f.clock->Advance(milliseconds(1500));
  REQUIRE(f.clock->AwaitWaiting(1, milliseconds(10000)));  // Still waiting.
  f.clock->Advance(milliseconds(500));
  call.join();
  CHECK(f.clock->SteadyNow() - start == milliseconds(2000));
  CHECK(status.code() == absl::StatusCode::kUnavailable);
  CHECK(other->GrantLease(5).ok());  // Another client reaches etcd.

  std::thread restored([&] { status = f.kv->GrantLease(5).status(); });
  f.etcd.Restore("a");
  restored.join();
  CHECK(status.ok());
}

}  // namespace
}  // namespace elrun::rdzv
