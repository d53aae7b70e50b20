#include "launcher/os/numa_binding.h"

#include <dirent.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace elrun {
namespace {

constexpr int kMaxCpu = 1 << 16;  // Far above any machine; bounds a hostile or broken list.

class Topology {
 public:
  Topology(std::string root, const std::set<int>& allowed) : root_(std::move(root)), allowed_(allowed) {
    if (root_.empty() || root_.back() != '/') root_ += '/';
  }

  absl::StatusOr<std::string> Read(const std::string& path) const {
    std::ifstream in(root_ + path);
    std::stringstream contents;
    contents << in.rdbuf();
    if (!in) return absl::NotFoundError(absl::StrCat("--numa-binding: cannot read /", path));
    return std::string(absl::StripAsciiWhitespace(contents.str()));
  }

  absl::StatusOr<int> ReadInt(const std::string& path) const {
    auto text = Read(path);
    if (!text.ok()) return text.status();
    int value = 0;
    if (!absl::SimpleAtoi(*text, &value)) {
      return absl::InvalidArgumentError(absl::StrCat("--numa-binding: /", path, " holds '", *text, "', not a number"));
    }
    return value;
  }

  absl::StatusOr<std::set<int>> ReadList(const std::string& path) const {
    auto text = Read(path);
    if (!text.ok()) return text.status();
    auto list = ParseCpuList(*text);
    if (!list.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--numa-binding: /", path, ": ", list.status().message()));
    }
    return list;
  }

  std::vector<std::string> Entries(const std::string& dir) const {
    std::vector<std::string> names;
    if (DIR* d = ::opendir((root_ + dir).c_str())) {
      while (dirent* entry = ::readdir(d)) {
        if (entry->d_name[0] != '.') names.push_back(entry->d_name);
      }
      ::closedir(d);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // NVIDIA display or 3D controllers, by PCI address (bus order).
  std::vector<std::string> NvidiaGpus() const {
    std::vector<std::string> gpus;
    for (const std::string& address : Entries("sys/bus/pci/devices")) {
      std::string dir = "sys/bus/pci/devices/" + address;
      auto vendor = Read(dir + "/vendor");
      auto cls = Read(dir + "/class");
      if (!vendor.ok() || !cls.ok() || absl::AsciiStrToLower(*vendor) != "0x10de") continue;
      if (absl::StartsWith(*cls, "0x0300") || absl::StartsWith(*cls, "0x0302")) gpus.push_back(address);
    }
    return gpus;
  }

  std::string Uuid(const std::string& address) const {
    auto info = Read("proc/driver/nvidia/gpus/" + address + "/information");
    if (!info.ok()) return "";
    for (absl::string_view line : absl::StrSplit(*info, '\n')) {
      if (absl::ConsumePrefix(&line, "GPU UUID:")) return std::string(absl::StripAsciiWhitespace(line));
    }
    return "";
  }

  absl::StatusOr<int> NodeOfGpu(const std::string& address) const {
    auto node = ReadInt("sys/bus/pci/devices/" + address + "/numa_node");
    if (!node.ok()) return node.status();
    return std::max(*node, 0);  // -1 on machines with one node: that node is 0.
  }

  // The node's CPUs this process may use.
  absl::StatusOr<std::set<int>> NodeCpus(int node) const {
    auto cpus = ReadList(absl::StrCat("sys/devices/system/node/node", node, "/cpulist"));
    if (!cpus.ok()) return cpus.status();
    std::set<int> usable;
    for (int cpu : *cpus) {
      if (allowed_.count(cpu)) usable.insert(cpu);
    }
    return usable;
  }

  absl::StatusOr<std::set<int>> PossibleNodes() const { return ReadList("sys/devices/system/node/possible"); }

  absl::StatusOr<int> Socket(int cpu) const {
    return ReadInt(absl::StrCat("sys/devices/system/cpu/cpu", cpu, "/topology/physical_package_id"));
  }

  absl::StatusOr<std::set<int>> CoreSiblings(int cpu) const {
    return ReadList(absl::StrCat("sys/devices/system/cpu/cpu", cpu, "/topology/thread_siblings_list"));
  }

  // The CPUs sharing `cpu`'s highest-level data or unified cache.
  absl::StatusOr<std::set<int>> LastLevelCacheSharers(int cpu) const {
    std::string dir = absl::StrCat("sys/devices/system/cpu/cpu", cpu, "/cache");
    int best = -1;
    std::set<int> sharers;
    for (const std::string& index : Entries(dir)) {
      if (!absl::StartsWith(index, "index")) continue;
      auto type = Read(dir + "/" + index + "/type");
      if (!type.ok() || (*type != "Unified" && *type != "Data")) continue;
      auto level = ReadInt(dir + "/" + index + "/level");
      if (!level.ok()) return level.status();
      if (*level <= best) continue;
      auto shared = ReadList(dir + "/" + index + "/shared_cpu_list");
      if (!shared.ok()) return shared.status();
      best = *level;
      sharers = *shared;
    }
    if (best < 0) return absl::NotFoundError(absl::StrCat("--numa-binding: no cache listed under /", dir));
    return sharers;
  }

 private:
  std::string root_;
  const std::set<int>& allowed_;
};

// The GPUs CUDA shows the workers, in device-index order.
absl::StatusOr<std::vector<std::string>> VisibleGpus(const Topology& topo, const std::vector<std::string>& all,
                                                     const std::optional<std::string>& visible) {
  if (!visible) return all;
  std::vector<std::string> shown;
  for (absl::string_view entry : absl::StrSplit(*visible, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    int index = -1;
    if (absl::SimpleAtoi(entry, &index)) {
      if (index < 0) break;  // CUDA stops at the first negative index ("-1" hides every GPU).
      if (index >= static_cast<int>(all.size())) {
        return absl::InvalidArgumentError(absl::StrCat("--numa-binding: CUDA_VISIBLE_DEVICES names GPU ", index,
                                                       " but this machine has ", all.size()));
      }
      shown.push_back(all[index]);
      continue;
    }
    std::vector<std::string> matches;
    if (absl::StartsWith(entry, "GPU-")) {
      for (const std::string& address : all) {
        if (absl::StartsWith(topo.Uuid(address), entry)) matches.push_back(address);
      }
    }
    if (matches.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat("--numa-binding: CUDA_VISIBLE_DEVICES entry '", entry, "' names ",
                                                     matches.empty() ? "no" : "more than one", " GPU of this machine"));
    }
    shown.push_back(matches.front());
  }
  return shown;
}

// Groups `cpus` by a key per CPU; the groups keyed by their smallest member of that key's set.
template <typename KeyOf>
absl::StatusOr<std::map<int, std::vector<int>>> GroupBy(const std::set<int>& cpus, KeyOf key_of) {
  std::map<int, std::vector<int>> groups;
  for (int cpu : cpus) {
    auto key = key_of(cpu);
    if (!key.ok()) return key.status();
    if (key->empty())
      return absl::InvalidArgumentError(absl::StrCat("--numa-binding: CPU ", cpu, " has an empty group"));
    groups[*key->begin()].push_back(cpu);
  }
  return groups;
}

absl::StatusOr<CpuBinding> BindOne(NumaMode mode, const Topology& topo, const std::vector<std::string>& gpus, int gpu) {
  auto node = topo.NodeOfGpu(gpus[gpu]);
  if (!node.ok()) return node.status();
  auto node_cpus = topo.NodeCpus(*node);
  if (!node_cpus.ok()) return node_cpus.status();
  std::set<int> cpus;
  // The GPU's place among the visible GPUs of its node, for the modes that split a node.
  int peers = 0;
  int place = 0;
  if (mode == NumaMode::kExclusive || mode == NumaMode::kCoreComplex) {
    for (int other = 0; other < static_cast<int>(gpus.size()); ++other) {
      auto other_node = topo.NodeOfGpu(gpus[other]);
      if (!other_node.ok()) return other_node.status();
      if (*other_node != *node) continue;
      if (other < gpu) ++place;
      ++peers;
    }
  }
  switch (mode) {
    case NumaMode::kNode: cpus = *node_cpus; break;
    case NumaMode::kSocket: {
      if (node_cpus->empty()) break;
      auto socket = topo.Socket(*node_cpus->begin());
      if (!socket.ok()) return socket.status();
      auto nodes = topo.PossibleNodes();
      if (!nodes.ok()) return nodes.status();
      for (int other : *nodes) {
        auto other_cpus = topo.NodeCpus(other);
        if (!other_cpus.ok() || other_cpus->empty()) continue;  // A memory-only or offline node.
        auto other_socket = topo.Socket(*other_cpus->begin());
        if (!other_socket.ok()) return other_socket.status();
        if (*other_socket == *socket) cpus.insert(other_cpus->begin(), other_cpus->end());
      }
      break;
    }
    case NumaMode::kExclusive: {
      auto cores = GroupBy(*node_cpus, [&](int cpu) { return topo.CoreSiblings(cpu); });
      if (!cores.ok()) return cores.status();
      int count = static_cast<int>(cores->size());
      if (count < peers) {
        return absl::FailedPreconditionError(absl::StrCat("--numa-binding exclusive: NUMA node ", *node, " has ", count,
                                                          " usable physical cores for ", peers, " GPUs"));
      }
      int each = count / peers;
      int extra = count % peers;  // The lowest GPUs get one core more.
      int start = place * each + std::min(place, extra);
      int end = start + each + (place < extra ? 1 : 0);
      int i = 0;
      for (const auto& [first, threads] : *cores) {
        if (i >= start && i < end) cpus.insert(threads.begin(), threads.end());
        ++i;
      }
      break;
    }
    case NumaMode::kCoreComplex: {
      auto caches = GroupBy(*node_cpus, [&](int cpu) { return topo.LastLevelCacheSharers(cpu); });
      if (!caches.ok()) return caches.status();
      std::vector<std::vector<int>> ordered;
      for (auto& [first, members] : *caches) ordered.push_back(members);
      // Fuller caches first, then by their lowest CPU (torch's order).
      std::stable_sort(ordered.begin(), ordered.end(),
                       [](const std::vector<int>& a, const std::vector<int>& b) { return a.size() > b.size(); });
      if (!ordered.empty()) {
        const std::vector<int>& mine = ordered[place % ordered.size()];
        cpus.insert(mine.begin(), mine.end());
      }
      break;
    }
  }
  if (cpus.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("--numa-binding: GPU ", gpu, " (", gpus[gpu],
                                                      ") is on NUMA node ", *node,
                                                      ", which has no CPU this process may use"));
  }
  return CpuBinding{std::vector<int>(cpus.begin(), cpus.end()), *node};
}

}  // namespace

std::optional<NumaMode> ParseNumaMode(absl::string_view name) {
  if (name == "node") return NumaMode::kNode;
  if (name == "socket") return NumaMode::kSocket;
  if (name == "exclusive") return NumaMode::kExclusive;
  if (name == "core-complex") return NumaMode::kCoreComplex;
  return std::nullopt;
}

absl::StatusOr<std::set<int>> ParseCpuList(absl::string_view text) {
  std::set<int> cpus;
  for (absl::string_view part : absl::StrSplit(absl::StripAsciiWhitespace(text), ',', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    std::vector<absl::string_view> bounds = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int lo = 0;
    int hi = 0;
    if (!absl::SimpleAtoi(bounds[0], &lo) || (bounds.size() == 2 && !absl::SimpleAtoi(bounds[1], &hi))) {
      return absl::InvalidArgumentError(absl::StrCat("'", part, "' is not a CPU or a range of CPUs"));
    }
    if (bounds.size() == 1) hi = lo;
    if (lo < 0 || hi < lo || hi >= kMaxCpu) {
      return absl::InvalidArgumentError(absl::StrCat("'", part, "' is not a valid range of CPUs"));
    }
    for (int cpu = lo; cpu <= hi; ++cpu) cpus.insert(cpu);
  }
  return cpus;
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::vector<std::string> ranges;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    ranges.push_back(j == i ? absl::StrCat(cpus[i]) : absl::StrCat(cpus[i], "-", cpus[j]));
    i = j + 1;
  }
  return absl::StrJoin(ranges, ",");
}

absl::StatusOr<NumaPlan> PlanNumaBinding(NumaMode mode, int nproc,
                                         const std::optional<std::string>& cuda_visible_devices,
                                         const std::string& root, const std::set<int>& allowed) {
  Topology topo(root, allowed);
  NumaPlan plan;
  std::vector<std::string> all = topo.NvidiaGpus();
  if (all.empty()) {
    plan.note = "--numa-binding: no NVIDIA GPU on this machine; workers are not bound";
    return plan;
  }
  auto nodes = topo.PossibleNodes();
  if (!nodes.ok() || nodes->size() <= 1) {
    plan.note = "--numa-binding: this machine has one NUMA node; workers are not bound";
    return plan;
  }
  auto gpus = VisibleGpus(topo, all, cuda_visible_devices);
  if (!gpus.ok()) return gpus.status();
  for (int local_rank = 0; local_rank < nproc; ++local_rank) {
    if (local_rank >= static_cast<int>(gpus->size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("--numa-binding: local rank ", local_rank, " has no GPU (", gpus->size(), " visible)"));
    }
    auto binding = BindOne(mode, topo, *gpus, local_rank);
    if (!binding.ok()) return binding.status();
    plan.workers.push_back(*binding);
  }
  return plan;
}

}  // namespace elrun
