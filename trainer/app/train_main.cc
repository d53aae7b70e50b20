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
// Files: job.h (the run), job_setup.h (Setup), regroup.h (--keep-survivors), train_report.h (the
// end of a run); this file holds the loop and main.
#include <malloc.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "absl/strings/str_format.h"
#include "trainer/app/job.h"
#include "trainer/app/job_setup.h"
#include "trainer/app/regroup.h"
#include "trainer/app/train_options.h"
#include "trainer/app/train_report.h"
#include "trainer/dist/collectives.h"
#include "trainer/memory/caching_cpu_allocator.h"
#include "trainer/optim/foreach_sgd.h"
#include "trainer/runtime/thread_times.h"

namespace {

// Set by the SIGTERM handler only; the Job reads it (Job::stop_requested).
std::atomic<bool> g_stop_requested{false};

}  // namespace

namespace elrun::trainer::app {
namespace {

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
          loop.signalled = checkpoint.empty() ? job.stop_requested() : AnyRankStopping(job, job.stop_requested());
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

int Train(const TrainOptions& o, const std::atomic<bool>& stop_requested) {
  torch::set_num_threads(o.threads);
  auto job = Setup(o, stop_requested);
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
}  // namespace elrun::trainer::app

int main(int argc, char** argv) {
  auto parsed = elrun::trainer::ParseTrainOptions(argc, argv, std::cout);
  if (!parsed.ok()) return elrun::trainer::app::Fail(parsed.status());
  if (!parsed->has_value()) return 0;  // --help.
  const elrun::trainer::TrainOptions& o = **parsed;
  std::signal(SIGTERM, [](int) { g_stop_requested = true; });
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
    return elrun::trainer::app::Train(o, g_stop_requested);
  } catch (const c10::Error& error) {
    std::cerr << "elrun-train: " << error.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "elrun-train: " << error.what() << std::endl;
    return 1;
  }
}
