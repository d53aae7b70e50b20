#include "trainer/data/sampler.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/str_format.h"

namespace elrun::trainer {
namespace {

// Uniform in [0, bound) for bound >= 1, by rejection (no modulo bias), independent of the
// standard library's distribution implementations.
uint64_t Below(std::mt19937_64& gen, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound.
  for (;;) {
    const uint64_t r = gen();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

absl::StatusOr<DistributedSampler> DistributedSampler::Create(const SamplerOptions& options) {
  if (options.dataset_size < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("sampler: dataset size %d is negative", options.dataset_size));
  }
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("sampler: world size %d must be at least 1", options.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampler: rank %d is outside [0, %d)", options.rank, options.world_size));
  }
  if (options.batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("sampler: batch size %d must be at least 1", options.batch_size));
  }
  return DistributedSampler(options);
}

std::vector<int64_t> DistributedSampler::Order(int64_t epoch) const {
  std::vector<int64_t> order(options_.dataset_size);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (options_.shuffle && order.size() > 1) {
    std::mt19937_64 gen(options_.seed + static_cast<uint64_t>(epoch));
    for (size_t i = order.size() - 1; i > 0; --i) {
      std::swap(order[i], order[Below(gen, i + 1)]);
    }
  }
  return order;
}

int64_t DistributedSampler::Clamp(int64_t start) const { return std::clamp<int64_t>(start, 0, options_.dataset_size); }

int64_t DistributedSampler::NumSamples(int64_t start) const {
  const int64_t remaining = options_.dataset_size - Clamp(start);
  const int64_t world = options_.world_size;
  return options_.drop_last ? remaining / world : (remaining + world - 1) / world;
}

std::vector<int64_t> DistributedSampler::Indices(int64_t epoch, int64_t start) const {
  start = Clamp(start);
  const int64_t remaining = options_.dataset_size - start;
  const int64_t count = NumSamples(start);
  std::vector<int64_t> local;
  if (count == 0) return local;
  const std::vector<int64_t> order = Order(epoch);
  local.reserve(count);
  // Entry i of the padded remainder is remainder[i % R]: PyTorch's `indices += indices[:pad]`,
  // repeated when the padding exceeds the remainder. With drop_last, i < R always.
  for (int64_t j = 0; j < count; ++j) {
    const int64_t i = j * options_.world_size + options_.rank;
    local.push_back(order[start + i % remaining]);
  }
  return local;
}

std::vector<std::vector<int64_t>> DistributedSampler::Batches(int64_t epoch, int64_t start) const {
  const std::vector<int64_t> local = Indices(epoch, start);
  std::vector<std::vector<int64_t>> batches;
  batches.reserve(NumBatches(start));
  for (size_t begin = 0; begin < local.size(); begin += options_.batch_size) {
    const size_t end = std::min(local.size(), begin + static_cast<size_t>(options_.batch_size));
    batches.emplace_back(local.begin() + begin, local.begin() + end);
  }
  return batches;
}

int64_t DistributedSampler::NumBatches(int64_t start) const {
  return (NumSamples(start) + options_.batch_size - 1) / options_.batch_size;
}

int64_t DistributedSampler::Position(int64_t start, int64_t steps) const {
  start = Clamp(start);
  steps = std::clamp<int64_t>(steps, 0, NumBatches(start));  // No overflow below.
  const int64_t per_rank = std::min(steps * options_.batch_size, NumSamples(start));
  return std::min(options_.dataset_size, start + per_rank * options_.world_size);
}

}  // namespace elrun::trainer
