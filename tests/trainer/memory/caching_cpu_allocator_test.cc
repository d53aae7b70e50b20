// CachingCpuAllocator installed as LibTorch's CPU allocator: large tensors reuse freed blocks of
// their size, small ones go to c10's allocator, free blocks past the cache limit are unmapped.
#include "trainer/memory/caching_cpu_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

// After LibTorch's headers: c10's logging defines a CHECK of its own.
#include <doctest/doctest.h>

namespace elrun::trainer {
namespace {

constexpr int64_t kMiB = 1 << 20;

TEST_CASE("Large tensors reuse freed blocks; small ones and the cache limit behave") {
  CachingCpuAllocator& allocator = CachingCpuAllocator::Instance(/*cache_limit=*/12 * kMiB);
  CachingCpuAllocator::Install();
  CHECK(c10::GetCPUAllocator() == &allocator);

  const auto start = allocator.stats();
  void* first = nullptr;
  {
    torch::Tensor t = torch::ones({kMiB});  // 4 MiB.
    first = t.data_ptr();
    CHECK(t.sum().item<double>() == kMiB);
    CHECK(allocator.stats().maps == start.maps + 1);
    CHECK(allocator.stats().live_bytes == start.live_bytes + 4 * kMiB);
  }
  CHECK(allocator.stats().cached_bytes == start.cached_bytes + 4 * kMiB);
  {
    torch::Tensor again = torch::zeros({kMiB});  // Same size: the same block, zeroed.
    CHECK(again.data_ptr() == first);
    CHECK(again.sum().item<double>() == 0);
    CHECK(allocator.stats().maps == start.maps + 1);
    CHECK(allocator.stats().reuses == start.reuses + 1);
  }
  {
    torch::Tensor small = torch::ones({1000});  // 4 KB: c10's own allocator.
    CHECK(allocator.stats().live_bytes == start.live_bytes);
  }
  {
    // Three 4 MiB blocks freed with 12 MiB allowed cached (4 MiB already are): one is unmapped.
    std::vector<torch::Tensor> three{torch::empty({kMiB}), torch::empty({kMiB}), torch::empty({kMiB})};
  }
  CHECK(allocator.stats().cached_bytes <= 12 * kMiB);
  CHECK(allocator.stats().peak_mapped_bytes >= 12 * kMiB);
  allocator.ReleaseCached();
  CHECK(allocator.stats().cached_bytes == 0);

  // The raw interface (oneDNN's): small and large blocks both come back through raw_deleter().
  void* raw_small = allocator.raw_allocate(100);
  void* raw_large = allocator.raw_allocate(2 * kMiB);
  const auto before_raw_free = allocator.stats();
  allocator.raw_deallocate(raw_small);
  allocator.raw_deallocate(raw_large);
  CHECK(allocator.stats().live_bytes == before_raw_free.live_bytes - 2 * kMiB);

  // A size between pages is rounded up to whole pages: a slightly smaller request reuses it.
  void* block = nullptr;
  {
    torch::Tensor t = torch::empty({kMiB / 2 + 1000});
    block = t.data_ptr();
  }
  torch::Tensor u = torch::empty({kMiB / 2 + 990});
  CHECK(u.data_ptr() == block);
}

TEST_CASE("Over the cache limit, the blocks freed longest ago go, not the ones in use") {
  CachingCpuAllocator& allocator = CachingCpuAllocator::Instance(/*cache_limit=*/12 * kMiB);
  CachingCpuAllocator::Install();
  allocator.ReleaseCached();
  void* old_block = nullptr;
  {
    torch::Tensor old = torch::empty({2 * kMiB});  // 8 MiB of a size used once (an eval batch).
    old_block = old.data_ptr();
  }
  void* step_blocks[2] = {nullptr, nullptr};
  {
    // A training step's two 4 MiB tensors, freed after the old one: 16 MiB cached is over the
    // 12 MiB limit, so the old 8 MiB block is unmapped and these stay.
    torch::Tensor a = torch::empty({kMiB}), b = torch::empty({kMiB});
    step_blocks[0] = a.data_ptr();
    step_blocks[1] = b.data_ptr();
  }
  CHECK(allocator.stats().cached_bytes == 8 * kMiB);
  const auto before = allocator.stats();
  torch::Tensor again = torch::empty({kMiB});  // The next step reuses them: no new mapping.
  CHECK(allocator.stats().maps == before.maps);
  CHECK(allocator.stats().reuses == before.reuses + 1);
  CHECK((again.data_ptr() == step_blocks[0] || again.data_ptr() == step_blocks[1]));
  CHECK(again.data_ptr() != old_block);
}

}  // namespace
}  // namespace elrun::trainer
