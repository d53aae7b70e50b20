#include "trainer/memory/buffer_pool.h"

#include <algorithm>

namespace elrun::trainer {
namespace {

c10::StorageImpl* StorageOf(const torch::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

int64_t NeededBytes(const torch::Tensor& t) {
  return (t.storage_offset() + t.numel()) * static_cast<int64_t>(t.element_size());
}

}  // namespace

BufferPool::Loan BufferPool::Lend(int64_t numel) {
  TORCH_CHECK(numel > 0, "buffer pool: a loan needs at least one element, got ", numel);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(options_.dtype().toScalarType()));
  int best = -1;
  for (int i = 0; i < static_cast<int>(buffers_.size()); ++i) {
    const Buffer& b = buffers_[i];
    if (!b.lent && b.bytes >= bytes && (best < 0 || b.bytes < buffers_[best].bytes)) best = i;
  }
  if (best < 0) {
    Buffer b;
    b.memory = torch::empty({numel}, options_.requires_grad(false));
    b.bytes = bytes;
    bytes_ += bytes;
    buffers_.push_back(std::move(b));
    best = static_cast<int>(buffers_.size()) - 1;
  }
  Buffer& b = buffers_[best];
  b.lent = true;
  lent_bytes_ += b.bytes;
  peak_lent_bytes_ = std::max(peak_lent_bytes_, lent_bytes_);
  return Loan{best, b.memory.data_ptr()};
}

void BufferPool::Return(const Loan& loan) {
  TORCH_CHECK(loan.index >= 0 && loan.index < static_cast<int>(buffers_.size()) && buffers_[loan.index].lent,
              "buffer pool: return of a buffer that is not lent");
  Buffer& b = buffers_[loan.index];
  b.lent = false;
  b.borrower = nullptr;
  lent_bytes_ -= b.bytes;
}

bool BufferPool::HasMemory(const torch::Tensor& t) { return t.defined() && StorageOf(t)->nbytes() > 0; }

void BufferPool::LendTo(const torch::Tensor& t) {
  if (HasMemory(t)) return;
  c10::StorageImpl* storage = StorageOf(t);
  const int64_t bytes = NeededBytes(t);
  const int64_t element = static_cast<int64_t>(c10::elementSize(options_.dtype().toScalarType()));
  TORCH_CHECK(t.scalar_type() == options_.dtype().toScalarType() && t.device() == options_.device(),
              "buffer pool: tensor of ", t.toString(), " on ", t.device(), ", the pool lends ", options_.dtype(),
              " on ", options_.device());
  const Loan loan = Lend((bytes + element - 1) / element);
  buffers_[loan.index].borrower = storage;
  // Not owning: the pool keeps the memory, TakeFrom() takes it back.
  storage->set_data_ptr_noswap(at::DataPtr(loan.data, storage->device()));
  storage->set_nbytes(static_cast<size_t>(bytes));
}

void BufferPool::TakeFrom(const torch::Tensor& t) {
  if (!t.defined()) return;
  c10::StorageImpl* storage = StorageOf(t);
  auto it =
      std::find_if(buffers_.begin(), buffers_.end(), [&](const Buffer& b) { return b.lent && b.borrower == storage; });
  if (it == buffers_.end()) return;  // Not lent to it (already taken back).
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
  Return(Loan{static_cast<int>(it - buffers_.begin()), nullptr});
}

BufferPool& BufferPools::For(c10::ScalarType dtype) {
  auto& pool = pools_[dtype];
  if (!pool) pool = std::make_unique<BufferPool>(torch::TensorOptions().dtype(dtype).device(device_));
  return *pool;
}

int64_t BufferPools::bytes() const {
  int64_t total = 0;
  for (const auto& [dtype, pool] : pools_) total += pool->bytes();
  return total;
}

int64_t BufferPools::peak_lent_bytes() const {
  int64_t total = 0;
  for (const auto& [dtype, pool] : pools_) total += pool->peak_lent_bytes();
  return total;
}

}  // namespace elrun::trainer
