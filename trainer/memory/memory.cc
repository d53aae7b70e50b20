#include "trainer/memory/memory.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_format.h"

namespace elrun::trainer {
namespace {

int64_t Bytes(const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

}  // namespace

int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer) {
  int64_t total = 0;
  for (const auto& entry : optimizer.state()) {
    const torch::optim::OptimizerParamState* state = entry.second.get();
    if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
      total += Bytes(sgd->momentum_buffer());
    } else if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
      total += Bytes(adam->exp_avg()) + Bytes(adam->exp_avg_sq()) + Bytes(adam->max_exp_avg_sq());
    } else if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
      total += Bytes(adamw->exp_avg()) + Bytes(adamw->exp_avg_sq()) + Bytes(adamw->max_exp_avg_sq());
    }
  }
  return total;
}

int64_t ExpectedAdamStateBytes(const std::string& strategy, int64_t params, int world_size) {
  const double p = static_cast<double>(params), n = world_size;
  double bytes = 16 * p;
  if (strategy == "zero1") bytes = 8 * p + 8 * p / n;
  if (strategy == "zero2") bytes = 4 * p + 12 * p / n;
  if (strategy == "fsdp") bytes = 16 * p / n;
  return static_cast<int64_t>(bytes);
}

namespace {

// A "<field>: <n> kB" line of /proc/self/status, in bytes; 0 when absent.
int64_t StatusBytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) {
      std::istringstream fields(line.substr(field.size()));
      int64_t kib = 0;
      fields >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

}  // namespace

int64_t PeakRssBytes() { return StatusBytes("VmHWM:"); }
int64_t RssBytes() { return StatusBytes("VmRSS:"); }

std::string FormatMemoryReport(const MemoryReport& r) {
  auto mib = [](int64_t bytes) { return bytes / (1024.0 * 1024.0); };
  std::string line = absl::StrFormat(
      "params %.2f MiB  grads %.2f MiB  optimizer %.2f MiB  state %.2f MiB  peak %.2f MiB  peak RSS %.1f MiB",
      mib(r.params), mib(r.grads), mib(r.optimizer_state), mib(r.state()), mib(r.peak), mib(r.peak_rss));
  if (r.baseline_rss > 0) line += absl::StrFormat(" (baseline %.1f MiB)", mib(r.baseline_rss));
  if (r.on_cuda) {
    line += absl::StrFormat("  cuda allocated %.2f MiB  reserved %.2f MiB  peak %.2f MiB", mib(r.cuda.allocated),
                            mib(r.cuda.reserved), mib(r.cuda.peak_allocated));
  }
  return line;
}

}  // namespace elrun::trainer
