// --profile-steps: PyTorch's own profiler (Kineto) around a window of training steps, as
// torch.profiler does for a Python loop. Host operators are always recorded; on CUDA also the
// kernels, copies and CUDA runtime calls (through CUPTI). Each step is one "ProfilerStep#N"
// annotation, as torch.profiler's schedule writes, so that one reader
// (tests/support/trace_summary.py) summarises elrun-train's and a Python script's traces alike.
// The trace is Chrome's JSON (chrome://tracing, Perfetto). Not thread-safe: the training thread
// owns it. The header keeps LibTorch out.
#ifndef ELRUN_TRAINER_RUNTIME_STEP_PROFILER_H_
#define ELRUN_TRAINER_RUNTIME_STEP_PROFILER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace elrun::trainer {

class StepProfiler {
 public:
  // Profiles steps [first, end) (global step numbers, 0-based); writes the trace to `trace_path`.
  StepProfiler(int64_t first, int64_t end, std::string trace_path, bool cuda);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Around each step. BeforeStep(first) starts the profiler; AfterStep(end - 1) stops it and
  // writes the trace (the step's GPU work must be finished: the trainer reads the loss first).
  void BeforeStep(int64_t step);
  absl::Status AfterStep(int64_t step);
  // After the loop: a window cut short (--max-steps, SIGTERM) is written with the steps it has.
  absl::Status Finish();
  int64_t steps_recorded() const { return recorded_; }

 private:
  struct StepScope;
  absl::Status Stop();

  const int64_t first_, end_;
  const std::string trace_path_;
  const bool cuda_;
  bool active_ = false;
  int64_t recorded_ = 0;
  std::unique_ptr<StepScope> scope_;  // The open step's annotation.
};

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_RUNTIME_STEP_PROFILER_H_
