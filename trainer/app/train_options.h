// elrun-train's command line as typed values: every option is parsed and checked here, before
// the worker reads its environment, joins a rendezvous or opens a file, so a mistyped option is
// one line on stderr and exit 2 at once. Thread-compatible; no LibTorch.
#ifndef ELRUN_TRAINER_APP_TRAIN_OPTIONS_H_
#define ELRUN_TRAINER_APP_TRAIN_OPTIONS_H_

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/parallel/strategy.h"

namespace elrun::trainer {

enum class ModelChoice { kFashionNet, kMlp, kResMlp, kGpt };
// text: the byte-level corpus of text_corpus.h, --model gpt's (and only its) data.
enum class DatasetChoice { kFashionMnist, kSynthetic, kText };
// adam: L2 weight decay added to the gradient; adamw: decoupled weight decay (torch's AdamW).
enum class OptimizerChoice { kSgd, kAdam, kAdamW };
enum class LrSchedule { kConstant, kCosine };
// ddp: DistributedDataParallel; the others are FullyShardedDataParallel's strategies.
enum class LinearChoice { kAuto, kOneDnn, kAten };          // auto: ATen (train_main.cc says why).
enum class AllreduceChoice { kAuto, kShm, kProcessGroup };  // --allreduce auto|shm|gloo.
enum class DeviceChoice { kAuto, kCpu, kCuda };             // auto: CUDA when a device is visible.
enum class BackendChoice { kAuto, kGloo, kNccl };           // auto: NCCL for CUDA, Gloo for CPU.
// auto: channels-last on CPU, contiguous on CUDA (train_main.cc says why).
enum class MemoryFormatChoice { kAuto, kContiguous, kChannelsLast };
enum class PrecisionChoice {
  kFp32,
  kBf16,
  kFp16
};  // --precision fp32|bf16|fp16; --param-dtype/--reduce-dtype fp32|bf16.
// caching: large CPU tensors from CachingCpuAllocator (caching_cpu_allocator.h); default: c10's.
enum class CpuAllocatorChoice { kCaching, kDefault };

const char* OptimizerName(OptimizerChoice optimizer);
const char* PrecisionName(PrecisionChoice precision);  // fp32, bf16, fp16.

struct TrainOptions {
  ModelChoice model = ModelChoice::kFashionNet;
  LinearChoice linear = LinearChoice::kAuto;
  DatasetChoice dataset = DatasetChoice::kFashionMnist;
  std::string data_dir;  // Empty: Debian's Fashion-MNIST (kFashionMnistDir), or DefaultTextDir() for text.
  int epochs = 1;
  int64_t max_steps = 0;
  int64_t batch_size = 64;
  double lr = 0.05;  // 0.001 for adam unless given.
  double momentum = 0.9;
  double weight_decay = 0.0;
  LrSchedule lr_schedule = LrSchedule::kCosine;
  // The first warmup_fraction of the run's samples ramp the learning rate linearly from 0; the
  // schedule (constant or cosine) spans the rest.
  double warmup_fraction = 0.0;
  OptimizerChoice optimizer = OptimizerChoice::kSgd;
  Strategy strategy = Strategy::kDdp;
  std::vector<int64_t> mlp_hidden = {256, 128};
  int64_t resmlp_width = 256;  // --model resmlp: width and blocks (models.h).
  int64_t resmlp_blocks = 4;
  int64_t gpt_layers = 4;  // --model gpt (gpt.h): blocks, width, heads and context (tokens).
  int64_t gpt_width = 128;
  int64_t gpt_heads = 4;
  int64_t gpt_context = 128;
  // --model gpt: validation windows evaluated at the end (0: the whole split), and bytes of text
  // sampled from the trained model (0: none).
  int64_t eval_samples = 512;
  int64_t sample_bytes = 200;
  // Recompute each unit's (each child's) forward in backward instead of keeping its activations.
  bool activation_checkpointing = false;
  // --precision: compute in bf16 or fp16 with fp32 master weights and optimizer state, every
  // strategy (fsdp: as param_dtype; the others: autocast); fp16 adds dynamic loss scaling from
  // loss_scale (the initial scale).
  PrecisionChoice precision = PrecisionChoice::kFp32;
  double loss_scale = 65536.0;
  // Mixed precision (--strategy fsdp): compute and gather dtype, and the gradients' reduce dtype.
  PrecisionChoice param_dtype = PrecisionChoice::kFp32;
  std::optional<PrecisionChoice> reduce_dtype;  // Unset: param_dtype.
  bool offload_optimizer = false;               // --strategy fsdp: shards and optimizer state in CPU memory.
  bool report_memory = false;
  int accum_steps = 1;
  bool sync_bn = false;
  uint64_t seed = 0;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  // elrun --keep-survivors with a sharded strategy: each rank copies its neighbour's shards into
  // memory every N steps (shard_copies.h); 0: none (a lost rank's shards come from the checkpoint).
  int64_t shard_copy_every = 10;
  int threads = 1;
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  AllreduceChoice allreduce = AllreduceChoice::kAuto;
  DeviceChoice device = DeviceChoice::kAuto;
  BackendChoice backend = BackendChoice::kAuto;
  MemoryFormatChoice memory_format = MemoryFormatChoice::kAuto;
  CpuAllocatorChoice cpu_allocator = CpuAllocatorChoice::kCaching;
  std::string metrics_file;
  std::string step_times_file;
  int64_t log_every = 50;
  // How long a collective (and the store's set-up) may wait for a peer before it fails the
  // rank; a peer that died or hangs mid-collective thus fails the others, never hangs them.
  double collective_timeout_s = 300.0;
  double clip_grad_norm = 0.0;  // Clip by the global gradient norm before each step; 0: off.
  // cuDNN convolutions in TF32 on CUDA (PyTorch's default). Off: fp32, as on the CPU.
  bool allow_tf32 = false;
  // Capture the training step in a CUDA graph and replay it (cuda_graph_step.h).
  bool cuda_graph = false;
  // PyTorch's profiler over steps [profile_first, profile_end) when profile_end > 0; the trace
  // (Chrome JSON) to profile_trace.<rank>.
  int64_t profile_first = 0;
  int64_t profile_end = 0;
  std::string profile_trace;
};

// The --device/--backend pairs that cannot work on any machine: InvalidArgument, one line. The
// pairs that depend on the devices present are ResolvePlacement's (placement.h).
absl::Status CheckDeviceBackend(DeviceChoice device, BackendChoice backend);

// Parses elrun-train's arguments. nullopt after printing --help to `out`; InvalidArgument with a
// one-line message naming the option, the value and the choices for anything else wrong,
// including combinations no device can satisfy (--backend nccl --device cpu).
absl::StatusOr<std::optional<TrainOptions>> ParseTrainOptions(int argc, const char* const* argv, std::ostream& out);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_APP_TRAIN_OPTIONS_H_
