// MakeGlooBackend: the one file that includes ProcessGroupGloo.hpp. The torch wheel ships no Gloo
// headers (Gloo is compiled into libtorch_cpu); Debian's libgloo-dev provides the declarations
// that header names. Only pointers to Gloo's types cross this file, so their layout never matters.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "trainer/dist/process_group.h"

namespace elrun::trainer {

c10::intrusive_ptr<c10d::Backend> MakeGlooBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                  const GlooDevice& device, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->timeout = timeout;
  for (const std::string& name : device.interfaces) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
  }
  if (device.interfaces.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(device.address));
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
}

}  // namespace elrun::trainer
