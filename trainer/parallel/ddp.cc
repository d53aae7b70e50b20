#include "trainer/parallel/ddp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <sstream>

#include "trainer/dist/collectives.h"

namespace elrun::trainer {

struct DistributedDataParallel::Bucket {
  std::vector<size_t> params;
  torch::Tensor flat;
  int pending = 0;
  c10::intrusive_ptr<c10d::Work> work;
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 c10::intrusive_ptr<c10d::Backend> pg, DdpOptions options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(options) {
  CheckShmSpansGroup();
  for (const auto& item : module_->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    params_.push_back(item.value());
    names_.push_back(item.key());
  }
  std::vector<torch::Tensor> state = params_;
  for (const auto& buffer : module_->buffers()) state.push_back(buffer);
  if (!state.empty() && options_.broadcast_from_rank0) BroadcastFromRank0(*pg_, state);

  // Buckets in reverse registration order (roughly the order backward produces gradients), one
  // dtype each; a bucket closes once it reaches its limit (see DdpOptions).
  const int64_t first_cap = static_cast<int64_t>(options_.first_bucket_mb * 1024 * 1024);
  const int64_t cap = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
  bucket_of_.assign(params_.size(), -1);
  offset_.assign(params_.size(), 0);
  ready_.assign(params_.size(), false);
  int64_t bytes = 0;
  bool open = false;
  for (size_t k = params_.size(); k-- > 0;) {
    const torch::Tensor& p = params_[k];
    if (open && params_[layout_.back().front()].scalar_type() != p.scalar_type()) open = false;
    if (!open) {
      layout_.emplace_back();
      bytes = 0;
      open = true;
    }
    layout_.back().push_back(k);
    bytes += p.numel() * p.element_size();
    if (bytes >= (layout_.size() == 1 ? std::min(first_cap, cap) : cap)) open = false;
  }
  for (size_t b = 0; b < layout_.size(); ++b) {
    auto bucket = std::make_unique<Bucket>();
    bucket->params = layout_[b];
    int64_t numel = 0;
    for (size_t k : bucket->params) {
      bucket_of_[k] = static_cast<int>(b);
      offset_[k] = numel;
      numel += params_[k].numel();
    }
    bucket->flat = torch::zeros({numel}, params_[bucket->params.front()].options());
    buckets_.push_back(std::move(bucket));
  }
  ResetIteration();
  SetScale();

  for (size_t k = 0; k < params_.size(); ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[k]);
    accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          OnGradReady(k);
          return outputs;
        }));
    accumulators_.push_back(std::move(accumulator));
  }
}

DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::CheckShmSpansGroup() const {
  TORCH_CHECK(!options_.shm || options_.shm->Spans(*pg_),
              "DistributedDataParallel: the shared-memory all-reduce spans rank ",
              options_.shm ? options_.shm->rank() : 0, " of ", options_.shm ? options_.shm->world_size() : 0,
              ", the process group rank ", pg_->getRank(), " of ", pg_->getSize());
}

void DistributedDataParallel::SetScale() {
  // 1 / world size as a CPU number the kernels take as an argument: a device tensor would cost
  // an allocation and a fill kernel per gradient (on CUDA, launches are FashionNet's bottleneck).
  scale_ = at::scalar_tensor(1.0 / pg_->getSize(), at::kDouble);
  scale_.unsafeGetTensorImpl()->set_wrapped_number(true);
}

void DistributedDataParallel::Rebind(c10::intrusive_ptr<c10d::Backend> pg, std::shared_ptr<ShmAllreduce> shm) {
  // The failed step's pending all-reduces belong to the old group: dropped, never waited for.
  ResetIteration();
  pg_ = std::move(pg);
  options_.shm = std::move(shm);
  if (!pg_) {
    TORCH_CHECK(!options_.shm, "DistributedDataParallel: a shared-memory all-reduce needs its process group");
    return;  // Detached: the old group's last handle here is gone.
  }
  CheckShmSpansGroup();
  SetScale();
}

void DistributedDataParallel::ResetIteration() {
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& bucket : buckets_) {
    bucket->pending = static_cast<int>(bucket->params.size());
    bucket->work.reset();
  }
  next_launch_ = 0;
  in_backward_ = false;
}

void DistributedDataParallel::OnGradReady(size_t k) {
  if (!sync_) return;
  if (!in_backward_) {
    in_backward_ = true;
    stats_ = DdpStats{};
    stats_.buckets = static_cast<int>(buckets_.size());
    torch::autograd::Engine::get_default_engine().queue_callback([this] { Finalize(); });
  }
  if (ready_[k]) return;  // A parameter used twice in the graph accumulates before the hook.
  ready_[k] = true;
  stats_.last_grad_ready = std::chrono::steady_clock::now();
  Bucket& bucket = *buckets_[bucket_of_[k]];
  torch::Tensor grad = params_[k].grad();
  torch::NoGradGuard no_grad;
  auto slot = bucket.flat.narrow(0, offset_[k], params_[k].numel());
  if (grad.defined()) {
    // Averaged while copied in, as PyTorch's reducer does: one pass instead of a copy now and a
    // scaling pass over the reduced bucket at the end of backward (x * 1.0 is exact at 1 rank).
    at::mul_out(slot, grad.reshape({-1}), scale_);
  } else {
    slot.zero_();
  }
  if (--bucket.pending == 0) LaunchReadyBuckets();
}

void DistributedDataParallel::LaunchReadyBuckets() {
  // Collectives must be issued in the same order on every rank: launch in bucket order.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_]->pending == 0) {
    Bucket& bucket = *buckets_[next_launch_++];
    bucket.work = AllreduceSum(*pg_, options_.shm.get(), bucket.flat);
    if (stats_.bytes_reduced == 0) stats_.first_launch = std::chrono::steady_clock::now();
    stats_.bytes_reduced += bucket.flat.numel() * bucket.flat.element_size();
  }
}

void DistributedDataParallel::Finalize() {
  stats_.backward_end = std::chrono::steady_clock::now();
  stats_.buckets_launched_before_backward_end = static_cast<int>(next_launch_);
  std::vector<std::string> unused;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!ready_[k]) unused.push_back(names_[k]);
  }
  if (!unused.empty()) {
    if (!options_.find_unused_parameters) {
      std::ostringstream names;
      for (size_t i = 0; i < unused.size() && i < 8; ++i) names << (i ? ", " : "") << unused[i];
      ResetIteration();
      TORCH_CHECK(false, "DistributedDataParallel: ", unused.size(), " parameter(s) got no gradient in this backward (",
                  names.str(), "); set find_unused_parameters if some parameters are legitimately unused");
    }
    for (size_t k = 0; k < params_.size(); ++k) {
      if (!ready_[k]) OnGradReady(k);  // Reduced as zeros.
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    if (bucket->work) bucket->work->wait();  // Sums of gradients already divided by the world size.
    for (size_t k : bucket->params) {
      auto reduced = bucket->flat.narrow(0, offset_[k], params_[k].numel()).view_as(params_[k]);
      if (params_[k].grad().defined()) {
        params_[k].mutable_grad().copy_(reduced);
      } else {
        params_[k].mutable_grad() = reduced.clone();
      }
    }
  }
  ResetIteration();
}

int64_t DistributedDataParallel::bucket_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) bytes += bucket->flat.numel() * bucket->flat.element_size();
  return bytes;
}

void DistributedDataParallel::BroadcastBuffers() {
  std::vector<torch::Tensor> buffers;
  for (const auto& buffer : module_->buffers()) buffers.push_back(buffer);
  if (!buffers.empty()) BroadcastFromRank0(*pg_, buffers);
}

}  // namespace elrun::trainer
