// FullyShardedDataParallel's unit (one ShardedModule's parameters as one flat buffer) and the
// helpers its construction (fsdp_build.cc) and its steps (fsdp.cc) share. Private to //trainer/parallel:fsdp.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "trainer/memory/buffer_pool.h"
#include "trainer/parallel/fsdp.h"

namespace elrun::trainer {

struct FullyShardedDataParallel::Unit {
  std::vector<torch::Tensor> params;           // The module's parameters: views of `full`.
  std::vector<int64_t> offsets;                // Of each parameter in `full`.
  torch::Tensor full;                          // [padded]; kFsdp: lent by the pool while gathered.
  torch::Tensor shard;                         // [shard_numel]: a view of `full` unless kFsdp.
  torch::Tensor flat_grad;                     // [padded]; the parameters' .grad are views of it; lent by
                                               // the pool while needed when separate_grad.
  bool separate_shard = false;                 // kFsdp: shard is not a view of full.
  bool separate_grad = false;                  // kZero2/kFsdp: the gradient shard has its own memory.
  bool gathered = false;                       // kFsdp: full holds the current parameters.
  int64_t gathered_version = -1;               // kZero1/kZero2: full's version after the last gather.
  bool stale = false;                          // kZero1/kZero2: a synchronized backward since then.
  c10::intrusive_ptr<c10d::Work> gather_work;  // A prefetch in flight.
  std::vector<bool> ready;
  size_t pending = 0;
  bool grad_pending = false;    // flat_grad holds NoSync gradients not reduced yet.
  bool backward_begun = false;  // PreBackward ran in this backward.
  int64_t grad_version = -1;    // kZero1: the gradient shard's version after a reduction.
  ReduceScatterOp reduce_scatter;
  BufferPool::Loan receive;  // The reduce-scatter's receive space while it is active.
  BufferPool::Loan cast;     // flat_grad in the reduce dtype, when that differs, while active.
  c10::intrusive_ptr<c10d::Work> all_reduce;
};

namespace fsdp_internal {

inline int64_t Bytes(const torch::Tensor& t) { return t.numel() * t.element_size(); }

inline bool Allocated(const torch::Tensor& t) { return BufferPool::HasMemory(t); }

}  // namespace fsdp_internal
}  // namespace elrun::trainer
