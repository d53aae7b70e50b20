// The worker's process group, built from the environment contract that elrun (or torchrun) sets:
// a c10d TCPStore hosted by worker rank 0 at MASTER_ADDR:MASTER_PORT, and a Gloo process group
// (NCCL when built against a CUDA LibTorch, which Debian's is not). Thread-safe after creation.
#ifndef ELRUN_TRAINER_PROCESS_GROUP_H_
#define ELRUN_TRAINER_PROCESS_GROUP_H_

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"

namespace elrun::trainer {

// What the env contract says about this worker.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. InvalidArgument naming the
// variable when one is missing or malformed.
absl::StatusOr<DistEnv> ReadDistEnv(const std::map<std::string, std::string>& env);

struct Dist {
  DistEnv env;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
};

// Connects to (rank 0: hosts) the store and builds the Gloo group; waits up to `timeout` for
// the other ranks. Errors from LibTorch come back as a Status, never as an exception.
absl::StatusOr<Dist> InitProcessGroup(const DistEnv& env, std::chrono::milliseconds timeout);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PROCESS_GROUP_H_
