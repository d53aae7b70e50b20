// FSDP2-style sharding of any LibTorch module: wrap each block, then the root.
//
//   ShardGroup group(pg, options);                    // the strategy, mixed precision, device
//   for (...) blocks.push_back(register_module(name, FullyShard(Block(...), group)));
//   auto model = FullyShard(Net(...), group);         // the root: its other parameters
//   torch::optim::AdamW optimizer(model->fsdp().parameters(), ...);
//   torch::Tensor loss = Loss(model->forward(tokens, mask));   // any arguments, any outputs
//
// LibTorch modules have no forward hooks and a C++ model calls its children through typed
// members, so nothing can be slipped in around a child's forward from outside. Sharded<Impl> is
// a module that owns the block and has the block's own forward signature (a variadic template
// that forwards every argument), so a model's forward (`block->forward(x, mask)`) stays as it is
// and only the member's declared type changes from Block to Sharded<BlockImpl>. Around the call
// the wrapper gathers the unit's parameters, and on every tensor the block returns (a Tensor, a
// std::tuple or std::pair of them, a std::vector<Tensor>) it registers the hook that gathers the
// unit again before its backward. The wrapper registers the block's parameters, buffers and
// children under their own names, so named_parameters(), state dicts and checkpoints read as
// those of the unwrapped model (Python's torch.load sees the same names).
//
// FullyShard(module, group) shards the module the moment it is wrapped (its trainable parameters
// except those of Sharded modules below it), so a model whose constructor wraps each block as it
// builds it never holds more than one whole block. A Sharded<Impl> made without a group (e.g.
// declared in the model and built plainly) is sharded when the root's engine is made. The
// outermost wrapper is the root: its engine (FullyShardedDataParallel, fsdp.h) is made at the
// first call of fsdp() or forward() - a collective, as are forward and backward.
// Activation checkpointing (FsdpOptions) applies to units with no Sharded module below them and
// whose forward takes and returns only tensors.
// Thread-compatible, as any torch::nn::Module.
#ifndef ELRUN_TRAINER_PARALLEL_FULLY_SHARD_H_
#define ELRUN_TRAINER_PARALLEL_FULLY_SHARD_H_

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "trainer/parallel/activation_checkpoint.h"
#include "trainer/parallel/fsdp.h"

namespace elrun::trainer {

// What the units of one model share: the process group, the options (strategy, mixed precision,
// activation checkpointing) and the device the shards live on. Copies share one build.
class ShardGroup {
 public:
  ShardGroup(c10::intrusive_ptr<c10d::Backend> pg, FsdpOptions options = {}, torch::Device device = torch::kCPU);

 private:
  friend class ShardedModule;
  std::shared_ptr<FullyShardedDataParallel::Builder> builder_;
};

// What every Sharded<Impl> is, whatever it wraps: the engine's side of it.
class ShardedModule : public torch::nn::Module {
 public:
  ~ShardedModule() override;
  torch::nn::Module& wrapped() const { return *wrapped_; }
  // train()/eval() reach the wrapped module too (its own is_training() flag).
  void train(bool on = true) override;
  // The root's engine, made on first use: its parameters() are what the optimizer steps; NoSync,
  // checkpoints (sharded_checkpoint.h) and memory() take it. Collective the first time.
  FullyShardedDataParallel& fsdp();

 protected:
  ShardedModule(std::shared_ptr<torch::nn::Module> wrapped, const ShardGroup* group);
  // True when forward goes through an engine (made here when this is an unattached root).
  bool Attached();
  void Begin();
  void End(const std::vector<torch::Tensor>& outputs);
  bool Checkpointed() const;
  torch::Tensor CastInput(const torch::Tensor& t) const;
  std::optional<c10::ScalarType> OutputCast() const;

 private:
  friend class FullyShardedDataParallel;
  void Attach(FullyShardedDataParallel* engine, int64_t unit, bool leaf);
  void Detach();

  const std::shared_ptr<torch::nn::Module> wrapped_;
  std::shared_ptr<FullyShardedDataParallel::Builder> builder_;  // The group's, until the root is made.
  FullyShardedDataParallel* engine_ = nullptr;                  // Attached to (owned_ when the root).
  std::unique_ptr<FullyShardedDataParallel> owned_;
  int64_t unit_ = -1;  // This wrapper's unit in engine_; -1 for the root (the engine's root unit).
  bool leaf_ = true;   // No Sharded module below it.
};

namespace sharded_detail {

inline void Collect(const torch::Tensor& t, std::vector<torch::Tensor>& out) { out.push_back(t); }
inline void Collect(const std::vector<torch::Tensor>& v, std::vector<torch::Tensor>& out) {
  out.insert(out.end(), v.begin(), v.end());
}
template <class A, class B>
void Collect(const std::pair<A, B>& p, std::vector<torch::Tensor>& out);
template <class... Ts>
void Collect(const std::tuple<Ts...>& t, std::vector<torch::Tensor>& out);
template <class T>
void Collect(const T&, std::vector<torch::Tensor>&) {}  // Not a tensor.
template <class A, class B>
void Collect(const std::pair<A, B>& p, std::vector<torch::Tensor>& out) {
  Collect(p.first, out);
  Collect(p.second, out);
}
template <class... Ts>
void Collect(const std::tuple<Ts...>& t, std::vector<torch::Tensor>& out) {
  std::apply([&](const auto&... x) { (Collect(x, out), ...); }, t);
}

inline void Cast(torch::Tensor& t, c10::ScalarType dtype) {
  if (t.defined() && t.is_floating_point() && t.scalar_type() != dtype) t = t.to(dtype);
}
inline void Cast(std::vector<torch::Tensor>& v, c10::ScalarType dtype) {
  for (auto& t : v) Cast(t, dtype);
}
template <class A, class B>
void Cast(std::pair<A, B>& p, c10::ScalarType dtype);
template <class... Ts>
void Cast(std::tuple<Ts...>& t, c10::ScalarType dtype);
template <class T>
void Cast(T&, c10::ScalarType) {}
template <class A, class B>
void Cast(std::pair<A, B>& p, c10::ScalarType dtype) {
  Cast(p.first, dtype);
  Cast(p.second, dtype);
}
template <class... Ts>
void Cast(std::tuple<Ts...>& t, c10::ScalarType dtype) {
  std::apply([&](auto&... x) { (Cast(x, dtype), ...); }, t);
}

template <class T>
constexpr bool kIsTensor = std::is_same_v<std::decay_t<T>, torch::Tensor>;
template <class T>
struct TensorsOut : std::false_type {};
template <>
struct TensorsOut<torch::Tensor> : std::true_type {};
template <>
struct TensorsOut<std::vector<torch::Tensor>> : std::true_type {};
template <class... Ts>
struct TensorsOut<std::tuple<Ts...>> : std::bool_constant<(kIsTensor<Ts> && ...)> {};
// A forward activation checkpointing can recompute: tensors in, tensors out.
template <class Out, class... Args>
constexpr bool kCheckpointable = TensorsOut<std::decay_t<Out>>::value && (kIsTensor<Args> && ...);

template <class Out, size_t... I>
Out UnflattenTuple(const std::vector<torch::Tensor>& flat, std::index_sequence<I...>) {
  return Out(flat.at(I)...);
}

template <class Out>
Out Unflatten(std::vector<torch::Tensor> flat) {
  if constexpr (std::is_same_v<Out, torch::Tensor>) {
    return flat.at(0);
  } else if constexpr (std::is_same_v<Out, std::vector<torch::Tensor>>) {
    return flat;
  } else {
    return UnflattenTuple<Out>(flat, std::make_index_sequence<std::tuple_size_v<Out>>{});
  }
}

template <class Impl, size_t... I>
auto CallWith(Impl& impl, const std::vector<torch::Tensor>& xs, std::index_sequence<I...>) {
  return impl.forward(xs[I]...);
}

}  // namespace sharded_detail

// A module wrapping Impl (a LibTorch module with a forward) as a unit of sharding.
template <class Impl>
class ShardedImpl : public ShardedModule {
 public:
  // Without a group: sharded when the root's engine is made. With one: sharded now.
  explicit ShardedImpl(std::shared_ptr<Impl> module, const ShardGroup* group = nullptr)
      : ShardedModule(module, group), impl_(std::move(module)) {}

  Impl& module() const { return *impl_; }

  // Impl's forward, with the unit gathered around it.
  template <class... Args>
  auto forward(Args&&... args) {
    using Out = std::decay_t<decltype(impl_->forward(std::forward<Args>(args)...))>;
    if (!Attached()) return Out(impl_->forward(std::forward<Args>(args)...));
    Begin();
    Out out = Run<Out>(std::forward<Args>(args)...);
    std::vector<torch::Tensor> tensors;
    sharded_detail::Collect(out, tensors);
    End(tensors);
    if (auto dtype = OutputCast()) sharded_detail::Cast(out, *dtype);
    return out;
  }

 private:
  template <class T>
  decltype(auto) In(T&& x) const {
    if constexpr (sharded_detail::kIsTensor<T>) {
      return CastInput(x);
    } else {
      return std::forward<T>(x);
    }
  }

  template <class Out, class... Args>
  Out Run(Args&&... args) {
    if constexpr (sharded_detail::kCheckpointable<Out, Args...>) {
      if (Checkpointed()) {
        std::vector<torch::Tensor> inputs{In(args)...};
        std::shared_ptr<Impl> impl = impl_;
        auto flat = CheckpointedCall(inputs, [impl](const std::vector<torch::Tensor>& xs) {
          std::vector<torch::Tensor> outputs;
          sharded_detail::Collect(sharded_detail::CallWith(*impl, xs, std::index_sequence_for<Args...>{}), outputs);
          return outputs;
        });
        return sharded_detail::Unflatten<Out>(std::move(flat));
      }
    }
    return Out(impl_->forward(In(std::forward<Args>(args))...));
  }

  const std::shared_ptr<Impl> impl_;
};

// The holder a model declares its member as (Sharded<BlockImpl> block{nullptr}), as it would
// declare Block: register_module returns it, and block->forward(...) is the block's forward.
template <class Impl>
using Sharded = torch::nn::ModuleHolder<ShardedImpl<Impl>>;

// Wraps `module` as a unit of the model `group` shards, sharded now; the last FullyShard, around
// the model itself, makes the root.
template <class Impl>
Sharded<Impl> FullyShard(std::shared_ptr<Impl> module, const ShardGroup& group) {
  return Sharded<Impl>(std::make_shared<ShardedImpl<Impl>>(std::move(module), &group));
}
template <class Impl>
Sharded<Impl> FullyShard(torch::nn::ModuleHolder<Impl> module, const ShardGroup& group) {
  return FullyShard(module.ptr(), group);
}

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_FULLY_SHARD_H_
