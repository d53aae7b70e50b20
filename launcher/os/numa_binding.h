// --numa-binding: which CPUs and which memory node each local worker is bound to, from the
// GPU it uses (cuda:LOCAL_RANK within CUDA_VISIBLE_DEVICES) and the machine's topology in
// sysfs, with torchrun 2.11's modes (torch/numa/binding.py):
//   node          every CPU of the GPU's NUMA node;
//   socket        every CPU of the NUMA nodes on the GPU's socket;
//   exclusive     the GPU's even share of its NUMA node's physical cores (lower GPUs get the
//                 remainder), all hyper-threads of each core;
//   core-complex  one last-level-cache group of the GPU's NUMA node per GPU, round robin.
// Only CPUs the launcher may run on count. Memory is bound softly: the GPU's NUMA node is the
// preferred node (MPOL_PREFERRED), so an allocation falls back rather than fail. GPUs are
// NVIDIA PCI devices in bus order (CUDA's order with CUDA_DEVICE_ORDER=PCI_BUS_ID, and in
// practice for identical GPUs); CUDA_VISIBLE_DEVICES may name them by index or GPU-UUID.
// Pure but for reading files under `root` ("/" in elrun); thread-compatible.
#ifndef ELRUN_LAUNCHER_OS_NUMA_BINDING_H_
#define ELRUN_LAUNCHER_OS_NUMA_BINDING_H_

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace elrun {

enum class NumaMode { kNode, kSocket, kExclusive, kCoreComplex };

// "node", "socket", "exclusive", "core-complex"; nullopt for anything else.
std::optional<NumaMode> ParseNumaMode(absl::string_view name);

// One worker's binding: the CPUs it may run on and its preferred memory node.
struct CpuBinding {
  std::vector<int> cpus;  // Sorted, not empty.
  int memory_node = 0;
};

// The bindings of local ranks 0..nproc-1, or, when binding cannot apply on this machine (no
// NVIDIA GPU, a single NUMA node), none and `note` saying why.
struct NumaPlan {
  std::vector<CpuBinding> workers;
  std::string note;
};

// `cuda_visible_devices`: the variable's value, nullopt when unset. `allowed`: the CPUs the
// launcher may use (its affinity). Errors name the cause: a local rank without a GPU, a GPU
// whose NUMA node has no allowed CPU, exclusive with fewer cores than GPUs on a node
// (FailedPrecondition); a CUDA_VISIBLE_DEVICES entry that names no GPU, an unparsable sysfs file
// (InvalidArgument); a sysfs file that cannot be read (NotFound).
absl::StatusOr<NumaPlan> PlanNumaBinding(NumaMode mode, int nproc,
                                         const std::optional<std::string>& cuda_visible_devices,
                                         const std::string& root, const std::set<int>& allowed);

// sysfs's list syntax: "0-3,8,10-11" (whitespace around it ignored).
absl::StatusOr<std::set<int>> ParseCpuList(absl::string_view text);
std::string FormatCpuList(const std::vector<int>& cpus);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_OS_NUMA_BINDING_H_
