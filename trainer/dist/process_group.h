// The worker's process group, built from the environment contract that elrun (or torchrun) sets:
// a c10d TCPStore hosted by worker rank 0 at MASTER_ADDR:MASTER_PORT, and a c10d backend over it:
// Gloo for CPU tensors, NCCL for CUDA tensors (one device per rank). Thread-safe after creation.
// Only this target names ProcessGroupGloo and ProcessGroupNCCL; everything else takes the
// backend as a c10d::Backend.
#ifndef ELRUN_TRAINER_DIST_PROCESS_GROUP_H_
#define ELRUN_TRAINER_DIST_PROCESS_GROUP_H_

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"
#include "trainer/dist/backend_kind.h"
#include "trainer/dist/gloo_device.h"

namespace elrun::trainer {

// What the env contract says about this worker.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // TORCHELASTIC_RESTART_COUNT: the store's keys are kept apart per attempt under it, as torch's
  // own are ("attempt_<n>/"): torchrun's agent hosts a store that outlives an attempt, and a
  // restarted group must not read the keys of the one before.
  int restart_count = 0;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK and TORCHELASTIC_RESTART_COUNT, each defaulting to a single
// process's first attempt (0, 1, 0, 0) when unset, and, when WORLD_SIZE > 1, MASTER_ADDR and MASTER_PORT, which are
// then required. InvalidArgument naming the variable when a required one is missing or one is malformed, or when RANK
// is not below WORLD_SIZE.
absl::StatusOr<DistEnv> ReadDistEnv(const std::map<std::string, std::string>& env);

struct Dist {
  DistEnv env;
  BackendKind backend = BackendKind::kGloo;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> pg;
};

// Connects to (rank 0: hosts) the store and builds the backend; waits up to `timeout` for the
// other ranks. kNccl takes `cuda_device`, the index of this rank's CUDA device (made current).
// With `await_store` (a regroup, where the store host starts a few milliseconds after the
// others), a rank other than 0 first polls the store's port every 2 ms for up to 10 s: c10d's
// client backs off for about half a second after a refused connection. Errors from LibTorch come
// back as a Status (Unavailable), never as an exception.
absl::StatusOr<Dist> InitProcessGroup(const DistEnv& env, BackendKind backend, int cuda_device,
                                      std::chrono::milliseconds timeout, bool await_store = false);

// InitProcessGroup from this process's environment (ReadDistEnv), the CUDA device for kNccl
// being LOCAL_RANK's: what a worker program started by elrun or torchrun calls first.
absl::StatusOr<Dist> InitProcessGroupFromEnvironment(BackendKind backend, std::chrono::milliseconds timeout);

// A Gloo backend over `store` whose rank listens on `device` (gloo_device.h). Throws c10::Error.
c10::intrusive_ptr<c10d::Backend> MakeGlooBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                  const GlooDevice& device, std::chrono::milliseconds timeout);

// An NCCL backend over `store` for CUDA device `cuda_device`, bound to it (getBoundDeviceId) and
// connected eagerly, so a missing peer or a broken NCCL fails here rather than in the first
// collective. Throws c10::Error; on a build or machine without NCCL, too.
c10::intrusive_ptr<c10d::Backend> MakeNcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                  int cuda_device, std::chrono::milliseconds timeout);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_DIST_PROCESS_GROUP_H_
