#include "trainer/memory/cuda_memory.h"

#include <c10/cuda/CUDACachingAllocator.h>

namespace elrun::trainer {

namespace allocator = c10::cuda::CUDACachingAllocator;

CudaMemory CudaMemoryStats(int device) {
  const auto stats = allocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  CudaMemory m;
  m.allocated = stats.allocated_bytes[all].current;
  m.reserved = stats.reserved_bytes[all].current;
  m.peak_allocated = stats.allocated_bytes[all].peak;
  m.peak_reserved = stats.reserved_bytes[all].peak;
  return m;
}

void ResetCudaPeak(int device) { allocator::resetPeakStats(static_cast<c10::DeviceIndex>(device)); }

}  // namespace elrun::trainer
