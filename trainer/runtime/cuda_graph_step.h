// --cuda-graph: elrun-train's DDP training step (forward, loss, backward with DDP's bucketed
// all-reduce, SGD) captured once in a CUDA graph and replayed, so that a step costs one graph
// launch instead of ~70 kernel launches through the dispatcher and the autograd engine. On a
// small model at a small batch the GPU otherwise idles ~90% of each step (docs/gpu.md).
//
// The step: `warmup` eager steps on the capture stream (cuDNN and cuBLAS set up, momentum
// buffers created), then the next full batch is captured and replayed; every later full batch is
// copied into the captured input tensors and replayed. A batch of another size (an epoch's last)
// runs eagerly; the learning rate is a device tensor the captured SGD reads (ForeachSgd), so
// schedules work. After capture the gradients are the graph's own buffers: an eager step zeroes
// them in place instead of dropping them.
//
// Only what a graph can hold: one optimizer step per batch (no accumulation), SGD, DDP, no
// SyncBatchNorm, no gradient clipping (each needs a host decision or synchronisation per step);
// train_options.cc refuses the rest. Not thread-safe.
#ifndef ELRUN_TRAINER_RUNTIME_CUDA_GRAPH_STEP_H_
#define ELRUN_TRAINER_RUNTIME_CUDA_GRAPH_STEP_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "trainer/optim/foreach_sgd.h"
#include "trainer/parallel/data_parallel.h"

namespace elrun::trainer {

class CudaGraphStep {
 public:
  CudaGraphStep(const torch::Device& device, int64_t batch_size, int warmup_steps = 3);
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  // Runs `build` with the capture stream current, ordered after the caller's stream and before
  // what the caller queues next. Construct the DDP wrapper in it: DDP keeps each parameter's
  // gradient accumulator, which remembers the stream it was made on, and a capture needs them
  // on its own stream (else the autograd engine makes the legacy stream wait on the capture).
  void OnStream(const std::function<void()>& build);
  // The wrapper and optimizer to step (built in OnStream); the optimizer's rate becomes a
  // device tensor (ForeachSgd::set_device_lr).
  void Bind(DataParallel& dp, ForeachSgd& optimizer);

  // One training step at learning rate `lr` on the batch that `fetch` puts on the device (it
  // runs on the capture stream, so its copies are ordered before the step). Returns the loss,
  // after the step finished on the GPU.
  double Step(const std::function<std::pair<torch::Tensor, torch::Tensor>()>& fetch, double lr);
  bool captured() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_RUNTIME_CUDA_GRAPH_STEP_H_
