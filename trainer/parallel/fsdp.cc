// FullyShardedDataParallel's steps: gathers and reshards around each unit's forward and backward,
// the gradients' reduce-scatter (or all-reduce) as they become ready, memory accounting. Its
// construction is in fsdp_build.cc.
#include "trainer/parallel/fsdp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "trainer/parallel/activation_checkpoint.h"
#include "trainer/parallel/fsdp_unit.h"
#include "trainer/parallel/fully_shard.h"

namespace elrun::trainer {

using fsdp_internal::Allocated;
using fsdp_internal::Bytes;

FullyShardedDataParallel::~FullyShardedDataParallel() {
  if (classifier_ != nullptr) classifier_->set_child_hooks(nullptr);
  for (ShardedModule* wrapper : wrappers_) wrapper->Detach();
  // Collectives still in flight write into the pool's buffers: wait for them to end first. One
  // that failed (its group lost a rank: elrun-train's regroup in place destroys this wrapper then)
  // has ended too; its error was the caller's to see, and a destructor must not throw it.
  auto settle = [](const auto& finish) {
    try {
      finish();
    } catch (const std::exception&) {
    }
  };
  for (auto& unit : units_) {
    settle([&] {
      if (unit->gather_work) unit->gather_work->wait();
    });
    settle([&] {
      if (unit->reduce_scatter.active()) unit->reduce_scatter.Finish(unit->shard.grad(), 1.0, true);
    });
    ReturnReduceLoans(*unit);
    settle([&] {
      if (unit->all_reduce) unit->all_reduce->wait();
    });
    // The module outlives this wrapper: leave no parameter pointing into the pool's memory.
    pools_->For(unit->full).TakeFrom(unit->full);
    pools_->For(unit->flat_grad).TakeFrom(unit->flat_grad);
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
    if (unit->reduce_scatter.active()) {
      m.working += ReduceScatterOp::ReceiveNumel(DefaultReduceScatter(*pg_), unit->flat_grad.numel(), world_) *
                   static_cast<int64_t>(c10::elementSize(ReduceDtype(*unit)));
    }
    if (unit->separate_shard) m.held += Bytes(unit->shard);
    if (unit->separate_grad && unit->shard.grad().defined()) m.held += Bytes(unit->shard.grad());
    if (options_.strategy != Strategy::kFsdp) m.held += Bytes(unit->full);
    if (!unit->separate_grad) m.held += Bytes(unit->flat_grad);
  }
  m.pooled = pools_ ? pools_->bytes() : 0;
  m.pool_peak_lent = pools_ ? pools_->peak_lent_bytes() : 0;
  m.held += m.pooled;
  m.peak = std::max(peak_, std::max(m.params + m.grads + m.working, m.held));
  return m;
}

void FullyShardedDataParallel::ResetPeak() {
  peak_ = 0;
  UpdatePeak();
}

void FullyShardedDataParallel::Prefetch(Unit& unit) {
  if (unit.gather_work) return;
  switch (options_.strategy) {
    case Strategy::kNoShard: return;
    case Strategy::kZero1:
    case Strategy::kZero2:
      // Optimizers may update through .data() (SGD does), which the version counter does not
      // see: regather after every synchronized backward too, when a step is due.
      if (!unit.stale && unit.full._version() == unit.gathered_version) return;
      break;
    case Strategy::kFsdp:
      if (unit.gathered) return;
      pools_->For(unit.full).LendTo(unit.full);
      break;
    case Strategy::kDdp: return;  // Refused by the constructor.
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
  if (options_.strategy != Strategy::kFsdp) return;
  if (unit.gather_work) {
    unit.gather_work->wait();
    unit.gather_work.reset();
  }
  pools_->For(unit.full).TakeFrom(unit.full);
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

void FullyShardedDataParallel::PostForward(size_t u, const std::vector<torch::Tensor>& outputs) {
  bool backward_follows = false;
  for (const auto& output : outputs) backward_follows |= output.defined() && output.requires_grad();
  // The root unit's parameters are used all along the forward: keep them until its backward.
  if (static_cast<int>(u) != root_ || !backward_follows) Reshard(*units_[u]);
  if (!backward_follows) return;
  for (torch::Tensor output : outputs) {  // (A copy shares the tensor's hooks.)
    if (!output.defined() || !output.requires_grad()) continue;
    output.register_hook([this, u](const torch::Tensor& grad) {
      PreBackward(u);
      return grad;
    });
  }
}

void FullyShardedDataParallel::BeforeChild(const std::string& name) {
  auto it = unit_of_child_.find(name);
  if (it != unit_of_child_.end()) PreForward(it->second);
}

torch::Tensor FullyShardedDataParallel::RunChild(const std::string& name, const torch::Tensor& input,
                                                 const ChildFn& run) {
  if (!options_.activation_checkpointing || !unit_of_child_.count(name)) return run(input);
  // In backward the unit's output hook (PostForward) gathers it before the recomputation runs.
  return CheckpointedCall(input, run);
}

torch::Tensor FullyShardedDataParallel::AfterChild(const std::string& name, torch::Tensor output) {
  auto it = unit_of_child_.find(name);
  if (it != unit_of_child_.end()) PostForward(it->second, {output});
  return output;
}

void FullyShardedDataParallel::RootForwardBegin() {
  forward_order_.clear();
  if (root_ >= 0) PreForward(root_);
}

void FullyShardedDataParallel::RootForwardEnd(const std::vector<torch::Tensor>& outputs) {
  if (root_ >= 0) PostForward(root_, outputs);
  if (!forward_order_.empty()) last_forward_order_ = forward_order_;
  UpdatePeak();
}

torch::Tensor FullyShardedDataParallel::forward(const torch::Tensor& input) {
  TORCH_CHECK(classifier_ != nullptr, "FullyShardedDataParallel::forward: a root made by FullyShard runs its own");
  // Mixed precision: the model computes in param_dtype; the caller gets its own dtype back.
  const bool cast =
      options_.param_dtype.has_value() && input.is_floating_point() && input.scalar_type() != *options_.param_dtype;
  RootForwardBegin();
  torch::Tensor output = classifier_->forward(cast ? input.to(*options_.param_dtype) : input);
  RootForwardEnd({output});
  if (cast && output.is_floating_point()) output = output.to(input.scalar_type());
  return output;
}

c10::ScalarType FullyShardedDataParallel::ReduceDtype(const Unit& unit) const {
  return options_.reduce_dtype.value_or(unit.flat_grad.scalar_type());
}

void FullyShardedDataParallel::ReturnReduceLoans(Unit& unit) {
  for (BufferPool::Loan* loan : {&unit.receive, &unit.cast}) {
    if (loan->index >= 0) pools_->For(ReduceDtype(unit)).Return(*loan);
    *loan = {};
  }
}

void FullyShardedDataParallel::EnsureGradShard(Unit& unit) {
  if (unit.shard.grad().defined()) return;
  // The optimizer's zero_grad() set the gradient shard to None (LibTorch 2's default): start from
  // zeros again, with the same aliasing as the constructor set up.
  torch::NoGradGuard no_grad;
  const int64_t s = unit.shard.numel();
  switch (options_.strategy) {
    case Strategy::kNoShard:
      unit.flat_grad.zero_();
      unit.shard.mutable_grad() = unit.flat_grad;
      break;
    case Strategy::kZero1:
      unit.flat_grad.zero_();
      unit.shard.mutable_grad() =
          torch::empty({0}, unit.flat_grad.options()).set_(unit.flat_grad.storage(), rank_ * s, {s}, {1});
      unit.grad_version = -1;
      break;
    case Strategy::kZero2:
    case Strategy::kFsdp: unit.shard.mutable_grad() = torch::zeros({s}, unit.shard.options()); break;
    case Strategy::kDdp: break;  // Refused by the constructor.
  }
}

void FullyShardedDataParallel::PreBackward(size_t u) {
  if (!in_backward_) {
    in_backward_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { Finalize(); });
  }
  Unit& unit = *units_[u];
  // Once per backward: a unit with several outputs has a hook on each.
  if (unit.backward_begun) return;
  unit.backward_begun = true;
  if (!unit.grad_pending) EnsureGradShard(unit);
  if (options_.strategy == Strategy::kZero1 && sync_ && !unit.grad_pending) {
    TORCH_CHECK(unit.shard.grad()._version() != unit.grad_version,
                "FullyShardedDataParallel(zero1): gradients were not zeroed since the last synchronized "
                "backward; call zero_grad() or accumulate under NoSync");
  }
  Gather(unit);
  if (!Allocated(unit.flat_grad)) {
    pools_->For(unit.flat_grad).LendTo(unit.flat_grad);
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
  FinishReductions(0);               // At most one reduction in flight: bounds the unsharded gradients held.
  if (!Allocated(unit.flat_grad)) {  // Not part of this backward: reduces zeros.
    pools_->For(unit.flat_grad).LendTo(unit.flat_grad);
    unit.flat_grad.zero_();
  }
  if (options_.strategy == Strategy::kNoShard) {
    std::vector<torch::Tensor> tensors{unit.flat_grad};
    unit.all_reduce = pg_->allreduce(tensors);
    if (world_ > 1) bytes_.all_reduce += 2 * Bytes(unit.flat_grad) / world_ * (world_ - 1);
  } else {
    const ReduceScatterAlgorithm algorithm = DefaultReduceScatter(*pg_);
    const int64_t numel = ReduceScatterOp::ReceiveNumel(algorithm, unit.flat_grad.numel(), world_);
    const c10::ScalarType reduce = ReduceDtype(unit);
    const auto options = unit.flat_grad.options().dtype(reduce);
    torch::Tensor input = unit.flat_grad;
    if (reduce != unit.flat_grad.scalar_type()) {  // Mixed precision with another reduce dtype.
      unit.cast = pools_->For(reduce).Lend(unit.flat_grad.numel());
      input = torch::from_blob(unit.cast.data, {unit.flat_grad.numel()}, options);
      input.copy_(unit.flat_grad);
    }
    unit.receive = pools_->For(reduce).Lend(numel);
    unit.reduce_scatter =
        ReduceScatterOp::Start(*pg_, input, &bytes_, algorithm, torch::from_blob(unit.receive.data, {numel}, options));
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
      case Strategy::kNoShard:
        unit.all_reduce->wait();
        unit.all_reduce.reset();
        unit.flat_grad.mul_(scale);
        break;
      case Strategy::kZero1: {
        unit.reduce_scatter.Finish(unit.shard.grad(), scale, false);
        ReturnReduceLoans(unit);
        const int64_t s = unit.shard.numel();
        unit.flat_grad.narrow(0, 0, rank_ * s).zero_();  // Other ranks' shards: reduced there.
        unit.flat_grad.narrow(0, (rank_ + 1) * s, unit.flat_grad.numel() - (rank_ + 1) * s).zero_();
        unit.grad_version = unit.shard.grad()._version();
        break;
      }
      case Strategy::kZero2:
      case Strategy::kFsdp:
        unit.reduce_scatter.Finish(unit.shard.grad(), scale, true);
        ReturnReduceLoans(unit);
        pools_->For(unit.flat_grad).TakeFrom(unit.flat_grad);
        break;
      case Strategy::kDdp: break;  // Refused by the constructor.
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
    unit->backward_begun = false;
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
    if (unit.full.scalar_type() != unit.shard.scalar_type() || options_.offload_optimizer) {
      // Mixed precision or offload: the exact values are the master shards', gathered in their
      // dtype on the backend's device, and returned where the shards live.
      torch::Tensor flat = torch::empty({unit.full.numel()}, unit.full.options().dtype(unit.shard.dtype()));
      StartAllGather(*pg_, unit.shard, flat, &bytes_)->wait();
      for (size_t i = 0; i < unit.params.size(); ++i) {
        result[infos_[u].param_names[i]] = flat.narrow(0, unit.offsets[i], unit.params[i].numel())
                                               .view(unit.params[i].sizes())
                                               .to(unit.shard.device(), /*non_blocking=*/false, /*copy=*/true);
      }
      continue;
    }
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
