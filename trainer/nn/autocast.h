// torch.autocast for C++: within the guard's scope, ATen's autocast runs the ops of its lower-
// precision list (matmuls, convolutions) in `dtype` on `device`'s type and keeps the others
// (losses, reductions, norms) in fp32, casting the fp32 weights per op; on leaving the outermost
// guard the cache of cast weights is cleared, as Python's autocast does. Backward runs outside it.
// No guard (nullopt): nothing changes. Not thread-safe across threads of one process: autocast's
// state is thread-local, the guard is for the thread that runs the forward.
#ifndef ELRUN_TRAINER_NN_AUTOCAST_H_
#define ELRUN_TRAINER_NN_AUTOCAST_H_

#include <optional>

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace elrun::trainer {

class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype)
      : device_(device), enabled_(dtype.has_value()) {
    if (!enabled_) return;
    previous_enabled_ = at::autocast::is_autocast_enabled(device_);
    previous_dtype_ = at::autocast::get_autocast_dtype(device_);
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, *dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!enabled_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_, previous_enabled_);
    at::autocast::set_autocast_dtype(device_, previous_dtype_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  const c10::DeviceType device_;
  const bool enabled_;
  bool previous_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::ScalarType::Float;
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_NN_AUTOCAST_H_
