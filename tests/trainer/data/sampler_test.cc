// DistributedSampler: PyTorch's sharding semantics, determinism, and resuming at a global
// position with another world size.
#include "trainer/data/sampler.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

namespace elrun::trainer {
namespace {

DistributedSampler Make(int64_t n, int world, int rank, bool drop_last = false, bool shuffle = true, int64_t batch = 1,
                        uint64_t seed = 7) {
  absl::StatusOr<DistributedSampler> s = DistributedSampler::Create({n, world, rank, seed, shuffle, drop_last, batch});
  REQUIRE_MESSAGE(s.ok(), s.status().ToString());
  return *s;
}

// How often each index appears across all ranks' shards.
std::map<int64_t, int> Coverage(int64_t n, int world, bool drop_last, int64_t epoch, int64_t start = 0) {
  std::map<int64_t, int> seen;
  for (int rank = 0; rank < world; ++rank) {
    for (int64_t i : Make(n, world, rank, drop_last).Indices(epoch, start)) ++seen[i];
  }
  return seen;
}

TEST_CASE("Create rejects bad options") {
  CHECK(DistributedSampler::Create({-1, 1, 0}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(DistributedSampler::Create({10, 0, 0}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(DistributedSampler::Create({10, 2, 2}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(DistributedSampler::Create({10, 2, -1}).status().code() == absl::StatusCode::kInvalidArgument);
  SamplerOptions zero_batch{10, 2, 1};
  zero_batch.batch_size = 0;
  absl::Status s = DistributedSampler::Create(zero_batch).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("batch size 0") != std::string::npos);
}

TEST_CASE("the order is a permutation, the same on every rank and for every build") {
  std::vector<int64_t> order = Make(1000, 4, 0).Order(3);
  for (int rank = 1; rank < 4; ++rank) CHECK(Make(1000, 4, rank).Order(3) == order);
  std::vector<int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  CHECK(sorted == identity);
  CHECK(order != identity);
  // Pinned: mt19937_64 and the explicit Fisher-Yates are fully specified, so this never changes.
  CHECK(Make(10, 1, 0, false, true, 1, 0).Order(0) == std::vector<int64_t>{7, 2, 0, 8, 3, 9, 6, 1, 5, 4});
}

TEST_CASE("the order depends on seed + epoch") {
  CHECK(Make(100, 1, 0).Order(0) != Make(100, 1, 0).Order(1));
  CHECK(Make(100, 1, 0, false, true, 1, 5).Order(2) == Make(100, 1, 0, false, true, 1, 6).Order(1));
  CHECK(Make(100, 1, 0, false, true, 1, 5).Order(2) != Make(100, 1, 0, false, true, 1, 9).Order(2));
}

TEST_CASE("without shuffle the order is the identity") {
  std::vector<int64_t> order = Make(5, 1, 0, false, false).Order(4);
  CHECK(order == std::vector<int64_t>{0, 1, 2, 3, 4});
  CHECK(Make(5, 2, 1, false, false).Indices(4) == std::vector<int64_t>{1, 3, 0});  // Padded by 0.
}

TEST_CASE("shards are rank-strided slices of the order") {
  DistributedSampler r1 = Make(10, 3, 1);
  std::vector<int64_t> order = r1.Order(2);
  CHECK(r1.Indices(2) == std::vector<int64_t>{order[1], order[4], order[7], order[0]});
}

TEST_CASE("shards are disjoint and cover the dataset when it divides evenly") {
  for (bool drop_last : {false, true}) {
    std::map<int64_t, int> seen = Coverage(1200, 4, drop_last, 0);
    CHECK(seen.size() == 1200);
    CHECK(std::all_of(seen.begin(), seen.end(), [](auto& kv) { return kv.second == 1; }));
    CHECK(Make(1200, 4, 3, drop_last).NumSamples() == 300);
  }
}

TEST_CASE("padding wraps around; drop_last drops the tail") {
  // 10 samples, 4 ranks: PyTorch pads to 12 (num_samples 3) or drops to 8 (num_samples 2).
  SUBCASE("padding") {
    for (int rank = 0; rank < 4; ++rank) CHECK(Make(10, 4, rank).NumSamples() == 3);
    std::map<int64_t, int> seen = Coverage(10, 4, false, 1);
    CHECK(seen.size() == 10);
    std::vector<int64_t> order = Make(10, 4, 0).Order(1);
    CHECK(seen[order[0]] == 2);  // The two padding entries repeat the head of the order.
    CHECK(seen[order[1]] == 2);
    CHECK(seen[order[2]] == 1);
  }
  SUBCASE("drop_last") {
    for (int rank = 0; rank < 4; ++rank) CHECK(Make(10, 4, rank, true).NumSamples() == 2);
    std::map<int64_t, int> seen = Coverage(10, 4, true, 1);
    CHECK(seen.size() == 8);
    std::vector<int64_t> order = Make(10, 4, 0).Order(1);
    CHECK(seen.count(order[8]) == 0);
    CHECK(seen.count(order[9]) == 0);
  }
  SUBCASE("padding larger than the dataset repeats it") {
    // 2 samples, 5 ranks: [a b a b a].
    std::vector<int64_t> order = Make(2, 5, 0).Order(0);
    for (int rank = 0; rank < 5; ++rank) {
      CHECK(Make(2, 5, rank).Indices(0) == std::vector<int64_t>{order[rank % 2]});
      CHECK(Make(2, 5, rank, true).Indices(0).empty());
    }
  }
  SUBCASE("empty dataset") {
    CHECK(Make(0, 3, 2).Indices(0).empty());
    CHECK(Make(0, 3, 2).NumBatches() == 0);
  }
}

TEST_CASE("batches cut the shard; every rank gets the same batch sizes") {
  // 23 samples, 2 ranks: 12 each (padded), batch 5 -> 5, 5, 2.
  for (int rank = 0; rank < 2; ++rank) {
    DistributedSampler s = Make(23, 2, rank, false, true, 5);
    std::vector<std::vector<int64_t>> batches = s.Batches(0);
    REQUIRE(batches.size() == 3);
    CHECK(s.NumBatches() == 3);
    CHECK(batches[0].size() == 5);
    CHECK(batches[1].size() == 5);
    CHECK(batches[2].size() == 2);
    std::vector<int64_t> flat;
    for (auto& b : batches) flat.insert(flat.end(), b.begin(), b.end());
    CHECK(flat == s.Indices(0));
  }
}

TEST_CASE("Position counts the samples consumed by all ranks") {
  DistributedSampler s = Make(100, 4, 0, false, true, 8);  // 25 per rank: batches 8, 8, 8, 1.
  CHECK(s.Position(0, 0) == 0);
  CHECK(s.Position(0, 1) == 32);
  CHECK(s.Position(0, 3) == 96);
  CHECK(s.Position(0, 4) == 100);  // Last batch is 1 per rank: 4 more, three of them padding.
  CHECK(s.Position(0, 1000) == 100);
  CHECK(s.Position(96, 1) == 100);
  CHECK(s.Position(-5, 1) == 32);
}

// Runs `steps` batches on every rank of a world of `world` from `start`, returning the samples
// consumed (all ranks) and the new position.
int64_t Consume(int64_t n, int world, int64_t batch, int64_t epoch, int64_t start, int64_t steps,
                std::multiset<int64_t>* consumed) {
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::vector<int64_t>> batches = Make(n, world, rank, false, true, batch).Batches(epoch, start);
    for (int64_t k = 0; k < steps && k < static_cast<int64_t>(batches.size()); ++k) {
      consumed->insert(batches[k].begin(), batches[k].end());
    }
  }
  return Make(n, world, 0, false, true, batch).Position(start, steps);
}

TEST_CASE("the consumed samples are exactly the prefix of the order up to Position") {
  std::multiset<int64_t> consumed;
  int64_t position = Consume(1000, 3, 16, 5, 0, 7, &consumed);
  CHECK(position == 7 * 16 * 3);
  std::vector<int64_t> order = Make(1000, 3, 0).Order(5);
  CHECK(consumed == std::multiset<int64_t>(order.begin(), order.begin() + position));
}

TEST_CASE("resuming with another world size covers exactly the remaining samples") {
  const int64_t n = 1000;
  const int64_t epoch = 2;
  for (int new_world : {1, 2, 3, 5, 8}) {
    CAPTURE(new_world);
    std::multiset<int64_t> before;
    const int64_t position = Consume(n, 4, 10, epoch, 0, 6, &before);  // 4 ranks, 6 steps.
    REQUIRE(position == 240);
    std::multiset<int64_t> after;
    const int64_t end = Consume(n, new_world, 7, epoch, position, 1 << 20, &after);
    CHECK(end == n);
    std::set<int64_t> distinct_after(after.begin(), after.end());
    // Nothing consumed before is seen again, and everything else is seen.
    for (int64_t i : before) CHECK(distinct_after.count(i) == 0);
    CHECK(before.size() + distinct_after.size() == static_cast<size_t>(n));
    // Only padding is seen twice: fewer than new_world extra samples.
    CHECK(after.size() - distinct_after.size() < static_cast<size_t>(new_world));
    CHECK(after.size() == static_cast<size_t>(Make(n, new_world, 0).NumSamples(position) * new_world));
  }
}

TEST_CASE("resuming with drop_last drops only the tail of the remainder") {
  // 100 samples, resume at 37 with 3 ranks: 63 remain, 21 each, nothing dropped; at 38: 62
  // remain, 20 each, the last 2 of the order are dropped.
  std::vector<int64_t> order = Make(100, 3, 0).Order(0);
  std::map<int64_t, int> at37 = Coverage(100, 3, true, 0, 37);
  CHECK(at37.size() == 63);
  std::map<int64_t, int> at38 = Coverage(100, 3, true, 0, 38);
  CHECK(at38.size() == 60);
  CHECK(at38.count(order[98]) == 0);
  CHECK(at38.count(order[99]) == 0);
  CHECK(at38.count(order[38]) == 1);
  CHECK(at38.count(order[37]) == 0);
  CHECK(Make(100, 3, 0, true).Indices(0, 100).empty());
  CHECK(Make(100, 3, 0, true).Indices(0, 500).empty());
}

}  // namespace
}  // namespace elrun::trainer
