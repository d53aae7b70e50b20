// BufferPool: best-fit lending, reuse, exact size classes, lending storage to tensors and their
// views, and misuse.
#include "trainer/memory/buffer_pool.h"

#include <doctest/doctest.h>

namespace elrun::trainer {
namespace {

TEST_CASE("Loans are reused, best fit first; the pool never grows past what was lent at once") {
  BufferPool pool(torch::TensorOptions().dtype(torch::kFloat));
  auto a = pool.Lend(100);
  auto b = pool.Lend(40);
  CHECK(pool.buffers() == 2);
  CHECK(pool.bytes() == 4 * 140);
  CHECK(pool.lent_bytes() == 4 * 140);
  pool.Return(a);
  pool.Return(b);
  // 30 elements fit both: the smaller (b's) is lent.
  auto c = pool.Lend(30);
  CHECK(c.data == b.data);
  auto d = pool.Lend(30);  // Only the 100-element buffer is free.
  CHECK(d.data == a.data);
  CHECK(pool.buffers() == 2);
  auto e = pool.Lend(30);  // None free: a new buffer of exactly 30.
  CHECK(pool.buffers() == 3);
  CHECK(pool.bytes() == 4 * 170);
  CHECK(pool.peak_lent_bytes() == 4 * 170);
  for (const auto& loan : {c, d, e}) pool.Return(loan);
  CHECK(pool.lent_bytes() == 0);
  CHECK_THROWS_WITH_AS(pool.Return(c), doctest::Contains("not lent"), c10::Error);
  CHECK_THROWS_WITH_AS(pool.Lend(0), doctest::Contains("at least one element"), c10::Error);
}

TEST_CASE("LendTo gives a storage (and its views) memory; TakeFrom takes it back for the next") {
  BufferPool pool(torch::TensorOptions().dtype(torch::kFloat));
  torch::Tensor flat = torch::zeros({8});
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  torch::Tensor view = flat.narrow(0, 2, 3);
  // Take the tensor's own memory away, as FSDP does with a resharded unit.
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
  CHECK_FALSE(BufferPool::HasMemory(flat));

  pool.LendTo(flat);
  CHECK(BufferPool::HasMemory(flat));
  flat.copy_(torch::arange(8, torch::kFloat));
  CHECK(torch::equal(view, torch::tensor({2.0f, 3.0f, 4.0f})));  // The view sees the lent memory.
  void* where = flat.data_ptr();
  pool.LendTo(flat);  // Already lent: nothing changes.
  CHECK(flat.data_ptr() == where);
  CHECK(pool.buffers() == 1);

  pool.TakeFrom(flat);
  CHECK_FALSE(BufferPool::HasMemory(flat));
  CHECK(pool.lent_bytes() == 0);
  pool.TakeFrom(flat);  // Not lent: nothing to take.

  torch::Tensor other = torch::empty({6});
  auto* other_storage = other.storage().unsafeGetStorageImpl();
  other_storage->set_data_ptr_noswap(at::DataPtr(nullptr, other_storage->device()));
  other_storage->set_nbytes(0);
  pool.LendTo(other);  // The same buffer serves the next borrower.
  CHECK(other.data_ptr() == where);
  CHECK(pool.buffers() == 1);

  torch::Tensor wrong = torch::empty({4}, torch::kDouble);
  auto* wrong_storage = wrong.storage().unsafeGetStorageImpl();
  wrong_storage->set_data_ptr_noswap(at::DataPtr(nullptr, wrong_storage->device()));
  wrong_storage->set_nbytes(0);
  CHECK_THROWS_WITH_AS(pool.LendTo(wrong), doctest::Contains("the pool lends"), c10::Error);
}

}  // namespace
}  // namespace elrun::trainer
