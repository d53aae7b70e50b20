// --device and --backend against the devices a worker sees: every rule without a GPU.
#include "trainer/app/placement.h"

#include <doctest/doctest.h>

namespace elrun::trainer {
namespace {

TEST_CASE("auto picks CUDA and NCCL when a device is visible, else the CPU and Gloo") {
  auto gpu = ResolvePlacement(DeviceChoice::kAuto, BackendChoice::kAuto, 1, 2, "");
  REQUIRE(gpu.ok());
  CHECK(gpu->cuda);
  CHECK(gpu->cuda_device == 1);  // cuda:LOCAL_RANK.
  CHECK(gpu->backend == BackendKind::kNccl);
  auto cpu = ResolvePlacement(DeviceChoice::kAuto, BackendChoice::kAuto, 3, 0, "");
  REQUIRE(cpu.ok());
  CHECK_FALSE(cpu->cuda);
  CHECK(cpu->backend == BackendKind::kGloo);
}

TEST_CASE("--device cpu stays on the CPU on a GPU machine") {
  auto cpu = ResolvePlacement(DeviceChoice::kCpu, BackendChoice::kAuto, 0, 8, "");
  REQUIRE(cpu.ok());
  CHECK_FALSE(cpu->cuda);
  CHECK(cpu->backend == BackendKind::kGloo);
}

TEST_CASE("--device cuda without a visible device is one line naming the fix") {
  auto none = ResolvePlacement(DeviceChoice::kCuda, BackendChoice::kAuto, 0, 0, "");
  CHECK(none.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(none.status().message() == "--device=cuda: no CUDA device is visible (0 visible); use --device cpu or auto");
}

TEST_CASE("a LOCAL_RANK beyond the visible devices names both counts and CUDA_VISIBLE_DEVICES") {
  auto beyond = ResolvePlacement(DeviceChoice::kAuto, BackendChoice::kAuto, 2, 2, "4,5");
  CHECK(beyond.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(beyond.status().message()) ==
        "LOCAL_RANK=2 has no CUDA device (2 visible with CUDA_VISIBLE_DEVICES=4,5); start at most one worker "
        "per device (elrun --nproc-per-node gpu), or use --device cpu");
  CHECK(ResolvePlacement(DeviceChoice::kCuda, BackendChoice::kNccl, 1, 2, "4,5").ok());  // The last one fits.
}

TEST_CASE("nccl needs CUDA tensors; gloo does not take them") {
  auto nccl = ResolvePlacement(DeviceChoice::kAuto, BackendChoice::kNccl, 0, 0, "");
  CHECK(nccl.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(nccl.status().message()).find("--backend=nccl needs CUDA tensors") == 0);
  auto gloo = ResolvePlacement(DeviceChoice::kAuto, BackendChoice::kGloo, 0, 1, "");
  CHECK(gloo.status().code() == absl::StatusCode::kInvalidArgument);
  auto cpu_gloo = ResolvePlacement(DeviceChoice::kCpu, BackendChoice::kGloo, 0, 1, "");
  CHECK(cpu_gloo.ok());
  // Explicit pairs that no machine satisfies: the same line as elrun-train's option check.
  auto cpu_nccl = ResolvePlacement(DeviceChoice::kCpu, BackendChoice::kNccl, 0, 8, "");
  CHECK(cpu_nccl.status() == CheckDeviceBackend(DeviceChoice::kCpu, BackendChoice::kNccl));
  CHECK_FALSE(cpu_nccl.ok());
}

}  // namespace
}  // namespace elrun::trainer
