// FullyShardedDataParallel for LibTorch models, with the sharded strategies of PyTorch's FSDP /
// ZeRO (Strategy, strategy.h):
//   kNoShard  every rank holds all parameters, gradients and optimizer state; gradients
//             all-reduced per unit.
//   kZero1    full parameters and gradients on every rank; gradients reduce-scattered and each
//             rank's optimizer steps only its shard; the updated shards are all-gathered before
//             the next forward.
//   kZero2    as kZero1, but only the gradient shard is kept: a unit's unsharded gradient buffer
//             exists from its backward until its reduce-scatter.
//   kFsdp     (ZeRO-3) each rank keeps only its shards; a unit's full parameters are all-gathered
//             just before its forward and again for its backward, and freed right after each.
// Two ways to say what the units are:
//   - Any module, FSDP2's way (fully_shard.h): FullyShard(block, group) wraps each block in a
//     Sharded<Impl> that owns it and runs the gathering around its forward, whatever tensors it
//     takes and returns; FullyShard(root, group) then makes the root, whose remaining parameters
//     form the root unit. Each unit is sharded the moment it is wrapped.
//   - A Classifier (module_hooks.h) that runs its children through CallChild: every child of the
//     root with at least min_unit_params parameters is a unit (the wrap policy); the parameters of
//     smaller children and of the root form the root unit.
// Each unit's trainable parameters are flattened into one buffer, padded to a multiple of the
// world size and split evenly; the module's parameters become views into it. The optimizer is
// built over parameters(): one flat shard per unit, carrying its gradient shard.
// Gathers are issued in the forward order of the previous iteration and the next unit's gather
// is prefetched while the current one computes (in backward, the previous unit's).
// kZero1/kZero2 re-gather a unit in the first forward after a synchronized backward (the
// optimizer step is assumed to come in between) or after an in-place change of its shard; call
// ShardsChanged() after changing shards any other way.
// Gradient accumulation: under NoSync the unsharded gradients accumulate locally (memory of a
// full gradient per unit, no communication) and the next synchronized backward reduces them
// once; without NoSync (kZero2, kFsdp) every backward reduce-scatters and adds into the gradient
// shard (only the shard is kept, one collective per micro-batch). kZero1 and kNoShard keep full
// gradients anyway: accumulate with NoSync, or zero_grad between synchronized backward passes
// (checked).
// Thread-compatible: one training thread per wrapper; every rank must call forward/backward in
// the same order (collectives are issued from them).
#ifndef ELRUN_TRAINER_PARALLEL_FSDP_H_
#define ELRUN_TRAINER_PARALLEL_FSDP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "absl/status/statusor.h"
#include "trainer/dist/collectives.h"
#include "trainer/memory/buffer_pool.h"
#include "trainer/nn/module_hooks.h"
#include "trainer/parallel/strategy.h"

namespace elrun::trainer {

class ShardedModule;  // fully_shard.h

struct FsdpOptions {
  // kNoShard, kZero1, kZero2 or kFsdp (kDdp is DistributedDataParallel's, ddp.h: refused here).
  Strategy strategy = Strategy::kFsdp;
  int64_t min_unit_params = 1;
  bool prefetch = true;
  // Each child unit's forward keeps only its input; backward recomputes it with the unit
  // gathered (activation_checkpoint.h). The gradients are the same, bit for bit.
  bool activation_checkpointing = false;
  // Mixed precision, as PyTorch FSDP's MixedPrecision (kFsdp only): units are gathered, and
  // forward and backward run, in param_dtype (e.g. kBFloat16); gradients are reduce-scattered
  // in reduce_dtype (default: param_dtype) and summed into the master gradient shard. The
  // shards, their gradients and the optimizer state stay in the parameters' own dtype (fp32).
  // The root's forward casts floating inputs to param_dtype and floating outputs back to the
  // parameters' dtype. nullopt: no casting.
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  // kFsdp: the shards and their gradients, so also the optimizer's state, live in CPU memory
  // (for the GPU path: device memory holds only gathered units and gradients in flight); gathers
  // copy the shard up, reductions copy the reduced chunk down. On the CPU it changes no value.
  bool offload_optimizer = false;
};

struct FsdpUnitInfo {
  std::string name;                      // The child's name; "" for the root unit.
  std::vector<std::string> param_names;  // Full names (as module->named_parameters()).
  std::vector<std::vector<int64_t>> shapes;
  int64_t numel = 0;        // Trainable elements.
  int64_t padded = 0;       // numel rounded up to a multiple of the shard count.
  int64_t shard_numel = 0;  // padded / shard count (padded for kNoShard).
};

// Bytes of parameter and gradient storage this rank holds (optimizer state: memory.h).
struct FsdpMemory {
  int64_t params = 0;          // Gathered full units and separately held shards.
  int64_t grads = 0;           // Unsharded gradient buffers and separately held gradient shards.
  int64_t working = 0;         // Receive buffers of reduce-scatters in flight.
  int64_t pooled = 0;          // What the buffer pool holds, lent or not (buffer_pool.h).
  int64_t pool_peak_lent = 0;  // The most the pool had lent at one time.
  int64_t held = 0;            // All this memory that is resident: shards, kept buffers and the pool.
  // Highest of params + grads + working and of held since construction or ResetPeak.
  int64_t peak = 0;
};

class FullyShardedDataParallel : private ChildForwardHooks {
  using NamedParamList = std::vector<std::pair<std::string, torch::Tensor>>;  // Full names.

 public:
  // Builds the units while the model is constructed, so no rank ever holds the whole model: pass
  // it as MakeModel's ChildSink, then the model and the builder to the constructor. Each child
  // that the wrap policy makes a unit is moved to `device` and flattened as soon as it exists;
  // for kFsdp only its shard stays. Every rank must seed its generator alike before
  // MakeModel (the constructor checks a hash of each unit's initial values across ranks instead of
  // broadcasting them). Parameters and buffers of other children, the root's and the buffers
  // are still broadcast from rank 0.
  class Builder final : public ChildSink {
   public:
    Builder(c10::intrusive_ptr<c10d::Backend> pg, FsdpOptions options, torch::Device device);
    ~Builder() override;
    Builder(Builder&&);
    void TakeChild(const std::string& name, torch::nn::Module& child) override;
    // For FullyShard (fully_shard.h): makes `wrapper`'s module a unit now, of its trainable
    // parameters except those of the ShardedModules below it. False when there are none.
    bool TakeUnit(const ShardedModule& wrapper);
    const FsdpOptions& options() const { return options_; }
    c10d::Backend& process_group() const { return *pg_; }

   private:
    friend class FullyShardedDataParallel;
    struct Built;
    // Hashes the values of `params` (on the CPU), runs `to_device`, and makes them `built`'s unit.
    void Build(std::unique_ptr<Built> built, const std::string& name, const NamedParamList& params,
               const std::function<void()>& to_device);
    c10::intrusive_ptr<c10d::Backend> pg_;
    FsdpOptions options_;
    torch::Device device_;
    std::unique_ptr<BufferPools> pools_;
    std::vector<std::unique_ptr<Built>> built_;
  };

  // Broadcasts rank 0's parameters and buffers, then shards. Throws c10::Error on failure.
  FullyShardedDataParallel(std::shared_ptr<Classifier> module, c10::intrusive_ptr<c10d::Backend> pg,
                           FsdpOptions options = {});
  // `module` was built through `built` (Builder). Throws c10::Error on failure, also when the
  // ranks' initial values differ.
  FullyShardedDataParallel(std::shared_ptr<Classifier> module, Builder built);
  // The engine of a root made by FullyShard (fully_shard.h): `root` wraps `module`, and the units
  // are `root` itself (the root unit) and the ShardedModules in `module`'s tree, each built
  // through `built` when wrapped (or now, when wrapped without a group). Made by the root itself
  // (ShardedModule::fsdp); throws c10::Error on failure.
  FullyShardedDataParallel(ShardedModule& root, std::shared_ptr<torch::nn::Module> module, Builder built);
  ~FullyShardedDataParallel() override;
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Runs a Classifier module (train or eval mode) with the units gathered as needed. (A root
  // made by FullyShard runs through its own forward.)
  torch::Tensor forward(const torch::Tensor& input);

  // One flat shard per unit, each with its gradient shard: what the optimizer steps.
  const std::vector<torch::Tensor>& parameters() const { return shards_; }
  const std::vector<FsdpUnitInfo>& units() const { return infos_; }
  Strategy strategy() const { return options_.strategy; }
  torch::nn::Module& module() { return *module_; }
  int rank() const { return rank_; }
  int shard_count() const { return shards_per_unit_; }
  c10d::Backend& process_group() { return *pg_; }

  const CommBytes& comm_bytes() const { return bytes_; }
  FsdpMemory memory() const;
  void ResetPeak();

  // Every rank must call these (collective). The unsharded value of every trainable parameter,
  // by full name (cloned).
  std::map<std::string, torch::Tensor> FullParameters();
  // Call after writing into parameters() other than through an optimizer step (e.g. a load).
  void ShardsChanged();
  // Broadcasts rank 0's buffers (BatchNorm running stats).
  void BroadcastBuffers();

  class NoSync {
   public:
    explicit NoSync(FullyShardedDataParallel& fsdp) : fsdp_(fsdp), previous_(fsdp.sync_) { fsdp_.sync_ = false; }
    ~NoSync() { fsdp_.sync_ = previous_; }

   private:
    FullyShardedDataParallel& fsdp_;
    const bool previous_;
  };

 private:
  friend class ShardedModule;
  struct Unit;
  struct UnitSpec;
  FullyShardedDataParallel(std::shared_ptr<Classifier> module, Builder built, bool broadcast_all);
  // The wrap policy over a Classifier's children.
  std::vector<UnitSpec> PolicyUnits(Builder& built);
  // The ShardedModules in the tree, and `root` (nullptr for none) as the root unit.
  std::vector<UnitSpec> WrappedUnits(Builder& built, ShardedModule* root);
  void Init(Builder built, std::vector<UnitSpec> specs, bool broadcast_all);
  // Around the forward of a ShardedModule (fully_shard.h): its unit, or the whole model's.
  void UnitForwardBegin(size_t u) { PreForward(u); }
  void UnitForwardEnd(size_t u, const std::vector<torch::Tensor>& outputs) { PostForward(u, outputs); }
  void RootForwardBegin();
  void RootForwardEnd(const std::vector<torch::Tensor>& outputs);
  static std::unique_ptr<Unit> MakeUnit(BufferPools& pools, const FsdpOptions& options, int rank, int n,
                                        const std::string& name, const NamedParamList& params, FsdpUnitInfo* info);
  c10::ScalarType ReduceDtype(const Unit& unit) const;
  // Gives back a reduction's receive space and its cast copy of the gradient, where lent.
  void ReturnReduceLoans(Unit& unit);
  void BeforeChild(const std::string& name) override;
  torch::Tensor RunChild(const std::string& name, const torch::Tensor& input, const ChildFn& run) override;
  torch::Tensor AfterChild(const std::string& name, torch::Tensor output) override;
  void Gather(Unit& unit);
  void Prefetch(Unit& unit);
  void Reshard(Unit& unit);
  void PreForward(size_t u);
  // Registers the unit's pre-backward on every output that requires grad (the first to get its
  // gradient runs it) and reshards the unit (but the root's, used all along the forward).
  void PostForward(size_t u, const std::vector<torch::Tensor>& outputs);
  void EnsureGradShard(Unit& unit);
  void PreBackward(size_t u);
  void OnGradReady(size_t u, size_t i);
  void Reduce(size_t u);
  void FinishReductions(size_t keep);
  void Finalize();
  void UpdatePeak();

  const std::shared_ptr<torch::nn::Module> module_;
  Classifier* const classifier_;          // module_, when it is one (CallChild hooks).
  std::vector<ShardedModule*> wrappers_;  // In module_'s tree (and the root), attached.
  const c10::intrusive_ptr<c10d::Backend> pg_;
  const FsdpOptions options_;
  const int rank_;
  const int world_;
  int shards_per_unit_ = 1;
  std::unique_ptr<BufferPools> pools_;  // Declared before units_: outlives their loans.
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<FsdpUnitInfo> infos_;
  std::vector<torch::Tensor> shards_;
  std::map<std::string, size_t> unit_of_child_;
  int root_ = -1;  // Index of the root unit, -1 when every parameter is in a child unit.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<size_t> forward_order_, last_forward_order_;
  std::vector<size_t> in_flight_;  // Units whose reduction was launched, oldest first.
  bool in_backward_ = false;
  bool sync_ = true;
  CommBytes bytes_;
  int64_t peak_ = 0;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_FSDP_H_
