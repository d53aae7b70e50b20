#include "trainer/parallel/strategy.h"

#include "absl/strings/str_cat.h"

namespace elrun::trainer {

absl::StatusOr<Strategy> ParseStrategy(const std::string& name) {
  if (name == "ddp") return Strategy::kDdp;
  if (name == "no_shard") return Strategy::kNoShard;
  if (name == "zero1" || name == "shard_optimizer") return Strategy::kZero1;
  if (name == "zero2" || name == "shard_grad_op") return Strategy::kZero2;
  if (name == "fsdp" || name == "zero3" || name == "full_shard") return Strategy::kFsdp;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown strategy '", name, "': expected ddp, no_shard, zero1, zero2 or fsdp"));
}

const char* StrategyName(Strategy strategy) {
  switch (strategy) {
    case Strategy::kDdp: return "ddp";
    case Strategy::kNoShard: return "no_shard";
    case Strategy::kZero1: return "zero1";
    case Strategy::kZero2: return "zero2";
    case Strategy::kFsdp: return "fsdp";
  }
  return "?";
}

}  // namespace elrun::trainer
