// ShmAllreduce: sums equal to the ranks' sums in rank order, bit for bit, over many ops of mixed
// sizes issued ahead of their waits; the fits rule; setup that fails alike on every rank; and
// ops that fail, with the rank named, when a peer never arrives or its process has exited.
#include "trainer/dist/shm_allreduce.h"

#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace elrun::trainer {
namespace {

using std::chrono::milliseconds;

// Runs `body` for each rank on a thread, all with one in-memory store.
void OnThreads(int world, const std::function<void(int rank, c10d::Store& store)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) threads.emplace_back([&, rank] { body(rank, *store); });
  for (auto& t : threads) t.join();
}

// Odd ops are float64 (SyncBatchNorm's statistics), even ones float32 (DDP's buckets).
torch::Tensor Input(int rank, int op, int64_t n) {
  auto gen = at::detail::createCPUGenerator(1000 * op + rank);
  return torch::randn({n}, gen, op % 2 ? torch::kDouble : torch::kFloat);
}

TEST_CASE("sums of 2 and 3 ranks, 40 ops of mixed sizes and types in flight at once, equal the rank-order sums") {
  constexpr int64_t kCapacity = 5000;  // float64 elements.
  const std::vector<int64_t> sizes = {1, 7, 16, 17, 4999, 5000, 0, 33, 1024, 3};
  for (int world : {2, 3}) {
    CAPTURE(world);
    std::vector<std::vector<torch::Tensor>> results(world);
    OnThreads(world, [&](int rank, c10d::Store& store) {
      auto shm = ShmAllreduce::Create(store, "sum", rank, world, kCapacity * 8, std::chrono::seconds(30));
      REQUIRE_MESSAGE(shm.ok(), shm.status().ToString());
      std::vector<torch::Tensor> tensors;
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (int op = 0; op < 40; ++op) {
        tensors.push_back(Input(rank, op, sizes[op % sizes.size()]));
        works.push_back((*shm)->Allreduce(tensors.back()));  // Waited for only after all 40 are issued.
      }
      for (auto& work : works) work->wait();
      results[rank] = tensors;
    });
    for (int op = 0; op < 40; ++op) {
      CAPTURE(op);
      const int64_t n = sizes[op % sizes.size()];
      torch::Tensor expected = Input(0, op, n);
      for (int r = 1; r < world; ++r) expected = expected + Input(r, op, n);
      for (int r = 0; r < world; ++r) CHECK(torch::equal(results[r][op], expected));
    }
  }
}

TEST_CASE("one rank: the op is a copy through the segment") {
  OnThreads(1, [&](int rank, c10d::Store& store) {
    auto shm = ShmAllreduce::Create(store, "one", rank, 1, 64, std::chrono::seconds(5));
    REQUIRE(shm.ok());
    torch::Tensor t = torch::arange(16, torch::kFloat);
    (*shm)->Allreduce(t)->wait();
    CHECK(torch::equal(t, torch::arange(16, torch::kFloat)));
  });
}

TEST_CASE("Fits: contiguous float32 CPU tensors up to the capacity; others are refused") {
  OnThreads(1, [&](int rank, c10d::Store& store) {
    auto shm = ShmAllreduce::Create(store, "fits", rank, 1, 100 * 4, std::chrono::seconds(5));
    REQUIRE(shm.ok());
    ShmAllreduce& s = **shm;
    CHECK(s.Fits(torch::zeros({100})));
    CHECK(s.Fits(torch::zeros({112})));  // The capacity is rounded up to 64-byte slots: 448 bytes.
    CHECK_FALSE(s.Fits(torch::zeros({113})));
    CHECK(s.Fits(torch::zeros({56}, torch::kDouble)));
    CHECK_FALSE(s.Fits(torch::zeros({57}, torch::kDouble)));
    CHECK_FALSE(s.Fits(torch::zeros({10}, torch::kLong)));
    CHECK_FALSE(s.Fits(torch::zeros({10, 10}).t()));
    CHECK_FALSE(s.Fits(torch::Tensor()));
    CHECK_THROWS_WITH(s.Allreduce(torch::zeros({200})),
                      doctest::Contains("takes contiguous float32 or float64 CPU tensors of at most 448 bytes"));
  });
}

TEST_CASE("setup fails on every rank alike when the ranks disagree on the segment") {
  std::vector<absl::Status> statuses(2);
  OnThreads(2, [&](int rank, c10d::Store& store) {
    // Different capacities: rank 1 cannot use rank 0's segment, and rank 0 learns it.
    statuses[rank] =
        ShmAllreduce::Create(store, "mismatch", rank, 2, rank == 0 ? 1024 : 4096, std::chrono::seconds(5)).status();
  });
  for (const absl::Status& status : statuses) {
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK(std::string(status.message()).find("rank 1: rank 0's segment has") != std::string::npos);
    CHECK(std::string(status.message()).find("different capacities") != std::string::npos);
  }
  CHECK(ShmAllreduce::Create(*c10::make_intrusive<c10d::HashStore>(), "bad", 2, 2, 16, milliseconds(100))
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a rank that never arrives fails the op after the timeout, and every later op") {
  OnThreads(2, [&](int rank, c10d::Store& store) {
    auto shm = ShmAllreduce::Create(store, "late", rank, 2, 64, milliseconds(300));
    REQUIRE(shm.ok());
    if (rank == 1) return;  // Never issues an op (its object is destroyed: it stays a live process).
    torch::Tensor t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH((*shm)->Allreduce(t)->wait(), doctest::Contains("rank(s) 1 did not arrive within 0.3 s"));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
    CHECK_THROWS_WITH((*shm)->Allreduce(t)->wait(), doctest::Contains("did not arrive"));  // Broken for good.
  });
}

TEST_CASE("a wait with a timeout ends by it while the op's thread spins; the op completes when the peer comes") {
  // 2 ranks on this machine's CPUs: the op's thread spins before it sleeps (up to 10 ms).
  OnThreads(2, [&](int rank, c10d::Store& store) {
    auto shm = ShmAllreduce::Create(store, "wait_timeout", rank, 2, 64, std::chrono::seconds(30));
    REQUIRE(shm.ok());
    if (rank == 1) store.wait({"rank 0 timed out"});  // Arrives only after rank 0's wait gave up.
    torch::Tensor t = torch::full({4}, rank + 1.0f);
    auto work = (*shm)->Allreduce(t);
    if (rank == 0) {
      const auto start = std::chrono::steady_clock::now();
      CHECK_THROWS(work->wait(milliseconds(3)));
      const auto waited = std::chrono::steady_clock::now() - start;
      CHECK(waited >= milliseconds(3));
      CHECK(waited < std::chrono::seconds(5));
      store.set("rank 0 timed out", std::vector<uint8_t>{1});
    }
    work->wait();
    CHECK(t.equal(torch::full({4}, 3.0f)));
  });
}

TEST_CASE("a peer process that exited fails the op at once, naming its rank and pid") {
  // Rank 1 is a forked process that sets up its side and exits; rank 0 (this process) then
  // all-reduces with a long timeout and must fail well before it. Reaped, its pid is gone; not
  // reaped yet (a worker whose launcher was killed, until its adopter reaps it), it is a zombie.
  for (const bool reap : {true, false}) {
    CAPTURE(reap);
    c10d::TCPStoreOptions options;
    options.port = 0;
    options.isServer = true;
    options.numWorkers = 2;
    options.waitWorkers = false;
    options.timeout = std::chrono::seconds(30);
    auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
    const uint16_t port = server->getPort();
    pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      int code = 1;
      try {
        c10d::TCPStoreOptions client;
        client.port = port;
        client.isServer = false;
        client.timeout = std::chrono::seconds(30);
        c10d::TCPStore store("127.0.0.1", client);
        code = ShmAllreduce::Create(store, "exit", 1, 2, 64, std::chrono::seconds(30)).ok() ? 0 : 3;
      } catch (...) {
        code = 2;
      }
      ::_exit(code);
    }
    auto shm = ShmAllreduce::Create(*server, "exit", 0, 2, 64, std::chrono::seconds(60));
    siginfo_t info{};
    REQUIRE(::waitid(P_PID, child, &info, WEXITED | (reap ? 0 : WNOWAIT)) == 0);
    REQUIRE(info.si_code == CLD_EXITED);
    REQUIRE(info.si_status == 0);
    REQUIRE(shm.ok());
    torch::Tensor t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    const std::string expected = "rank 1 (pid " + std::to_string(child) + ") exited during the all-reduce";
    CHECK_THROWS_WITH((*shm)->Allreduce(t)->wait(), doctest::Contains(expected.c_str()));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
    if (!reap) REQUIRE(::waitpid(child, nullptr, 0) == child);
  }
}

TEST_CASE("nothing is left in /dev/shm once the ranks have set up") {
  auto count = [] {
    int n = 0;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      n += entry.path().filename().string().rfind("elrun-allreduce-" + std::to_string(::getpid()) + "-", 0) == 0;
    }
    return n;
  };
  OnThreads(2, [&](int rank, c10d::Store& store) {
    auto shm = ShmAllreduce::Create(store, "unlink", rank, 2, 1 << 20, std::chrono::seconds(30));
    REQUIRE(shm.ok());
    torch::Tensor t = torch::ones({1000});
    (*shm)->Allreduce(t)->wait();
    CHECK(t[0].item<float>() == 2.0f);
    CHECK(count() == 0);  // Unlinked during Create, mapped still.
  });
  CHECK(count() == 0);
}

}  // namespace
}  // namespace elrun::trainer
