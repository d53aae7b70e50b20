// Where a worker computes and how its ranks talk: the device (CPU, or cuda:LOCAL_RANK among the
// CUDA devices visible to it) and the backend (NCCL for CUDA, Gloo for CPU), from --device and
// --backend. A pure function of its inputs, so every rule is tested without a GPU.
#ifndef ELRUN_TRAINER_APP_PLACEMENT_H_
#define ELRUN_TRAINER_APP_PLACEMENT_H_

#include <string>

#include "absl/status/statusor.h"
#include "trainer/app/train_options.h"
#include "trainer/dist/backend_kind.h"

namespace elrun::trainer {

struct Placement {
  bool cuda = false;
  int cuda_device = -1;  // Index among the visible devices when cuda.
  BackendKind backend = BackendKind::kGloo;
};

// `visible_cuda_devices`: what the CUDA runtime reports (0 without a GPU or driver);
// `cuda_visible_devices`: the CUDA_VISIBLE_DEVICES value, for messages ("" when unset).
// FailedPrecondition, one line naming LOCAL_RANK and the device count, when this worker has no
// device; InvalidArgument for a device/backend pair that cannot work (CheckDeviceBackend's, and
// those that --device auto makes impossible on this machine).
absl::StatusOr<Placement> ResolvePlacement(DeviceChoice device, BackendChoice backend, int local_rank,
                                           int visible_cuda_devices, const std::string& cuda_visible_devices);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_APP_PLACEMENT_H_
