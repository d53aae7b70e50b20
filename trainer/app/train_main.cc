// elrun-train: the worker binary of the README's main job. Trains FashionNet (or an MLP) on
// Fashion-MNIST, or a byte-level GPT on text (the Python standard library's modules), with
// DistributedDataParallel or a sharded strategy, optional SyncBatchNorm and
// gradient accumulation, on CPU (Gloo, shared memory) or CUDA (NCCL, cuda:LOCAL_RANK);
// checkpoints periodically and on SIGTERM, resumes from the latest checkpoint (also under another
// world size or device), and reports test accuracy (for the GPT: validation loss and perplexity,
// and a sample of its text). Runs under elrun or Python's torchrun alike:
// everything distributed comes from the env contract.
// Shape: ParseTrainOptions (every option, before anything else) -> Setup (environment, device,
// data, process group, model, wrapper, optimizer, resume) -> TrainStep per batch -> Evaluate ->
// Report.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include <torch/torch.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trainer/app/gpt.h"
#include "trainer/app/models.h"
#include "trainer/app/placement.h"
#include "trainer/app/train_options.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/data/fashion_mnist.h"
#include "trainer/data/sampler.h"
#include "trainer/data/text_corpus.h"
#include "trainer/dist/collectives.h"
#include "trainer/dist/process_group.h"
#include "trainer/dist/shm_allreduce.h"
#include "trainer/memory/caching_cpu_allocator.h"
#include "trainer/memory/cuda_memory.h"
#include "trainer/memory/memory.h"
#include "trainer/nn/autocast.h"
#include "trainer/nn/linear_kernel.h"
#include "trainer/optim/foreach_sgd.h"
#include "trainer/optim/grad_scaler.h"
#include "trainer/parallel/data_parallel.h"
#include "trainer/parallel/live_state.h"
#include "trainer/parallel/shard_copies.h"
#include "trainer/parallel/sync_batch_norm.h"
#include "trainer/runtime/control_channel.h"
#include "trainer/runtime/cuda_graph_step.h"
#include "trainer/runtime/heartbeat_client.h"
#include "trainer/runtime/step_profiler.h"
#include "trainer/runtime/thread_times.h"

extern char** environ;

namespace elrun::trainer {
namespace {

std::atomic<bool> g_stop_requested{false};  // Set by the SIGTERM handler only.

// Exit codes: 2 for what the user must change (options, environment, devices), 1 for failures
// while running (a peer, a file, the data).
int Fail(const absl::Status& status) {
  std::cerr << "elrun-train: " << status.message() << std::endl;
  const bool usage =
      status.code() == absl::StatusCode::kInvalidArgument || status.code() == absl::StatusCode::kFailedPrecondition;
  return usage ? 2 : 1;
}

// A failure that must not stop training (the profiler's trace): one line on stderr.
void Warn(const absl::Status& status) {
  if (!status.ok()) std::cerr << "elrun-train: " << status.message() << std::endl;
}

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

// --collective-timeout, for the process group and the shared-memory all-reduce.
std::chrono::milliseconds CollectiveTimeout(const TrainOptions& o) {
  return std::chrono::milliseconds(static_cast<int64_t>(o.collective_timeout_s * 1000));
}

// The learning rate of the step that starts at `position` of the whole run, a fraction in [0, 1]
// of epochs x dataset samples. Derived from the global sample position, not the step count, so a
// run resumed under another world size continues on the same curve.
// The first --warmup-fraction of the run ramps linearly from 0 (the first step gets a small
// positive rate, not 0); the schedule spans the rest.
double ScheduledLr(const TrainOptions& o, double position) {
  position = std::clamp(position, 0.0, 1.0);
  const double warmup = o.warmup_fraction;
  if (warmup > 0 && position < warmup) return o.lr * std::max(position, 1e-3 * warmup) / warmup;
  if (o.lr_schedule == LrSchedule::kConstant) return o.lr;
  const double after = warmup < 1 ? (position - warmup) / (1 - warmup) : 1.0;
  return o.lr * 0.5 * (1.0 + std::cos(M_PI * after));
}

void SetLr(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const TrainOptions& o,
                                                       const std::vector<torch::Tensor>& params) {
  if (o.optimizer == OptimizerChoice::kAdam) {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (o.optimizer == OptimizerChoice::kAdamW) {
    // Every parameter decays, LayerNorms and biases too: the sharded strategies step flat shards
    // that mix them, as FSDP1's flat parameters did.
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  }
  return std::make_unique<ForeachSgd>(params,
                                      torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
}

std::string MemoryJson(const MemoryReport& m) {
  std::string json =
      absl::StrFormat(R"("params_bytes":%d,"grads_bytes":%d,"optimizer_bytes":%d,"state_bytes":%d,"peak_bytes":%d,)"
                      R"("peak_rss_bytes":%d,"baseline_rss_bytes":%d)",
                      m.params, m.grads, m.optimizer_state, m.state(), m.peak, m.peak_rss, m.baseline_rss);
  if (m.on_cuda) {
    json += absl::StrFormat(R"(,"cuda_allocated_bytes":%d,"cuda_reserved_bytes":%d,"cuda_peak_allocated_bytes":%d,)"
                            R"("cuda_peak_reserved_bytes":%d)",
                            m.cuda.allocated, m.cuda.reserved, m.cuda.peak_allocated, m.cuda.peak_reserved);
  }
  return json;
}

// The q-quantile (0..1, nearest rank) of `values`, 0 when empty. Reorders `values`.
double Quantile(std::vector<double>& values, double q) {
  if (values.empty()) return 0;
  const size_t k = std::min(values.size() - 1, static_cast<size_t>(q * static_cast<double>(values.size())));
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(k), values.end());
  return values[k];
}

// The training loop's time on this thread, split (from the kernel's schedstat) into time on a
// CPU, time runnable but waiting for one, and the rest, blocked: with DDP, mostly waiting for the
// slowest rank. Empty when the kernel does not tell.
std::string LoopTimesJson(const absl::StatusOr<ThreadTimes>& start, const absl::StatusOr<ThreadTimes>& end,
                          double elapsed_s) {
  if (!start.ok() || !end.ok()) return "";
  const double cpu = end->cpu_s - start->cpu_s, runqueue = end->runqueue_s - start->runqueue_s;
  return absl::StrFormat(R"("loop_cpu_s":%.3f,"loop_runqueue_s":%.3f,"loop_blocked_s":%.3f,)", cpu, runqueue,
                         std::max(0.0, elapsed_s - cpu - runqueue));
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

std::map<std::string, std::string> Environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

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
  int rank() const { return env.rank; }
  bool sharded() const { return o.strategy != Strategy::kDdp; }
  int world() const { return env.world_size; }
  bool text() const { return o.dataset == DatasetChoice::kText; }
  int64_t train_size() const { return text() ? text_train.size(0) : train.size(); }
};

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
                   torch::nn::functional::CrossEntropyFuncOptions::reduction_t reduction = torch::kMean) {
  namespace F = torch::nn::functional;
  if (logits.dim() == 3) return Loss(logits.flatten(0, 1), targets.flatten(), reduction);
  return F::cross_entropy(logits, targets, F::CrossEntropyFuncOptions().reduction(reduction));
}

// DDP's buckets and SyncBatchNorm's statistics go through shared memory where every rank can map
// it (all on this host, CPU tensors); the sharded strategies' collectives stay on the backend.
absl::Status SetUpSharedMemory(Job& job) {
  const TrainOptions& o = job.o;
  job.allreduce = job.world() > 1 ? BackendName(job.dist.backend) : "none";
  if (job.world() == 1 || job.placement.cuda || o.allreduce == AllreduceChoice::kProcessGroup ||
      (o.strategy != Strategy::kDdp && !o.sync_bn)) {
    return absl::OkStatus();
  }
  int64_t capacity = 1 << 20;          // SyncBatchNorm's statistics: 2 x channels + 1 doubles.
  if (o.strategy == Strategy::kDdp) {  // A bucket holds at most its limit plus its last tensor.
    int64_t largest = 0;
    for (const auto& p : job.model->parameters()) largest = std::max<int64_t>(largest, p.numel() * p.element_size());
    capacity = std::max<int64_t>(
        capacity, static_cast<int64_t>(std::max(o.bucket_cap_mb, o.first_bucket_mb) * 1024 * 1024) + largest);
  }
  auto created =
      ShmAllreduce::Create(*job.dist.store, "shm_allreduce", job.rank(), job.world(), capacity, CollectiveTimeout(o));
  if (created.ok()) {
    job.shm = std::move(*created);
    job.allreduce = "shm";
  } else if (o.allreduce == AllreduceChoice::kShm) {
    return absl::UnavailableError(created.status().message());
  } else if (job.rank() == 0) {
    std::cerr << "elrun-train: " << created.status().message() << "; all-reduces go through Gloo" << std::endl;
  }
  return absl::OkStatus();
}

// How long building a regrouped process group may take: a replacement worker starts in about a
// second.
constexpr std::chrono::seconds kRegroupTimeout{60};

// The integer in `env`'s `name`, `fallback` when unset; InvalidArgument naming it when it is not
// an integer in [low, high].
absl::StatusOr<int64_t> EnvInt(const std::map<std::string, std::string>& env, const std::string& name, int64_t fallback,
                               int64_t low, int64_t high) {
  auto it = env.find(name);
  if (it == env.end()) return fallback;
  int64_t value = 0;
  if (!absl::SimpleAtoi(it->second, &value) || value < low || value > high) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "='", it->second.substr(0, 32), "' is not an integer in [", low, ", ", high, "]"));
  }
  return value;
}

// Every SyncBatchNorm of the model over `pg` and `shm` (null: none, the old group dropped).
void AttachSyncBatchNorms(Job& job, c10::intrusive_ptr<c10d::Backend> pg, std::shared_ptr<ShmAllreduce> shm) {
  for (const auto& module : job.model->modules()) {
    if (auto* norm = dynamic_cast<SyncBatchNormImpl*>(module.get())) norm->Attach(pg, shm);
  }
}

// Seconds since this process started (/proc/self/stat against /proc/uptime; 10 ms ticks).
double ProcessAgeSeconds() {
  std::ifstream stat("/proc/self/stat"), uptime("/proc/uptime");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(text.substr(paren + 2));  // From field 3, the state.
  std::string field;
  for (int i = 3; i < 22 && fields >> field;) ++i;  // Field 22: the start time, in clock ticks.
  double started_ticks = 0, now_s = 0;
  if (!(fields >> started_ticks) || !(uptime >> now_s)) return 0;
  return now_s - started_ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// For a survivor: when its collective failed, when elrun's regroup came, and when the new group
// was built.
struct RegroupTimes {
  std::chrono::steady_clock::time_point failed, told, grouped;
};

// Milliseconds from `from` to `to`.
double Ms(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// For rank 0's line on a regroup: how long it took, for a survivor since its collective failed
// (`survivor`), for a standby spare since it was called in, for a replacement since it started.
std::string RegroupTook(const Job& job, const std::optional<RegroupTimes>& survivor) {
  const auto now = std::chrono::steady_clock::now();
  if (survivor) {
    return absl::StrFormat(
        "%.0f ms after its collective failed (elrun's regroup after %.0f ms, the new group after %.0f ms)",
        Ms(survivor->failed, now), Ms(survivor->failed, survivor->told), Ms(survivor->failed, survivor->grouped));
  }
  if (job.told_at) return absl::StrFormat("%.0f ms after this standby worker was called in", Ms(*job.told_at, now));
  return absl::StrFormat("%.0f ms after this replacement started", ProcessAgeSeconds() * 1e3);
}

// Sharded strategies with copies: agreed by every rank of the group (a collective), this rank's
// shards and its neighbour's are copied into memory now, and every --shard-copy-every steps.
absl::Status StartShardCopies(Job& job) {
  job.shard_copies.reset();
  const bool want = job.control && job.sharded() && job.o.shard_copy_every > 0;
  try {
    std::vector<torch::Tensor> flag{torch::tensor({want ? 1 : 0}, torch::kInt).to(CommDevice(*job.dist.pg))};
    c10d::AllreduceOptions min;
    min.reduceOp = c10d::ReduceOp::MIN;
    job.dist.pg->allreduce(flag, min)->wait();
    if (flag[0].cpu().item<int>() == 0) return absl::OkStatus();
  } catch (const std::exception& error) {
    return absl::UnavailableError(absl::StrCat("shard copies: ", ErrorText(error)));
  }
  job.shard_copies = std::make_unique<ShardCopies>();
  auto own = job.dp->LiveShard(*job.optimizer, job.progress);
  if (!own.ok()) return own.status();
  return job.shard_copies->Refresh(*job.dist.pg, *std::move(own));
}

// --keep-survivors, sharded strategies: the new group rebuilds the newest whole set of shard files
// its ranks hold in memory (shard_copies.h) - `live` is this rank's shard as it stopped (none for
// a replacement) - and every rank loads it, resharded for the new world; then the copies start
// again in this world. Unavailable when no whole set is held (the worker fails and elrun restarts
// the group, which resumes from the checkpoint).
absl::Status TakeShardedState(Job& job, const std::optional<ShardBytes>& live,
                              const std::optional<RegroupTimes>& survivor) {
  std::vector<const ShardBytes*> copies;
  if (job.shard_copies) copies = job.shard_copies->held();
  auto sync = GatherShardSet(*job.dist.pg, live, copies);
  if (!sync.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "regroup: ", sync.status().message(),
        sync.status().code() == absl::StatusCode::kNotFound ? "; elrun restarts the group from its checkpoint" : ""));
  }
  job.shard_copies.reset();  // The old world's: the new world copies its own below.
  auto loaded = job.dp->LoadShards(sync->files, "the shards held in memory", *job.optimizer);
  if (!loaded.ok()) return absl::UnavailableError(absl::StrCat("regroup: ", loaded.status().message()));
  job.progress = *loaded;
  job.progress.world_size = job.world();
  if (job.rank() == 0) {
    const ShardSetChoice& set = sync->choice;
    std::cout << absl::StrFormat(
                     "regrouped in place (generation %d): %d ranks, %d restarted; the %d-shard set of step %d from "
                     "memory (%d live, %d from copies; %d bytes, not from disk)%s, %s",
                     job.generation, job.world(), sync->stateless_ranks, set.count, set.step,
                     set.count - set.from_copies, set.from_copies, sync->bytes,
                     sync->reached > set.step ? absl::StrFormat("; back from step %d", sync->reached) : "",
                     RegroupTook(job, survivor))
              << std::endl;
  }
  return StartShardCopies(job);
}

// --keep-survivors: this rank takes the job's live state. ddp: that of the rank furthest along
// (live_state.h); `mine` is this rank's progress, nullopt for a replacement without state. The
// sharded strategies: TakeShardedState with `live`. The new group's rank 0 says whose state and
// how long the regroup took.
absl::Status TakeLiveState(Job& job, const std::optional<TrainProgress>& mine,
                           const std::optional<ShardBytes>& live = std::nullopt,
                           std::optional<RegroupTimes> survivor = std::nullopt) {
  if (job.sharded()) return TakeShardedState(job, live, survivor);
  auto sync = SyncLiveState(*job.dist.pg, *job.dp, *job.optimizer, mine);
  if (!sync.ok()) return absl::UnavailableError(sync.status().message());
  job.progress = sync->progress;
  if (job.rank() == 0) {
    std::cout << absl::StrFormat(
                     "regrouped in place (generation %d): %d ranks, %d restarted; the live state of rank %d at step "
                     "%d (%d bytes, not from disk), %s",
                     job.generation, job.world(), sync->stateless_ranks, sync->source_rank, job.progress.step,
                     sync->bytes, RegroupTook(job, survivor))
              << std::endl;
  }
  return absl::OkStatus();
}

absl::Status BuildModel(Job& job, bool joining);

// --keep-survivors: a collective failed (`error`), because a peer died. elrun restarts only that
// worker and tells this one the new group: every handle on the old group is dropped first (so
// peers still blocked in it see its sockets close), then the new group is built and the job's
// live state taken. Unavailable (the worker then fails, and elrun restarts the whole group) when
// no regroup comes within job.regroup_wait or the new group cannot be built; Cancelled on SIGTERM.
// Also entered between steps when elrun's regroup came while this rank's collectives still worked
// (a new round of a multi-node job): dropping the old group then fails its peers' collectives.
absl::Status RegroupInPlace(Job& job, const std::string& error) {
  RegroupTimes times;
  times.failed = std::chrono::steady_clock::now();
  const auto start = times.failed;
  // The sharded strategies: this rank's shard as it stopped, then the wrapper, the optimizer and
  // the model go (they are built again for the new world). ddp keeps them over the new group.
  std::optional<ShardBytes> live;
  if (job.sharded()) {
    auto shard = job.dp->LiveShard(*job.optimizer, job.progress);
    if (shard.ok()) {
      live = *std::move(shard);
    } else {  // It goes on without: the others' copies may hold its shard.
      std::cerr << "elrun-train: rank " << job.rank() << ": " << shard.status().message() << std::endl;
    }
    job.optimizer.reset();
    job.optimizer_params.clear();
    job.dp.reset();
    job.model.reset();
  } else {
    if (absl::Status s = job.dp->Rebind(nullptr, nullptr); !s.ok()) return s;
    if (job.o.sync_bn) AttachSyncBatchNorms(job, nullptr, nullptr);
  }
  job.shm.reset();
  job.dist.pg.reset();
  job.dist.store.reset();
  std::optional<Regroup> next;
  while (!next && !g_stop_requested && std::chrono::steady_clock::now() - start < job.regroup_wait) {
    next = job.control->Wait(std::chrono::milliseconds(100));
  }
  if (g_stop_requested) return absl::CancelledError("stopped while waiting to regroup");
  if (!next) {
    return absl::UnavailableError(
        absl::StrCat(error, "; no regroup from elrun within ", job.regroup_wait.count() / 1000.0, " s"));
  }
  times.told = std::chrono::steady_clock::now();
  auto env = ReadDistEnv(next->env);
  if (!env.ok()) return absl::UnavailableError(absl::StrCat("regroup: ", env.status().message()));
  job.env = *env;
  job.generation = next->generation;
  auto dist = InitProcessGroup(job.env, job.placement.backend, job.placement.cuda_device,
                               std::min<std::chrono::milliseconds>(CollectiveTimeout(job.o), kRegroupTimeout),
                               /*await_store=*/true);
  if (!dist.ok()) return absl::UnavailableError(absl::StrCat("regroup: ", dist.status().message()));
  job.dist = std::move(*dist);
  if (job.sharded()) {
    try {
      if (absl::Status s = BuildModel(job, /*joining=*/true); !s.ok()) return s;
    } catch (const std::exception& error) {
      return absl::UnavailableError(absl::StrCat("regroup: ", ErrorText(error)));
    }
  } else {
    if (absl::Status s = SetUpSharedMemory(job); !s.ok()) return s;
    if (job.o.sync_bn) AttachSyncBatchNorms(job, job.dist.pg, job.shm);
    if (absl::Status s = job.dp->Rebind(job.dist.pg, job.shm); !s.ok()) return s;
  }
  times.grouped = std::chrono::steady_clock::now();
  SamplerOptions sampler_options = job.sampler->options();
  sampler_options.world_size = job.world();
  sampler_options.rank = job.rank();
  auto sampler = DistributedSampler::Create(sampler_options);
  if (!sampler.ok()) return sampler.status();
  *job.sampler = std::move(*sampler);
  if (absl::Status s = TakeLiveState(job, job.progress, live, times); !s.ok()) return s;
  if (job.heartbeat) job.heartbeat->Ready(job.generation);
  return absl::OkStatus();
}

// --dataset text: the corpus of --data-dir (default: DefaultTextDir) cut into windows, checked to
// hold a step's sequences and a validation sequence; rank 0 names it.
absl::Status LoadText(Job& job) {
  std::string dir = job.o.data_dir;
  if (dir.empty()) {
    auto found = DefaultTextDir();
    if (!found.ok()) return absl::UnavailableError(found.status().message());
    dir = *found;
  }
  auto corpus = LoadTextCorpus(dir);
  if (!corpus.ok()) return absl::UnavailableError(corpus.status().message());
  job.text_train = TextWindows(corpus->train, job.o.gpt_context);
  job.text_validation = TextWindows(corpus->validation, job.o.gpt_context);
  if (job.text_train.size(0) < job.o.batch_size * job.world() || job.text_validation.size(0) == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--data-dir %s: %d training and %d validation sequences of %d bytes; a step needs %d (--batch-size x "
        "world size)",
        dir, job.text_train.size(0), job.text_validation.size(0), job.o.gpt_context + 1,
        job.o.batch_size * job.world()));
  }
  if (job.rank() == 0) {
    std::cout << absl::StrFormat("text corpus %s: %d training files (%d bytes), %d validation files (%d bytes)", dir,
                                 corpus->train_files.size(), corpus->train.numel(), corpus->validation_files.size(),
                                 corpus->validation.numel())
              << std::endl;
  }
  return absl::OkStatus();
}

// The data sets of --dataset (for text, the corpus cut into windows).
absl::Status LoadData(Job& job) {
  const TrainOptions& o = job.o;
  if (o.dataset == DatasetChoice::kText) return LoadText(job);
  if (o.dataset == DatasetChoice::kFashionMnist) {
    const std::string dir = o.data_dir.empty() ? kFashionMnistDir : o.data_dir;
    auto train = LoadFashionMnist(dir, Split::kTrain);
    if (!train.ok()) return absl::UnavailableError(train.status().message());
    auto test = LoadFashionMnist(dir, Split::kTest);
    if (!test.ok()) return absl::UnavailableError(test.status().message());
    job.train = std::move(*train);
    job.test = std::move(*test);
  } else {
    job.train = SyntheticDataset(4096, o.seed);
    job.test = SyntheticDataset(1024, o.seed + 1);
  }
  return absl::OkStatus();
}

// --keep-survivors' standby spare (ELRUN_STANDBY=1, launcher/job/standby_worker.h): does the
// start-up that needs no peer (LibTorch is loaded by now; the data), then waits on its control
// channel until elrun hands it a failed worker's contract, which it writes into `env`: from then
// on it is that worker, joining the survivors. Cancelled on SIGTERM.
absl::Status StandBy(Job& job, std::map<std::string, std::string>& env) {
  auto dist_env = ReadDistEnv(env);  // The launch it was made from: its world, for the data's checks.
  if (!dist_env.ok()) return dist_env.status();
  job.env = *dist_env;
  auto generation = EnvInt(env, "ELRUN_GENERATION", job.env.restart_count, 0, int64_t{1} << 40);
  if (!generation.ok()) return generation.status();
  job.control = ControlChannel::FromEnvironment(env, *generation);
  if (!job.control) return absl::FailedPreconditionError("ELRUN_STANDBY=1 without a usable ELRUN_CONTROL_FILE");
  if (absl::Status s = LoadData(job); !s.ok()) return s;
  std::optional<Regroup> next;
  while (!next && !g_stop_requested) next = job.control->Wait(std::chrono::milliseconds(100));
  if (!next) return absl::CancelledError("stopped while standing by");
  job.told_at = std::chrono::steady_clock::now();
  for (const auto& [name, value] : next->env) env[name] = value;
  env["ELRUN_GENERATION"] = std::to_string(next->generation);
  env["ELRUN_JOIN_LIVE"] = "1";
  return absl::OkStatus();
}

// The model, its data-parallel wrapper and the optimizer over job.dist, from --seed: collective
// (the sharded strategies check the ranks built alike; ddp and sharding without a sink broadcast
// rank 0's values unless `joining`). Also at a sharded strategy's regroup in place, for the new
// world. Throws c10::Error when a collective fails.
absl::Status BuildModel(Job& job, bool joining) {
  const TrainOptions& o = job.o;
  // Weights are drawn on the CPU from the seed, then moved: the same start on every device.
  torch::manual_seed(o.seed);
  MlpOptions mlp;
  mlp.hidden = o.mlp_hidden;
  // auto is ATen's Linear on both devices since torch 2.11: its CPU build's Linear (MKL) beat the
  // oneDNN 1x1-convolution route in train_bench (docs/benchmarks.md), which Debian's reference BLAS needed.
  job.linear = o.linear == LinearChoice::kOneDnn ? LinearKernel::kOneDnn : LinearKernel::kAten;
  // The sharded strategies shard each layer as the model is built: no rank ever holds the whole
  // model (SyncBatchNorm swaps modules after construction, and a CUDA graph captures the wrapper's
  // construction: those build it whole first, as ddp does).
  FsdpOptions sharding;
  sharding.strategy = o.strategy;
  sharding.activation_checkpointing = o.activation_checkpointing;
  sharding.offload_optimizer = o.offload_optimizer;
  auto dtype = [](PrecisionChoice p) {
    return p == PrecisionChoice::kBf16   ? torch::kBFloat16
           : p == PrecisionChoice::kFp16 ? torch::kHalf
                                         : torch::kFloat32;
  };
  if (o.param_dtype != PrecisionChoice::kFp32) sharding.param_dtype = dtype(o.param_dtype);
  // --precision: fsdp gathers and computes in it (FSDP2's MixedPrecisionPolicy); the other
  // strategies keep whole fp32 parameters and run forward under autocast (torch.autocast).
  if (o.precision != PrecisionChoice::kFp32) {
    if (o.strategy == Strategy::kFsdp) {
      sharding.param_dtype = dtype(o.precision);
    } else {
      job.autocast = dtype(o.precision);
    }
  }
  if (o.reduce_dtype) sharding.reduce_dtype = dtype(*o.reduce_dtype);
  std::unique_ptr<ChildSink> sink;
  if (!o.sync_bn && !o.cuda_graph) sink = DataParallel::ShardingSink(job.dist.pg, job.device, sharding);
  absl::StatusOr<std::shared_ptr<Classifier>> model;
  if (o.model == ModelChoice::kGpt) {
    GptOptions gpt;
    gpt.vocabulary = kByteVocabulary;
    gpt.context = o.gpt_context;
    gpt.layers = o.gpt_layers;
    gpt.width = o.gpt_width;
    gpt.heads = o.gpt_heads;
    model = MakeGpt(gpt, sink.get());
  } else if (o.model == ModelChoice::kResMlp) {
    ResMlpOptions resmlp;
    resmlp.width = o.resmlp_width;
    resmlp.blocks = o.resmlp_blocks;
    resmlp.linear = job.linear;
    model = MakeResMlp(resmlp, sink.get());
  } else {
    model = MakeModel(o.model == ModelChoice::kMlp ? "mlp" : "fashionnet", mlp, job.linear, sink.get());
  }
  if (!model.ok()) return model.status();
  job.model = std::move(*model);
  job.model->to(job.device);
  // Channels-last on CPU: there oneDNN's convolutions and ATen's max-pooling and batch norm are
  // vectorised over channels in NHWC and much faster than in NCHW (docs/benchmarks.md,
  // "Training"). The weights decide the convolutions' output layout; they are copied, not
  // contiguous()'d, because a one-channel tensor counts as both layouts and would keep its NCHW
  // strides (then suggest_memory_format() says NCHW). On CUDA cuDNN takes either; contiguous
  // until measured otherwise.
  job.channels_last = o.memory_format == MemoryFormatChoice::kChannelsLast ||
                      (o.memory_format == MemoryFormatChoice::kAuto && !job.placement.cuda);
  // Sharded weights are views of flat buffers (contiguous): nothing to convert.
  if (job.channels_last && sink == nullptr) {
    for (auto& p : job.model->parameters()) {
      if (p.dim() == 4) {
        p.set_data(p.data().to(p.options(), /*non_blocking=*/false, /*copy=*/true, torch::MemoryFormat::ChannelsLast));
      }
    }
  }
  if (absl::Status s = SetUpSharedMemory(job); !s.ok()) return s;
  if (o.sync_bn) ConvertSyncBatchNorm(*job.model, job.dist.pg, job.shm);
  DdpOptions ddp_options;
  ddp_options.bucket_cap_mb = o.bucket_cap_mb;
  ddp_options.first_bucket_mb = o.first_bucket_mb;
  if (o.strategy == Strategy::kDdp) ddp_options.shm = job.shm;
  ddp_options.broadcast_from_rank0 = !joining;
  if (o.cuda_graph) {
    if (!job.placement.cuda) return absl::InvalidArgumentError("--cuda-graph needs CUDA; this rank runs on the CPU");
    job.graph = std::make_unique<CudaGraphStep>(job.device, o.batch_size);
    job.graph->OnStream([&] { job.dp = DataParallel::Create(job.model, job.dist.pg, sharding, ddp_options); });
  } else {
    job.dp = DataParallel::Create(job.model, job.dist.pg, sharding, ddp_options, std::move(sink));
  }
  job.optimizer_params = job.dp->OptimizerParameters();
  job.optimizer = MakeOptimizer(o, job.optimizer_params);
  if (o.precision == PrecisionChoice::kFp16) {
    GradScalerOptions scaling;
    scaling.init_scale = o.loss_scale;
    job.scaler = std::make_unique<GradScaler>(scaling, job.dist.pg);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Job>> Setup(const TrainOptions& o) {
  auto job = std::make_unique<Job>();
  job->o = o;
  std::map<std::string, std::string> env = Environment();
  const bool standby = env.count("ELRUN_STANDBY") > 0 && env.at("ELRUN_STANDBY") == "1";
  if (standby) {
    if (absl::Status s = StandBy(*job, env); !s.ok()) return s;
  }
  auto dist_env = ReadDistEnv(env);
  if (!dist_env.ok()) return dist_env.status();
  job->env = *dist_env;
  job->heartbeat = HeartbeatClient::FromEnvironment(env);
  auto generation = EnvInt(env, "ELRUN_GENERATION", job->env.restart_count, 0, int64_t{1} << 40);
  if (!generation.ok()) return generation.status();
  job->generation = *generation;
  auto wait_ms = EnvInt(env, "ELRUN_REGROUP_WAIT_MS", job->regroup_wait.count(), 100, 3600 * 1000);
  if (!wait_ms.ok()) return wait_ms.status();
  job->regroup_wait = std::chrono::milliseconds(*wait_ms);
  // elrun restarted only this worker of the job (--keep-survivors): the others are alive and
  // regrouping; its state comes from them, not from the checkpoint.
  const bool joining = env.count("ELRUN_JOIN_LIVE") > 0 && env.at("ELRUN_JOIN_LIVE") == "1";
  auto visible = env.find("CUDA_VISIBLE_DEVICES");
  auto placement =
      ResolvePlacement(o.device, o.backend, job->env.local_rank, static_cast<int>(torch::cuda::device_count()),
                       visible == env.end() ? "" : visible->second);
  if (!placement.ok()) return placement.status();
  job->placement = *placement;
  if (job->placement.cuda) {
    job->device = torch::Device(torch::kCUDA, job->placement.cuda_device);
    at::globalContext().setAllowTF32CuDNN(o.allow_tf32);
  }
  if (!o.step_times_file.empty()) {
    auto opened = StepTimes::Open(absl::StrCat(o.step_times_file, ".", job->rank()));
    if (!opened.ok()) return opened.status();
    job->step_times = std::move(*opened);
  }
  if (o.profile_end > 0) {
    const std::string path = absl::StrCat(o.profile_trace, ".", job->rank());
    if (!std::ofstream(path, std::ios::trunc))
      return absl::InvalidArgumentError("--profile-trace: cannot write " + path);
    job->profiler = std::make_unique<StepProfiler>(o.profile_first, o.profile_end, path, job->placement.cuda);
  }
  if (!o.checkpoint_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(o.checkpoint_dir, error);
    if (error)
      return absl::UnavailableError(absl::StrCat("--checkpoint-dir=", o.checkpoint_dir, ": ", error.message()));
  }

  // The data before the rendezvous: a rank without it fails alone and at once.
  if (!standby) {
    if (absl::Status s = LoadData(*job); !s.ok()) return s;
  }
  SamplerOptions sampler_options;
  sampler_options.dataset_size = job->train_size();
  sampler_options.world_size = job->world();
  sampler_options.rank = job->rank();
  sampler_options.seed = o.seed;
  sampler_options.drop_last = true;
  sampler_options.batch_size = o.batch_size;
  auto sampler = DistributedSampler::Create(sampler_options);
  if (!sampler.ok()) return sampler.status();
  job->sampler = std::make_unique<DistributedSampler>(std::move(*sampler));

  auto dist = InitProcessGroup(job->env, job->placement.backend, job->placement.cuda_device, CollectiveTimeout(o),
                               /*await_store=*/joining);
  if (!dist.ok()) return absl::UnavailableError(dist.status().message());
  job->dist = std::move(*dist);

  job->baseline_rss = RssBytes();
  if (absl::Status s = BuildModel(*job, joining); !s.ok()) return s;
  job->metrics = std::make_unique<Metrics>(job->rank() == 0 ? o.metrics_file : "");

  // Not on CUDA: a survivor's NCCL collective with a dead peer does not fail until the NCCL
  // watchdog's timeout (it would need ncclCommAbort), so elrun restarts the group at once instead.
  if (job->heartbeat && job->dp->CanRegroup() && !job->graph && !job->scaler && !job->placement.cuda) {
    if (!job->control) job->control = ControlChannel::FromEnvironment(env, job->generation);
  } else {
    job->control.reset();  // A standby that cannot regroup: it fails as any other worker would.
  }

  job->progress.world_size = job->world();
  if (joining) {
    if (absl::Status s = TakeLiveState(*job, std::nullopt); !s.ok()) return s;
  } else if (!o.checkpoint_dir.empty()) {
    auto loaded = job->dp->Load(o.checkpoint_dir, *job->optimizer);
    if (loaded.ok()) {
      job->progress = *loaded;
      if (job->scaler && job->progress.loss_scale > 0) {
        job->scaler->Restore(job->progress.loss_scale, job->progress.loss_scale_growth_tracker);
      }
      if (job->rank() == 0) {
        std::cout << absl::StrFormat("resumed from %s: epoch %d, step %d, sample %d (written by %d ranks, now %d)",
                                     o.checkpoint_dir, job->progress.epoch, job->progress.step,
                                     job->progress.samples_seen, job->progress.world_size, job->world())
                  << std::endl;
      }
      job->progress.world_size = job->world();
    } else if (loaded.status().code() != absl::StatusCode::kNotFound) {
      return absl::UnavailableError(loaded.status().message());
    }
  }
  if (!joining && job->sharded()) {  // A joining rank's copies started with the state it took.
    if (absl::Status s = StartShardCopies(*job); !s.ok()) return s;
  }
  // MakeOptimizer's SGD is a ForeachSgd (CheckCudaGraph refused the others).
  if (job->graph) job->graph->Bind(*job->dp, static_cast<ForeachSgd&>(*job->optimizer));
  if (job->control) job->heartbeat->Ready(job->generation);
  return job;
}

// The model's output for `input`, under autocast for --precision bf16/fp16 (but fsdp, whose
// units compute in it themselves), in fp32.
torch::Tensor Forward(Job& job, const torch::Tensor& input) {
  AutocastGuard autocast(job.device.type(), job.autocast);
  torch::Tensor output = job.dp->Forward(input);
  return job.autocast && output.is_floating_point() ? output.to(torch::kFloat) : output;
}

// One optimizer step over `batch` (split into --accum-steps micro-batches; only the last one
// communicates). Returns the batch's loss. --precision fp16: the loss is scaled before backward,
// the gradients unscaled before clipping, and the step skipped on every rank when any rank's
// gradients hold an inf or a NaN (GradScaler).
double TrainStep(Job& job, const std::vector<int64_t>& batch, double lr) {
  const TrainOptions& o = job.o;
  if (job.graph) {
    return job.graph->Step(
        [&] {
          return std::make_pair(Rows(job.train.images, batch, job.device), Rows(job.train.labels, batch, job.device));
        },
        lr);
  }
  auto [images, labels] = Examples(job, /*train=*/true, batch);
  const int64_t micro = images.size(0) / o.accum_steps;
  // The sharded strategies' gradient shards are zeroed in place, not freed and allocated again
  // at every step: the same memory all along, nothing for the heap to fragment.
  job.optimizer->zero_grad(/*set_to_none=*/o.strategy == Strategy::kDdp);
  torch::Tensor loss_sum;  // Of the micro-batches' losses, each already divided by their count.
  for (int m = 0; m < o.accum_steps; ++m) {
    const int64_t size = m + 1 < o.accum_steps ? micro : images.size(0) - m * micro;
    torch::Tensor loss = Loss(Forward(job, images.narrow(0, m * micro, size)), labels.narrow(0, m * micro, size));
    if (o.accum_steps > 1) loss = loss / o.accum_steps;
    job.dp->Backward(job.scaler ? job.scaler->Scale(loss) : loss, /*synchronize=*/m + 1 == o.accum_steps);
    loss_sum = m == 0 ? loss.detach() : loss_sum + loss.detach();
  }
  if (job.scaler) job.scaler->Unscale(job.optimizer_params);
  if (o.clip_grad_norm > 0) job.dp->ClipGradNorm(o.clip_grad_norm);
  SetLr(*job.optimizer, lr);
  if (job.scaler) {
    job.scaler->Step(*job.optimizer, job.optimizer_params);
  } else {
    job.optimizer->step();
  }
  return loss_sum.item<double>();  // On CUDA: waits for the step, so step times are real.
}

// True on every rank when any rank asked to stop: ranks must leave the loop at the same step,
// because checkpointing (and, for the sharded strategies, saving itself) is collective. Asked
// after every step, so it goes through shared memory when the job has it.
bool AnyRankStopping(Job& job, bool local) {
  torch::Tensor flag = torch::tensor({local ? 1.0f : 0.0f}).to(CommDevice(*job.dist.pg));
  AllreduceSum(*job.dist.pg, job.shm.get(), flag)->wait();
  return flag.item<float>() > 0;
}

// What Evaluate measured over every rank's share of the held-out split.
struct Evaluation {
  double accuracy = 0;  // The image models: test accuracy.
  double loss = 0;      // The GPT: mean next-byte cross-entropy on validation (nats).
  int64_t samples = 0;
};

// Test accuracy, or for text the validation loss, over every rank's strided share of the held-out
// split (the first --eval-samples windows for text), reduced across ranks. Every rank runs the
// same number of forward passes (the sharded strategies' forward is collective): a rank whose
// share ran out forwards one sample and counts nothing.
Evaluation Evaluate(Job& job) {
  torch::NoGradGuard no_grad;
  job.model->eval();
  const int64_t available = job.text() ? job.text_validation.size(0) : job.test.size();
  const int64_t n = job.text() && job.o.eval_samples > 0 ? std::min(available, job.o.eval_samples) : available;
  const int64_t chunk = job.text() ? 64 : 1000;
  const int64_t most = (n + job.world() - 1) / job.world();  // Rank 0's share, the largest.
  std::vector<int64_t> shard;
  for (int64_t i = job.rank(); i < n; i += job.world()) shard.push_back(i);
  double correct = 0, loss_sum = 0, total = 0;
  for (int64_t begin = 0; begin < most; begin += chunk) {
    const auto from = std::min<size_t>(shard.size(), begin), to = std::min<size_t>(shard.size(), begin + chunk);
    const bool empty = from == to;
    std::vector<int64_t> indices = empty ? std::vector<int64_t>{0}
                                         : std::vector<int64_t>(shard.begin() + static_cast<std::ptrdiff_t>(from),
                                                                shard.begin() + static_cast<std::ptrdiff_t>(to));
    auto [inputs, targets] = Examples(job, /*train=*/false, indices);
    torch::Tensor logits = Forward(job, inputs);
    if (empty) continue;
    if (job.text()) {
      loss_sum += Loss(logits, targets, torch::kSum).item<double>();
      total += static_cast<double>(targets.numel());
    } else {
      correct += logits.argmax(1).eq(targets).sum().item<double>();
      total += static_cast<double>(indices.size());
    }
  }
  std::vector<torch::Tensor> sums{
      torch::tensor({correct, loss_sum, total}, torch::kDouble).to(CommDevice(*job.dist.pg))};
  job.dist.pg->allreduce(sums)->wait();
  job.model->train();
  torch::Tensor totals = sums[0].cpu();
  Evaluation result;
  const double count = std::max(1.0, totals[2].item<double>());
  result.accuracy = totals[0].item<double>() / count;
  result.loss = totals[1].item<double>() / count;
  result.samples = n;
  return result;
}

// --model gpt: `--sample-bytes` bytes the trained model writes after a prompt (the validation
// text's first line, at most half a context), drawn from its softmax with a generator seeded by
// --seed. Every rank runs the same forward passes (collective for the sharded strategies) and
// draws the same bytes; rank 0 prints them, bytes outside printable ASCII as '?'.
void PrintSample(Job& job) {
  const TrainOptions& o = job.o;
  if (!job.text() || o.sample_bytes == 0) return;
  torch::NoGradGuard no_grad;
  job.model->eval();
  // The validation text's first window holds its first context + 1 bytes.
  const torch::Tensor first = job.text_validation[0].contiguous();
  const auto* bytes = first.data_ptr<uint8_t>();
  const int64_t limit = std::min<int64_t>(first.numel(), std::max<int64_t>(1, o.gpt_context / 2));
  std::vector<int64_t> text;
  for (int64_t i = 0; i < limit && (i == 0 || bytes[i - 1] != '\n'); ++i) text.push_back(bytes[i]);
  const size_t prompt = text.size();
  at::Generator generator = at::detail::createCPUGenerator(o.seed);
  for (int64_t i = 0; i < o.sample_bytes; ++i) {
    const int64_t window = std::min<int64_t>(static_cast<int64_t>(text.size()), o.gpt_context);
    torch::Tensor context = torch::tensor(std::vector<int64_t>(text.end() - window, text.end()), torch::kLong);
    torch::Tensor logits = Forward(job, context.unsqueeze(0).to(job.device)).select(1, window - 1)[0];
    torch::Tensor probabilities = torch::softmax(logits.to(torch::kCPU, torch::kFloat), 0);
    text.push_back(torch::multinomial(probabilities, 1, /*replacement=*/false, generator).item<int64_t>());
  }
  job.model->train();
  if (job.rank() != 0) return;
  std::string shown;
  for (size_t i = 0; i < text.size(); ++i) {
    const int64_t c = text[i];
    shown += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? static_cast<char>(c) : '?';
    if (i + 1 == prompt) shown += "»";  // Where the prompt ends.
  }
  std::cout << absl::StrFormat("sample (%d prompt bytes, then %d sampled):\n%s", prompt, o.sample_bytes, shown)
            << std::endl;
}

// What the loop measured, for Report.
struct LoopStats {
  double elapsed_s = 0;
  int64_t samples = 0;  // All ranks together.
  double last_loss = 0;
  std::vector<double> step_ms;
  std::string loop_times;  // LoopTimesJson.
  bool signalled = false;  // SIGTERM reached some rank: all save and exit 143 together.
  absl::Status last_save;  // The last checkpoint's save (its error fails the job at the end).
};

MemoryReport Memory(Job& job) {
  MemoryReport memory = job.dp->Memory(*job.optimizer);
  memory.baseline_rss = job.baseline_rss;
  if (job.placement.cuda) {
    memory.on_cuda = true;
    memory.cuda = CudaMemoryStats(job.placement.cuda_device);
  }
  return memory;
}

void ReportMemory(Job& job, const LoopStats& loop) {
  const TrainOptions& o = job.o;
  const MemoryReport memory = Memory(job);
  std::string expected;
  if (o.optimizer != OptimizerChoice::kSgd) {
    int64_t params = 0;
    for (const auto& p : job.model->parameters()) params += p.numel();
    const std::string strategy = o.strategy == Strategy::kNoShard ? "ddp" : StrategyName(o.strategy);
    expected = absl::StrFormat("  (ZeRO formula for fp32 Adam(W): %.2f MiB)",
                               ExpectedAdamStateBytes(strategy, params, job.world()) / (1024.0 * 1024.0));
  }
  const int64_t steps = loop.samples / std::max<int64_t>(1, o.batch_size * job.world());
  std::cout << absl::StrFormat("memory rank %d %s: %s%s", job.rank(), StrategyName(o.strategy),
                               FormatMemoryReport(memory), expected)
            << std::endl;
  std::cout << absl::StrFormat(R"(memory-json {"rank":%d,"strategy":"%s",%s,"step_time_s":%.6f})", job.rank(),
                               StrategyName(o.strategy), MemoryJson(memory),
                               loop.elapsed_s / std::max<int64_t>(1, steps))
            << std::endl;
}

void Report(Job& job, LoopStats& loop, const Evaluation& evaluation) {
  const TrainOptions& o = job.o;
  if (job.rank() != 0) return;
  const double rate = loop.samples / std::max(loop.elapsed_s, 1e-9);
  const int64_t steps = loop.samples / std::max<int64_t>(1, o.batch_size * job.world());
  std::string quality;  // What the summary line and the metrics say about the held-out split.
  if (job.text()) {
    const double tokens_per_s = rate * static_cast<double>(o.gpt_context);
    std::cout << absl::StrFormat(
                     "done: %d steps, %d epochs, %.1f s, %.0f samples/s (%.0f tokens/s), validation loss %.4f, "
                     "perplexity %.3f (%d sequences)",
                     job.progress.step, o.epochs, loop.elapsed_s, rate, tokens_per_s, evaluation.loss,
                     std::exp(evaluation.loss), evaluation.samples)
              << std::endl;
    quality = absl::StrFormat(R"("validation_loss":%.6f,"perplexity":%.6f,"tokens_per_s":%.1f)", evaluation.loss,
                              std::exp(evaluation.loss), tokens_per_s);
  } else {
    std::cout << absl::StrFormat("done: %d steps, %d epochs, %.1f s, %.0f samples/s, test accuracy %.4f",
                                 job.progress.step, o.epochs, loop.elapsed_s, rate, evaluation.accuracy)
              << std::endl;
    quality = absl::StrFormat(R"("test_accuracy":%.6f)", evaluation.accuracy);
  }
  quality += absl::StrFormat(R"(,"precision":"%s")",
                             PrecisionName(o.precision != PrecisionChoice::kFp32 ? o.precision : o.param_dtype));
  if (job.scaler) {
    std::cout << absl::StrFormat("fp16: %d of %d steps skipped for inf/NaN gradients, loss scale %g",
                                 job.scaler->skipped_steps(), steps, job.scaler->scale())
              << std::endl;
    quality +=
        absl::StrFormat(R"(,"loss_scale":%.17g,"skipped_steps":%d)", job.scaler->scale(), job.scaler->skipped_steps());
  }
  job.metrics->Write(absl::StrFormat(
      R"({"event":"end",%s,"samples_per_s":%.1f,"steps":%d,"epochs":%d,"seconds":%.2f,)"
      R"("world_size":%d,"strategy":"%s","optimizer":"%s","linear":"%s","allreduce":"%s","device":"%s",)"
      R"("backend":"%s","memory_format":"%s","step_time_s":%.6f,"step_ms_p10":%.3f,"step_ms_p50":%.3f,)"
      R"("step_ms_p90":%.3f,%s%s})",
      quality, rate, job.progress.step, o.epochs, loop.elapsed_s, job.world(), StrategyName(o.strategy),
      OptimizerName(o.optimizer), LinearKernelName(job.linear), job.allreduce, job.device.str(),
      BackendName(job.dist.backend), job.channels_last ? "channels-last" : "contiguous",
      loop.elapsed_s / std::max<int64_t>(1, steps), Quantile(loop.step_ms, 0.1), Quantile(loop.step_ms, 0.5),
      Quantile(loop.step_ms, 0.9), loop.loop_times, MemoryJson(Memory(job))));
}

// --keep-survivors: the model's buffers (BatchNorm's running statistics) as a step started, and
// that step, so that a survivor whose step failed after its forward goes back to the state of the
// steps it completed before taking part in a regroup. Copied into the same tensors every step.
class BufferSnapshot {
 public:
  explicit BufferSnapshot(const TrainProgress& progress) : progress_(progress) {}
  void Take(torch::nn::Module& model) {
    torch::NoGradGuard no_grad;
    const std::vector<torch::Tensor> buffers = model.buffers();
    if (copies_.size() != buffers.size()) {
      copies_.clear();
      for (const auto& b : buffers) copies_.push_back(torch::empty_like(b));
    }
    for (size_t i = 0; i < buffers.size(); ++i) copies_[i].copy_(buffers[i]);
    step_ = progress_.step;
  }
  void Restore(torch::nn::Module& model) {
    torch::NoGradGuard no_grad;
    const std::vector<torch::Tensor> buffers = model.buffers();
    for (size_t i = 0; i < buffers.size() && i < copies_.size(); ++i) buffers[i].copy_(copies_[i]);
  }
  // The step the snapshot was taken at the start of; -1 before the first.
  int64_t step() const { return step_; }

 private:
  const TrainProgress& progress_;
  std::vector<torch::Tensor> copies_;
  int64_t step_ = -1;
};

// The epochs from the resumed position on; stops early at --max-steps or on SIGTERM.
LoopStats RunLoop(Job& job) {
  const TrainOptions& o = job.o;
  TrainProgress& progress = job.progress;
  const std::string& checkpoint = o.checkpoint_dir;
  LoopStats loop;
  // A save that fails (a full disk) leaves the last checkpoint saved current and intact (every
  // file is written aside and renamed into place; a sharded set is published only when every
  // rank wrote its shard). Training goes on after a periodic one; the last one fails the job.
  auto save = [&](bool final) {
    if (checkpoint.empty()) return;
    if (job.scaler) {
      progress.loss_scale = job.scaler->scale();
      progress.loss_scale_growth_tracker = job.scaler->growth_tracker();
    }
    loop.last_save = final ? job.dp->Export(checkpoint, *job.optimizer, progress)
                           : job.dp->Save(checkpoint, *job.optimizer, progress);
    if (!loop.last_save.ok()) {
      std::cerr << "elrun-train: the checkpoint of step " << progress.step
                << " was not saved: " << loop.last_save.message() << "; the last one saved stays current" << std::endl;
    }
  };
  const auto start_time = std::chrono::steady_clock::now();
  const absl::StatusOr<ThreadTimes> start_times = CurrentThreadTimes();
  const double dataset = static_cast<double>(job.train_size());
  bool stop = false;
  // --keep-survivors: a failed collective regroups in place (RegroupInPlace) and the epochs go
  // on from the job's live state; any other run fails as before.
  BufferSnapshot step_start_buffers(progress);
  for (;;) {
    try {
      for (; progress.epoch < o.epochs && !stop; ++progress.epoch, progress.samples_seen = 0) {
        const int64_t start = progress.samples_seen;
        auto batches = job.sampler->Batches(progress.epoch, start);
        for (size_t b = 0; b < batches.size(); ++b) {
          if (o.max_steps > 0 && progress.step >= o.max_steps) {  // Also when resumed at or past it.
            stop = true;
            break;
          }
          const auto step_start = std::chrono::steady_clock::now();
          const double step_cpu_start = job.step_times ? ThreadCpuSeconds() : 0;
          const double position =
              (progress.epoch * dataset + job.sampler->Position(start, static_cast<int64_t>(b))) / (o.epochs * dataset);
          const double lr = ScheduledLr(o, position);
          if (job.control) step_start_buffers.Take(*job.model);
          if (job.control && job.control->pending()) {  // A new round (elsewhere): regroup now.
            throw std::runtime_error("elrun regroups the job");
          }
          if (job.profiler) job.profiler->BeforeStep(progress.step);
          loop.last_loss = TrainStep(job, batches[b], lr);
          if (job.profiler) Warn(job.profiler->AfterStep(progress.step));
          loop.step_ms.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start).count());
          if (job.step_times) {
            job.step_times->Write(progress.step, loop.step_ms.back(), (ThreadCpuSeconds() - step_cpu_start) * 1e3);
          }
          if (job.heartbeat) job.heartbeat->Beat(progress.step, loop.step_ms.back());
          ++progress.step;
          loop.samples += static_cast<int64_t>(batches[b].size()) * job.world();
          progress.samples_seen = job.sampler->Position(start, static_cast<int64_t>(b) + 1);
          if (job.shard_copies) {
            job.shard_copies->Settle();  // This step's collectives completed: so did every rank's last copy.
            if (progress.step % o.shard_copy_every == 0) {
              auto own = job.dp->LiveShard(*job.optimizer, progress);
              absl::Status copied = own.ok() ? job.shard_copies->Refresh(*job.dist.pg, *std::move(own)) : own.status();
              if (!copied.ok()) throw std::runtime_error(std::string(copied.message()));
            }
          }
          if (o.checkpoint_every > 0 && progress.step % o.checkpoint_every == 0) save(false);
          if (job.rank() == 0 && o.log_every > 0 && progress.step % o.log_every == 0) {
            const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
            const double rate = loop.samples / std::max(elapsed, 1e-9);
            const double left = (o.epochs - progress.epoch) * dataset - progress.samples_seen;
            std::cout << absl::StrFormat("epoch %d  step %d  loss %.4f  lr %.4g  %.0f samples/s  ETA %.0f s",
                                         progress.epoch, progress.step, loop.last_loss, lr, rate,
                                         left / std::max(rate, 1e-9))
                      << std::endl;
            job.metrics->Write(
                absl::StrFormat(R"({"event":"step","epoch":%d,"step":%d,"loss":%.6f,"lr":%.6g,"samples_per_s":%.1f})",
                                progress.epoch, progress.step, loop.last_loss, lr, rate));
          }
          loop.signalled = checkpoint.empty() ? g_stop_requested.load() : AnyRankStopping(job, g_stop_requested);
          if ((o.max_steps > 0 && progress.step >= o.max_steps) || loop.signalled) {
            stop = true;
            break;
          }
        }
        if (stop) break;
      }
      break;
    } catch (const std::exception& error) {
      if (!job.control) throw;
      // The step that failed may have run forward (BatchNorm's running statistics moved) but no
      // optimizer step: back to the state of the step this rank completed last.
      if (step_start_buffers.step() == progress.step) step_start_buffers.Restore(*job.model);
      const std::string what = ErrorText(error);
      std::cerr << absl::StrFormat("elrun-train: rank %d: %s; regrouping in place", job.rank(), what) << std::endl;
      absl::Status regrouped = RegroupInPlace(job, what);
      if (regrouped.code() == absl::StatusCode::kCancelled) {
        loop.signalled = true;  // SIGTERM while regrouping: no group left to save with.
        loop.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
        return loop;
      }
      if (!regrouped.ok()) throw std::runtime_error(std::string(regrouped.message()));
    }
  }
  loop.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  if (job.profiler) Warn(job.profiler->Finish());
  loop.loop_times = LoopTimesJson(start_times, CurrentThreadTimes(), loop.elapsed_s);
  if (loop.signalled) {
    save(false);
  } else {
    save(true);
  }
  return loop;
}

int Train(const TrainOptions& o) {
  torch::set_num_threads(o.threads);
  auto job = Setup(o);
  if (job.status().code() == absl::StatusCode::kCancelled) return 0;  // A standby no longer needed.
  if (!job.ok()) return Fail(job.status());
  LoopStats loop = RunLoop(**job);
  if (o.report_memory) ReportMemory(**job, loop);
  if (loop.signalled) return 128 + SIGTERM;
  const Evaluation evaluation = Evaluate(**job);
  PrintSample(**job);
  Report(**job, loop, evaluation);
  if (!loop.last_save.ok()) {
    std::cerr << "elrun-train: the job's final checkpoint was not saved: " << loop.last_save.message() << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace elrun::trainer

int main(int argc, char** argv) {
  auto parsed = elrun::trainer::ParseTrainOptions(argc, argv, std::cout);
  if (!parsed.ok()) return elrun::trainer::Fail(parsed.status());
  if (!parsed->has_value()) return 0;  // --help.
  const elrun::trainer::TrainOptions& o = **parsed;
  std::signal(SIGTERM, [](int) { elrun::trainer::g_stop_requested = true; });
  // Every step frees and reallocates the same tensors. With glibc's adaptive mmap threshold a
  // rank could keep mmap/munmap-ing them: measured, one rank took ~36,000 page faults/s and
  // the job ran at half speed (520 instead of 1144 samples/s). Keep them in the heap.
  // glibc's own tunables in the environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
  // MALLOC_ARENA_MAX) win over these defaults.
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) ::mallopt(M_MMAP_THRESHOLD, 256 << 20);
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // The sharded strategies all-gather whole layers; Gloo receives each into a fresh layer-sized
  // buffer on its own threads, whose arenas cap heaps at 64 MiB, so every receive was new kernel
  // memory (measured ~100,000 page faults per rank per step for a 53.6M-parameter MLP). One
  // arena keeps those buffers in the main heap: fsdp's step went from 10.6 s to 7.0 s there.
  // Every strategy but ddp gets it (no_shard too); ddp is left alone: one arena made
  // FashionNet's DDP ~6% slower (1520 -> 1420 samples/s).
  if (o.strategy != elrun::trainer::Strategy::kDdp && std::getenv("MALLOC_ARENA_MAX") == nullptr) {
    ::mallopt(M_ARENA_MAX, 1);
  }
  if (o.cpu_allocator == elrun::trainer::CpuAllocatorChoice::kCaching) {
    elrun::trainer::CachingCpuAllocator::Install();
  }
  try {
    return elrun::trainer::Train(o);
  } catch (const c10::Error& error) {
    std::cerr << "elrun-train: " << error.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "elrun-train: " << error.what() << std::endl;
    return 1;
  }
}
