// MakeNcclBackend: the one file that includes ProcessGroupNCCL.hpp (with the wheel's own nccl.h,
// the version libtorch_cuda was built with).
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "trainer/dist/process_group.h"

namespace elrun::trainer {

c10::intrusive_ptr<c10d::Backend> MakeNcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                  int cuda_device, std::chrono::milliseconds timeout) {
  TORCH_CHECK(cuda_device >= 0 && cuda_device < static_cast<int>(c10::cuda::device_count()), "CUDA device ",
              cuda_device, " does not exist (", static_cast<int>(c10::cuda::device_count()), " visible)");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(cuda_device));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(cuda_device));
  nccl->setBoundDeviceId(device);
  nccl->eagerConnectSingleDevice(device);
  return nccl;
}

}  // namespace elrun::trainer
