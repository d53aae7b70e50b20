#include "trainer/memory/caching_cpu_allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace elrun::trainer {

CachingCpuAllocator& CachingCpuAllocator::Instance(size_t cache_limit) {
  static CachingCpuAllocator* instance = new CachingCpuAllocator(cache_limit);  // Never destroyed:
  return *instance;  // tensors may be freed during static destruction.
}

void CachingCpuAllocator::Install(size_t cache_limit) {
  // Priority 1: above c10's default CPU allocator (0).
  c10::SetCPUAllocator(&Instance(cache_limit), /*priority=*/1);
}

c10::DataPtr CachingCpuAllocator::allocate(size_t bytes) {
  if (bytes < kMinBytes) return c10::GetDefaultCPUAllocator()->allocate(bytes);
  const size_t size = (bytes + kGranule - 1) / kGranule * kGranule;
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      auto cached = it->second.back();  // The most recently freed of this size.
      it->second.pop_back();
      block = cached->block;
      lru_.erase(cached);
      stats_.cached_bytes -= static_cast<int64_t>(size);
      ++stats_.reuses;
    }
  }
  const bool mapped = block == nullptr;
  if (mapped) {
    block = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(block != MAP_FAILED, "CachingCpuAllocator: out of memory mapping ", size,
                " bytes: ", std::strerror(errno));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (mapped) ++stats_.maps;
  live_[block] = size;
  stats_.live_bytes += static_cast<int64_t>(size);
  stats_.peak_mapped_bytes = std::max(stats_.peak_mapped_bytes, stats_.live_bytes + stats_.cached_bytes);
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  return c10::DataPtr(block, block, &CachingCpuAllocator::Free, c10::Device(c10::DeviceType::CPU));
}

void CachingCpuAllocator::Free(void* ptr) { Instance().FreeBlock(ptr); }

void CachingCpuAllocator::FreeBlock(void* ptr) {
  std::vector<Cached> unmap;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) {
      // A small block of c10's allocator, freed through raw_deleter() (oneDNN allocates raw).
      c10::DeleterFnPtr small = c10::GetDefaultCPUAllocator()->raw_deleter();
      TORCH_INTERNAL_ASSERT(small != nullptr, "CachingCpuAllocator: c10's CPU allocator has no raw deleter");
      small(ptr);
      return;
    }
    const size_t size = it->second;
    live_.erase(it);
    stats_.live_bytes -= static_cast<int64_t>(size);
    lru_.push_front(Cached{ptr, size});
    free_[size].push_back(lru_.begin());
    stats_.cached_bytes += static_cast<int64_t>(size);
    // Over the limit: unmap the blocks freed longest ago (sizes no longer in use), not this one.
    while (static_cast<size_t>(stats_.cached_bytes) > cache_limit_) {
      const Cached victim = lru_.back();
      auto& of_size = free_[victim.size];  // Oldest first: the victim is at the front.
      of_size.erase(of_size.begin());
      lru_.pop_back();
      stats_.cached_bytes -= static_cast<int64_t>(victim.size);
      unmap.push_back(victim);
    }
  }
  for (const Cached& c : unmap) ::munmap(c.block, c.size);
}

void CachingCpuAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

CachingCpuAllocator::Stats CachingCpuAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingCpuAllocator::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_live_bytes = stats_.live_bytes;
}

void CachingCpuAllocator::ReleaseCached() {
  std::list<Cached> cached;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cached.swap(lru_);
    free_.clear();
    stats_.cached_bytes = 0;
  }
  for (const Cached& c : cached) ::munmap(c.block, c.size);
}

}  // namespace elrun::trainer
