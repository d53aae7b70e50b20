// A sum all-reduce of float32 and float64 CPU tensors between ranks on one host, through one shared memory
// segment instead of Gloo's TCP loopback ring: each rank copies its tensor into its slot, sums
// its 1/N slice across all slots, and copies the summed whole out. No sockets, no kernel copies
// and one futex wake per phase, so DDP's buckets cost memory bandwidth only.
//
// Setup is collective over a c10d store. Rank 0 creates the segment under a random name, every
// rank maps it and checks a token, and all ranks learn through the store whether every one of
// them could. If one could not (a rank on another host, a private /dev/shm), Create returns
// Unavailable on every rank and the caller keeps its process group. The name is unlinked once all
// ranks have it mapped, so nothing is left in /dev/shm after the job, whatever way it ends.
//
// Ops run in issue order on a thread of the object's own; Allreduce returns at once with a Work
// to wait on. Every rank must issue the same sequence of ops, as with any collective. A waiting
// rank sleeps on a futex, but first, when there are no more ranks than CPUs, spins for up to
// 10 ms, yielding its CPU to any thread that wants it: a CPU that went idle can take a
// millisecond to wake again on a virtual machine, and that once per collective. An op fails (its
// Work's wait throws) when a peer process has exited or has not arrived within the timeout; the
// object is then broken and fails every later op.
#ifndef ELRUN_TRAINER_DIST_SHM_ALLREDUCE_H_
#define ELRUN_TRAINER_DIST_SHM_ALLREDUCE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace elrun::trainer {

class ShmAllreduce {
 public:
  // Collective over `store` (keys under `key_prefix`). `capacity_bytes`: the largest tensor an op
  // takes. The segment holds 2 x world_size slots of that size; pages a rank never touches cost
  // no memory. Unavailable (on every rank) when the ranks cannot share the segment.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ShmAllreduce>> Create(c10d::Store& store,
                                                                            const std::string& key_prefix, int rank,
                                                                            int world_size, int64_t capacity_bytes,
                                                                            std::chrono::milliseconds timeout);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  // Whether Allreduce takes `tensor`: contiguous float32 or float64 on CPU, at most capacity
  // bytes (rounded up to 64).
  bool Fits(const at::Tensor& tensor) const;
  // Starts summing `tensor` over the ranks, in place. Throws c10::Error when it does not fit.
  c10::intrusive_ptr<c10d::Work> Allreduce(at::Tensor tensor);

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  // Whether this object joins the same ranks as `pg`, as the callers that take both require.
  bool Spans(const c10d::Backend& pg) const { return rank_ == pg.getRank() && world_ == pg.getSize(); }

 private:
  struct Header;
  class Op;
  ShmAllreduce(int rank, int world, int64_t capacity_bytes, void* base, size_t bytes,
               std::chrono::milliseconds timeout);
  void Loop();
  void Run(Op& op, uint64_t generation);
  // Publishes this rank's arrival at `target` and waits until every rank is there.
  void Barrier(uint64_t target);
  bool AllArrived(uint64_t target) const;
  char* Slot(uint64_t generation, int rank) const;

  const int rank_;
  const int world_;
  const int64_t capacity_bytes_;
  void* const base_;
  const size_t bytes_;
  const std::chrono::milliseconds timeout_;
  Header* const header_;

  absl::Mutex mutex_;
  absl::CondVar wake_;
  std::deque<c10::intrusive_ptr<Op>> queue_ ABSL_GUARDED_BY(mutex_);
  std::atomic<bool> stopping_{false};  // Set under mutex_; Barrier reads it without.
  const bool may_spin_;                // world_ <= the CPUs this process may use.
  std::string broken_;                 // Set by the thread: why ops now fail.
  uint64_t generation_ = 0;            // Ops run so far (the thread's).
  std::thread thread_;
};

// Sums `tensor` over the ranks in place: through `shm` when it is set and fits the tensor, else
// through `pg`. The choice depends only on the tensor and `shm`, so it is the same on every rank.
c10::intrusive_ptr<c10d::Work> AllreduceSum(c10d::Backend& pg, ShmAllreduce* shm, at::Tensor tensor);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_DIST_SHM_ALLREDUCE_H_
