// The sharding collectives over flat buffers, with the bytes each one sends counted, and with no
// hidden flat temporaries: every byte received lands in a buffer the caller gave.
//   all-gather into one flat buffer: NCCL's _allgather_base (in place); on Gloo, whose
//     _allgather_base receives into a fresh [n, s] tensor and copies out of it, one broadcast per
//     rank, each in place into that rank's chunk of the output (same bytes sent in all).
//   reduce-scatter: NCCL's _reduce_scatter_base; on Gloo and other backends one alltoall_base
//     (rank r receives every rank's chunk r, in place into the receive buffer) and a local sum in
//     rank order: each rank sends (n-1)/n of the buffer, the bandwidth optimum, and the result is
//     deterministic (the same summation order on every rank and every run). Gloo's own
//     _reduce_scatter_base all-reduces a full-size copy of the input: twice the traffic and a
//     hidden buffer as large as the input.
// Both are asynchronous; Wait() (or Finish) completes them. On CUDA (NCCL) the wait orders the
// caller's current stream after the collective's stream without blocking the host. The tensors
// live on the backend's device (CommDevice). Thread-compatible.
#ifndef ELRUN_TRAINER_DIST_COLLECTIVES_H_
#define ELRUN_TRAINER_DIST_COLLECTIVES_H_

#include <cstdint>
#include <exception>
#include <string>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace elrun::trainer {

// The device whose tensors `pg` takes: the CUDA device an NCCL backend is bound to, else the CPU.
torch::Device CommDevice(const c10d::Backend& pg);

enum class ReduceScatterAlgorithm {
  kNative,    // The backend's _reduce_scatter_base.
  kAllToAll,  // alltoall_base and a rank-ordered local sum.
};
// kNative for NCCL, kAllToAll for Gloo and any other backend.
ReduceScatterAlgorithm DefaultReduceScatter(const c10d::Backend& pg);

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
// full is rank r's shard. `shard` may be a view of `full`, and may have another dtype (it is cast
// into this rank's chunk first, and the gather runs in full's dtype: mixed precision). Returns
// the work to wait on; the tensors must stay alive until then. Nothing is allocated but the works.
c10::intrusive_ptr<c10d::Work> StartAllGather(c10d::Backend& pg, const torch::Tensor& shard, const torch::Tensor& full,
                                              CommBytes* bytes);

// A reduce-scatter in flight: `input` ([n*s]) of every rank summed chunk-wise, this rank
// receiving chunk `rank`.
class ReduceScatterOp {
 public:
  ReduceScatterOp() = default;
  static ReduceScatterOp Start(c10d::Backend& pg, const torch::Tensor& input, CommBytes* bytes);
  static ReduceScatterOp Start(c10d::Backend& pg, const torch::Tensor& input, CommBytes* bytes,
                               ReduceScatterAlgorithm algorithm);
  // Receives into `receive` (contiguous, same dtype and device, at least ReceiveNumel elements):
  // no allocation of its own.
  static ReduceScatterOp Start(c10d::Backend& pg, const torch::Tensor& input, CommBytes* bytes,
                               ReduceScatterAlgorithm algorithm, const torch::Tensor& receive);
  // Elements of receive space Start needs for `input_numel` on `n` ranks.
  static int64_t ReceiveNumel(ReduceScatterAlgorithm algorithm, int64_t input_numel, int n);

  bool active() const { return started_; }
  // Waits, then writes (or, with accumulate, adds) scale x sum of the chunks into `output` ([s]),
  // which may have another dtype or live on another device (mixed precision, offload).
  void Finish(const torch::Tensor& output, double scale, bool accumulate);

 private:
  bool started_ = false;
  c10::intrusive_ptr<c10d::Work> work_;  // Null for a world of one.
  torch::Tensor input_;                  // Kept alive while Gloo reads it.
  // kAllToAll: [n, s], row r is rank r's chunk for this rank; kNative: [1, s], the sum.
  torch::Tensor received_;
};

// Broadcasts `tensors` from rank 0 in place. A contiguous tensor of at least
// kBroadcastBucketBytes goes as itself (no copy); smaller ones are coalesced per dtype into
// buckets of at most that size. So no copy of the whole model is ever made: the largest
// temporary is one bucket.
inline constexpr int64_t kBroadcastBucketBytes = 16 << 20;
void BroadcastFromRank0(c10d::Backend& pg, const std::vector<torch::Tensor>& tensors, CommBytes* bytes = nullptr);

// The message of an exception from a collective, without LibTorch's backtrace: c10::Error's
// (from collectives), or Gloo's own as it is (gloo::IoException from a failed send or receive).
std::string ErrorText(const std::exception& error);

// Synchronous forms, for tests and simple callers.
// Broadcasts `tensor` from `root` in place (one tensor, no bucketing).
void Broadcast(c10d::Backend& pg, torch::Tensor& tensor, int root);
void AllGather(c10d::Backend& pg, const torch::Tensor& shard, const torch::Tensor& full, CommBytes* bytes = nullptr);
void ReduceScatter(c10d::Backend& pg, const torch::Tensor& input, const torch::Tensor& output,
                   CommBytes* bytes = nullptr);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_DIST_COLLECTIVES_H_
