// What PyTorch's CUDA caching allocator holds on one device (torch.cuda.memory_allocated,
// memory_reserved, max_memory_allocated): the GPU side of elrun-train's memory report.
// Thread-safe (the allocator's statistics are).
#ifndef ELRUN_TRAINER_MEMORY_CUDA_MEMORY_H_
#define ELRUN_TRAINER_MEMORY_CUDA_MEMORY_H_

#include <cstdint>

namespace elrun::trainer {

struct CudaMemory {
  int64_t allocated = 0;       // Bytes in live tensors now.
  int64_t reserved = 0;        // Bytes the allocator holds from the driver now.
  int64_t peak_allocated = 0;  // Highest `allocated` since the last ResetCudaPeak.
  int64_t peak_reserved = 0;
};

// The statistics of CUDA device `device` (an index among the visible ones). Throws c10::Error
// when it does not exist.
CudaMemory CudaMemoryStats(int device);
void ResetCudaPeak(int device);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_MEMORY_CUDA_MEMORY_H_
