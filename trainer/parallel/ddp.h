// DistributedDataParallel for LibTorch modules (LibTorch has none in C++, pytorch#48959).
// Wrapping broadcasts rank 0's parameters and buffers; then, during every backward, each
// gradient marks its bucket ready the moment autograd has accumulated it, and a bucket's
// all-reduce starts asynchronously as soon as its last gradient is in - in bucket order, the
// same on every rank - so communication overlaps the rest of backward. At the end of backward
// the reduced gradients, averaged by world size, are written back. NoSync skips communication
// for gradient accumulation. Thread-compatible: one training thread per wrapper.
#ifndef ELRUN_TRAINER_PARALLEL_DDP_H_
#define ELRUN_TRAINER_PARALLEL_DDP_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "trainer/dist/shm_allreduce.h"

namespace elrun::trainer {

struct DdpOptions {
  // Bucket sizes as in PyTorch's DDP: gradients are taken in reverse registration order and a
  // bucket is closed as soon as it holds at least its limit (so its last tensor may take it past
  // the limit). The first bucket's limit is small so that the gradients backward
  // produces first (the last layers) are all-reduced while the rest of backward still runs.
  double bucket_cap_mb = 25.0;
  // Parameters that get no gradient in an iteration are an error unless this is set; then they
  // are reduced as zeros (the way Python's find_unused_parameters=True behaves).
  bool find_unused_parameters = false;
  // PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES; bucket_cap_mb applies instead when smaller.
  double first_bucket_mb = 1.0;
  // When set, buckets it fits (shm_allreduce.h) are all-reduced through shared memory instead of
  // the process group: for ranks on one host. It must span the same ranks as the group.
  std::shared_ptr<ShmAllreduce> shm;
  // Wrapping broadcasts rank 0's parameters and buffers. Off for a worker that joins a running
  // job (--keep-survivors): its state comes from a survivor afterwards (live_state.h), and the
  // survivors, whose wrappers exist, broadcast nothing then.
  bool broadcast_from_rank0 = true;
};

// What the last synchronized backward did (for tests and metrics).
struct DdpStats {
  int buckets = 0;
  int buckets_launched_before_backward_end = 0;
  std::chrono::steady_clock::time_point first_launch;     // First all-reduce started.
  std::chrono::steady_clock::time_point last_grad_ready;  // Autograd produced the last gradient.
  std::chrono::steady_clock::time_point backward_end;
  int64_t bytes_reduced = 0;
};

class DistributedDataParallel {
 public:
  // Wraps `module` (kept alive by the wrapper). Broadcasts its parameters and buffers from rank
  // 0. Throws c10::Error when the collective fails, or when options.shm spans other ranks than
  // `pg`.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, c10::intrusive_ptr<c10d::Backend> pg,
                          DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }
  const DdpStats& last_stats() const { return stats_; }
  // Parameter indices per bucket, in launch order (reverse registration order).
  const std::vector<std::vector<size_t>>& bucket_layout() const { return layout_; }

  // While alive, backward passes accumulate gradients locally without communicating.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.sync_) { ddp_.sync_ = false; }
    ~NoSync() { ddp_.sync_ = previous_; }

   private:
    DistributedDataParallel& ddp_;
    const bool previous_;
  };

  // Goes on over `pg` (and `shm`, when set, spanning the same ranks) after the old group failed:
  // a step whose collectives did not finish is dropped, and gradients are averaged over the new
  // world size. Nothing is broadcast: the caller makes every rank's state the same. A null `pg`
  // (and `shm`) only drops the old group's handles: no backward may run until the next Rebind.
  // Throws c10::Error when `shm` spans other ranks than `pg`.
  void Rebind(c10::intrusive_ptr<c10d::Backend> pg, std::shared_ptr<ShmAllreduce> shm);

  // Broadcasts rank 0's buffers (e.g. BatchNorm running stats) to every rank.
  void BroadcastBuffers();

  // Bytes of the buckets' flat buffers (held besides the parameters' gradients).
  int64_t bucket_bytes() const;

 private:
  struct Bucket;
  void OnGradReady(size_t param_index);
  void LaunchReadyBuckets();
  void Finalize();
  void ResetIteration();

  void CheckShmSpansGroup() const;
  void SetScale();  // scale_ = 1 / the group's size.

  const std::shared_ptr<torch::nn::Module> module_;
  c10::intrusive_ptr<c10d::Backend> pg_;  // Rebind replaces it and options_.shm.
  DdpOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // Kept alive for the hooks.
  std::vector<std::vector<size_t>> layout_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<int> bucket_of_;   // Param index -> bucket.
  std::vector<int64_t> offset_;  // Param index -> offset in its bucket's flat buffer.
  std::vector<bool> ready_;
  torch::Tensor scale_;  // 1 / world size, a wrapped CPU number.
  size_t next_launch_ = 0;
  bool in_backward_ = false;
  bool sync_ = true;
  DdpStats stats_;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_DDP_H_
