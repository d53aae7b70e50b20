#include "trainer/app/job.h"

#include <algorithm>
#include <iostream>

#include "trainer/nn/autocast.h"

namespace elrun::trainer::app {

int Fail(const absl::Status& status) {
  std::cerr << "elrun-train: " << status.message() << std::endl;
  const bool usage =
      status.code() == absl::StatusCode::kInvalidArgument || status.code() == absl::StatusCode::kFailedPrecondition;
  return usage ? 2 : 1;
}

void Warn(const absl::Status& status) {
  if (!status.ok()) std::cerr << "elrun-train: " << status.message() << std::endl;
}

// --collective-timeout, for the process group and the shared-memory all-reduce.
std::chrono::milliseconds CollectiveTimeout(const TrainOptions& o) {
  return std::chrono::milliseconds(static_cast<int64_t>(o.collective_timeout_s * 1000));
}

// Rows `indices` of `data` on `device`. For CUDA they are gathered into pinned host memory and
// copied without blocking the host (the copy is ordered before the kernels that read it on the
// same stream; the pinned block is reused only after the copy finished).
torch::Tensor Rows(const torch::Tensor& data, const std::vector<int64_t>& indices, const torch::Device& device) {
  torch::Tensor index = torch::tensor(indices, torch::kLong);
  if (device.is_cpu()) return data.index_select(0, index);
  std::vector<int64_t> shape = data.sizes().vec();
  shape[0] = static_cast<int64_t>(indices.size());
  torch::Tensor pinned = torch::empty(shape, data.options().pinned_memory(true));
  torch::index_select_out(pinned, data, 0, index);
  return pinned.to(device, /*non_blocking=*/true);
}

// A batch's inputs and targets on the device: images and labels, or for text each window's
// first context bytes and the bytes that follow each (int64 token ids).
std::pair<torch::Tensor, torch::Tensor> Examples(const Job& job, bool train, const std::vector<int64_t>& indices) {
  if (job.text()) {
    torch::Tensor windows = Rows(train ? job.text_train : job.text_validation, indices, job.device).to(torch::kLong);
    const int64_t context = windows.size(1) - 1;
    return {windows.narrow(1, 0, context), windows.narrow(1, 1, context)};
  }
  const Dataset& data = train ? job.train : job.test;
  return {Rows(data.images, indices, job.device), Rows(data.labels, indices, job.device)};
}

// Cross-entropy, averaged over the samples, or for next-token logits [B, T, V] over every
// position.
torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& targets,
                   torch::nn::functional::CrossEntropyFuncOptions::reduction_t reduction) {
  namespace F = torch::nn::functional;
  if (logits.dim() == 3) return Loss(logits.flatten(0, 1), targets.flatten(), reduction);
  return F::cross_entropy(logits, targets, F::CrossEntropyFuncOptions().reduction(reduction));
}

// The model's output for `input`, under autocast for --precision bf16/fp16 (but fsdp, whose
// units compute in it themselves), in fp32.
torch::Tensor Forward(Job& job, const torch::Tensor& input) {
  AutocastGuard autocast(job.device.type(), job.autocast);
  torch::Tensor output = job.dp->Forward(input);
  return job.autocast && output.is_floating_point() ? output.to(torch::kFloat) : output;
}

}  // namespace elrun::trainer::app
