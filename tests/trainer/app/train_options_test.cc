// elrun-train's options: typed values, defaults, and one line for each wrong value or pair.
#include "trainer/app/train_options.h"

#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

namespace elrun::trainer {
namespace {

absl::StatusOr<std::optional<TrainOptions>> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "elrun-train");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out;
  return ParseTrainOptions(static_cast<int>(argv.size()), argv.data(), out);
}

std::string Error(std::vector<std::string> args) { return std::string(Parse(std::move(args)).status().message()); }

TEST_CASE("defaults") {
  auto parsed = Parse({});
  REQUIRE(parsed.ok());
  REQUIRE(parsed->has_value());
  const TrainOptions& o = **parsed;
  CHECK(o.strategy == Strategy::kDdp);
  CHECK(o.device == DeviceChoice::kAuto);
  CHECK(o.backend == BackendChoice::kAuto);
  CHECK(o.linear == LinearChoice::kAuto);
  CHECK(o.optimizer == OptimizerChoice::kSgd);
  CHECK(o.lr == doctest::Approx(0.05));
  CHECK(o.lr_schedule == LrSchedule::kCosine);
  CHECK(o.collective_timeout_s == doctest::Approx(300.0));
  CHECK(o.clip_grad_norm == 0.0);
  CHECK_FALSE(o.allow_tf32);
  CHECK(o.memory_format == MemoryFormatChoice::kAuto);
  CHECK(o.profile_end == 0);
}

TEST_CASE("--memory-format: auto, contiguous or channels-last") {
  auto parsed = Parse({"--memory-format", "channels-last"});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->memory_format == MemoryFormatChoice::kChannelsLast);
  CHECK(Error({"--memory-format", "nhwc"}) == "--memory-format=nhwc: expected auto, contiguous or channels-last");
}

TEST_CASE("--cpu-allocator, --model resmlp and --activation-checkpointing") {
  auto parsed = Parse({});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->cpu_allocator == CpuAllocatorChoice::kCaching);
  CHECK_FALSE((*parsed)->activation_checkpointing);
  parsed = Parse({"--cpu-allocator", "default", "--model", "resmlp", "--resmlp-width", "64", "--resmlp-blocks", "3",
                  "--strategy", "fsdp", "--activation-checkpointing"});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->cpu_allocator == CpuAllocatorChoice::kDefault);
  CHECK((*parsed)->model == ModelChoice::kResMlp);
  CHECK((*parsed)->resmlp_width == 64);
  CHECK((*parsed)->resmlp_blocks == 3);
  CHECK((*parsed)->activation_checkpointing);
  CHECK(Error({"--cpu-allocator", "tcmalloc"}) == "--cpu-allocator=tcmalloc: expected caching or default");
  CHECK(Error({"--activation-checkpointing"}) ==
        "--activation-checkpointing needs a sharded --strategy (no_shard, zero1, zero2 or fsdp); no_shard computes "
        "what ddp does");
  CHECK(Error({"--resmlp-blocks", "0"}).find("--resmlp-blocks") != std::string::npos);
}

TEST_CASE("--param-dtype, --reduce-dtype and --offload-optimizer: fsdp only") {
  auto parsed = Parse({"--strategy", "fsdp", "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--offload-optimizer"});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->param_dtype == PrecisionChoice::kBf16);
  CHECK((*parsed)->reduce_dtype == PrecisionChoice::kFp32);
  CHECK((*parsed)->offload_optimizer);
  parsed = Parse({});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->param_dtype == PrecisionChoice::kFp32);
  CHECK_FALSE((*parsed)->reduce_dtype.has_value());
  CHECK(Error({"--strategy", "fsdp", "--param-dtype", "fp16"}) == "--param-dtype=fp16: expected fp32 or bf16");
  CHECK(Error({"--strategy", "zero2", "--param-dtype", "bf16"}) ==
        "--param-dtype and --reduce-dtype need --strategy fsdp");
  CHECK(Error({"--reduce-dtype", "bf16"}) == "--param-dtype and --reduce-dtype need --strategy fsdp");
  CHECK(Error({"--offload-optimizer"}) == "--offload-optimizer needs --strategy fsdp");
}

TEST_CASE("--model gpt: text by default, its sizes, adamw, warmup; text and images do not mix") {
  auto parsed =
      Parse({"--model", "gpt", "--gpt-layers", "6", "--gpt-width", "192", "--gpt-heads", "6", "--gpt-context", "256",
             "--optimizer", "adamw", "--warmup-fraction", "0.1", "--eval-samples", "0", "--sample-bytes", "50"});
  REQUIRE(parsed.ok());
  const TrainOptions& o = **parsed;
  CHECK(o.model == ModelChoice::kGpt);
  CHECK(o.dataset == DatasetChoice::kText);
  CHECK(o.gpt_layers == 6);
  CHECK(o.gpt_width == 192);
  CHECK(o.gpt_heads == 6);
  CHECK(o.gpt_context == 256);
  CHECK(o.optimizer == OptimizerChoice::kAdamW);
  CHECK(o.lr == doctest::Approx(1e-3));  // adamw's default, as adam's.
  CHECK(o.warmup_fraction == doctest::Approx(0.1));
  CHECK(o.eval_samples == 0);
  CHECK(o.sample_bytes == 50);
  CHECK(std::string(OptimizerName(o.optimizer)) == "adamw");
  auto defaults = Parse({});
  REQUIRE(defaults.ok());
  CHECK((**defaults).dataset == DatasetChoice::kFashionMnist);

  CHECK(Error({"--model", "gpt", "--gpt-width", "100", "--gpt-heads", "3"}) ==
        "--gpt-width=100 is not a multiple of --gpt-heads=3");
  CHECK(Error({"--model", "gpt", "--dataset", "fashion-mnist"}) ==
        "--model gpt trains on --dataset text (byte tokens), not on images");
  CHECK(Error({"--dataset", "text"}) == "--dataset text is --model gpt's: the image models need images");
  CHECK(Error({"--model", "gpt", "--cuda-graph"}) == "--cuda-graph captures the image models' step, not --model gpt");
  CHECK(Error({"--warmup-fraction", "1.5"}).find("--warmup-fraction") != std::string::npos);
  CHECK(Error({"--model", "gpt", "--gpt-layers", "0"}).find("--gpt-layers") != std::string::npos);
  CHECK(Error({"--dataset", "books"}) == "--dataset=books: expected fashion-mnist, synthetic or text");
}

TEST_CASE("--profile-steps FIRST:END with --profile-trace") {
  auto parsed = Parse({"--profile-steps", "10:20", "--profile-trace", "/tmp/t.json"});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->profile_first == 10);
  CHECK((*parsed)->profile_end == 20);
  CHECK((*parsed)->profile_trace == "/tmp/t.json");
  for (const char* bad : {"20:10", "5:5", "-1:3", "3", "a:b", "1:2:3"}) {
    CAPTURE(bad);
    CHECK(Error({"--profile-steps", bad, "--profile-trace", "t"}) ==
          std::string("--profile-steps ") + bad + ": expected FIRST:END, step numbers with 0 <= FIRST < END");
  }
  CHECK(Error({"--profile-steps", "1:2"}) == "--profile-steps needs --profile-trace PATH");
  CHECK(Error({"--profile-trace", "t"}) == "--profile-trace needs --profile-steps FIRST:END");
}

TEST_CASE("--cuda-graph refuses what a captured step cannot hold") {
  auto parsed = Parse({"--cuda-graph", "--device", "cuda"});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->cuda_graph);
  const std::string tail = ": it captures DDP with SGD on CUDA, one step per batch";
  CHECK(Error({"--cuda-graph", "--device", "cpu"}) == "--cuda-graph does not support --device cpu" + tail);
  CHECK(Error({"--cuda-graph", "--strategy", "zero2"}) == "--cuda-graph does not support a sharded --strategy" + tail);
  CHECK(Error({"--cuda-graph", "--optimizer", "adam"}) == "--cuda-graph does not support --optimizer adam" + tail);
  CHECK(Error({"--cuda-graph", "--accum-steps", "2"}) == "--cuda-graph does not support --accum-steps > 1" + tail);
  CHECK(Error({"--cuda-graph", "--sync-bn"}) == "--cuda-graph does not support --sync-bn" + tail);
  CHECK(Error({"--cuda-graph", "--clip-grad-norm", "1"}) == "--cuda-graph does not support --clip-grad-norm" + tail);
}

TEST_CASE("--clip-grad-norm: a non-negative norm") {
  auto parsed = Parse({"--clip-grad-norm", "1.5"});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->clip_grad_norm == doctest::Approx(1.5));
  CHECK_FALSE(Parse({"--clip-grad-norm", "-1"}).ok());
}

TEST_CASE("--collective-timeout: seconds, positive") {
  auto parsed = Parse({"--collective-timeout", "2.5"});
  REQUIRE(parsed.ok());
  CHECK((*parsed)->collective_timeout_s == doctest::Approx(2.5));
  CHECK_FALSE(Parse({"--collective-timeout", "0"}).ok());
  CHECK_FALSE(Parse({"--collective-timeout", "soon"}).ok());
}

TEST_CASE("every choice becomes its enum; strategy aliases too") {
  auto parsed = Parse({"--strategy", "full_shard", "--device", "cuda", "--backend", "nccl", "--optimizer", "adam",
                       "--lr-schedule", "constant", "--model", "mlp", "--linear", "aten", "--allreduce", "gloo",
                       "--dataset", "synthetic"});
  REQUIRE(parsed.ok());
  const TrainOptions& o = **parsed;
  CHECK(o.strategy == Strategy::kFsdp);
  CHECK(o.device == DeviceChoice::kCuda);
  CHECK(o.backend == BackendChoice::kNccl);
  CHECK(o.optimizer == OptimizerChoice::kAdam);
  CHECK(o.lr == doctest::Approx(1e-3));  // Adam's default unless --lr is given.
  CHECK(o.lr_schedule == LrSchedule::kConstant);
  CHECK(o.model == ModelChoice::kMlp);
  CHECK(o.linear == LinearChoice::kAten);
  CHECK(o.allreduce == AllreduceChoice::kProcessGroup);
  CHECK(o.dataset == DatasetChoice::kSynthetic);
  CHECK(StrategyName(o.strategy) == std::string("fsdp"));
}

TEST_CASE("an unknown value names the option, the value and the choices") {
  CHECK(Error({"--strategy", "zero4"}) == "--strategy=zero4: expected ddp, no_shard, zero1, zero2 or fsdp");
  CHECK(Error({"--device", "tpu"}) == "--device=tpu: expected auto, cpu or cuda");
  CHECK(Error({"--backend", "mpi"}) == "--backend=mpi: expected auto, gloo or nccl");
  CHECK(Error({"--optimizer", "lamb"}) == "--optimizer=lamb: expected sgd, adam or adamw");
  CHECK(Error({"--lr-schedule", "step"}) == "--lr-schedule=step: expected constant or cosine");
  CHECK(Error({"--linear", "mkl"}) == "--linear=mkl: expected auto, onednn or aten");
  CHECK(Error({"--allreduce", "tcp"}) == "--allreduce=tcp: expected auto, shm or gloo");
}

TEST_CASE("pairs no device can satisfy are refused before anything runs") {
  CHECK(Error({"--backend", "nccl", "--device", "cpu"}).find("--backend=nccl needs CUDA tensors") == 0);
  CHECK(Error({"--backend", "gloo", "--device", "cuda"}) ==
        "--backend=gloo with --device cuda: CUDA tensors go through nccl");
  CHECK(Error({"--allreduce", "shm", "--device", "cuda"}) ==
        "--allreduce=shm sums CPU tensors: use it with --device cpu");
  CHECK(Error({"--batch-size", "10", "--accum-steps", "3"}) == "--batch-size=10 is not divisible by --accum-steps=3");
  CHECK(Error({"--mlp-hidden", "64,0"}) == "--mlp-hidden: width 0 is not positive");
}

TEST_CASE("malformed numbers and unknown flags are errors; --help is not") {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--epochs", "0"}, {"--batch-size", "x"}, {"--lr", "-1"}, {"--no-such-flag"}}) {
    auto parsed = Parse(args);
    CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(parsed.status().message()).find("see elrun-train --help") != std::string::npos);
  }
  auto help = Parse({"--help"});
  REQUIRE(help.ok());
  CHECK_FALSE(help->has_value());
}

}  // namespace
}  // namespace elrun::trainer
