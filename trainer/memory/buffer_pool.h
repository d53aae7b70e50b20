// A persistent, size-classed pool of flat buffers: what FullyShardedDataParallel lends a unit's
// gathered parameters, its unsharded gradient and a reduce-scatter's receive space to, so the
// same few blocks serve every step instead of each gather and each backward allocating (and the
// heap keeping) fresh unit-sized memory.
// A size class is an exact element count (FSDP's classes are its units' padded sizes). Lend()
// gives the smallest free buffer that holds the request, or makes a new one of exactly the
// requested class; buffers are never freed while the pool lives. So the pool holds, per class,
// at most the largest number of buffers of that class lent at one time: with FSDP's at most two
// units gathered (the one in use and the prefetched one), at most two per class.
// Buffers live on one device (the pool's TensorOptions); on CUDA they come from the caching
// allocator once and stay. Thread-compatible.
#ifndef ELRUN_TRAINER_MEMORY_BUFFER_POOL_H_
#define ELRUN_TRAINER_MEMORY_BUFFER_POOL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include <torch/torch.h>

namespace elrun::trainer {

class BufferPool {
 public:
  explicit BufferPool(torch::TensorOptions options) : options_(options) {}
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `numel` elements (its first `numel` are the caller's); index it back
  // with Return(). The contents are whatever the last borrower left.
  struct Loan {
    int index = -1;
    void* data = nullptr;
  };
  Loan Lend(int64_t numel);
  void Return(const Loan& loan);

  // Points the storage of `t` (and so every view of it) at a lent buffer large enough for it,
  // or takes it away again; `t`'s storage must have no memory of its own while lent. Views keep
  // their offsets, so tensors autograd saved are valid again after the next LendTo.
  void LendTo(const torch::Tensor& t);
  void TakeFrom(const torch::Tensor& t);
  static bool HasMemory(const torch::Tensor& t);

  int64_t bytes() const { return bytes_; }            // Everything the pool holds.
  int64_t lent_bytes() const { return lent_bytes_; }  // What is lent now.
  int64_t peak_lent_bytes() const { return peak_lent_bytes_; }
  int buffers() const { return static_cast<int>(buffers_.size()); }

 private:
  struct Buffer {
    torch::Tensor memory;
    int64_t bytes = 0;
    bool lent = false;
    const c10::StorageImpl* borrower = nullptr;  // LendTo's storage, if any.
  };
  const torch::TensorOptions options_;
  std::vector<Buffer> buffers_;
  int64_t bytes_ = 0;
  int64_t lent_bytes_ = 0;
  int64_t peak_lent_bytes_ = 0;
};

// One BufferPool per dtype, all on one device: mixed precision lends compute-dtype parameters
// and gradients, and reduce-dtype communication buffers.
class BufferPools {
 public:
  explicit BufferPools(torch::Device device) : device_(device) {}
  BufferPools(const BufferPools&) = delete;
  BufferPools& operator=(const BufferPools&) = delete;

  BufferPool& For(c10::ScalarType dtype);
  BufferPool& For(const torch::Tensor& t) { return For(t.scalar_type()); }
  int64_t bytes() const;            // Held by all pools.
  int64_t peak_lent_bytes() const;  // Sum of the pools' peaks (an upper bound of the joint peak).

 private:
  const torch::Device device_;
  std::map<c10::ScalarType, std::unique_ptr<BufferPool>> pools_;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_MEMORY_BUFFER_POOL_H_
