// Memory accounting for training state: bytes of an optimizer's state tensors, the process's
// peak resident set, and the per-rank report of elrun-train's --report-memory. The ZeRO paper's
// fp32 Adam figures (P parameters, N ranks): DDP 16P; ZeRO-1 8P + 8P/N; ZeRO-2 4P + 12P/N;
// ZeRO-3 16P/N. Thread-compatible.
#ifndef ELRUN_TRAINER_MEMORY_MEMORY_H_
#define ELRUN_TRAINER_MEMORY_MEMORY_H_

#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "trainer/memory/cuda_memory.h"

namespace elrun::trainer {

// Bytes of every state tensor of `optimizer` (SGD momentum buffers; Adam exp_avg, exp_avg_sq,
// max_exp_avg_sq). State of other optimizer types counts as 0.
int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer);

// The model-state bytes a fp32 Adam run should hold per rank, by the formulas above.
int64_t ExpectedAdamStateBytes(const std::string& strategy, int64_t params, int world_size);

// VmHWM of this process (peak resident set) in bytes; 0 when /proc is unavailable.
int64_t PeakRssBytes();
// VmRSS of this process (resident set now) in bytes; 0 when /proc is unavailable.
int64_t RssBytes();

struct MemoryReport {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer_state = 0;
  int64_t working = 0;  // Transient communication buffers at the moment of the report.
  int64_t peak = 0;     // Highest params + grads + working seen, plus optimizer state.
  int64_t peak_rss = 0;
  // The resident set before the model was built: LibTorch, the data set, the process group.
  // What the training state adds to is peak_rss - baseline_rss. 0: not measured.
  int64_t baseline_rss = 0;
  // On CUDA: the caching allocator's view of this rank's device (cuda_memory.h).
  bool on_cuda = false;
  CudaMemory cuda;
  int64_t state() const { return params + grads + optimizer_state; }
};

// One line: "params 1.00 MiB  grads ...  optimizer ...  state ...  peak ...  peak RSS ...", then
// on CUDA "  cuda allocated ...  reserved ...  peak ...".
std::string FormatMemoryReport(const MemoryReport& report);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_MEMORY_MEMORY_H_
