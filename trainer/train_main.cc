// elrun-train: the worker binary of the README's main job. Trains FashionNet (or an MLP) on
// Fashion-MNIST with DistributedDataParallel, optional SyncBatchNorm and gradient accumulation,
// checkpoints periodically and on SIGTERM, resumes from the latest checkpoint (also under
// another world size), and reports test accuracy. Runs under elrun or Python's torchrun alike:
// everything distributed comes from the env contract.
#include <malloc.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trainer/checkpoint.h"
#include "trainer/memory.h"
#include "trainer/data_parallel.h"
#include "trainer/fashion_mnist.h"
#include "trainer/linear_kernel.h"
#include "trainer/models.h"
#include "trainer/process_group.h"
#include "trainer/sampler.h"
#include "trainer/shm_allreduce.h"
#include "trainer/sync_batch_norm.h"
#include "trainer/thread_times.h"

extern char** environ;

namespace elrun::trainer {
namespace {

std::atomic<bool> g_stop_requested{false};  // Set by the SIGTERM handler only.

struct Options {
  std::string model = "fashionnet";
  std::string linear = "onednn";
  std::string dataset = "fashion-mnist";
  std::string data_dir = kFashionMnistDir;
  int epochs = 1;
  int64_t max_steps = 0;
  int64_t batch_size = 64;
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  std::string lr_schedule = "cosine";
  std::string optimizer = "sgd";
  std::string strategy = "ddp";
  std::vector<int64_t> mlp_hidden = MlpOptions{}.hidden;
  bool report_memory = false;
  int accum_steps = 1;
  bool sync_bn = false;
  uint64_t seed = 0;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int threads = 1;
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  std::string allreduce = "auto";
  std::string metrics_file;
  std::string step_times_file;
  int64_t log_every = 50;
};

int Fail(const std::string& message, int code = 1) {
  std::cerr << "elrun-train: " << message << std::endl;
  return code;
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

// The learning rate of the step that starts at `position` of the whole run, a fraction in [0, 1]
// of epochs x dataset samples. Derived from the global sample position, not the step count, so a
// run resumed under another world size continues on the same curve.
double ScheduledLr(const Options& o, double position) {
  if (o.lr_schedule == "constant") return o.lr;
  return o.lr * 0.5 * (1.0 + std::cos(M_PI * std::clamp(position, 0.0, 1.0)));
}

void SetLr(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const Options& o, const std::vector<torch::Tensor>& params) {
  if (o.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
  }
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
}

// True on every rank when any rank asked to stop: ranks must leave the loop at the same step,
// because checkpointing (and, for the sharded strategies, saving itself) is collective. Asked
// after every step, so it goes through shared memory when the job has it.
bool AnyRankStopping(c10d::ProcessGroup& pg, ShmAllreduce* shm, bool local) {
  torch::Tensor flag = torch::tensor({local ? 1.0f : 0.0f});
  AllreduceSum(pg, shm, flag)->wait();
  return flag.item<float>() > 0;
}

std::string MemoryJson(const MemoryReport& m) {
  return absl::StrFormat(
      R"("params_bytes":%d,"grads_bytes":%d,"optimizer_bytes":%d,"state_bytes":%d,"peak_bytes":%d,"peak_rss_bytes":%d)",
      m.params, m.grads, m.optimizer_state, m.state(), m.peak, m.peak_rss);
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

torch::Tensor Gather(const torch::Tensor& data, const std::vector<int64_t>& indices) {
  return data.index_select(0, torch::tensor(indices, torch::kLong));
}

// Test accuracy over every rank's strided shard of the test set, reduced across ranks.
double Evaluate(Classifier& model, DataParallel& parallel, const Dataset& test, c10d::ProcessGroup& pg, int rank,
                int world) {
  torch::NoGradGuard no_grad;
  model.eval();
  int64_t correct = 0, total = 0;
  std::vector<int64_t> shard;
  for (int64_t i = rank; i < test.size(); i += world) shard.push_back(i);
  for (size_t begin = 0; begin < shard.size(); begin += 1000) {
    std::vector<int64_t> chunk(shard.begin() + begin, shard.begin() + std::min(shard.size(), begin + 1000));
    auto logits = parallel.Forward(Gather(test.images, chunk));
    correct += logits.argmax(1).eq(Gather(test.labels, chunk)).sum().item<int64_t>();
    total += static_cast<int64_t>(chunk.size());
  }
  std::vector<torch::Tensor> counts{torch::tensor({correct, total}, torch::kLong)};
  pg.allreduce(counts)->wait();
  model.train();
  return counts[0][0].item<double>() / std::max<int64_t>(1, counts[0][1].item<int64_t>());
}

int Train(const Options& o) {
  torch::set_num_threads(o.threads);
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  auto dist_env = ReadDistEnv(env);
  if (!dist_env.ok()) return Fail(std::string(dist_env.status().message()), 2);
  const int rank = dist_env->rank, world = dist_env->world_size;
  std::unique_ptr<StepTimes> step_times;
  if (!o.step_times_file.empty()) {
    auto opened = StepTimes::Open(absl::StrCat(o.step_times_file, ".", rank));
    if (!opened.ok()) return Fail(std::string(opened.status().message()), 2);
    step_times = std::move(*opened);
  }
  auto dist = InitProcessGroup(*dist_env, std::chrono::seconds(120));
  if (!dist.ok()) return Fail(std::string(dist.status().message()));

  absl::StatusOr<Dataset> train, test;
  if (o.dataset == "fashion-mnist") {
    train = LoadFashionMnist(o.data_dir, Split::kTrain);
    test = LoadFashionMnist(o.data_dir, Split::kTest);
  } else if (o.dataset == "synthetic") {
    train = SyntheticDataset(4096, o.seed);
    test = SyntheticDataset(1024, o.seed + 1);
  } else {
    return Fail(absl::StrCat("--dataset=", o.dataset, ": expected fashion-mnist or synthetic"), 2);
  }
  if (!train.ok()) return Fail(std::string(train.status().message()));
  if (!test.ok()) return Fail(std::string(test.status().message()));
  if (o.batch_size % o.accum_steps != 0) {
    return Fail(absl::StrCat("--batch-size=", o.batch_size, " is not divisible by --accum-steps=",
                             o.accum_steps), 2);
  }

  torch::manual_seed(o.seed);
  MlpOptions mlp;
  mlp.hidden = o.mlp_hidden;
  auto linear = ParseLinearKernel(o.linear);
  if (!linear.ok()) return Fail(absl::StrCat("--linear: ", linear.status().message()), 2);
  auto model = MakeModel(o.model, mlp, *linear);
  if (!model.ok()) return Fail(std::string(model.status().message()), 2);
  if (o.lr_schedule != "constant" && o.lr_schedule != "cosine") {
    return Fail(absl::StrCat("--lr-schedule=", o.lr_schedule, ": expected constant or cosine"), 2);
  }
  if (o.optimizer != "sgd" && o.optimizer != "adam") {
    return Fail(absl::StrCat("--optimizer=", o.optimizer, ": expected sgd or adam"), 2);
  }
  if (o.allreduce != "auto" && o.allreduce != "shm" && o.allreduce != "gloo") {
    return Fail(absl::StrCat("--allreduce=", o.allreduce, ": expected auto, shm or gloo"), 2);
  }
  // DDP's buckets and SyncBatchNorm's statistics go through shared memory where every rank can
  // map it (all on this host); the sharded strategies' collectives stay on Gloo.
  std::shared_ptr<ShmAllreduce> shm;
  std::string allreduce = world > 1 ? "gloo" : "none";
  if (world > 1 && o.allreduce != "gloo" && (o.strategy == "ddp" || o.sync_bn)) {
    int64_t capacity = 1 << 20;  // SyncBatchNorm's statistics: 2 x channels + 1 doubles.
    if (o.strategy == "ddp") {  // A bucket holds at most its limit plus its last tensor.
      int64_t largest = 0;
      for (const auto& p : (*model)->parameters()) largest = std::max<int64_t>(largest, p.numel() * p.element_size());
      capacity = std::max<int64_t>(
          capacity, static_cast<int64_t>(std::max(o.bucket_cap_mb, o.first_bucket_mb) * 1024 * 1024) + largest);
    }
    auto created = ShmAllreduce::Create(*dist->store, "shm_allreduce", rank, world, capacity, std::chrono::seconds(120));
    if (created.ok()) {
      shm = std::move(*created);
      allreduce = "shm";
    } else if (o.allreduce == "shm") {
      return Fail(std::string(created.status().message()));
    } else if (rank == 0) {
      std::cerr << "elrun-train: " << created.status().message() << "; all-reduces go through Gloo" << std::endl;
    }
  }
  if (o.sync_bn) ConvertSyncBatchNorm(**model, dist->pg, shm);
  DdpOptions ddp_options;
  ddp_options.bucket_cap_mb = o.bucket_cap_mb;
  ddp_options.first_bucket_mb = o.first_bucket_mb;
  if (o.strategy == "ddp") ddp_options.shm = shm;
  auto parallel = DataParallel::Create(o.strategy, *model, dist->pg, ddp_options);
  if (!parallel.ok()) return Fail(std::string(parallel.status().message()), 2);
  std::unique_ptr<torch::optim::Optimizer> optimizer_owner = MakeOptimizer(o, (*parallel)->OptimizerParameters());
  torch::optim::Optimizer& optimizer = *optimizer_owner;

  TrainProgress progress;
  progress.world_size = world;
  const std::string& checkpoint = o.checkpoint_dir;
  if (!checkpoint.empty()) {
    std::error_code error;
    std::filesystem::create_directories(o.checkpoint_dir, error);
    if (error) return Fail(absl::StrCat("--checkpoint-dir=", o.checkpoint_dir, ": ", error.message()));
  }
  if (!checkpoint.empty()) {
    auto loaded = (*parallel)->Load(checkpoint, optimizer);
    if (loaded.ok()) {
      progress = *loaded;
      if (rank == 0) {
        std::cout << absl::StrFormat("resumed from %s: epoch %d, step %d, sample %d (written by %d ranks, now %d)",
                                     checkpoint, progress.epoch, progress.step, progress.samples_seen,
                                     progress.world_size, world)
                  << std::endl;
      }
      progress.world_size = world;
    } else if (loaded.status().code() != absl::StatusCode::kNotFound) {
      return Fail(std::string(loaded.status().message()));
    }
  }

  DataParallel& dp = **parallel;
  Metrics metrics(rank == 0 ? o.metrics_file : "");
  auto save = [&](bool final) {
    if (checkpoint.empty()) return;
    absl::Status saved = final ? dp.Export(checkpoint, optimizer, progress) : dp.Save(checkpoint, optimizer, progress);
    if (!saved.ok()) std::cerr << "elrun-train: " << saved.message() << std::endl;
  };

  SamplerOptions sampler_options;
  sampler_options.dataset_size = train->size();
  sampler_options.world_size = world;
  sampler_options.rank = rank;
  sampler_options.seed = o.seed;
  sampler_options.drop_last = true;
  sampler_options.batch_size = o.batch_size;
  auto sampler = DistributedSampler::Create(sampler_options);
  if (!sampler.ok()) return Fail(std::string(sampler.status().message()), 2);

  const auto start_time = std::chrono::steady_clock::now();
  const absl::StatusOr<ThreadTimes> start_times = CurrentThreadTimes();
  // Each step's time from its data to the end of the optimizer step (communication included),
  // for the end record's spread: with DDP, a step ends when the slowest rank's does.
  std::vector<double> step_ms;
  int64_t samples_done = 0;
  double last_loss = 0;
  bool stop = false;
  bool signalled = false;  // SIGTERM reached some rank: all save and exit 143 together.
  for (; progress.epoch < o.epochs && !stop; ++progress.epoch, progress.samples_seen = 0) {
    const int64_t start = progress.samples_seen;
    auto batches = sampler->Batches(progress.epoch, start);
    for (size_t b = 0; b < batches.size(); ++b) {
      if (o.max_steps > 0 && progress.step >= o.max_steps) {  // Also when resumed at or past it.
        stop = true;
        break;
      }
      const auto step_start = std::chrono::steady_clock::now();
      const double step_cpu_start = step_times ? ThreadCpuSeconds() : 0;
      auto images = Gather(train->images, batches[b]);
      auto labels = Gather(train->labels, batches[b]);
      const int64_t micro = images.size(0) / o.accum_steps;
      optimizer.zero_grad();
      double loss_sum = 0;
      for (int m = 0; m < o.accum_steps; ++m) {
        int64_t size = m + 1 < o.accum_steps ? micro : images.size(0) - m * micro;
        auto loss = torch::nn::functional::cross_entropy(dp.Forward(images.narrow(0, m * micro, size)),
                                                         labels.narrow(0, m * micro, size)) /
                    o.accum_steps;
        dp.Backward(loss, /*synchronize=*/m + 1 == o.accum_steps);
        loss_sum += loss.item<double>();
      }
      const double position =
          (static_cast<double>(progress.epoch) * train->size() + sampler->Position(start, static_cast<int64_t>(b))) /
          (static_cast<double>(o.epochs) * train->size());
      SetLr(optimizer, ScheduledLr(o, position));
      optimizer.step();
      step_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start).count());
      if (step_times) step_times->Write(progress.step, step_ms.back(), (ThreadCpuSeconds() - step_cpu_start) * 1e3);
      ++progress.step;
      samples_done += images.size(0) * world;
      progress.samples_seen = sampler->Position(start, static_cast<int64_t>(b) + 1);
      last_loss = loss_sum;
      if (o.checkpoint_every > 0 && progress.step % o.checkpoint_every == 0) save(false);
      if (rank == 0 && o.log_every > 0 && progress.step % o.log_every == 0) {
        double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
        double rate = samples_done / std::max(elapsed, 1e-9);
        int64_t left = (o.epochs - progress.epoch) * train->size() - progress.samples_seen;
        std::cout << absl::StrFormat("epoch %d  step %d  loss %.4f  lr %.4g  %.0f samples/s  ETA %.0f s",
                                     progress.epoch, progress.step, last_loss, ScheduledLr(o, position), rate,
                                     left / std::max(rate, 1e-9))
                  << std::endl;
        metrics.Write(absl::StrFormat(R"({"event":"step","epoch":%d,"step":%d,"loss":%.6f,"lr":%.6g,"samples_per_s":%.1f})",
                                      progress.epoch, progress.step, last_loss, ScheduledLr(o, position), rate));
      }
      signalled =
          checkpoint.empty() ? g_stop_requested.load() : AnyRankStopping(*dist->pg, shm.get(), g_stop_requested);
      if ((o.max_steps > 0 && progress.step >= o.max_steps) || signalled) {
        stop = true;
        break;
      }
    }
    if (stop) break;
  }
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  const std::string loop_times = LoopTimesJson(start_times, CurrentThreadTimes(), elapsed);
  const int64_t steps_done = samples_done / std::max<int64_t>(1, o.batch_size * world);
  const MemoryReport memory = dp.Memory(optimizer);
  if (o.report_memory) {
    std::string expected;
    if (o.optimizer == "adam") {
      int64_t params = 0;
      for (const auto& p : (*model)->parameters()) params += p.numel();
      expected = absl::StrFormat("  (ZeRO formula for fp32 Adam: %.2f MiB)",
                                 ExpectedAdamStateBytes(o.strategy == "no_shard" ? "ddp" : o.strategy, params, world) /
                                     (1024.0 * 1024.0));
    }
    std::cout << absl::StrFormat("memory rank %d %s: %s%s", rank, o.strategy, FormatMemoryReport(memory), expected)
              << std::endl;
    std::cout << absl::StrFormat(R"(memory-json {"rank":%d,"strategy":"%s",%s,"step_time_s":%.6f})", rank,
                                 o.strategy, MemoryJson(memory), elapsed / std::max<int64_t>(1, steps_done))
              << std::endl;
  }
  if (signalled) {
    save(false);
    return 128 + SIGTERM;
  }
  save(true);
  double accuracy = Evaluate(**model, dp, *test, *dist->pg, rank, world);
  double rate = samples_done / std::max(elapsed, 1e-9);
  if (rank == 0) {
    std::cout << absl::StrFormat("done: %d steps, %d epochs, %.1f s, %.0f samples/s, test accuracy %.4f",
                                 progress.step, o.epochs, elapsed, rate, accuracy)
              << std::endl;
    metrics.Write(absl::StrFormat(
        R"({"event":"end","test_accuracy":%.6f,"samples_per_s":%.1f,"steps":%d,"epochs":%d,"seconds":%.2f,"world_size":%d,"strategy":"%s","optimizer":"%s","linear":"%s","allreduce":"%s","step_time_s":%.6f,"step_ms_p10":%.3f,"step_ms_p50":%.3f,"step_ms_p90":%.3f,%s%s})",
        accuracy, rate, progress.step, o.epochs, elapsed, world, o.strategy, o.optimizer, o.linear, allreduce,
        elapsed / std::max<int64_t>(1, steps_done), Quantile(step_ms, 0.1), Quantile(step_ms, 0.5),
        Quantile(step_ms, 0.9), loop_times, MemoryJson(memory)));
  }
  return 0;
}

}  // namespace
}  // namespace elrun::trainer

int main(int argc, char** argv) {
  using elrun::trainer::Options;
  Options o;
  CLI::App app("elrun-train: data-parallel training of FashionNet on Fashion-MNIST (LibTorch).",
               "elrun-train");
  app.add_option("--model", o.model, "fashionnet or mlp")->capture_default_str();
  app.add_option("--linear", o.linear,
                 "kernel of the fully connected layers: onednn (as a 1x1 convolution) or aten (the linked BLAS)")
      ->capture_default_str();
  app.add_option("--dataset", o.dataset, "fashion-mnist or synthetic")->capture_default_str();
  app.add_option("--data-dir", o.data_dir, "Fashion-MNIST IDX files")->capture_default_str();
  app.add_option("--epochs", o.epochs, "epochs")->capture_default_str()->check(CLI::Range(1, 100000));
  app.add_option("--max-steps", o.max_steps, "stop after this many steps (0: no limit)")->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "samples per rank per step")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  CLI::Option* lr = app.add_option("--lr", o.lr, "learning rate (default 0.05 for sgd, 0.001 for adam)");
  app.add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
  app.add_option("--optimizer", o.optimizer, "sgd or adam")->capture_default_str();
  app.add_option("--strategy", o.strategy,
                 "ddp (bucketed all-reduce), no_shard, zero1, zero2 or fsdp (FullyShardedDataParallel)")
      ->capture_default_str();
  app.add_option("--mlp-hidden", o.mlp_hidden, "hidden layer widths of --model mlp")
      ->delimiter(',')->capture_default_str();
  app.add_flag("--report-memory", o.report_memory,
               "print each rank's parameter, gradient and optimizer-state bytes, peak and peak RSS");
  app.add_option("--weight-decay", o.weight_decay, "SGD weight decay (L2)")->capture_default_str();
  app.add_option("--lr-schedule", o.lr_schedule,
                 "constant, or cosine: lr x (1 + cos(pi x fraction of epochs done)) / 2, per step")
      ->capture_default_str();
  app.add_option("--accum-steps", o.accum_steps, "micro-batches per step (communication once per step)")
      ->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_flag("--sync-bn", o.sync_bn, "convert BatchNorm layers to SyncBatchNorm");
  app.add_option("--seed", o.seed, "seed of weights and data order")->capture_default_str();
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "save and resume checkpoint.pt here");
  app.add_option("--checkpoint-every", o.checkpoint_every, "save every N steps (0: at the end and on SIGTERM)")->capture_default_str();
  app.add_option("--threads", o.threads, "intra-op threads per rank")->capture_default_str()->check(CLI::Range(1, 256));
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "DDP bucket size limit (MiB)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--first-bucket-mb", o.first_bucket_mb,
                 "limit of DDP's first bucket (MiB), small so the last layers' all-reduce overlaps backward")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--allreduce", o.allreduce,
                 "transport of DDP's and SyncBatchNorm's all-reduces: shm (shared memory, all ranks on "
                 "this host), gloo, or auto (shm where every rank can map it, else gloo)")
      ->capture_default_str();
  app.add_option("--metrics-file", o.metrics_file, "JSON lines: steps and a final {\"event\":\"end\",...}");
  app.add_option("--step-times-file", o.step_times_file,
                 "each rank appends to PATH.<rank>: per step, its wall and CPU milliseconds (tab-separated)");
  app.add_option("--log-every", o.log_every, "progress line every N steps (rank 0)")->capture_default_str();
  try {
    app.parse(argc, argv);
    if (lr->count() == 0 && o.optimizer == "adam") o.lr = 1e-3;
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& error) {
    std::cerr << "elrun-train: " << error.what() << "; see elrun-train --help" << std::endl;
    return 2;
  }
  std::signal(SIGTERM, [](int) { elrun::trainer::g_stop_requested = true; });
  // Every step frees and reallocates the same tensors. With glibc's adaptive mmap threshold a
  // rank could keep mmap/munmap-ing them: measured, one rank took ~36,000 page faults/s and
  // the job ran at half speed (520 instead of 1144 samples/s). Keep them in the heap.
  ::mallopt(M_MMAP_THRESHOLD, 256 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // The sharded strategies all-gather whole layers; Gloo receives each into a fresh layer-sized
  // buffer on its own threads, whose arenas cap heaps at 64 MiB, so every receive was new kernel
  // memory (measured ~100,000 page faults per rank per step for a 53.6M-parameter MLP). One
  // arena keeps those buffers in the main heap: fsdp's step went from 10.6 s to 7.0 s there.
  // ddp is left alone: one arena made FashionNet's DDP ~6% slower (1520 -> 1420 samples/s).
  if (o.strategy != "ddp") ::mallopt(M_ARENA_MAX, 1);
  try {
    return elrun::trainer::Train(o);
  } catch (const c10::Error& error) {
    std::cerr << "elrun-train: " << error.what_without_backtrace() << std::endl;
    return 1;
  }
}
