#include "trainer/runtime/step_profiler.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <exception>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace elrun::trainer {
namespace {

namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

std::set<ActivityType> Activities(bool cuda) {
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  return activities;
}

}  // namespace

// One step's "ProfilerStep#N" range, as torch.profiler.profile.step() records it.
struct StepProfiler::StepScope {
  explicit StepScope(int64_t step) : name(absl::StrCat("ProfilerStep#", step)), record(at::RecordScope::USER_SCOPE) {
    if (record.isActive()) record.before(name);
  }
  std::string name;  // Outlives `record`, which refers to it.
  at::RecordFunction record;
};

StepProfiler::StepProfiler(int64_t first, int64_t end, std::string trace_path, bool cuda)
    : first_(first), end_(end), trace_path_(std::move(trace_path)), cuda_(cuda) {}

StepProfiler::~StepProfiler() {
  if (active_) (void)Stop();
}

void StepProfiler::BeforeStep(int64_t step) {
  if (step == first_ && !active_) {
    const ProfilerConfig config(ProfilerState::KINETO);
    kineto::prepareProfiler(config, Activities(cuda_));
    kineto::enableProfiler(config, Activities(cuda_));
    active_ = true;
  }
  if (active_) scope_ = std::make_unique<StepScope>(step);
}

absl::Status StepProfiler::AfterStep(int64_t step) {
  if (!active_) return absl::OkStatus();
  scope_.reset();
  ++recorded_;
  return step + 1 >= end_ ? Stop() : absl::OkStatus();
}

absl::Status StepProfiler::Finish() { return active_ ? Stop() : absl::OkStatus(); }

absl::Status StepProfiler::Stop() {
  scope_.reset();
  active_ = false;
  try {
    std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
    if (!trace_path_.empty()) result->save(trace_path_);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--profile-trace ", trace_path_, ": ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace elrun::trainer
