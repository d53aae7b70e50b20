// elrun-train's run: the Job that Setup builds (job_setup.h) and the training loop, the regroup
// (regroup.h) and the report (train_report.h) work on, and the helpers they share to turn sample
// indices into a batch and a batch into a loss. One training thread uses a Job; nothing in it is
// locked.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trainer/app/models.h"
#include "trainer/app/placement.h"
#include "trainer/app/train_options.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/data/fashion_mnist.h"
#include "trainer/data/sampler.h"
#include "trainer/dist/process_group.h"
#include "trainer/dist/shm_allreduce.h"
#include "trainer/nn/linear_kernel.h"
#include "trainer/optim/grad_scaler.h"
#include "trainer/parallel/data_parallel.h"
#include "trainer/parallel/shard_copies.h"
#include "trainer/runtime/control_channel.h"
#include "trainer/runtime/cuda_graph_step.h"
#include "trainer/runtime/heartbeat_client.h"
#include "trainer/runtime/step_profiler.h"

namespace elrun::trainer::app {

// Prints `status` as elrun-train's one-line error and returns the exit code: 2 for what the user
// must change (options, environment, devices), 1 for failures while running (a peer, a file, the
// data).
int Fail(const absl::Status& status);

// A failure that must not stop training (the profiler's trace): one line on stderr; nothing when ok.
void Warn(const absl::Status& status);

// Appends one JSON line to the metrics file (rank 0 only).
class Metrics {
 public:
  explicit Metrics(const std::string& path) {
    if (!path.empty()) out_.open(path, std::ios::app);
  }
  void Write(const std::string& json) {
    if (out_.is_open()) out_ << json << "\n" << std::flush;
  }

 private:
  std::ofstream out_;
};

// One line per training step of this rank, tab-separated: the step, its wall time and the training
// thread's CPU time in it (ms). A step longer than its CPU time was blocked (waiting for the slowest
// rank, with DDP) or preempted; steps of the same length took different CPU time when the CPU ran
// at another speed. Appended to, like the metrics file, so that a restarted worker continues it
// from the step it resumed at; each line is flushed (a ~20-byte write per step), so a killed
// worker loses none.
class StepTimes {
 public:
  static absl::StatusOr<std::unique_ptr<StepTimes>> Open(const std::string& path) {
    std::error_code missing;
    const bool fresh = std::filesystem::file_size(path, missing) == 0 || missing;
    auto times = std::unique_ptr<StepTimes>(new StepTimes());
    times->out_.open(path, std::ios::app);
    if (!times->out_) return absl::InvalidArgumentError(absl::StrCat("--step-times-file: cannot write ", path));
    if (fresh) times->out_ << "step\tstep_ms\tcpu_ms\n" << std::flush;
    return times;
  }
  void Write(int64_t step, double step_ms, double cpu_ms) {
    out_ << step << '\t' << absl::StrFormat("%.3f\t%.3f", step_ms, cpu_ms) << '\n' << std::flush;
  }

 private:
  StepTimes() = default;
  std::ofstream out_;
};

// Everything a run holds, built by Setup.
struct Job {
  TrainOptions o;
  DistEnv env;
  Placement placement;
  torch::Device device = torch::kCPU;           // From placement.
  LinearKernel linear = LinearKernel::kOneDnn;  // --linear resolved for the device.
  bool channels_last = false;                   // --memory-format resolved for the device.
  Dist dist;
  Dataset train, test;
  // --dataset text: windows of gpt_context + 1 bytes (TextWindows), at least one of validation.
  torch::Tensor text_train, text_validation;
  std::shared_ptr<Classifier> model;
  std::shared_ptr<ShmAllreduce> shm;
  std::string allreduce = "none";  // How DDP's and SyncBatchNorm's sums travel: shm, gloo, nccl.
  std::unique_ptr<DataParallel> dp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::vector<torch::Tensor> optimizer_params;  // What the optimizer steps (dp->OptimizerParameters()).
  // --precision bf16/fp16 with a strategy other than fsdp: forward and loss under autocast in it.
  std::optional<c10::ScalarType> autocast;
  std::unique_ptr<GradScaler> scaler;    // --precision fp16.
  std::unique_ptr<CudaGraphStep> graph;  // --cuda-graph.
  std::unique_ptr<DistributedSampler> sampler;
  std::unique_ptr<StepTimes> step_times;
  std::unique_ptr<StepProfiler> profiler;
  std::unique_ptr<HeartbeatClient> heartbeat;  // elrun's ELRUN_HEARTBEAT_FILE, when given.
  // elrun --keep-survivors: its ELRUN_CONTROL_FILE, when this run can regroup in place (on the
  // CPU, without fp16's loss scaler) and beats.
  std::unique_ptr<ControlChannel> control;
  int64_t generation = 0;  // ELRUN_GENERATION (else TORCHELASTIC_RESTART_COUNT), then the last regroup's.
  // How long a survivor waits for elrun's regroup: ELRUN_REGROUP_WAIT_MS (a multi-node job's next
  // round), else 10 s.
  std::chrono::milliseconds regroup_wait{10000};
  // --keep-survivors with a sharded strategy and --shard-copy-every > 0: this rank's and its
  // neighbour's shards, in memory.
  std::unique_ptr<ShardCopies> shard_copies;
  // A standby spare: when elrun handed it a failed worker's contract.
  std::optional<std::chrono::steady_clock::time_point> told_at;
  std::unique_ptr<Metrics> metrics;
  TrainProgress progress;
  int64_t baseline_rss = 0;  // Before the model was built (MemoryReport::baseline_rss).
  // Set by main's SIGTERM handler; outlives the job.
  const std::atomic<bool>* stop_flag = nullptr;
  int rank() const { return env.rank; }
  bool sharded() const { return o.strategy != Strategy::kDdp; }
  int world() const { return env.world_size; }
  bool text() const { return o.dataset == DatasetChoice::kText; }
  int64_t train_size() const { return text() ? text_train.size(0) : train.size(); }
  bool stop_requested() const { return stop_flag != nullptr && stop_flag->load(); }
};

// --collective-timeout, for the process group and the shared-memory all-reduce.
std::chrono::milliseconds CollectiveTimeout(const TrainOptions& o);

// Rows `indices` of `data` on `device`. For CUDA they are gathered into pinned host memory and
// copied without blocking the host (the copy is ordered before the kernels that read it on the
// same stream; the pinned block is reused only after the copy finished).
torch::Tensor Rows(const torch::Tensor& data, const std::vector<int64_t>& indices, const torch::Device& device);

// A batch's inputs and targets on the device: images and labels, or for text each window's
// first context bytes and the bytes that follow each (int64 token ids).
std::pair<torch::Tensor, torch::Tensor> Examples(const Job& job, bool train, const std::vector<int64_t>& indices);

// Cross-entropy, averaged over the samples, or for next-token logits [B, T, V] over every
// position.
torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& targets,
                   torch::nn::functional::CrossEntropyFuncOptions::reduction_t reduction = torch::kMean);

// The model's output for `input`, under autocast for --precision bf16/fp16 (but fsdp, whose
// units compute in it themselves), in fp32.
torch::Tensor Forward(Job& job, const torch::Tensor& input);

}  // namespace elrun::trainer::app
