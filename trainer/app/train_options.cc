#include "trainer/app/train_options.h"

#include <utility>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace elrun::trainer {
namespace {

template <typename E>
using Choices = std::vector<std::pair<std::string, E>>;

// The value `text` of --flag among `choices`; the error lists the choices, the last with "or".
template <typename E>
absl::StatusOr<E> Pick(const std::string& flag, const std::string& text, const Choices<E>& choices, size_t listed = 0) {
  for (const auto& [name, value] : choices) {
    if (name == text) return value;
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < (listed ? listed : choices.size()); ++i) names.push_back(choices[i].first);
  const std::string last = names.back();
  names.pop_back();
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", text, ": expected ", absl::StrJoin(names, ", "),
                                                 names.empty() ? "" : " or ", last));
}

struct RawChoices {
  std::string model = "fashionnet", linear = "auto", dataset, lr_schedule = "cosine", optimizer = "sgd",
              strategy = "ddp", allreduce = "auto", device = "auto", backend = "auto", memory_format = "auto",
              cpu_allocator = "caching", param_dtype = "fp32", reduce_dtype, precision = "fp32";
};

// What a captured step cannot hold: each needs a decision on the host or a synchronisation per
// step (or, for the sharded strategies, collectives this capture does not cover yet).
absl::Status CheckCudaGraph(const TrainOptions& o) {
  if (!o.cuda_graph) return absl::OkStatus();
  const char* conflict = o.device == DeviceChoice::kCpu           ? "--device cpu"
                         : o.strategy != Strategy::kDdp           ? "a sharded --strategy"
                         : o.optimizer == OptimizerChoice::kAdam  ? "--optimizer adam"
                         : o.optimizer == OptimizerChoice::kAdamW ? "--optimizer adamw"
                         : o.accum_steps > 1                      ? "--accum-steps > 1"
                         : o.sync_bn                              ? "--sync-bn"
                         : o.clip_grad_norm > 0                   ? "--clip-grad-norm"
                         : o.activation_checkpointing             ? "--activation-checkpointing"
                                                                  : nullptr;
  if (conflict == nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--cuda-graph does not support ", conflict,
                                                 ": it captures DDP with SGD on CUDA, one step per batch"));
}

absl::Status Resolve(const RawChoices& raw, TrainOptions& o) {
  auto model = Pick<ModelChoice>("model", raw.model,
                                 {{"fashionnet", ModelChoice::kFashionNet},
                                  {"mlp", ModelChoice::kMlp},
                                  {"resmlp", ModelChoice::kResMlp},
                                  {"gpt", ModelChoice::kGpt}});
  auto linear = Pick<LinearChoice>(
      "linear", raw.linear,
      {{"auto", LinearChoice::kAuto}, {"onednn", LinearChoice::kOneDnn}, {"aten", LinearChoice::kAten}});
  // --model gpt reads text unless told otherwise; the image models read Fashion-MNIST.
  const std::string dataset_name = !raw.dataset.empty() ? raw.dataset : raw.model == "gpt" ? "text" : "fashion-mnist";
  auto dataset = Pick<DatasetChoice>("dataset", dataset_name,
                                     {{"fashion-mnist", DatasetChoice::kFashionMnist},
                                      {"synthetic", DatasetChoice::kSynthetic},
                                      {"text", DatasetChoice::kText}});
  auto schedule = Pick<LrSchedule>("lr-schedule", raw.lr_schedule,
                                   {{"constant", LrSchedule::kConstant}, {"cosine", LrSchedule::kCosine}});
  auto optimizer = Pick<OptimizerChoice>(
      "optimizer", raw.optimizer,
      {{"sgd", OptimizerChoice::kSgd}, {"adam", OptimizerChoice::kAdam}, {"adamw", OptimizerChoice::kAdamW}});
  auto strategy = Pick<Strategy>("strategy", raw.strategy,
                                 {{"ddp", Strategy::kDdp},
                                  {"no_shard", Strategy::kNoShard},
                                  {"zero1", Strategy::kZero1},
                                  {"zero2", Strategy::kZero2},
                                  {"fsdp", Strategy::kFsdp},
                                  {"shard_optimizer", Strategy::kZero1},
                                  {"shard_grad_op", Strategy::kZero2},
                                  {"zero3", Strategy::kFsdp},
                                  {"full_shard", Strategy::kFsdp}},
                                 /*listed=*/5);
  auto allreduce = Pick<AllreduceChoice>(
      "allreduce", raw.allreduce,
      {{"auto", AllreduceChoice::kAuto}, {"shm", AllreduceChoice::kShm}, {"gloo", AllreduceChoice::kProcessGroup}});
  auto device =
      Pick<DeviceChoice>("device", raw.device,
                         {{"auto", DeviceChoice::kAuto}, {"cpu", DeviceChoice::kCpu}, {"cuda", DeviceChoice::kCuda}});
  auto backend = Pick<BackendChoice>(
      "backend", raw.backend,
      {{"auto", BackendChoice::kAuto}, {"gloo", BackendChoice::kGloo}, {"nccl", BackendChoice::kNccl}});
  auto memory_format = Pick<MemoryFormatChoice>("memory-format", raw.memory_format,
                                                {{"auto", MemoryFormatChoice::kAuto},
                                                 {"contiguous", MemoryFormatChoice::kContiguous},
                                                 {"channels-last", MemoryFormatChoice::kChannelsLast}});
  auto param_dtype = Pick<PrecisionChoice>("param-dtype", raw.param_dtype,
                                           {{"fp32", PrecisionChoice::kFp32}, {"bf16", PrecisionChoice::kBf16}});
  if (!param_dtype.ok()) return param_dtype.status();
  o.param_dtype = *param_dtype;
  auto precision = Pick<PrecisionChoice>(
      "precision", raw.precision,
      {{"fp32", PrecisionChoice::kFp32}, {"bf16", PrecisionChoice::kBf16}, {"fp16", PrecisionChoice::kFp16}});
  if (!precision.ok()) return precision.status();
  o.precision = *precision;
  if (!raw.reduce_dtype.empty()) {
    auto reduce_dtype = Pick<PrecisionChoice>("reduce-dtype", raw.reduce_dtype,
                                              {{"fp32", PrecisionChoice::kFp32}, {"bf16", PrecisionChoice::kBf16}});
    if (!reduce_dtype.ok()) return reduce_dtype.status();
    o.reduce_dtype = *reduce_dtype;
  }
  auto cpu_allocator =
      Pick<CpuAllocatorChoice>("cpu-allocator", raw.cpu_allocator,
                               {{"caching", CpuAllocatorChoice::kCaching}, {"default", CpuAllocatorChoice::kDefault}});
  for (const absl::Status& s :
       {model.status(), linear.status(), dataset.status(), schedule.status(), optimizer.status(), strategy.status(),
        allreduce.status(), device.status(), backend.status(), memory_format.status(), cpu_allocator.status()}) {
    if (!s.ok()) return s;
  }
  o.model = *model;
  o.linear = *linear;
  o.dataset = *dataset;
  o.lr_schedule = *schedule;
  o.optimizer = *optimizer;
  o.strategy = *strategy;
  o.allreduce = *allreduce;
  o.device = *device;
  o.backend = *backend;
  o.memory_format = *memory_format;
  o.cpu_allocator = *cpu_allocator;

  if (o.batch_size % o.accum_steps != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch-size=", o.batch_size, " is not divisible by --accum-steps=", o.accum_steps));
  }
  if (absl::Status s = CheckDeviceBackend(o.device, o.backend); !s.ok()) return s;
  if (o.allreduce == AllreduceChoice::kShm && o.device == DeviceChoice::kCuda) {
    return absl::InvalidArgumentError("--allreduce=shm sums CPU tensors: use it with --device cpu");
  }
  if (absl::Status s = CheckCudaGraph(o); !s.ok()) return s;
  if ((o.param_dtype != PrecisionChoice::kFp32 || o.reduce_dtype) && o.strategy != Strategy::kFsdp) {
    return absl::InvalidArgumentError("--param-dtype and --reduce-dtype need --strategy fsdp");
  }
  if (o.precision != PrecisionChoice::kFp32 && o.param_dtype != PrecisionChoice::kFp32 &&
      o.precision != o.param_dtype) {
    return absl::InvalidArgumentError("--precision and --param-dtype disagree: give one of them");
  }
  if (o.precision != PrecisionChoice::kFp32 && o.cuda_graph) {
    return absl::InvalidArgumentError("--precision bf16/fp16 does not run in a --cuda-graph step: drop one of them");
  }
  if (!(o.loss_scale > 0) || o.loss_scale > 1e38) {
    return absl::InvalidArgumentError(absl::StrCat("--loss-scale=", o.loss_scale, ": expected a number in (0, 1e38]"));
  }
  if (o.offload_optimizer && o.strategy != Strategy::kFsdp) {
    return absl::InvalidArgumentError("--offload-optimizer needs --strategy fsdp");
  }
  if (o.activation_checkpointing && o.strategy == Strategy::kDdp) {
    // Our DDP, like PyTorch's without static_graph, finishes a backward when the first reentrant
    // recomputation does: FSDP's strategies (no_shard is DDP's arithmetic) hook the outer one.
    return absl::InvalidArgumentError(
        "--activation-checkpointing needs a sharded --strategy (no_shard, zero1, zero2 or fsdp); no_shard "
        "computes what ddp does");
  }
  if ((o.model == ModelChoice::kGpt) != (o.dataset == DatasetChoice::kText)) {
    return absl::InvalidArgumentError(o.model == ModelChoice::kGpt
                                          ? "--model gpt trains on --dataset text (byte tokens), not on images"
                                          : "--dataset text is --model gpt's: the image models need images");
  }
  if (o.model == ModelChoice::kGpt) {
    if (o.gpt_width % o.gpt_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--gpt-width=", o.gpt_width, " is not a multiple of --gpt-heads=", o.gpt_heads));
    }
    if (o.cuda_graph)
      return absl::InvalidArgumentError("--cuda-graph captures the image models' step, not --model gpt");
  }
  for (int64_t width : o.mlp_hidden) {
    if (width <= 0) return absl::InvalidArgumentError(absl::StrCat("--mlp-hidden: width ", width, " is not positive"));
  }
  return absl::OkStatus();
}

// --profile-steps FIRST:END (and --profile-trace, which it needs): a window of at least one step.
absl::Status ParseProfileSteps(const std::string& text, TrainOptions& o) {
  if (text.empty()) {
    if (!o.profile_trace.empty()) return absl::InvalidArgumentError("--profile-trace needs --profile-steps FIRST:END");
    return absl::OkStatus();
  }
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  int64_t first = 0, end = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &first) || !absl::SimpleAtoi(parts[1], &end) || first < 0 ||
      end <= first) {
    return absl::InvalidArgumentError(
        absl::StrCat("--profile-steps ", text, ": expected FIRST:END, step numbers with 0 <= FIRST < END"));
  }
  if (o.profile_trace.empty()) return absl::InvalidArgumentError("--profile-steps needs --profile-trace PATH");
  o.profile_first = first;
  o.profile_end = end;
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckDeviceBackend(DeviceChoice device, BackendChoice backend) {
  if (backend == BackendChoice::kNccl && device == DeviceChoice::kCpu) {
    return absl::InvalidArgumentError(
        "--backend=nccl needs CUDA tensors: use --device cuda (or auto on a GPU machine), or --backend gloo");
  }
  if (backend == BackendChoice::kGloo && device == DeviceChoice::kCuda) {
    return absl::InvalidArgumentError("--backend=gloo with --device cuda: CUDA tensors go through nccl");
  }
  return absl::OkStatus();
}

const char* PrecisionName(PrecisionChoice precision) {
  switch (precision) {
    case PrecisionChoice::kFp32: return "fp32";
    case PrecisionChoice::kBf16: return "bf16";
    case PrecisionChoice::kFp16: return "fp16";
  }
  return "?";
}

const char* OptimizerName(OptimizerChoice optimizer) {
  switch (optimizer) {
    case OptimizerChoice::kSgd: return "sgd";
    case OptimizerChoice::kAdam: return "adam";
    case OptimizerChoice::kAdamW: return "adamw";
  }
  return "?";
}

namespace {

// The model, its data and the run's length.
void AddModelAndDataOptions(CLI::App& app, TrainOptions& o, RawChoices& raw) {
  app.add_option("--model", raw.model,
                 "fashionnet, mlp (--mlp-hidden), resmlp (--resmlp-width, --resmlp-blocks) or gpt (a byte-level "
                 "decoder-only transformer: --gpt-layers, --gpt-width, --gpt-heads, --gpt-context)")
      ->capture_default_str();
  app.add_option("--linear", raw.linear,
                 "kernel of the fully connected layers: aten (torch's Linear: MKL on CPU, cuBLAS on CUDA), "
                 "onednn (as a 1x1 convolution), or auto (aten)")
      ->capture_default_str();
  app.add_option("--dataset", raw.dataset,
                 "fashion-mnist or synthetic for the image models; text for --model gpt (the default for each)");
  app.add_option("--data-dir", o.data_dir,
                 "Fashion-MNIST IDX files (default: Debian's dataset-fashion-mnist), or for --dataset text a folder "
                 "whose *.py files are the corpus (default: the newest /usr/lib/python3.N; every 10th file by "
                 "name is validation)");
  app.add_option("--epochs", o.epochs, "epochs")->capture_default_str()->check(CLI::Range(1, 100000));
  app.add_option("--max-steps", o.max_steps, "stop after this many steps (0: no limit)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", o.batch_size, "samples per rank per step")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
}

// The optimizer and the data-parallel strategy; returns --lr's option (its default depends on
// the optimizer).
CLI::Option* AddOptimizerOptions(CLI::App& app, TrainOptions& o, RawChoices& raw) {
  CLI::Option* lr = app.add_option("--lr", o.lr, "learning rate (default 0.05 for sgd, 0.001 for adam and adamw)")
                        ->check(CLI::PositiveNumber);
  app.add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_option("--optimizer", raw.optimizer,
                 "sgd, adam (weight decay as L2 in the gradient) or adamw (decoupled weight decay)")
      ->capture_default_str();
  app.add_option("--strategy", raw.strategy,
                 "ddp (bucketed all-reduce), no_shard, zero1, zero2 or fsdp (FullyShardedDataParallel)")
      ->capture_default_str();
  return lr;
}

// The models' shapes and the GPT's evaluation and sample.
void AddModelShapeOptions(CLI::App& app, TrainOptions& o) {
  app.add_option("--mlp-hidden", o.mlp_hidden, "hidden layer widths of --model mlp")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--resmlp-width", o.resmlp_width,
                 "--model resmlp: the residual stream's width (each block's hidden layer is 4x that)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--resmlp-blocks", o.resmlp_blocks, "--model resmlp: residual blocks (each one FSDP unit)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--gpt-layers", o.gpt_layers, "--model gpt: transformer blocks (each one FSDP unit)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  app.add_option("--gpt-width", o.gpt_width, "--model gpt: the residual stream's width (the MLP's is 4x)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  app.add_option("--gpt-heads", o.gpt_heads, "--model gpt: attention heads (dividing --gpt-width)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  app.add_option("--gpt-context", o.gpt_context, "--model gpt: tokens (bytes) per training sequence")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--eval-samples", o.eval_samples,
                 "--model gpt: validation sequences whose loss and perplexity are reported at the end (0: all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--sample-bytes", o.sample_bytes,
                 "--model gpt: bytes of text the trained model writes at the end (rank 0 prints them; 0: none)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
}

// Memory and precision: activation checkpointing, mixed precision, offloading, the report.
void AddMemoryOptions(CLI::App& app, TrainOptions& o, RawChoices& raw) {
  app.add_flag("--activation-checkpointing", o.activation_checkpointing,
               "keep only each unit's (each child layer's or block's) input in forward and recompute the "
               "unit in backward: less activation memory for about one more forward of compute");
  app.add_option("--precision", raw.precision,
                 "compute in fp32, bf16 or fp16 with fp32 master weights and optimizer state, any --strategy "
                 "(fsdp gathers in it, as FSDP2's MixedPrecisionPolicy; the others run forward under autocast, as "
                 "torch.autocast); fp16 scales the loss dynamically, as torch.amp.GradScaler")
      ->capture_default_str();
  app.add_option("--loss-scale", o.loss_scale,
                 "--precision fp16: the initial loss scale; halved on every step skipped for inf/NaN gradients "
                 "(on any rank), doubled after 2000 steps without one")
      ->capture_default_str();
  app.add_option("--param-dtype", raw.param_dtype,
                 "--strategy fsdp: gather and compute in fp32 or bf16 (mixed precision, as PyTorch FSDP's "
                 "param_dtype: the shards, their gradients and Adam's state stay fp32)")
      ->capture_default_str();
  app.add_option("--reduce-dtype", raw.reduce_dtype,
                 "--strategy fsdp: reduce-scatter the gradients in fp32 or bf16 (default: --param-dtype)");
  app.add_flag("--offload-optimizer", o.offload_optimizer,
               "--strategy fsdp: keep the parameter and gradient shards, and so the optimizer's state, in CPU "
               "memory; the device holds only gathered units and gradients in flight (on the CPU: no change)");
  app.add_flag("--report-memory", o.report_memory,
               "print each rank's parameter, gradient and optimizer-state bytes, peak, peak RSS and, on CUDA, "
               "the caching allocator's allocated, reserved and peak bytes");
}

// Regularisation, the learning-rate schedule, accumulation, SyncBatchNorm and the seed.
void AddScheduleOptions(CLI::App& app, TrainOptions& o, RawChoices& raw) {
  app.add_option("--weight-decay", o.weight_decay,
                 "weight decay: added to the gradient (L2) for sgd and adam, decoupled for adamw")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lr-schedule", raw.lr_schedule,
                 "constant, or cosine: lr x (1 + cos(pi x fraction of epochs done)) / 2, per step")
      ->capture_default_str();
  app.add_option("--warmup-fraction", o.warmup_fraction,
                 "ramp the learning rate linearly from 0 over this fraction of the run's samples; --lr-schedule "
                 "spans the rest")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--accum-steps", o.accum_steps, "micro-batches per step (communication once per step)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_flag("--sync-bn", o.sync_bn, "convert BatchNorm layers to SyncBatchNorm");
  app.add_option("--seed", o.seed, "seed of weights and data order")->capture_default_str();
}

// Checkpoints and --keep-survivors' in-memory shard copies.
void AddCheckpointOptions(CLI::App& app, TrainOptions& o) {
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "save checkpoints here and resume from them: checkpoint.pt, or sharded/ for the sharded strategies "
                 "(loadable at another world size)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "save every N steps (0: at the end and on SIGTERM)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--shard-copy-every", o.shard_copy_every,
                 "under elrun --keep-survivors with a sharded strategy: copy the neighbour rank's shards into memory "
                 "every N steps, so a lost rank's state is rebuilt from memory (0: from the checkpoint)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
}

// Threads, communication, device, backend, memory format and allocator.
void AddRuntimeOptions(CLI::App& app, TrainOptions& o, RawChoices& raw) {
  app.add_option("--threads", o.threads, "intra-op threads per rank")->capture_default_str()->check(CLI::Range(1, 256));
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "DDP bucket size limit (MiB)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--first-bucket-mb", o.first_bucket_mb,
                 "limit of DDP's first bucket (MiB), small so the last layers' all-reduce overlaps backward")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--allreduce", raw.allreduce,
                 "transport of DDP's and SyncBatchNorm's all-reduces on CPU: shm (shared memory, all ranks on "
                 "this host), gloo (the process group), or auto (shm where every rank can map it, else the "
                 "process group)")
      ->capture_default_str();
  app.add_option("--device", raw.device,
                 "cpu, cuda (worker i uses cuda:LOCAL_RANK among CUDA_VISIBLE_DEVICES), or auto (cuda when a "
                 "device is visible)")
      ->capture_default_str();
  app.add_option("--backend", raw.backend, "gloo, nccl, or auto (nccl for CUDA, gloo for CPU)")->capture_default_str();
  app.add_option("--memory-format", raw.memory_format,
                 "layout of the convolutions' weights and activations: channels-last (NHWC: oneDNN's "
                 "convolutions and ATen's pooling and batch norm vectorise over channels), contiguous (NCHW, "
                 "PyTorch's default), or auto (channels-last on CPU, contiguous on CUDA)")
      ->capture_default_str();
  app.add_option("--cpu-allocator", raw.cpu_allocator,
                 "caching (CPU tensors of 1 MiB and more come from per-size free lists of mapped blocks, "
                 "as CUDA's caching allocator does: the resident memory follows the live tensors and a "
                 "steady step makes no new mappings) or default (c10's allocator, i.e. glibc malloc)")
      ->capture_default_str();
}

// What the run writes besides checkpoints, CUDA's step options, the collectives' timeout and the
// profiler; --profile-steps' text goes to `profile_steps`.
void AddOutputOptions(CLI::App& app, TrainOptions& o, std::string& profile_steps) {
  app.add_option("--metrics-file", o.metrics_file, "JSON lines: steps and a final {\"event\":\"end\",...}");
  app.add_option("--step-times-file", o.step_times_file,
                 "each rank appends to PATH.<rank>: per step, its wall and CPU milliseconds (tab-separated)");
  app.add_option("--log-every", o.log_every, "progress line every N steps (rank 0)")->capture_default_str();
  app.add_option("--clip-grad-norm", o.clip_grad_norm,
                 "clip gradients by their global L2 norm before each step (as torch's clip_grad_norm_; "
                 "the whole model's norm under every strategy); 0: off")
      ->check(CLI::Range(0.0, 1e12))
      ->capture_default_str();
  app.add_flag("--allow-tf32", o.allow_tf32,
               "CUDA: cuDNN convolutions in TF32, as PyTorch's default (faster; off: fp32, matching the CPU)");
  app.add_flag("--cuda-graph", o.cuda_graph,
               "CUDA: capture the whole DDP step (forward, backward, all-reduce, SGD) in a CUDA graph once and "
               "replay it per batch: one launch per step instead of dozens; DDP with SGD only, no SyncBatchNorm, "
               "accumulation or clipping");
  app.add_option("--collective-timeout", o.collective_timeout_s,
                 "seconds a collective waits for its peers before this rank fails")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  app.add_option("--profile-steps", profile_steps,
                 "FIRST:END: PyTorch's profiler (Kineto) over steps FIRST..END-1, host operators and, on CUDA, "
                 "kernels and copies; needs --profile-trace");
  app.add_option("--profile-trace", o.profile_trace,
                 "each rank writes its profile to PATH.<rank> (Chrome trace JSON; tests/support/trace_summary.py "
                 "summarises it)");
}

}  // namespace

absl::StatusOr<std::optional<TrainOptions>> ParseTrainOptions(int argc, const char* const* argv, std::ostream& out) {
  TrainOptions o;
  RawChoices raw;
  CLI::App app(
      "elrun-train: data-parallel training of FashionNet on Fashion-MNIST, or of a byte-level GPT on text "
      "(LibTorch), on CPU or CUDA.",
      "elrun-train");
  AddModelAndDataOptions(app, o, raw);
  CLI::Option* lr = AddOptimizerOptions(app, o, raw);
  AddModelShapeOptions(app, o);
  AddMemoryOptions(app, o, raw);
  AddScheduleOptions(app, o, raw);
  AddCheckpointOptions(app, o);
  AddRuntimeOptions(app, o, raw);
  std::string profile_steps;
  AddOutputOptions(app, o, profile_steps);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return std::optional<TrainOptions>();
  } catch (const CLI::ParseError& error) {
    return absl::InvalidArgumentError(absl::StrCat(error.what(), "; see elrun-train --help"));
  }
  if (absl::Status s = Resolve(raw, o); !s.ok()) return s;
  if (absl::Status s = ParseProfileSteps(profile_steps, o); !s.ok()) return s;
  if (lr->count() == 0 && o.optimizer != OptimizerChoice::kSgd) o.lr = 1e-3;
  return std::optional<TrainOptions>(std::move(o));
}

}  // namespace elrun::trainer
