#include "trainer/runtime/cuda_graph_step.h"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace elrun::trainer {

namespace {

// `waiter` runs what is queued on it next only after what `first` has queued so far.
void Order(const c10::cuda::CUDAStream& first, const c10::cuda::CUDAStream& waiter) {
  at::cuda::CUDAEvent done;
  done.record(first);
  done.block(waiter);
}

}  // namespace

struct CudaGraphStep::State {
  State(const torch::Device& device, int64_t batch_size, int warmup)
      : batch_size(batch_size),
        warmup(warmup),
        stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())),
        lr(torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(device))) {}

  torch::Tensor Eager(const torch::Tensor& images, const torch::Tensor& labels) {
    optimizer->zero_grad(/*set_to_none=*/!graph);  // Captured gradients stay where the graph writes.
    torch::Tensor loss = torch::nn::functional::cross_entropy(dp->Forward(images), labels);
    dp->Backward(loss, /*synchronize=*/true);
    optimizer->step();
    return loss.detach();
  }

  DataParallel* dp = nullptr;
  ForeachSgd* optimizer = nullptr;
  const int64_t batch_size;
  const int warmup;
  int eager_steps = 0;
  c10::cuda::CUDAStream stream;
  torch::Tensor lr;  // The captured SGD's learning rate.
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  torch::Tensor images, labels, loss;  // The graph's input and output tensors.
};

CudaGraphStep::CudaGraphStep(const torch::Device& device, int64_t batch_size, int warmup_steps)
    : s_(std::make_unique<State>(device, batch_size, warmup_steps)) {}

void CudaGraphStep::OnStream(const std::function<void()>& build) {
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(s_->stream.device_index());
  Order(caller, s_->stream);
  {
    c10::cuda::CUDAStreamGuard on_stream(s_->stream);
    build();
  }
  Order(s_->stream, caller);
}

void CudaGraphStep::Bind(DataParallel& dp, ForeachSgd& optimizer) {
  s_->dp = &dp;
  s_->optimizer = &optimizer;
  optimizer.set_device_lr(s_->lr);
}

CudaGraphStep::~CudaGraphStep() = default;

bool CudaGraphStep::captured() const { return s_->graph != nullptr; }

double CudaGraphStep::Step(const std::function<std::pair<torch::Tensor, torch::Tensor>()>& fetch, double lr) {
  State& s = *s_;
  // Everything on the capture stream: the batch's copies, warm-up, capture and replays (a graph
  // must be captured on a stream other than the default one). Each step ends by reading the
  // loss, so nothing of it is in flight when other streams (evaluation, checkpoints) run.
  TORCH_CHECK(s.dp != nullptr, "CudaGraphStep::Step before Bind");
  Order(c10::cuda::getCurrentCUDAStream(s.stream.device_index()), s.stream);  // E.g. a resumed checkpoint.
  c10::cuda::CUDAStreamGuard on_stream(s.stream);
  auto [images, labels] = fetch();
  s.lr.fill_(lr);
  const bool full = images.size(0) == s.batch_size;
  if (!full || (s.graph == nullptr && s.eager_steps < s.warmup)) {
    ++s.eager_steps;
    return s.Eager(images, labels).item<double>();
  }
  if (s.graph == nullptr) {
    s.images = images.clone();
    s.labels = labels.clone();
    s.optimizer->zero_grad(/*set_to_none=*/true);  // Backward allocates them inside the graph's pool.
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    // Thread-local: the autograd engine's device thread launches backward onto this stream, and
    // other threads (NCCL's watchdog) may query their own events meanwhile.
    graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    torch::Tensor loss = torch::nn::functional::cross_entropy(s.dp->Forward(s.images), s.labels);
    s.dp->Backward(loss, /*synchronize=*/true);
    s.optimizer->step();
    s.loss = loss.detach();
    graph->capture_end();
    s.graph = std::move(graph);
  } else {
    s.images.copy_(images);
    s.labels.copy_(labels);
  }
  s.graph->replay();
  return s.loss.item<double>();
}

}  // namespace elrun::trainer
