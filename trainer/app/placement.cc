#include "trainer/app/placement.h"

#include "absl/strings/str_cat.h"

namespace elrun::trainer {

absl::StatusOr<Placement> ResolvePlacement(DeviceChoice device, BackendChoice backend, int local_rank,
                                           int visible_cuda_devices, const std::string& cuda_visible_devices) {
  const std::string visible = absl::StrCat(
      visible_cuda_devices, " visible",
      cuda_visible_devices.empty() ? std::string() : absl::StrCat(" with CUDA_VISIBLE_DEVICES=", cuda_visible_devices));
  if (absl::Status s = CheckDeviceBackend(device, backend); !s.ok()) return s;
  Placement placement;
  placement.cuda = device == DeviceChoice::kCuda || (device == DeviceChoice::kAuto && visible_cuda_devices > 0);
  if (!placement.cuda) {
    if (backend == BackendChoice::kNccl) {  // --device auto without a visible device.
      return absl::InvalidArgumentError(absl::StrCat(
          "--backend=nccl needs CUDA tensors, and no CUDA device is visible (", visible, "); use --backend gloo"));
    }
    return placement;
  }
  if (visible_cuda_devices == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device=cuda: no CUDA device is visible (", visible, "); use --device cpu or auto"));
  }
  if (local_rank >= visible_cuda_devices) {
    return absl::FailedPreconditionError(
        absl::StrCat("LOCAL_RANK=", local_rank, " has no CUDA device (", visible,
                     "); start at most one worker per device (elrun --nproc-per-node gpu), or use --device cpu"));
  }
  if (backend == BackendChoice::kGloo) {  // --device auto with a visible device.
    return absl::InvalidArgumentError("--backend=gloo with CUDA tensors: CUDA tensors go through nccl");
  }
  placement.cuda_device = local_rank;
  placement.backend = BackendKind::kNccl;
  return placement;
}

}  // namespace elrun::trainer
