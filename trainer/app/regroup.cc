#include "trainer/app/regroup.h"

#include <unistd.h>

#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trainer/app/job_setup.h"
#include "trainer/dist/collectives.h"
#include "trainer/parallel/live_state.h"
#include "trainer/parallel/sync_batch_norm.h"

namespace elrun::trainer::app {

namespace {

// How long building a regrouped process group may take: a replacement worker starts in about a
// second.
constexpr std::chrono::seconds kRegroupTimeout{60};

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

}  // namespace

void AttachSyncBatchNorms(Job& job, c10::intrusive_ptr<c10d::Backend> pg, std::shared_ptr<ShmAllreduce> shm) {
  for (const auto& module : job.model->modules()) {
    if (auto* norm = dynamic_cast<SyncBatchNormImpl*>(module.get())) norm->Attach(pg, shm);
  }
}

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

absl::Status TakeLiveState(Job& job, const std::optional<TrainProgress>& mine, const std::optional<ShardBytes>& live,
                           const std::optional<RegroupTimes>& survivor) {
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
  while (!next && !job.stop_requested() && std::chrono::steady_clock::now() - start < job.regroup_wait) {
    next = job.control->Wait(std::chrono::milliseconds(100));
  }
  if (job.stop_requested()) return absl::CancelledError("stopped while waiting to regroup");
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

}  // namespace elrun::trainer::app
