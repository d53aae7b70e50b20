// Runs the body of each rank on its own thread with a real process group (Gloo over loopback TCP,
// or another backend such as NCCL) over an in-memory store, for tests of collectives without
// spawning processes.
#ifndef ELRUN_TESTS_TRAINER_RANK_THREADS_H_
#define ELRUN_TESTS_TRAINER_RANK_THREADS_H_

#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "trainer/dist/process_group.h"

namespace elrun::trainer {

using PG = c10::intrusive_ptr<c10d::Backend>;

using BackendFactory = std::function<PG(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world)>;

// Runs `body` on `world` threads, each with the backend `make` builds over one in-memory store.
// Exceptions of a rank fail the test with the rank's message. The body also gets the store the
// group was set up with (for more setup over it).
inline void RunRanksOn(int world, const BackendFactory& make,
                       const std::function<void(int rank, PG pg, c10d::Store& store)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        PG pg = make(store, rank, world);
        body(rank, pg, *store);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) {
    CHECK_MESSAGE(errors[rank].empty(), "rank ", rank, ": ", errors[rank]);
  }
}

// Gloo over loopback; `timeout` bounds every collective.
inline void RunRanksWithStore(int world, const std::function<void(int rank, PG pg, c10d::Store& store)>& body,
                              std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  RunRanksOn(
      world,
      [timeout](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
        return MakeGlooBackend(store, rank, size, GlooDevice{{}, "127.0.0.1"}, timeout);
      },
      body);
}

inline void RunRanks(int world, const std::function<void(int rank, PG pg)>& body,
                     std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  RunRanksWithStore(
      world, [&](int rank, PG pg, c10d::Store&) { body(rank, pg); }, timeout);
}

}  // namespace elrun::trainer

#endif  // ELRUN_TESTS_TRAINER_RANK_THREADS_H_
