// The reduce-scatter and all-gather over flat buffers, on 1, 2 and 3 ranks (threads, real Gloo
// over loopback): Gloo's native reduce-scatter and the all-to-all one (the default on Gloo), the
// in-place all-gather; values, byte counts, caller-given receive buffers, misuse.
#include "trainer/dist/collectives.h"

#include <doctest/doctest.h>

#include "tests/trainer/rank_threads.h"

namespace elrun::trainer {
namespace {

torch::Tensor RankInput(int rank, int64_t numel) {
  return torch::arange(numel, torch::kFloat) * (rank + 1) + 0.25 * rank;
}

TEST_CASE("ReduceScatter sums chunk r of every rank into rank r; AllGather undoes the split") {
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    const int64_t shard = 5;
    RunRanks(world, [&](int rank, PG pg) {
      CommBytes bytes;
      torch::Tensor input = RankInput(rank, world * shard);
      torch::Tensor out = torch::empty({shard});
      ReduceScatter(*pg, input, out, &bytes);
      torch::Tensor expected = torch::zeros({world * shard});
      for (int r = 0; r < world; ++r) expected += RankInput(r, world * shard);
      CHECK(torch::equal(out, expected.narrow(0, rank * shard, shard)));
      CHECK(bytes.reduce_scatter == int64_t{4} * shard * (world - 1));  // (n-1)/n of the buffer.

      torch::Tensor full = torch::full({world * shard}, -1.0);
      AllGather(*pg, out, full, &bytes);
      CHECK(torch::equal(full, expected));
      CHECK(bytes.all_gather == int64_t{4} * shard * (world - 1));
      // In place: the shard may be a view of the full buffer it is gathered into.
      torch::Tensor again = torch::zeros({world * shard});
      again.narrow(0, rank * shard, shard).copy_(out);
      AllGather(*pg, again.narrow(0, rank * shard, shard), again);
      CHECK(torch::equal(again, expected));
    });
  }
}

TEST_CASE("ReduceScatterOp: asynchronous, scaled and accumulating") {
  RunRanks(2, [](int rank, PG pg) {
    torch::Tensor input = RankInput(rank, 8);
    ReduceScatterOp op = ReduceScatterOp::Start(*pg, input, nullptr);
    CHECK(op.active());
    torch::Tensor out = torch::ones({4});
    op.Finish(out, 0.5, /*accumulate=*/true);
    CHECK_FALSE(op.active());
    torch::Tensor sum = (RankInput(0, 8) + RankInput(1, 8)).narrow(0, rank * 4, 4);
    CHECK(torch::allclose(out, 1 + 0.5 * sum));
  });
}

TEST_CASE("The all-to-all reduce-scatter gives what the backend's own gives") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    RunRanks(world, [&](int rank, PG pg) {
      // Gloo's _reduce_scatter_base all-reduces a full copy: all-to-all is the default there.
      CHECK(DefaultReduceScatter(*pg) == ReduceScatterAlgorithm::kAllToAll);
      CHECK(CommDevice(*pg) == torch::Device(torch::kCPU));
      torch::Tensor input = RankInput(rank, world * 6);
      torch::Tensor native = torch::zeros({6}), fallback = torch::zeros({6});
      CommBytes native_bytes, fallback_bytes;
      ReduceScatterOp::Start(*pg, input, &native_bytes, ReduceScatterAlgorithm::kNative).Finish(native, 1.0, false);
      ReduceScatterOp::Start(*pg, input, &fallback_bytes, ReduceScatterAlgorithm::kAllToAll)
          .Finish(fallback, 1.0, false);
      CHECK(torch::allclose(native, fallback));
      CHECK(native_bytes.reduce_scatter == fallback_bytes.reduce_scatter);
      // The fallback sums in rank order: bit-identical on every run.
      torch::Tensor again = torch::zeros({6});
      ReduceScatterOp::Start(*pg, input, nullptr, ReduceScatterAlgorithm::kAllToAll).Finish(again, 1.0, false);
      CHECK(torch::equal(again, fallback));
    });
  }
}

TEST_CASE("Receive buffers and gathers: results land in the caller's memory, nothing else changes") {
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    RunRanks(world, [&](int rank, PG pg) {
      const int64_t shard = 7;
      torch::Tensor input = RankInput(rank, world * shard);
      const int64_t needed = ReduceScatterOp::ReceiveNumel(ReduceScatterAlgorithm::kAllToAll, input.numel(), world);
      CHECK(needed == world * shard);
      CHECK(ReduceScatterOp::ReceiveNumel(ReduceScatterAlgorithm::kNative, input.numel(), world) == shard);
      // A larger buffer: only its first `needed` elements are written.
      torch::Tensor receive = torch::full({needed + 3}, 42.0);
      const void* where = receive.data_ptr();
      ReduceScatterOp op = ReduceScatterOp::Start(*pg, input, nullptr, ReduceScatterAlgorithm::kAllToAll, receive);
      torch::Tensor out = torch::zeros({shard});
      op.Finish(out, 1.0, false);
      torch::Tensor expected = torch::zeros({world * shard});
      for (int r = 0; r < world; ++r) expected += RankInput(r, world * shard);
      CHECK(torch::equal(out, expected.narrow(0, rank * shard, shard)));
      CHECK(receive.data_ptr() == where);
      CHECK(torch::equal(receive.narrow(0, needed, 3), torch::full({3}, 42.0)));
      CHECK_THROWS_WITH_AS(
          ReduceScatterOp::Start(*pg, input, nullptr, ReduceScatterAlgorithm::kAllToAll, torch::zeros({needed - 1})),
          doctest::Contains("at least"), c10::Error);

      // A separate shard is gathered into `full` without touching anything past it.
      torch::Tensor backing = torch::full({world * shard + 2}, -7.0);
      torch::Tensor full = backing.narrow(0, 0, world * shard);
      AllGather(*pg, out, full);
      CHECK(torch::equal(full, expected));
      CHECK(torch::equal(backing.narrow(0, world * shard, 2), torch::full({2}, -7.0)));
    });
  }
}

TEST_CASE("Misuse is an error, not a hang") {
  RunRanks(2, [](int, PG pg) {
    CHECK_THROWS_WITH_AS(ReduceScatter(*pg, torch::zeros({5}), torch::zeros({2})),
                         doctest::Contains("do not split evenly over 2 ranks"), c10::Error);
    CHECK_THROWS_WITH_AS(AllGather(*pg, torch::zeros({3}), torch::zeros({5})), doctest::Contains("expected 2 x 3"),
                         c10::Error);
  });
}

TEST_CASE("BroadcastFromRank0 overwrites every rank's tensors with rank 0's, per dtype") {
  RunRanks(3, [](int rank, PG pg) {
    torch::Tensor a = torch::full({2, 2}, static_cast<float>(rank));
    torch::Tensor b = torch::full({3}, static_cast<int64_t>(rank + 10));
    CommBytes bytes;
    BroadcastFromRank0(*pg, {a, b}, &bytes);
    CHECK(torch::equal(a, torch::zeros({2, 2})));
    CHECK(torch::equal(b, torch::full({3}, int64_t{10})));
    CHECK(bytes.broadcast == (rank == 0 ? (16 + 24) * 2 : 0));
  });
}

TEST_CASE("BroadcastFromRank0 sends big contiguous tensors in place and buckets the small ones") {
  RunRanks(2, [](int rank, PG pg) {
    const int64_t big = kBroadcastBucketBytes / 4 + 5;  // Floats: just over one bucket.
    torch::Tensor large = torch::full({big}, static_cast<float>(rank + 1));
    const void* storage = large.data_ptr();
    torch::Tensor strided = torch::full({4, 6}, static_cast<float>(rank + 1)).t();  // Not contiguous.
    std::vector<torch::Tensor> smalls;
    for (int i = 0; i < 5; ++i) smalls.push_back(torch::full({i + 1}, static_cast<float>(rank * 100 + i)));
    std::vector<torch::Tensor> all{large, strided};
    all.insert(all.end(), smalls.begin(), smalls.end());
    BroadcastFromRank0(*pg, all);
    CHECK(large.data_ptr() == storage);
    CHECK(torch::equal(large, torch::ones({big})));
    CHECK(torch::equal(strided, torch::ones({6, 4})));
    for (int i = 0; i < 5; ++i) CHECK(torch::equal(smalls[i], torch::full({i + 1}, static_cast<float>(i))));
  });
}

}  // namespace
}  // namespace elrun::trainer
