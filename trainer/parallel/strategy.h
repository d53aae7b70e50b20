// The data-parallel strategies DataParallel (data_parallel.h) trains with: DDP, or one of the
// sharded strategies of FullyShardedDataParallel (fsdp.h). A plain enum, no LibTorch, so an
// application's option parser can name it without compiling torch headers.
#ifndef ELRUN_TRAINER_PARALLEL_STRATEGY_H_
#define ELRUN_TRAINER_PARALLEL_STRATEGY_H_

namespace elrun::trainer {

enum class Strategy { kDdp, kNoShard, kZero1, kZero2, kFsdp };

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_PARALLEL_STRATEGY_H_
