#include "trainer/parallel/live_state.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "trainer/dist/collectives.h"

namespace elrun::trainer {

absl::StatusOr<LiveSync> SyncLiveState(c10d::Backend& pg, DataParallel& dp, torch::optim::Optimizer& optimizer,
                                       const std::optional<TrainProgress>& mine) {
  const int rank = pg.getRank(), world = pg.getSize();
  const torch::Device device = CommDevice(pg);
  LiveSync sync;
  try {
    // Every rank's step (-1: none), by an all-reduce of one slot each.
    torch::Tensor steps = torch::full({world}, -1, torch::kLong);
    steps[rank] = mine ? mine->step : -1;
    steps = steps.to(device);
    std::vector<torch::Tensor> all{steps};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    pg.allreduce(all, max)->wait();
    const torch::Tensor gathered = all[0].cpu();
    int64_t best = -1;
    for (int r = 0; r < world; ++r) {
      const int64_t step = gathered[r].item<int64_t>();
      if (step < 0) ++sync.stateless_ranks;
      if (step > best) {
        best = step;
        sync.source_rank = r;
      }
    }
    if (best < 0) return absl::FailedPreconditionError("regroup: no rank of the new group holds training state");

    // The source's state as bytes: first their count (-1: the source failed to serialise), then
    // the bytes themselves.
    std::vector<char> bytes;
    absl::Status source_error;
    if (rank == sync.source_rank) {
      absl::StatusOr<std::vector<char>> state = dp.StateBytes(optimizer, *mine);
      if (state.ok()) {
        bytes = std::move(*state);
      } else {
        source_error = state.status();
      }
    }
    torch::Tensor count =
        torch::full({1}, source_error.ok() ? static_cast<int64_t>(bytes.size()) : -1, torch::kLong).to(device);
    Broadcast(pg, count, sync.source_rank);
    const int64_t size = count.cpu().item<int64_t>();
    if (size < 0) {
      if (!source_error.ok()) return source_error;
      return absl::InternalError(absl::StrCat("regroup: rank ", sync.source_rank, " could not serialise its state"));
    }
    sync.bytes = size;
    torch::Tensor wire = torch::empty({size}, torch::kUInt8);
    if (rank == sync.source_rank) std::memcpy(wire.data_ptr<uint8_t>(), bytes.data(), bytes.size());
    wire = wire.to(device);
    Broadcast(pg, wire, sync.source_rank);
    if (rank == sync.source_rank) {
      sync.progress = *mine;
    } else {
      wire = wire.cpu().contiguous();
      bytes.assign(reinterpret_cast<const char*>(wire.data_ptr<uint8_t>()),
                   reinterpret_cast<const char*>(wire.data_ptr<uint8_t>()) + size);
      absl::StatusOr<TrainProgress> loaded =
          dp.LoadStateBytes(bytes, absl::StrCat("the live state of rank ", sync.source_rank), optimizer);
      if (!loaded.ok()) return loaded.status();
      sync.progress = *loaded;
    }
    sync.progress.world_size = world;
    return sync;
  } catch (const std::exception& error) {
    return absl::UnavailableError(absl::StrCat("regroup: ", ErrorText(error)));
  }
}

}  // namespace elrun::trainer
