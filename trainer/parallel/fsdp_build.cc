// FullyShardedDataParallel's construction: units from the wrappers the model was built with
// (fully_shard.h) or from the policy, their flat buffers and shards, and the check that every
// rank built the same model. Its steps are in fsdp.cc.
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

namespace {

// A flat [numel] tensor whose storage has no memory yet: the pool lends it some while needed
// (BufferPool::LendTo). Views of it can be taken at once; they are valid while it is lent.
torch::Tensor UnbackedFlat(int64_t numel, const torch::TensorOptions& options) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, c10::GetAllocator(options.device().type()),
                       /*resizable=*/false);
  const c10::ScalarType dtype = options.dtype().toScalarType();
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::computeDispatchKey(dtype, options.layout(), options.device())),
      options.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return t;
}

}  // namespace

namespace {

using NamedParams = std::vector<std::pair<std::string, torch::Tensor>>;

// The ShardedModules below `module` (not itself). None below a Classifier's children.
std::vector<std::shared_ptr<torch::nn::Module>> NestedWrappers(torch::nn::Module& module) {
  std::vector<std::shared_ptr<torch::nn::Module>> wrappers;
  for (const auto& m : module.modules(/*include_self=*/false)) {
    if (dynamic_cast<ShardedModule*>(m.get()) != nullptr) wrappers.push_back(m);
  }
  return wrappers;
}

// The tensors of the ShardedModules below `module`: `of` gives each one's (parameters() or buffers()).
template <class Of>
std::set<const void*> NestedTensors(torch::nn::Module& module, Of of) {
  std::set<const void*> nested;
  for (const auto& m : NestedWrappers(module)) {
    for (const auto& t : of(*m)) nested.insert(t.unsafeGetTensorImpl());
  }
  return nested;
}

// The trainable parameters of `module` that belong to no ShardedModule below it, named
// "<prefix>.<parameter>" (just "<parameter>" for an empty prefix); and their count.
NamedParams UnitParams(const std::string& prefix, torch::nn::Module& module, int64_t* count) {
  const std::set<const void*> nested = NestedTensors(module, [](torch::nn::Module& m) { return m.parameters(); });
  NamedParams params;
  *count = 0;
  for (const auto& p : module.named_parameters()) {
    if (!p.value().requires_grad() || nested.count(p.value().unsafeGetTensorImpl())) continue;
    params.emplace_back(prefix.empty() ? p.key() : prefix + "." + p.key(), p.value());
    *count += p.value().numel();
  }
  return params;
}

// FNV-1a over the 64-bit words of `tensors` (CPU; the tail bytes one by one), in order: equal on
// every rank that built the same values, whatever its thread count.
uint64_t HashValues(const std::vector<torch::Tensor>& tensors) {
  constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t h = 1469598103934665603ull;
  for (const auto& t : tensors) {
    torch::Tensor c = t.detach().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    const size_t n = static_cast<size_t>(c.numel()) * c.element_size();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t word;
      std::memcpy(&word, bytes + i, 8);
      h = (h ^ word) * kPrime;
    }
    for (; i < n; ++i) h = (h ^ bytes[i]) * kPrime;
  }
  return h;
}

}  // namespace

// One unit: the parameters become views of a flat buffer, and the shard is kept as the strategy
// says. The parameters' values are copied once (into the pool's buffer for kFsdp, which is
// then returned: only the shard stays).
std::unique_ptr<FullyShardedDataParallel::Unit> FullyShardedDataParallel::MakeUnit(
    BufferPools& pools, const FsdpOptions& fsdp_options, int rank, int n, const std::string& name,
    const NamedParamList& params, FsdpUnitInfo* info_out) {
  const Strategy strategy = fsdp_options.strategy;
  torch::NoGradGuard no_grad;
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
  const auto options = params.front().second.options().requires_grad(false);  // The master dtype.
  for (const auto& p : params) {
    TORCH_CHECK(p.second.scalar_type() == options.dtype().toScalarType(), "FullyShardedDataParallel: unit '", name,
                "' mixes ", options.dtype(), " and ", p.second.dtype(), " parameters");
  }
  const auto compute = options.dtype(fsdp_options.param_dtype.value_or(options.dtype().toScalarType()));
  const bool mixed = compute.dtype() != options.dtype();
  TORCH_CHECK(!mixed || strategy == Strategy::kFsdp,
              "FullyShardedDataParallel: mixed precision (param_dtype) needs the full_shard strategy");
  TORCH_CHECK(!fsdp_options.offload_optimizer || strategy == Strategy::kFsdp,
              "FullyShardedDataParallel: offload_optimizer needs the full_shard strategy");
  const torch::Device master_device = fsdp_options.offload_optimizer ? torch::Device(torch::kCPU) : options.device();
  // (Offload takes this path on the CPU too, where it changes no value: so the CPU tests pin it.)
  const bool separate_master = mixed || fsdp_options.offload_optimizer;
  // kFsdp's gathered parameters and kZero2/kFsdp's unsharded gradients are lent
  // by the pool while needed; the other strategies keep them.
  const bool pooled_full = strategy == Strategy::kFsdp;
  const bool pooled_grad = strategy == Strategy::kFsdp || strategy == Strategy::kZero2;
  unit->full = pooled_full ? UnbackedFlat(info.padded, compute) : torch::empty({info.padded}, compute);
  unit->flat_grad = pooled_grad ? UnbackedFlat(info.padded, compute) : torch::zeros({info.padded}, compute);
  // Views are checked against their storage's size when taken: take them while lent.
  if (pooled_full) pools.For(unit->full).LendTo(unit->full);
  if (pooled_grad) pools.For(unit->flat_grad).LendTo(unit->flat_grad);
  const int64_t s = info.shard_numel;
  // Mixed precision or offload: this rank's shard, exact, from the parameters, where it lives.
  torch::Tensor master;
  if (separate_master) {
    master = torch::zeros({s}, options.device(master_device));
    for (size_t i = 0; i < unit->params.size(); ++i) {
      const int64_t begin = std::max<int64_t>(unit->offsets[i], rank * s);
      const int64_t end = std::min<int64_t>(unit->offsets[i] + unit->params[i].numel(), (rank + 1) * s);
      if (begin >= end) continue;
      master.narrow(0, begin - rank * s, end - begin)
          .copy_(unit->params[i].detach().reshape({-1}).narrow(0, begin - unit->offsets[i], end - begin));
    }
  }
  unit->full.narrow(0, info.numel, info.padded - info.numel).zero_();  // The padding.
  for (size_t i = 0; i < unit->params.size(); ++i) {
    torch::Tensor& p = unit->params[i];
    auto slot = unit->full.narrow(0, unit->offsets[i], p.numel()).view(p.sizes());
    slot.copy_(p);  // (Mixed precision: rounded to the compute dtype, as every gather will.)
    p.set_data(slot);
    p.mutable_grad() = unit->flat_grad.narrow(0, unit->offsets[i], p.numel()).view(p.sizes());
  }
  switch (strategy) {
    case Strategy::kNoShard:
      unit->shard = unit->full;
      unit->shard.mutable_grad() = unit->flat_grad;
      break;
    case Strategy::kZero1:
      unit->shard = unit->full.narrow(0, rank * s, s);
      // Aliases the flat gradient's memory without being an autograd view of it: optimizers'
      // zero_grad() detach_()es gradients, which views refuse.
      unit->shard.mutable_grad() = torch::empty({0}, options).set_(unit->flat_grad.storage(), rank * s, {s}, {1});
      break;
    case Strategy::kZero2:
      unit->shard = unit->full.narrow(0, rank * s, s);
      unit->shard.mutable_grad() = torch::zeros({s}, options);
      unit->separate_grad = true;
      break;
    case Strategy::kFsdp:
      unit->shard = separate_master ? master : unit->full.narrow(0, rank * s, s).clone();
      unit->shard.mutable_grad() = torch::zeros({s}, unit->shard.options());
      unit->separate_shard = true;
      unit->separate_grad = true;
      pools.For(unit->full).TakeFrom(unit->full);
      break;
    case Strategy::kDdp: break;  // Refused by the constructor.
  }
  pools.For(unit->flat_grad).TakeFrom(unit->flat_grad);
  unit->gathered_version = unit->full._version();
  unit->ready.assign(unit->params.size(), false);
  unit->pending = unit->params.size();
  *info_out = std::move(info);
  return unit;
}

struct FullyShardedDataParallel::Builder::Built {
  std::string child;              // The Classifier child's name (TakeChild); "" from TakeUnit.
  const void* wrapper = nullptr;  // The ShardedModule (TakeUnit).
  std::unique_ptr<Unit> unit;
  FsdpUnitInfo info;
  int64_t hash = 0;  // HashValues, 62 bits: its negation fits too (checked with one MAX).
};

// A unit to be: its name ("" for the root unit) and parameters, or what the builder made of it.
struct FullyShardedDataParallel::UnitSpec {
  std::string name;
  NamedParamList params;
  Builder::Built* built = nullptr;
  ShardedModule* wrapper = nullptr;  // Attached once the unit exists (nullptr: a Classifier's child or root).
  bool root = false;
};

FullyShardedDataParallel::Builder::Builder(c10::intrusive_ptr<c10d::Backend> pg, FsdpOptions options,
                                           torch::Device device)
    : pg_(std::move(pg)), options_(options), device_(device), pools_(std::make_unique<BufferPools>(device)) {
  TORCH_CHECK(options_.strategy != Strategy::kDdp,
              "FullyShardedDataParallel: kDdp is DistributedDataParallel's strategy (ddp.h), not a sharded one");
}

FullyShardedDataParallel::Builder::~Builder() = default;
FullyShardedDataParallel::Builder::Builder(Builder&&) = default;

void FullyShardedDataParallel::Builder::TakeChild(const std::string& name, torch::nn::Module& child) {
  TORCH_CHECK(pools_ != nullptr, "FullyShardedDataParallel::Builder: used after its model's engine was made");
  int64_t count = 0;
  NamedParamList params = UnitParams(name, child, &count);
  // The wrap policy, as the constructor applies it: smaller children stay whole, for the root unit.
  if (params.empty() || count < options_.min_unit_params) return;
  auto built = std::make_unique<Built>();
  built->child = name;
  // One child's parameters at a time on the device (set_data: same tensors).
  Build(std::move(built), name, params, [&] { child.to(device_); });
}

void FullyShardedDataParallel::Builder::Build(std::unique_ptr<Built> built, const std::string& name,
                                              const NamedParamList& params, const std::function<void()>& to_device) {
  std::vector<torch::Tensor> values;
  for (const auto& p : params) values.push_back(p.second);
  built->hash = static_cast<int64_t>(HashValues(values) & 0x3fffffffffffffffull);  // On the CPU, before moving.
  to_device();
  const int n = options_.strategy == Strategy::kNoShard ? 1 : pg_->getSize();
  built->unit = MakeUnit(*pools_, options_, pg_->getRank(), n, name, params, &built->info);
  built_.push_back(std::move(built));
}

bool FullyShardedDataParallel::Builder::TakeUnit(const ShardedModule& wrapper) {
  TORCH_CHECK(pools_ != nullptr, "FullyShard: the group's root was already made; wrap every unit before its root");
  int64_t count = 0;
  NamedParamList params = UnitParams("", wrapper.wrapped(), &count);
  if (params.empty()) return false;
  auto built = std::make_unique<Built>();
  built->wrapper = &wrapper;
  Build(std::move(built), "", params, [&] {
    // This unit's parameters and the buffers of its own modules on the device; not those of units
    // below it, which are views of their flat buffers already.
    torch::NoGradGuard no_grad;
    for (const auto& p : params) p.second.set_data(p.second.data().to(device_));
    const std::set<const void*> nested =
        NestedTensors(wrapper.wrapped(), [](torch::nn::Module& m) { return m.buffers(); });
    for (auto& b : wrapper.wrapped().buffers()) {
      if (!nested.count(b.unsafeGetTensorImpl())) b.set_data(b.data().to(device_));
    }
  });
  return true;
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<Classifier> module,
                                                   c10::intrusive_ptr<c10d::Backend> pg, FsdpOptions options)
    : FullyShardedDataParallel(std::move(module), Builder(std::move(pg), options, torch::kCPU),
                               /*broadcast_all=*/true) {}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<Classifier> module, Builder built)
    : FullyShardedDataParallel(std::move(module), std::move(built), /*broadcast_all=*/false) {}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<Classifier> module, Builder built,
                                                   bool broadcast_all)
    : module_(module),
      classifier_(module.get()),
      pg_(built.pg_),
      options_(built.options_),
      rank_(pg_->getRank()),
      world_(pg_->getSize()) {
  std::vector<UnitSpec> specs = PolicyUnits(built);
  Init(std::move(built), std::move(specs), broadcast_all);
}

FullyShardedDataParallel::FullyShardedDataParallel(ShardedModule& root, std::shared_ptr<torch::nn::Module> module,
                                                   Builder built)
    : module_(std::move(module)),
      classifier_(nullptr),
      pg_(built.pg_),
      options_(built.options_),
      rank_(pg_->getRank()),
      world_(pg_->getSize()) {
  std::vector<UnitSpec> specs = WrappedUnits(built, &root);
  Init(std::move(built), std::move(specs), /*broadcast_all=*/false);
  root.Attach(this, -1, /*leaf=*/false);
}

std::vector<FullyShardedDataParallel::UnitSpec> FullyShardedDataParallel::PolicyUnits(Builder& built) {
  std::map<std::string, Builder::Built*> built_children;
  for (auto& b : built.built_) built_children[b->child] = b.get();
  // Wrap policy: children with enough parameters are units; the rest is the root unit.
  std::vector<UnitSpec> specs;
  std::set<const void*> claimed;
  for (const auto& child : module_->named_children()) {
    UnitSpec spec;
    spec.name = child.key();
    if (auto b = built_children.find(child.key()); b != built_children.end()) {
      spec.built = b->second;
    } else {
      int64_t count = 0;
      spec.params = UnitParams(child.key(), *child.value(), &count);
      if (spec.params.empty() || count < options_.min_unit_params) continue;
    }
    for (const auto& p : child.value()->parameters()) claimed.insert(p.unsafeGetTensorImpl());
    specs.push_back(std::move(spec));
  }
  UnitSpec rest;
  rest.root = true;
  for (const auto& p : module_->named_parameters()) {
    if (p.value().requires_grad() && !claimed.count(p.value().unsafeGetTensorImpl())) {
      rest.params.emplace_back(p.key(), p.value());
    }
  }
  if (!rest.params.empty()) specs.push_back(std::move(rest));
  return specs;
}

std::vector<FullyShardedDataParallel::UnitSpec> FullyShardedDataParallel::WrappedUnits(Builder& built,
                                                                                       ShardedModule* root) {
  std::map<const void*, Builder::Built*> built_wrappers;
  for (auto& b : built.built_) {
    if (b->wrapper != nullptr) built_wrappers[b->wrapper] = b.get();
  }
  std::vector<UnitSpec> specs;
  auto add = [&](const std::string& path, ShardedModule& wrapper, bool is_root) {
    TORCH_CHECK(wrapper.engine_ == nullptr, "FullyShard: '", path, "' already belongs to another root");
    UnitSpec spec;
    spec.name = path;
    spec.wrapper = &wrapper;
    spec.root = is_root;
    if (auto b = built_wrappers.find(&wrapper); b != built_wrappers.end()) {
      spec.built = b->second;
      // Named when built without its place in the model: now it has one.
      for (auto& name : spec.built->info.param_names) name = path.empty() ? name : path + "." + name;
      spec.built->info.name = path;
      spec.built->child = path;
    } else {
      int64_t count = 0;
      spec.params = UnitParams(path, wrapper.wrapped(), &count);
      if (spec.params.empty()) return;  // No parameters of its own: runs plainly.
    }
    specs.push_back(std::move(spec));
  };
  for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
    if (auto* wrapper = dynamic_cast<ShardedModule*>(item.value().get())) add(item.key(), *wrapper, false);
  }
  if (root != nullptr) add("", *root, true);
  return specs;
}

void FullyShardedDataParallel::Init(Builder built, std::vector<UnitSpec> specs, bool broadcast_all) {
  TORCH_CHECK(options_.strategy != Strategy::kDdp,
              "FullyShardedDataParallel: kDdp is DistributedDataParallel's strategy (ddp.h), not a sharded one");
  shards_per_unit_ = options_.strategy == Strategy::kNoShard ? 1 : world_;

  // Units built as the model was constructed hold values every rank drew from the same seed:
  // check that with one small all-reduce instead of broadcasting them.
  if (!built.built_.empty() && world_ > 1) {
    const int64_t count = static_cast<int64_t>(built.built_.size());
    torch::Tensor bounds = torch::empty({2 * count}, torch::kInt64);
    for (int64_t u = 0; u < count; ++u) {
      const int64_t h = built.built_[u]->hash;
      bounds[u] = h;
      bounds[count + u] = -h;
    }
    bounds = bounds.to(CommDevice(*pg_));
    std::vector<torch::Tensor> one{bounds};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    pg_->allreduce(one, max)->wait();
    bounds = bounds.cpu();
    for (int64_t u = 0; u < count; ++u) {
      const int64_t h = built.built_[u]->hash;
      TORCH_CHECK(bounds[u].item<int64_t>() == h && bounds[count + u].item<int64_t>() == -h,
                  "FullyShardedDataParallel: the ranks initialised different values for '", built.built_[u]->child,
                  "' (every rank must seed its generator alike before building the model)");
    }
  }
  // Everything else is rank 0's: parameters not built (and the frozen ones) and the buffers.
  std::set<const void*> built_params;
  for (const auto& spec : specs) {
    if (spec.built == nullptr) continue;
    for (const auto& p : spec.built->unit->params) built_params.insert(p.unsafeGetTensorImpl());
  }
  {
    std::vector<torch::Tensor> state;
    for (const auto& p : module_->parameters()) {
      if (!built_params.count(p.unsafeGetTensorImpl())) state.push_back(p);
    }
    for (const auto& b : module_->buffers()) state.push_back(b);
    if (broadcast_all || !state.empty()) BroadcastFromRank0(*pg_, state, &bytes_);
  }
  TORCH_CHECK(!specs.empty(), "FullyShardedDataParallel: the module has no trainable parameters");
  // Every trainable parameter in exactly one unit.
  {
    std::set<const void*> in_unit;
    for (const auto& spec : specs) {
      const auto& params = spec.built ? spec.built->unit->params : std::vector<torch::Tensor>{};
      for (const auto& p : params) in_unit.insert(p.unsafeGetTensorImpl());
      for (const auto& p : spec.params) in_unit.insert(p.second.unsafeGetTensorImpl());
    }
    for (const auto& p : module_->named_parameters()) {
      TORCH_CHECK(!p.value().requires_grad() || in_unit.count(p.value().unsafeGetTensorImpl()),
                  "FullyShardedDataParallel: parameter '", p.key(), "' is in no unit");
    }
  }

  if (built.built_.empty()) {
    // Not built by the builder: the pools are on the device of the module's parameters.
    pools_ = std::make_unique<BufferPools>(specs.front().params.front().second.device());
  } else {
    pools_ = std::move(built.pools_);
  }
  for (auto& spec : specs) {
    std::unique_ptr<Unit> unit;
    FsdpUnitInfo info;
    if (spec.built != nullptr) {
      unit = std::move(spec.built->unit);
      info = std::move(spec.built->info);
    } else {
      unit = MakeUnit(*pools_, options_, rank_, shards_per_unit_, spec.name, spec.params, &info);
    }
    const size_t index = units_.size();
    if (spec.root) {
      root_ = static_cast<int>(index);
    } else if (spec.wrapper != nullptr) {
      spec.wrapper->Attach(this, static_cast<int64_t>(index), /*leaf=*/NestedWrappers(spec.wrapper->wrapped()).empty());
      wrappers_.push_back(spec.wrapper);
    } else {
      unit_of_child_[spec.name] = index;
    }
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
  if (classifier_ != nullptr) classifier_->set_child_hooks(this);
  UpdatePeak();
}

}  // namespace elrun::trainer
