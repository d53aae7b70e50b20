// --numa-binding's plan against machine descriptions written as sysfs trees, one per test.
#include "launcher/os/numa_binding.h"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <string>

namespace elrun {
namespace {

// A sysfs tree under TEST_TMPDIR: 2 sockets of 2 NUMA nodes; node n holds CPUs 4n..4n+3 as
// two cores of two hyper-threads ({4n, 4n+1}, {4n+2, 4n+3}), each core its own L3 group;
// NVIDIA GPUs at 0000:17:00.0 and 0000:31:00.0 (node 0), 0000:b1:00.0 (node 2) and
// 0000:ca:00.0 (node 3), plus an NVIDIA audio function and an Intel device that are no GPUs.
class Machine {
 public:
  explicit Machine(const std::string& name) {
    const char* tmp = std::getenv("TEST_TMPDIR");
    root_ = std::string(tmp ? tmp : "/tmp") + "/numa_" + name + "/";
    REQUIRE((::mkdir(root_.c_str(), 0755) == 0 || errno == EEXIST));
    Write("sys/devices/system/node/possible", "0-3\n");
    for (int node = 0; node < 4; ++node) {
      Write("sys/devices/system/node/node" + std::to_string(node) + "/cpulist",
            std::to_string(4 * node) + "-" + std::to_string(4 * node + 3) + "\n");
    }
    for (int cpu = 0; cpu < 16; ++cpu) {
      std::string dir = "sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/";
      int core = cpu / 2 * 2;
      std::string pair = std::to_string(core) + "-" + std::to_string(core + 1);
      Write(dir + "topology/physical_package_id", cpu < 8 ? "0\n" : "1\n");
      Write(dir + "topology/thread_siblings_list", pair + "\n");
      Write(dir + "cache/index0/type", "Instruction\n");
      Write(dir + "cache/index0/level", "1\n");
      Write(dir + "cache/index0/shared_cpu_list", std::to_string(cpu) + "\n");
      Write(dir + "cache/index3/type", "Unified\n");
      Write(dir + "cache/index3/level", "3\n");
      Write(dir + "cache/index3/shared_cpu_list", pair + "\n");
    }
    Gpu("0000:17:00.0", 0, "GPU-aaaa1111-0000");
    Gpu("0000:31:00.0", 0, "GPU-bbbb2222-0000");
    Gpu("0000:b1:00.0", 2, "GPU-cccc3333-0000");
    Gpu("0000:ca:00.0", 3, "GPU-cccc4444-0000");
    Device("0000:17:00.1", "0x10de", "0x040300", 0);
    Device("0000:00:1f.0", "0x8086", "0x030000", 0);
  }

  void Write(const std::string& path, const std::string& text) {
    for (size_t slash = path.find('/'); slash != std::string::npos; slash = path.find('/', slash + 1)) {
      ::mkdir((root_ + path.substr(0, slash)).c_str(), 0755);
    }
    std::ofstream out(root_ + path);
    out << text;
    REQUIRE(out.good());
  }
  void Device(const std::string& address, const std::string& vendor, const std::string& cls, int node) {
    Write("sys/bus/pci/devices/" + address + "/vendor", vendor + "\n");
    Write("sys/bus/pci/devices/" + address + "/class", cls + "\n");
    Write("sys/bus/pci/devices/" + address + "/numa_node", std::to_string(node) + "\n");
  }
  void Gpu(const std::string& address, int node, const std::string& uuid) {
    Device(address, "0x10de", "0x030200", node);
    Write("proc/driver/nvidia/gpus/" + address + "/information",
          "Model: \t\t NVIDIA H200\nGPU UUID: \t\t " + uuid + "\nBus Location: \t " + address + "\n");
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

std::set<int> AllCpus() {
  std::set<int> all;
  for (int cpu = 0; cpu < 16; ++cpu) all.insert(cpu);
  return all;
}

// "cpus@node" per local rank, e.g. "0-3@0 8-11@2".
std::string Plan(const Machine& m, NumaMode mode, int nproc, std::optional<std::string> visible = std::nullopt,
                 const std::set<int>& allowed = AllCpus()) {
  auto plan = PlanNumaBinding(mode, nproc, visible, m.root(), allowed);
  if (!plan.ok()) return "error: " + std::string(plan.status().message());
  if (!plan->note.empty()) return "note: " + plan->note;
  std::string out;
  for (const CpuBinding& b : plan->workers) {
    out += (out.empty() ? "" : " ") + FormatCpuList(b.cpus) + "@" + std::to_string(b.memory_node);
  }
  return out;
}

TEST_CASE("the four modes, as torch/numa/binding.py computes them") {
  Machine m("modes");
  CHECK(Plan(m, NumaMode::kNode, 4) == "0-3@0 0-3@0 8-11@2 12-15@3");
  CHECK(Plan(m, NumaMode::kSocket, 4) == "0-7@0 0-7@0 8-15@2 8-15@3");
  // Node 0's two cores split between its two GPUs; a GPU alone on its node gets all of it.
  CHECK(Plan(m, NumaMode::kExclusive, 4) == "0-1@0 2-3@0 8-11@2 12-15@3");
  // One last-level-cache group per GPU of the node, round robin.
  CHECK(Plan(m, NumaMode::kCoreComplex, 4) == "0-1@0 2-3@0 8-9@2 12-13@3");
  CHECK(Plan(m, NumaMode::kNode, 1) == "0-3@0");
}

TEST_CASE("only CPUs elrun may use count") {
  Machine m("allowed");
  std::set<int> allowed = AllCpus();
  allowed.erase(0);
  allowed.erase(9);
  CHECK(Plan(m, NumaMode::kNode, 3, std::nullopt, allowed) == "1-3@0 1-3@0 8,10-11@2");
  CHECK(Plan(m, NumaMode::kExclusive, 2, std::nullopt, allowed) == "1@0 2-3@0");
  std::set<int> none_on_node2 = AllCpus();
  for (int cpu = 8; cpu < 12; ++cpu) none_on_node2.erase(cpu);
  CHECK(Plan(m, NumaMode::kNode, 3, std::nullopt, none_on_node2) ==
        "error: --numa-binding: GPU 2 (0000:b1:00.0) is on NUMA node 2, which has no CPU this process may use");
}

TEST_CASE("CUDA_VISIBLE_DEVICES picks and orders the GPUs, by index or UUID") {
  Machine m("visible");
  CHECK(Plan(m, NumaMode::kNode, 2, "2,0") == "8-11@2 0-3@0");
  // Exclusive splits a node among the visible GPUs only.
  CHECK(Plan(m, NumaMode::kExclusive, 2, "1,3") == "0-3@0 12-15@3");
  CHECK(Plan(m, NumaMode::kNode, 2, "GPU-cccc4444,GPU-aaaa") == "12-15@3 0-3@0");
  CHECK(Plan(m, NumaMode::kNode, 1, "7") ==
        "error: --numa-binding: CUDA_VISIBLE_DEVICES names GPU 7 but this machine has 4");
  CHECK(Plan(m, NumaMode::kNode, 1, "GPU-cccc") ==
        "error: --numa-binding: CUDA_VISIBLE_DEVICES entry 'GPU-cccc' names more than one GPU of this machine");
  CHECK(Plan(m, NumaMode::kNode, 1, "MIG-1234") ==
        "error: --numa-binding: CUDA_VISIBLE_DEVICES entry 'MIG-1234' names no GPU of this machine");
  CHECK(Plan(m, NumaMode::kNode, 1, "-1") == "error: --numa-binding: local rank 0 has no GPU (0 visible)");
  CHECK(Plan(m, NumaMode::kNode, 5) == "error: --numa-binding: local rank 4 has no GPU (4 visible)");
}

TEST_CASE("without GPUs or without a second NUMA node, nothing is bound and one line says why") {
  Machine single("single");
  single.Write("sys/devices/system/node/possible", "0\n");
  CHECK(Plan(single, NumaMode::kNode, 2) ==
        "note: --numa-binding: this machine has one NUMA node; workers are not bound");
  Machine m("nogpu");
  auto plan = PlanNumaBinding(NumaMode::kNode, 2, std::nullopt, m.root() + "nothing-here/", AllCpus());
  REQUIRE(plan.ok());
  CHECK(plan->workers.empty());
  CHECK(plan->note == "--numa-binding: no NVIDIA GPU on this machine; workers are not bound");
}

TEST_CASE("a broken sysfs file is an error naming it, never a crash") {
  Machine m("broken");
  m.Write("sys/bus/pci/devices/0000:17:00.0/numa_node", "zero\n");
  CHECK(Plan(m, NumaMode::kNode, 1) ==
        "error: --numa-binding: /sys/bus/pci/devices/0000:17:00.0/numa_node holds 'zero', not a number");
  m.Write("sys/bus/pci/devices/0000:17:00.0/numa_node", "0\n");
  m.Write("sys/devices/system/node/node0/cpulist", "3-1\n");
  CHECK(Plan(m, NumaMode::kNode, 1) ==
        "error: --numa-binding: /sys/devices/system/node/node0/cpulist: '3-1' is not a valid range of CPUs");
}

TEST_CASE("sysfs lists parse and format") {
  CHECK(*ParseCpuList("0-3,8,10-11\n") == std::set<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK(ParseCpuList("")->empty());
  CHECK_FALSE(ParseCpuList("x").ok());
  CHECK_FALSE(ParseCpuList("1-").ok());
  CHECK_FALSE(ParseCpuList("-1").ok());
  CHECK_FALSE(ParseCpuList("0-99999999").ok());
  CHECK(FormatCpuList({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11");
  CHECK(FormatCpuList({5}) == "5");
  CHECK(FormatCpuList({}) == "");
  CHECK(ParseNumaMode("core-complex") == NumaMode::kCoreComplex);
  CHECK_FALSE(ParseNumaMode("numa").has_value());
}

}  // namespace
}  // namespace elrun
