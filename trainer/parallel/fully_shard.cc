#include "trainer/parallel/fully_shard.h"

namespace elrun::trainer {

ShardGroup::ShardGroup(c10::intrusive_ptr<c10d::Backend> pg, FsdpOptions options, torch::Device device)
    : builder_(std::make_shared<FullyShardedDataParallel::Builder>(std::move(pg), options, device)) {}

ShardedModule::ShardedModule(std::shared_ptr<torch::nn::Module> wrapped, const ShardGroup* group)
    : wrapped_(std::move(wrapped)) {
  TORCH_CHECK(wrapped_ != nullptr, "FullyShard: no module to wrap");
  // The wrapped module's own parameters, buffers and children under their own names: the
  // wrapper adds no level to the names (state dicts read as the unwrapped model's).
  for (const auto& p : wrapped_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : wrapped_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
  for (const auto& c : wrapped_->named_children()) register_module(c.key(), c.value());
  if (!wrapped_->is_training()) Module::train(false);
  if (group != nullptr) {
    builder_ = group->builder_;
    builder_->TakeUnit(*this);
  }
}

ShardedModule::~ShardedModule() = default;

void ShardedModule::train(bool on) {
  Module::train(on);
  wrapped_->train(on);
}

FullyShardedDataParallel& ShardedModule::fsdp() {
  TORCH_CHECK(Attached(), "FullyShard: this module is not sharded (wrap it with FullyShard and a ShardGroup)");
  TORCH_CHECK(unit_ < 0, "FullyShard: fsdp() is the root's; this module is a unit inside one");
  return *engine_;
}

bool ShardedModule::Attached() {
  if (engine_ != nullptr) return true;
  if (builder_ == nullptr) return false;
  // The outermost wrapper of a group, used first: the root. Its engine takes the group's build.
  // (Its constructor attaches this wrapper, which lets go of the group's builder.)
  owned_ = std::make_unique<FullyShardedDataParallel>(*this, wrapped_, std::move(*builder_));
  return true;
}

void ShardedModule::Attach(FullyShardedDataParallel* engine, int64_t unit, bool leaf) {
  engine_ = engine;
  unit_ = unit;
  leaf_ = leaf;
  builder_.reset();
}

void ShardedModule::Detach() { engine_ = nullptr; }

void ShardedModule::Begin() {
  if (unit_ < 0) {
    engine_->RootForwardBegin();
  } else {
    engine_->UnitForwardBegin(static_cast<size_t>(unit_));
  }
}

void ShardedModule::End(const std::vector<torch::Tensor>& outputs) {
  if (unit_ < 0) {
    engine_->RootForwardEnd(outputs);
  } else {
    engine_->UnitForwardEnd(static_cast<size_t>(unit_), outputs);
  }
}

bool ShardedModule::Checkpointed() const { return unit_ >= 0 && leaf_ && engine_->options_.activation_checkpointing; }

torch::Tensor ShardedModule::CastInput(const torch::Tensor& t) const {
  const auto& dtype = engine_->options_.param_dtype;
  if (unit_ >= 0 || !dtype || !t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype) return t;
  return t.to(*dtype);
}

std::optional<c10::ScalarType> ShardedModule::OutputCast() const {
  if (unit_ >= 0 || !engine_->options_.param_dtype || engine_->shards_.empty()) return std::nullopt;
  return engine_->shards_.front().scalar_type();
}

}  // namespace elrun::trainer
