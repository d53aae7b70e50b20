#include "trainer/dist/collectives.h"

#include <map>

namespace elrun::trainer {
namespace {

int64_t Bytes(const torch::Tensor& t) { return t.numel() * t.element_size(); }

}  // namespace

torch::Device CommDevice(const c10d::Backend& pg) {
  if (pg.getBackendName() == "nccl") {
    std::optional<at::Device> bound = pg.getBoundDeviceId();
    TORCH_CHECK(bound.has_value(), "an NCCL backend must be bound to its device (MakeNcclBackend does it)");
    return *bound;
  }
  return torch::kCPU;
}

ReduceScatterAlgorithm DefaultReduceScatter(const c10d::Backend& pg) {
  return pg.getBackendName() == "nccl" ? ReduceScatterAlgorithm::kNative : ReduceScatterAlgorithm::kAllToAll;
}

namespace {

// Several works in flight as one: wait() waits for each, in order.
class WorkGroup final : public c10d::Work {
 public:
  explicit WorkGroup(std::vector<c10::intrusive_ptr<c10d::Work>> works) : works_(std::move(works)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& work : works_) work->wait(timeout);
    return true;
  }
  bool isCompleted() override {
    for (auto& work : works_) {
      if (!work->isCompleted()) return false;
    }
    return true;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> StartAllGather(c10d::Backend& pg, const torch::Tensor& shard, const torch::Tensor& full,
                                              CommBytes* bytes) {
  const int n = pg.getSize();
  TORCH_CHECK(shard.is_contiguous() && full.is_contiguous() && shard.dim() == 1 && full.dim() == 1,
              "all-gather: shard and full buffer must be contiguous 1-d tensors");
  TORCH_CHECK(full.numel() == n * shard.numel(), "all-gather: full buffer has ", full.numel(), " elements, expected ",
              n, " x ", shard.numel());
  const int64_t s = shard.numel();
  if (bytes) bytes->all_gather += s * static_cast<int64_t>(full.element_size()) * (n - 1);
  if (pg.getBackendName() != "gloo" && shard.scalar_type() == full.scalar_type() && shard.device() == full.device()) {
    torch::Tensor output = full, input = shard;
    return pg._allgather_base(output, input);
  }
  // This rank's chunk first (cast to full's dtype: mixed precision gathers a copy of the shard).
  torch::Tensor mine = full.narrow(0, pg.getRank() * s, s);
  if (mine.data_ptr() != shard.data_ptr()) {
    torch::NoGradGuard no_grad;
    mine.copy_(shard);
  }
  if (pg.getBackendName() != "gloo") {  // In place: the input is the output's own chunk.
    torch::Tensor output = full;
    return pg._allgather_base(output, mine);
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int r = 0; r < n; ++r) {
    c10d::BroadcastOptions options;
    options.rootRank = r;
    std::vector<torch::Tensor> chunk{full.narrow(0, r * s, s)};
    works.push_back(pg.broadcast(chunk, options));
  }
  return c10::make_intrusive<WorkGroup>(std::move(works));
}

ReduceScatterOp ReduceScatterOp::Start(c10d::Backend& pg, const torch::Tensor& input, CommBytes* bytes) {
  return Start(pg, input, bytes, DefaultReduceScatter(pg));
}

int64_t ReduceScatterOp::ReceiveNumel(ReduceScatterAlgorithm algorithm, int64_t input_numel, int n) {
  return algorithm == ReduceScatterAlgorithm::kNative ? input_numel / n : input_numel;
}

ReduceScatterOp ReduceScatterOp::Start(c10d::Backend& pg, const torch::Tensor& input, CommBytes* bytes,
                                       ReduceScatterAlgorithm algorithm) {
  return Start(pg, input, bytes, algorithm,
               torch::empty({ReceiveNumel(algorithm, input.numel(), pg.getSize())}, input.options()));
}

ReduceScatterOp ReduceScatterOp::Start(c10d::Backend& pg, const torch::Tensor& input, CommBytes* bytes,
                                       ReduceScatterAlgorithm algorithm, const torch::Tensor& receive) {
  const int n = pg.getSize();
  TORCH_CHECK(input.is_contiguous() && input.dim() == 1, "reduce-scatter: input must be a contiguous 1-d tensor");
  TORCH_CHECK(input.numel() % n == 0, "reduce-scatter: ", input.numel(), " elements do not split evenly over ", n,
              " ranks");
  const int64_t needed = ReceiveNumel(algorithm, input.numel(), n);
  TORCH_CHECK(receive.is_contiguous() && receive.numel() >= needed && receive.scalar_type() == input.scalar_type() &&
                  receive.device() == input.device(),
              "reduce-scatter: the receive buffer must be contiguous ", input.scalar_type(), " on ", input.device(),
              " with at least ", needed, " elements");
  ReduceScatterOp op;
  op.input_ = input;
  const bool native = algorithm == ReduceScatterAlgorithm::kNative;
  op.received_ = receive.reshape({-1}).narrow(0, 0, needed).view({native ? 1 : n, input.numel() / n});
  op.started_ = true;
  if (n == 1) {
    op.received_.view({-1}).copy_(input);
    return op;
  }
  torch::Tensor output = op.received_.view({-1});
  if (native) {
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    op.work_ = pg._reduce_scatter_base(output, op.input_, options);
  } else {
    std::vector<int64_t> equal_splits;  // Empty: n equal chunks.
    op.work_ = pg.alltoall_base(output, op.input_, equal_splits, equal_splits);
  }
  if (bytes) bytes->reduce_scatter += Bytes(input) / n * (n - 1);
  return op;
}

void ReduceScatterOp::Finish(const torch::Tensor& output, double scale, bool accumulate) {
  TORCH_CHECK(started_, "reduce-scatter: Finish without Start");
  if (work_) work_->wait();
  torch::NoGradGuard no_grad;
  TORCH_CHECK(output.numel() == received_.size(1), "reduce-scatter: output has ", output.numel(),
              " elements, expected ", received_.size(1));
  torch::Tensor sum = received_.select(0, 0);
  for (int64_t r = 1; r < received_.size(0); ++r) sum.add_(received_.select(0, r));  // Rank order.
  if (scale != 1.0) sum.mul_(scale);
  torch::Tensor out = output.view({-1});
  if (sum.device() != out.device()) sum = sum.to(out.device());  // An offloaded gradient shard.
  if (accumulate) {
    out.add_(sum);
  } else {
    out.copy_(sum);
  }
  started_ = false;
  work_.reset();
  input_ = torch::Tensor();
  received_ = torch::Tensor();
}

std::string ErrorText(const std::exception& error) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&error)) return c10->what_without_backtrace();
  return error.what();
}

void Broadcast(c10d::Backend& pg, torch::Tensor& tensor, int root) {
  std::vector<torch::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  pg.broadcast(tensors, options)->wait();
}

void BroadcastFromRank0(c10d::Backend& pg, const std::vector<torch::Tensor>& tensors, CommBytes* bytes) {
  torch::NoGradGuard no_grad;
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  auto broadcast = [&](torch::Tensor t) {
    std::vector<torch::Tensor> one{std::move(t)};
    pg.broadcast(one, options)->wait();
    if (bytes && pg.getRank() == 0) bytes->broadcast += Bytes(one[0]) * (pg.getSize() - 1);
  };
  // Every rank walks the same tensors in the same order, so the collectives match.
  std::map<c10::ScalarType, std::vector<torch::Tensor>> small;
  for (const auto& t : tensors) {
    if (t.is_contiguous() && Bytes(t) >= kBroadcastBucketBytes) {
      broadcast(t.detach());  // In place: no copy of a big tensor.
    } else {
      small[t.scalar_type()].push_back(t);
    }
  }
  for (auto& [type, group] : small) {
    for (size_t begin = 0; begin < group.size();) {
      size_t end = begin;
      int64_t size = 0;
      while (end < group.size() && (end == begin || size + Bytes(group[end]) <= kBroadcastBucketBytes)) {
        size += Bytes(group[end++]);
      }
      std::vector<torch::Tensor> flats;
      for (size_t i = begin; i < end; ++i) flats.push_back(group[i].detach().reshape({-1}));
      torch::Tensor flat = torch::cat(flats);
      broadcast(flat);
      int64_t offset = 0;
      for (size_t i = begin; i < end; ++i) {
        group[i].detach().copy_(flat.narrow(0, offset, group[i].numel()).view_as(group[i]));
        offset += group[i].numel();
      }
      begin = end;
    }
  }
}

void AllGather(c10d::Backend& pg, const torch::Tensor& shard, const torch::Tensor& full, CommBytes* bytes) {
  StartAllGather(pg, shard, full, bytes)->wait();
}

void ReduceScatter(c10d::Backend& pg, const torch::Tensor& input, const torch::Tensor& output, CommBytes* bytes) {
  ReduceScatterOp::Start(pg, input, bytes).Finish(output, 1.0, false);
}

}  // namespace elrun::trainer
