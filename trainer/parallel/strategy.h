// The one data-parallel strategy enum of the training library: DDP (ddp.h) or one of the
// sharded strategies of FullyShardedDataParallel (fsdp.h). DataParallel (data_parallel.h) and
// FsdpOptions::strategy both take it. No LibTorch here, so an application's option parser can
// name it without compiling torch headers.
#ifndef ELRUN_TRAINER_PARALLEL_STRATEGY_H_
#define ELRUN_TRAINER_PARALLEL_STRATEGY_H_

#include <string>

#include "absl/status/statusor.h"

namespace elrun::trainer {

enum class Strategy {
  kDdp,      // DistributedDataParallel: bucketed all-reduce overlapping backward.
  kNoShard,  // FSDP without sharding: every rank holds everything; gradients all-reduced per unit.
  kZero1,    // Optimizer state sharded (PyTorch FSDP's SHARD_OPTIMIZER, ZeRO-1).
  kZero2,    // Optimizer state and gradients sharded (SHARD_GRAD_OP, ZeRO-2).
  kFsdp,     // Parameters too (FULL_SHARD, ZeRO-3).
};

// ddp, no_shard, zero1|shard_optimizer, zero2|shard_grad_op, fsdp|zero3|full_shard.
absl::StatusOr<Strategy> ParseStrategy(const std::string& name);
const char* StrategyName(Strategy strategy);  // ddp, no_shard, zero1, zero2, fsdp.

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_STRATEGY_H_
