// Which dataset indices each rank reads in an epoch: PyTorch's DistributedSampler semantics
// (per-epoch shuffle identical on every rank, rank-strided shards, drop_last or wrap-around
// padding), plus per-rank batches and resuming mid-epoch from a global sample position, possibly
// with a different world size. Immutable after Create; safe to share between threads.
#ifndef ELRUN_TRAINER_DATA_SAMPLER_H_
#define ELRUN_TRAINER_DATA_SAMPLER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace elrun::trainer {

struct SamplerOptions {
  int64_t dataset_size = 0;
  int world_size = 1;
  int rank = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  // true: drop the tail of the epoch's order so that every rank gets the same count;
  // false: pad by wrapping around to the start of the order (a few samples are seen twice).
  bool drop_last = false;
  int64_t batch_size = 1;  // Per rank.
};

// The global order of an epoch is `Order(epoch)`: a permutation of 0..dataset_size-1 (the
// identity when !shuffle), from std::mt19937_64 seeded with seed + epoch and an explicit
// Fisher-Yates shuffle, so it is the same on every rank, build and platform. (It is not the
// permutation torch.randperm would give; the sharding semantics are PyTorch's.)
//
// Resuming. A `start` position counts samples of Order(epoch) consumed by all ranks together.
// Ranks step in lockstep and rank r takes positions r, r + W, r + 2W, ... of the order, so after
// every rank has finished k batches of b samples, exactly the prefix Order(epoch)[0, start) has
// been consumed, with start = Position(old start, k) (= old start + k*b*W, capped as described
// there). Given `start`, the remaining samples Order(epoch)[start, N) are what gets sharded -
// by the same rules (padding or drop_last) applied to the remainder - among the world size of
// the sampler at hand, which need not be the one that produced `start`. So a job restarted with
// fewer or more ranks sees each sample of the epoch once (plus padding duplicates) - never a
// sample twice across the restart, and never misses one unless drop_last drops it.
class DistributedSampler {
 public:
  // InvalidArgument when dataset_size < 0, world_size < 1, rank not in [0, world_size) or
  // batch_size < 1.
  [[nodiscard]] static absl::StatusOr<DistributedSampler> Create(const SamplerOptions& options);

  const SamplerOptions& options() const { return options_; }

  // The global order of `epoch` (size dataset_size), identical on every rank.
  std::vector<int64_t> Order(int64_t epoch) const;

  // How many samples each rank gets when the epoch is resumed at global position `start`
  // (clamped to [0, dataset_size]): with R = dataset_size - start remaining, ceil(R / W), or
  // floor(R / W) with drop_last. At start 0 this is PyTorch's num_samples.
  int64_t NumSamples(int64_t start = 0) const;

  // This rank's indices for `epoch` from global position `start`: R' = Order[start, N) padded by
  // wrap-around (or truncated with drop_last) to NumSamples(start) * W entries, then entries
  // rank, rank + W, ... of it.
  std::vector<int64_t> Indices(int64_t epoch, int64_t start = 0) const;

  // Indices() cut into batches of batch_size; the last one may be smaller. Every rank gets the
  // same number of batches with the same sizes, so DDP ranks stay in step.
  std::vector<std::vector<int64_t>> Batches(int64_t epoch, int64_t start = 0) const;
  int64_t NumBatches(int64_t start = 0) const;

  // The global position after every rank has finished `steps` batches since resuming at `start`:
  // start + min(steps * batch_size, NumSamples(start)) * W, capped at dataset_size (padding
  // samples are duplicates, not progress). Save it in a checkpoint and pass it back as `start`.
  // Once it equals dataset_size - or all NumBatches(start) batches are done, which with drop_last
  // leaves it short of that - the epoch is over: continue with epoch + 1 from 0.
  int64_t Position(int64_t start, int64_t steps) const;

 private:
  explicit DistributedSampler(const SamplerOptions& options) : options_(options) {}
  int64_t Clamp(int64_t start) const;

  SamplerOptions options_;  // Constant after construction (not const, so samplers assign).
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_DATA_SAMPLER_H_
