// Sharding collectives that Gloo in LibTorch 1.13 lacks (its reduce_scatter and _allgather_base
// throw "not supported"), built from what it has, with the bytes each one sends counted.
//   reduce-scatter: one alltoall_base (rank r receives every rank's chunk r) and a local sum in
//     rank order: each rank sends (n-1)/n of the buffer, the bandwidth optimum, and the result is
//     deterministic (the same summation order on every rank and every run).
//   all-gather into one flat buffer: Gloo's allgather with the output chunks as views of it.
// Both are asynchronous; Wait() (or Finish) completes them. Thread-compatible.
#ifndef ELRUN_TRAINER_COLLECTIVES_H_
#define ELRUN_TRAINER_COLLECTIVES_H_

#include <cstdint>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace elrun::trainer {

// Bytes this rank sent, by collective (the algorithms' traffic, not counting protocol headers):
// all-gather and reduce-scatter of a buffer of B bytes send (n-1)/n x B, an all-reduce 2(n-1)/n x B.
struct CommBytes {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  int64_t broadcast = 0;
  int64_t total() const { return all_gather + reduce_scatter + all_reduce + broadcast; }
};

// All-gathers `shard` ([s], contiguous) of every rank into `full` ([n*s], contiguous): chunk r of
// full is rank r's shard. `shard` may be a view of `full`. Returns the work to wait on; the
// tensors must stay alive until then.
c10::intrusive_ptr<c10d::Work> StartAllGather(c10d::ProcessGroup& pg, const torch::Tensor& shard,
                                              const torch::Tensor& full, CommBytes* bytes);

// A reduce-scatter in flight: `input` ([n*s]) of every rank summed chunk-wise, this rank
// receiving chunk `rank`.
class ReduceScatterOp {
 public:
  ReduceScatterOp() = default;
  static ReduceScatterOp Start(c10d::ProcessGroup& pg, const torch::Tensor& input, CommBytes* bytes);

  bool active() const { return started_; }
  // Waits, then writes (or, with accumulate, adds) scale x sum of the chunks into `output` ([s]).
  void Finish(const torch::Tensor& output, double scale, bool accumulate);

 private:
  bool started_ = false;
  c10::intrusive_ptr<c10d::Work> work_;  // Null for a world of one.
  torch::Tensor input_;     // Kept alive while Gloo reads it.
  torch::Tensor received_;  // [n, s]: row r is rank r's chunk for this rank.
};

// Broadcasts `tensors` from rank 0 in place, coalesced into one flat buffer per dtype.
void BroadcastFromRank0(c10d::ProcessGroup& pg, const std::vector<torch::Tensor>& tensors,
                        CommBytes* bytes = nullptr);

// Synchronous forms, for tests and simple callers.
void AllGather(c10d::ProcessGroup& pg, const torch::Tensor& shard, const torch::Tensor& full,
               CommBytes* bytes = nullptr);
void ReduceScatter(c10d::ProcessGroup& pg, const torch::Tensor& input, const torch::Tensor& output,
                   CommBytes* bytes = nullptr);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_COLLECTIVES_H_
