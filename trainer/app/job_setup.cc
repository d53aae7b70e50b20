#include "trainer/app/job_setup.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trainer/app/gpt.h"
#include "trainer/app/regroup.h"
#include "trainer/data/text_corpus.h"
#include "trainer/memory/memory.h"
#include "trainer/optim/foreach_sgd.h"
#include "trainer/parallel/sync_batch_norm.h"

extern char** environ;

namespace elrun::trainer::app {

namespace {

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

std::map<std::string, std::string> Environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

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
  while (!next && !job.stop_requested()) next = job.control->Wait(std::chrono::milliseconds(100));
  if (!next) return absl::CancelledError("stopped while standing by");
  job.told_at = std::chrono::steady_clock::now();
  for (const auto& [name, value] : next->env) env[name] = value;
  env["ELRUN_GENERATION"] = std::to_string(next->generation);
  env["ELRUN_JOIN_LIVE"] = "1";
  return absl::OkStatus();
}

}  // namespace

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

absl::StatusOr<std::unique_ptr<Job>> Setup(const TrainOptions& o, const std::atomic<bool>& stop) {
  auto job = std::make_unique<Job>();
  job->o = o;
  job->stop_flag = &stop;
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

}  // namespace elrun::trainer::app
