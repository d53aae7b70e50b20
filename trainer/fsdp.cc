#include "trainer/fsdp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"

namespace elrun::trainer {

struct FullyShardedDataParallel::Unit {
  std::vector<torch::Tensor> params;  // The module's parameters: views of `full`.
  std::vector<int64_t> offsets;       // Of each parameter in `full`.
  torch::Tensor full;                 // [padded]; storage released while resharded.
  torch::Tensor shard;                // [shard_numel]: a view of `full` unless kFullShard.
  torch::Tensor flat_grad;            // [padded]; the parameters' .grad are views of it.
  bool separate_shard = false;        // kFullShard: shard is not a view of full.
  bool separate_grad = false;         // kShardGradOp/kFullShard: the gradient shard has its own memory.
  bool gathered = false;              // kFullShard: full holds the current parameters.
  int64_t gathered_version = -1;      // kShardOptimizer/GradOp: full's version after the last gather.
  bool stale = false;                 // kShardOptimizer/GradOp: a synchronized backward since then.
  c10::intrusive_ptr<c10d::Work> gather_work;  // A prefetch in flight.
  std::vector<bool> ready;
  size_t pending = 0;
  bool grad_pending = false;  // flat_grad holds NoSync gradients not reduced yet.
  int64_t grad_version = -1;  // kShardOptimizer: the gradient shard's version after a reduction.
  ReduceScatterOp reduce_scatter;
  c10::intrusive_ptr<c10d::Work> all_reduce;
};

namespace {

int64_t Bytes(const torch::Tensor& t) { return t.numel() * t.element_size(); }

c10::StorageImpl* StorageOf(const torch::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

bool Allocated(const torch::Tensor& t) { return t.defined() && StorageOf(t)->nbytes() > 0; }

// Gives the storage of `t` (and of every view of it) its memory back, or takes it away. Views
// keep their offsets, so parameters and the tensors autograd saved are valid again after Allocate.
// The storage's own allocator serves it, so this works for CPU and CUDA (caching allocator) alike;
// the old contents are not kept (every caller overwrites them). On CUDA a released block is
// reused only by work ordered after what was queued on its stream, and the NCCL backend records
// its own streams' use of the tensors it was given.
void Allocate(const torch::Tensor& t) {
  if (Allocated(t)) return;
  c10::StorageImpl* storage = StorageOf(t);
  const size_t bytes = static_cast<size_t>(Bytes(t) + t.storage_offset() * t.element_size());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}
void Release(const torch::Tensor& t) {
  c10::StorageImpl* storage = StorageOf(t);
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

}  // namespace

absl::StatusOr<ShardingStrategy> ParseShardingStrategy(const std::string& name) {
  if (name == "ddp" || name == "no_shard") return ShardingStrategy::kNoShard;
  if (name == "zero1" || name == "shard_optimizer") return ShardingStrategy::kShardOptimizer;
  if (name == "zero2" || name == "shard_grad_op") return ShardingStrategy::kShardGradOp;
  if (name == "fsdp" || name == "zero3" || name == "full_shard") return ShardingStrategy::kFullShard;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown sharding strategy '", name, "': expected ddp, zero1, zero2 or fsdp"));
}

std::string ShardingStrategyName(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kNoShard: return "no_shard";
    case ShardingStrategy::kShardOptimizer: return "zero1";
    case ShardingStrategy::kShardGradOp: return "zero2";
    case ShardingStrategy::kFullShard: return "fsdp";
  }
  return "?";
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<Classifier> module,
                                                   c10::intrusive_ptr<c10d::Backend> pg,
                                                   FsdpOptions options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(options), rank_(pg_->getRank()),
      world_(pg_->getSize()) {
  const ShardingStrategy strategy = options_.strategy;
  shards_per_unit_ = strategy == ShardingStrategy::kNoShard ? 1 : world_;
  {
    std::vector<torch::Tensor> state;
    for (const auto& p : module_->parameters()) state.push_back(p);
    for (const auto& b : module_->buffers()) state.push_back(b);
    BroadcastFromRank0(*pg_, state, &bytes_);
  }

  // Wrap policy: children with enough parameters are units; the rest is the root unit.
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, torch::Tensor>>>> groups;
  std::set<const void*> claimed;
  for (const auto& child : module_->named_children()) {
    std::vector<std::pair<std::string, torch::Tensor>> params;
    int64_t count = 0;
    for (const auto& p : child.value()->named_parameters()) {
      if (!p.value().requires_grad()) continue;
      params.emplace_back(child.key() + "." + p.key(), p.value());
      count += p.value().numel();
    }
    if (params.empty() || count < options_.min_unit_params) continue;
    for (const auto& p : params) claimed.insert(p.second.unsafeGetTensorImpl());
    unit_of_child_[child.key()] = groups.size();
    groups.emplace_back(child.key(), std::move(params));
  }
  std::vector<std::pair<std::string, torch::Tensor>> rest;
  for (const auto& p : module_->named_parameters()) {
    if (p.value().requires_grad() && !claimed.count(p.value().unsafeGetTensorImpl())) {
      rest.emplace_back(p.key(), p.value());
    }
  }
  if (!rest.empty()) {
    root_ = static_cast<int>(groups.size());
    groups.emplace_back("", std::move(rest));
  }

  torch::NoGradGuard no_grad;
  const int n = shards_per_unit_;
  for (auto& [name, params] : groups) {
    auto unit = std::make_unique<Unit>();
    FsdpUnitInfo info;
    info.name = name;
    for (const auto& [param_name, p] : params) {
      info.param_names.push_back(param_name);
      info.shapes.push_back(p.sizes().vec());
      unit->offsets.push_back(info.numel);
      unit->params.push_back(p);
      info.numel += p.numel();
    }
    info.padded = (info.numel + n - 1) / n * n;
    info.shard_numel = info.padded / n;
    const auto options = params.front().second.options().requires_grad(false);
    unit->full = torch::zeros({info.padded}, options);
    unit->flat_grad = torch::zeros({info.padded}, options);
    for (size_t i = 0; i < unit->params.size(); ++i) {
      torch::Tensor& p = unit->params[i];
      auto slot = unit->full.narrow(0, unit->offsets[i], p.numel()).view(p.sizes());
      slot.copy_(p);
      p.set_data(slot);
      p.mutable_grad() = unit->flat_grad.narrow(0, unit->offsets[i], p.numel()).view(p.sizes());
    }
    const int64_t s = info.shard_numel;
    switch (strategy) {
      case ShardingStrategy::kNoShard:
        unit->shard = unit->full;
        unit->shard.mutable_grad() = unit->flat_grad;
        break;
      case ShardingStrategy::kShardOptimizer:
        unit->shard = unit->full.narrow(0, rank_ * s, s);
        // Aliases the flat gradient's memory without being an autograd view of it: optimizers'
        // zero_grad() detach_()es gradients, which views refuse.
        unit->shard.mutable_grad() =
            torch::empty({0}, options).set_(unit->flat_grad.storage(), rank_ * s, {s}, {1});
        break;
      case ShardingStrategy::kShardGradOp:
        unit->shard = unit->full.narrow(0, rank_ * s, s);
        unit->shard.mutable_grad() = torch::zeros({s}, options);
        unit->separate_grad = true;
        Release(unit->flat_grad);
        break;
      case ShardingStrategy::kFullShard:
        unit->shard = unit->full.narrow(0, rank_ * s, s).clone();
        unit->shard.mutable_grad() = torch::zeros({s}, options);
        unit->separate_shard = true;
        unit->separate_grad = true;
        Release(unit->flat_grad);
        Release(unit->full);
        break;
    }
    unit->gathered_version = unit->full._version();
    unit->ready.assign(unit->params.size(), false);
    unit->pending = unit->params.size();
    shards_.push_back(unit->shard);
    infos_.push_back(std::move(info));
    units_.push_back(std::move(unit));
  }

  for (size_t u = 0; u < units_.size(); ++u) {
    for (size_t i = 0; i < units_[u]->params.size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(units_[u]->params[i]);
      accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, u, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            OnGradReady(u, i);
            return outputs;
          }));
      accumulators_.push_back(std::move(accumulator));
    }
  }
  for (size_t u = 0; u < units_.size(); ++u) last_forward_order_.push_back(u);
  module_->set_child_hooks(this);
  UpdatePeak();
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  module_->set_child_hooks(nullptr);
  for (auto& unit : units_) {
    if (unit->gather_work) unit->gather_work->wait();
    if (unit->reduce_scatter.active()) unit->reduce_scatter.Finish(unit->shard.grad(), 1.0, true);
    if (unit->all_reduce) unit->all_reduce->wait();
  }
}

void FullyShardedDataParallel::UpdatePeak() { peak_ = std::max(peak_, memory().peak); }

FsdpMemory FullyShardedDataParallel::memory() const {
  FsdpMemory m;
  for (const auto& unit : units_) {
    if (Allocated(unit->full)) m.params += Bytes(unit->full);
    if (Allocated(unit->flat_grad)) m.grads += Bytes(unit->flat_grad);
    if (unit->separate_shard) m.params += Bytes(unit->shard);
    if (unit->separate_grad && unit->shard.grad().defined()) m.grads += Bytes(unit->shard.grad());
    if (unit->reduce_scatter.active()) m.working += Bytes(unit->flat_grad);
  }
  m.peak = std::max(peak_, m.params + m.grads + m.working);
  return m;
}

void FullyShardedDataParallel::ResetPeak() {
  peak_ = 0;
  UpdatePeak();
}

void FullyShardedDataParallel::Prefetch(Unit& unit) {
  if (unit.gather_work) return;
  switch (options_.strategy) {
    case ShardingStrategy::kNoShard:
      return;
    case ShardingStrategy::kShardOptimizer:
    case ShardingStrategy::kShardGradOp:
      // Optimizers may update through .data() (SGD does), which the version counter does not
      // see: regather after every synchronized backward too, when a step is due.
      if (!unit.stale && unit.full._version() == unit.gathered_version) return;
      break;
    case ShardingStrategy::kFullShard:
      if (unit.gathered) return;
      Allocate(unit.full);
      break;
  }
  unit.gather_work = StartAllGather(*pg_, unit.shard, unit.full, &bytes_);
  UpdatePeak();
}

void FullyShardedDataParallel::Gather(Unit& unit) {
  Prefetch(unit);
  if (unit.gather_work) {
    unit.gather_work->wait();
    unit.gather_work.reset();
    unit.gathered = true;
    unit.gathered_version = unit.full._version();
    unit.stale = false;
  }
}

void FullyShardedDataParallel::Reshard(Unit& unit) {
  if (options_.strategy != ShardingStrategy::kFullShard) return;
  if (unit.gather_work) {
    unit.gather_work->wait();
    unit.gather_work.reset();
  }
  Release(unit.full);
  unit.gathered = false;
}

void FullyShardedDataParallel::PreForward(size_t u) {
  Gather(*units_[u]);
  forward_order_.push_back(u);
  if (!options_.prefetch) return;
  // Prefetch the unit that followed this one in the last iteration's forward.
  auto at = std::find(last_forward_order_.begin(), last_forward_order_.end(), u);
  if (at != last_forward_order_.end() && at + 1 != last_forward_order_.end()) Prefetch(*units_[*(at + 1)]);
}

torch::Tensor FullyShardedDataParallel::PostForward(size_t u, torch::Tensor output) {
  const bool backward_follows = output.requires_grad();
  // The root unit's parameters are used all along the forward: keep them until its backward.
  if (static_cast<int>(u) != root_ || !backward_follows) Reshard(*units_[u]);
  if (backward_follows) {
    output.register_hook([this, u](const torch::Tensor& grad) {
      PreBackward(u);
      return grad;
    });
  }
  return output;
}

void FullyShardedDataParallel::BeforeChild(const std::string& name) {
  auto it = unit_of_child_.find(name);
  if (it != unit_of_child_.end()) PreForward(it->second);
}

torch::Tensor FullyShardedDataParallel::AfterChild(const std::string& name, torch::Tensor output) {
  auto it = unit_of_child_.find(name);
  return it == unit_of_child_.end() ? output : PostForward(it->second, std::move(output));
}

torch::Tensor FullyShardedDataParallel::forward(const torch::Tensor& input) {
  forward_order_.clear();
  if (root_ >= 0) PreForward(root_);
  torch::Tensor output = module_->forward(input);
  if (root_ >= 0) output = PostForward(root_, output);
  if (!forward_order_.empty()) last_forward_order_ = forward_order_;
  UpdatePeak();
  return output;
}

void FullyShardedDataParallel::EnsureGradShard(Unit& unit) {
  if (unit.shard.grad().defined()) return;
  // The optimizer's zero_grad() set the gradient shard to None (LibTorch 2's default): start from
  // zeros again, with the same aliasing as the constructor set up.
  torch::NoGradGuard no_grad;
  const int64_t s = unit.shard.numel();
  switch (options_.strategy) {
    case ShardingStrategy::kNoShard:
      unit.flat_grad.zero_();
      unit.shard.mutable_grad() = unit.flat_grad;
      break;
    case ShardingStrategy::kShardOptimizer:
      unit.flat_grad.zero_();
      unit.shard.mutable_grad() =
          torch::empty({0}, unit.flat_grad.options()).set_(unit.flat_grad.storage(), rank_ * s, {s}, {1});
      unit.grad_version = -1;
      break;
    case ShardingStrategy::kShardGradOp:
    case ShardingStrategy::kFullShard:
      unit.shard.mutable_grad() = torch::zeros({s}, unit.shard.options());
      break;
  }
}

void FullyShardedDataParallel::PreBackward(size_t u) {
  if (!in_backward_) {
    in_backward_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { Finalize(); });
  }
  Unit& unit = *units_[u];
  if (!unit.grad_pending) EnsureGradShard(unit);
  if (options_.strategy == ShardingStrategy::kShardOptimizer && sync_ && !unit.grad_pending) {
    TORCH_CHECK(unit.shard.grad()._version() != unit.grad_version,
                "FullyShardedDataParallel(zero1): gradients were not zeroed since the last synchronized "
                "backward; call zero_grad() or accumulate under NoSync");
  }
  Gather(unit);
  if (!Allocated(unit.flat_grad)) {
    Allocate(unit.flat_grad);
    unit.flat_grad.zero_();
  }
  UpdatePeak();
  if (!options_.prefetch) return;
  // Backward runs the units in reverse forward order: prefetch the one before this.
  auto at = std::find(last_forward_order_.begin(), last_forward_order_.end(), u);
  if (at != last_forward_order_.end() && at != last_forward_order_.begin()) Prefetch(*units_[*(at - 1)]);
}

void FullyShardedDataParallel::OnGradReady(size_t u, size_t i) {
  Unit& unit = *units_[u];
  if (unit.ready[i]) return;
  unit.ready[i] = true;
  if (--unit.pending > 0) return;
  Reshard(unit);  // This unit's backward is over.
  if (sync_) {
    Reduce(u);
  } else {
    unit.grad_pending = true;
  }
}

void FullyShardedDataParallel::Reduce(size_t u) {
  Unit& unit = *units_[u];
  if (!unit.grad_pending) EnsureGradShard(unit);
  FinishReductions(0);  // At most one reduction in flight: bounds the unsharded gradients held.
  if (!Allocated(unit.flat_grad)) {  // Not part of this backward: reduces zeros.
    Allocate(unit.flat_grad);
    unit.flat_grad.zero_();
  }
  if (options_.strategy == ShardingStrategy::kNoShard) {
    std::vector<torch::Tensor> tensors{unit.flat_grad};
    unit.all_reduce = pg_->allreduce(tensors);
    if (world_ > 1) bytes_.all_reduce += 2 * Bytes(unit.flat_grad) / world_ * (world_ - 1);
  } else {
    unit.reduce_scatter = ReduceScatterOp::Start(*pg_, unit.flat_grad, &bytes_);
  }
  in_flight_.push_back(u);
  UpdatePeak();
}

void FullyShardedDataParallel::FinishReductions(size_t keep) {
  torch::NoGradGuard no_grad;
  const double scale = 1.0 / world_;
  while (in_flight_.size() > keep) {
    Unit& unit = *units_[in_flight_.front()];
    in_flight_.erase(in_flight_.begin());
    switch (options_.strategy) {
      case ShardingStrategy::kNoShard:
        unit.all_reduce->wait();
        unit.all_reduce.reset();
        unit.flat_grad.mul_(scale);
        break;
      case ShardingStrategy::kShardOptimizer: {
        unit.reduce_scatter.Finish(unit.shard.grad(), scale, false);
        const int64_t s = unit.shard.numel();
        unit.flat_grad.narrow(0, 0, rank_ * s).zero_();  // Other ranks' shards: reduced there.
        unit.flat_grad.narrow(0, (rank_ + 1) * s, unit.flat_grad.numel() - (rank_ + 1) * s).zero_();
        unit.grad_version = unit.shard.grad()._version();
        break;
      }
      case ShardingStrategy::kShardGradOp:
      case ShardingStrategy::kFullShard:
        unit.reduce_scatter.Finish(unit.shard.grad(), scale, true);
        Release(unit.flat_grad);
        break;
    }
    unit.grad_pending = false;
  }
}

void FullyShardedDataParallel::Finalize() {
  // Units that (partly) got no gradient in this backward: reduce what they have (zeros for the
  // missing parameters), as PyTorch's FSDP does.
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    if (unit.pending == 0) continue;
    Reshard(unit);
    if (sync_) {
      Reduce(u);
    } else if (Allocated(unit.flat_grad)) {
      unit.grad_pending = true;
    }
  }
  FinishReductions(0);
  for (auto& unit : units_) {
    std::fill(unit->ready.begin(), unit->ready.end(), false);
    unit->pending = unit->params.size();
    // A prefetch started in backward must not outlive the optimizer step that follows.
    Reshard(*unit);
    if (unit->gather_work) {
      unit->gather_work->wait();
      unit->gather_work.reset();
    }
    if (sync_) unit->stale = true;
  }
  in_backward_ = false;
}

std::map<std::string, torch::Tensor> FullyShardedDataParallel::FullParameters() {
  std::map<std::string, torch::Tensor> result;
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = *units_[u];
    Gather(unit);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      result[infos_[u].param_names[i]] = unit.params[i].detach().clone();
    }
    Reshard(unit);
  }
  return result;
}

void FullyShardedDataParallel::ShardsChanged() {
  for (auto& unit : units_) {
    if (unit->gather_work) {
      unit->gather_work->wait();
      unit->gather_work.reset();
    }
    unit->gathered_version = -1;
    if (unit->gathered) Reshard(*unit);
  }
}

void FullyShardedDataParallel::BroadcastBuffers() {
  std::vector<torch::Tensor> buffers;
  for (const auto& b : module_->buffers()) buffers.push_back(b);
  BroadcastFromRank0(*pg_, buffers, &bytes_);
}

}  // namespace elrun::trainer
