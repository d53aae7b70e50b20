// In-memory shard copies for regrouping the sharded strategies in place: which set of shard files
// a new group rebuilds (the newest whole one, live shards first), the ring exchange that leaves
// each rank its neighbour's shard, a rank lost from 3 rebuilt on 2 exactly (parameters and Adam
// state), two neighbours lost at once found out on every rank, and a set that is not one refused.
// Ranks are threads over a real Gloo group on loopback.
#include "trainer/parallel/shard_copies.h"

#include <doctest/doctest.h>

#include "tests/trainer/parallel/small_mlp.h"
#include "tests/trainer/rank_threads.h"

namespace elrun::trainer {
namespace {

ShardKey Live(int shard, int count, int64_t step) { return ShardKey{shard, count, step, false}; }
ShardKey Copy(int shard, int count, int64_t step) { return ShardKey{shard, count, step, true}; }

TEST_CASE("The newest whole set wins, each shard from a live holder first, then the lowest rank") {
  // Old world 3, rank 1 lost at step 26: survivors live at 26, copies of step 21 (each rank holds
  // its own and rank + 1's), and a replacement with nothing.
  std::vector<std::vector<ShardKey>> by_rank = {
      {Live(0, 3, 26), Copy(0, 3, 21), Copy(1, 3, 21)},
      {Live(2, 3, 26), Copy(2, 3, 21), Copy(0, 3, 21)},
      {},
  };
  auto choice = ChooseShardSet(by_rank);
  REQUIRE(choice);
  CHECK(choice->step == 21);
  CHECK(choice->count == 3);
  CHECK(choice->holders == std::vector<int>{0, 0, 1});
  CHECK(choice->from_copies == 3);

  // Nothing lost (a node joined): the live set, with no step to redo.
  by_rank[2] = {Live(1, 3, 26), Copy(1, 3, 21), Copy(2, 3, 21)};
  choice = ChooseShardSet(by_rank);
  REQUIRE(choice);
  CHECK(choice->step == 26);
  CHECK(choice->holders == std::vector<int>{0, 2, 1});
  CHECK(choice->from_copies == 0);

  // A live shard beats a lower rank's copy.
  choice = ChooseShardSet({{Copy(0, 1, 9)}, {Live(0, 1, 9)}});
  REQUIRE(choice);
  CHECK(choice->holders == std::vector<int>{1});
  CHECK(choice->from_copies == 0);

  // A newer set with a hole loses to an older whole one; then no whole set at all.
  choice = ChooseShardSet({{Copy(0, 2, 30), Copy(0, 2, 20), Copy(1, 2, 20)}});
  REQUIRE(choice);
  CHECK(choice->step == 20);
  CHECK_FALSE(ChooseShardSet({{Copy(0, 2, 30)}, {Copy(0, 2, 20)}}));
  CHECK_FALSE(ChooseShardSet({{}, {}}));
  // Keys that name no shard of their set are ignored.
  CHECK_FALSE(ChooseShardSet({{Copy(2, 2, 5), Copy(-1, 2, 5), Copy(0, 0, 5), Copy(0, 2, -3)}}));
}

TEST_CASE("Refresh keeps the newest pair beside the previous one until Settle") {
  RunRanks(3, [&](int rank, PG pg) {
    ShardCopies copies;
    for (int64_t step : {7, 14}) {
      ShardBytes own;
      own.shard = rank;
      own.count = 3;
      own.step = step;
      own.bytes.assign(static_cast<size_t>(10 + rank), static_cast<char>('a' + rank));
      REQUIRE(copies.Refresh(*pg, own).ok());
    }
    auto held = copies.held();
    REQUIRE(held.size() == 4);
    const int next = (rank + 1) % 3;
    CHECK(held[0]->step == 14);
    CHECK(held[0]->shard == rank);
    CHECK(held[1]->step == 14);
    CHECK(held[1]->shard == next);  // The neighbour's, as it sent it.
    CHECK(held[1]->bytes == std::vector<char>(static_cast<size_t>(10 + next), static_cast<char>('a' + next)));
    CHECK(held[2]->step == 7);
    copies.Settle();
    held = copies.held();
    REQUIRE(held.size() == 2);
    CHECK(held[0]->step == 14);
    CHECK(copies.bytes() == 20 + rank + next);
  });
}

// Three ranks train `steps` Adam steps with `strategy` and copy their shards; returns every rank's
// copies and the unsharded parameters and state at the copy.
struct Trained {
  std::vector<ShardCopies> copies{3};
  std::map<std::string, torch::Tensor> params;
  std::map<std::string, ParamState> state;
};

Trained TrainOnThree(const std::string& strategy, int steps) {
  Trained trained;
  std::vector<std::shared_ptr<Classifier>> models{SmallMlp(1), SmallMlp(1), SmallMlp(1)};
  RunRanks(3, [&](int rank, PG pg) {
    FsdpOptions options;
    options.strategy = *ParseStrategy(strategy);
    FullyShardedDataParallel fsdp(models[rank], pg, options);
    torch::optim::Adam adam(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    auto gen = at::detail::createCPUGenerator(rank);
    TrainProgress progress;
    progress.world_size = 3;
    TrainSmallMlp(fsdp, adam, gen, steps, progress);
    auto own = LiveShardBytes(fsdp, adam, progress);
    REQUIRE(own.ok());
    REQUIRE(trained.copies[rank].Refresh(*pg, *std::move(own)).ok());
    auto params = fsdp.FullParameters();
    auto state = FullOptimizerState(fsdp, adam);
    if (rank == 0) {
      trained.params = params;
      trained.state = state;
    }
  });
  return trained;
}

TEST_CASE("A rank lost from 3 is rebuilt from its neighbour's copy on 2 ranks, exactly") {
  for (const std::string strategy : {"fsdp", "zero1"}) {
    CAPTURE(strategy);
    Trained trained = TrainOnThree(strategy, 3);
    // Old rank 1 is gone; old ranks 0 and 2 are the new ranks 0 and 1.
    const std::vector<int> old_rank{0, 2};
    std::vector<std::shared_ptr<Classifier>> models{SmallMlp(5), SmallMlp(5)};
    RunRanks(2, [&](int rank, PG pg) {
      auto sync = GatherShardSet(*pg, std::nullopt, trained.copies[old_rank[rank]].held());
      REQUIRE_MESSAGE(sync.ok(), sync.status().ToString());
      CHECK(sync->choice.step == 3);
      CHECK(sync->choice.count == 3);
      CHECK(sync->choice.from_copies == 3);
      CHECK(sync->choice.holders == std::vector<int>{0, 0, 1});  // Old rank 0 holds shard 1's copy.
      CHECK(sync->stateless_ranks == 0);
      CHECK(sync->reached == -1);  // No live shard.
      FsdpOptions options;
      options.strategy = *ParseStrategy(strategy);
      FullyShardedDataParallel fsdp(models[rank], pg, options);
      torch::optim::Adam adam(fsdp.parameters(), torch::optim::AdamOptions(0.01));
      auto loaded = LoadShardSet(sync->files, "copies", fsdp, adam);
      REQUIRE_MESSAGE(loaded.ok(), loaded.status().ToString());
      CHECK(loaded->step == 3);
      CHECK(loaded->world_size == 3);
      auto params = fsdp.FullParameters();
      auto state = FullOptimizerState(fsdp, adam);
      if (rank != 0) return;
      REQUIRE(params.size() == trained.params.size());
      for (const auto& [name, t] : trained.params) CHECK_MESSAGE(torch::equal(t, params.at(name)), name);
      for (const auto& [name, fields] : trained.state) {
        for (const auto& [field, t] : fields)
          CHECK_MESSAGE(torch::equal(t, state.at(name).at(field)), name, ".", field);
      }
    });
  }
}

TEST_CASE("With no rank lost (a node joined) the live shards are the set: no step to redo") {
  Trained trained = TrainOnThree("zero2", 2);
  RunRanks(4, [&](int rank, PG pg) {  // The fourth rank joined without state.
    std::optional<ShardBytes> live;
    std::vector<const ShardBytes*> copies;
    if (rank < 3) {
      copies = trained.copies[rank].held();
      live = *copies[0];  // Its own shard, as it is now.
    }
    auto sync = GatherShardSet(*pg, live, copies);
    REQUIRE_MESSAGE(sync.ok(), sync.status().ToString());
    CHECK(sync->choice.step == 2);
    CHECK(sync->choice.holders == std::vector<int>{0, 1, 2});
    CHECK(sync->choice.from_copies == 0);
    CHECK(sync->reached == 2);
    CHECK(sync->stateless_ranks == 1);
    REQUIRE(sync->files.size() == 3);
    for (int k = 0; k < 3; ++k) CHECK(sync->files[k] == trained.copies[k].held()[0]->bytes);
  });
}

TEST_CASE("Two neighbours lost at once leave no whole set, and every rank says so") {
  Trained trained = TrainOnThree("fsdp", 1);
  // Old ranks 1 and 2 are gone: shard 2 lived only on them. Old rank 0 and a replacement remain.
  RunRanks(2, [&](int rank, PG pg) {
    std::vector<const ShardBytes*> held;
    if (rank == 0) held = trained.copies[0].held();
    auto sync = GatherShardSet(*pg, std::nullopt, held);
    CHECK(sync.status().code() == absl::StatusCode::kNotFound);
  });
}

TEST_CASE("Shard files that are not one whole set are refused with a reason") {
  Trained trained = TrainOnThree("fsdp", 1);
  auto model = SmallMlp(3);
  RunRanks(1, [&](int, PG pg) {
    FullyShardedDataParallel fsdp(model, pg);
    torch::optim::Adam adam(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    // Rank 0 holds shards 0 and 1 of 3: two files are not the set, and out of order they are not
    // its first two either.
    auto held = trained.copies[0].held();
    auto loaded = LoadShardSet({held[0]->bytes, held[1]->bytes}, "copies", fsdp, adam);
    CHECK(loaded.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(loaded.status().message()).find("says it is shard 0 of 3") != std::string::npos);
    loaded = LoadShardSet({held[1]->bytes, held[0]->bytes, held[0]->bytes}, "copies", fsdp, adam);
    CHECK(loaded.status().code() == absl::StatusCode::kInvalidArgument);
    loaded = LoadShardSet({std::vector<char>{'x', 'y'}}, "copies", fsdp, adam);
    CHECK(loaded.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(loaded.status().message()).find("not an elrun sharded checkpoint") != std::string::npos);
    CHECK(LoadShardSet({}, "copies", fsdp, adam).status().code() == absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace elrun::trainer
