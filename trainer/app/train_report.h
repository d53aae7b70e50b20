// What elrun-train reports at the end of a run: the held-out evaluation, the GPT's text sample,
// the memory report (--report-memory) and rank 0's summary line and metrics record. Called from
// the training thread; Evaluate and PrintSample are collective.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/app/job.h"
#include "trainer/runtime/thread_times.h"

namespace elrun::trainer::app {

// What Evaluate measured over every rank's share of the held-out split.
struct Evaluation {
  double accuracy = 0;  // The image models: test accuracy.
  double loss = 0;      // The GPT: mean next-byte cross-entropy on validation (nats).
  int64_t samples = 0;
};

// What the loop measured, for Report.
struct LoopStats {
  double elapsed_s = 0;
  int64_t samples = 0;  // All ranks together.
  double last_loss = 0;
  std::vector<double> step_ms;
  std::string loop_times;  // LoopTimesJson.
  bool signalled = false;  // SIGTERM reached some rank: all save and exit 143 together.
  absl::Status last_save;  // The last checkpoint's save (its error fails the job at the end).
};

// Test accuracy, or for text the validation loss, over every rank's strided share of the held-out
// split (the first --eval-samples windows for text), reduced across ranks. Every rank runs the
// same number of forward passes (the sharded strategies' forward is collective): a rank whose
// share ran out forwards one sample and counts nothing.
Evaluation Evaluate(Job& job);

// --model gpt: `--sample-bytes` bytes the trained model writes after a prompt (the validation
// text's first line, at most half a context), drawn from its softmax with a generator seeded by
// --seed. Every rank runs the same forward passes (collective for the sharded strategies) and
// draws the same bytes; rank 0 prints them, bytes outside printable ASCII as '?'.
void PrintSample(Job& job);

// --report-memory: every rank's memory line and its memory-json record.
void ReportMemory(Job& job, const LoopStats& loop);

// Rank 0: the summary line (and fp16's skipped steps) and the metrics file's end record.
void Report(Job& job, LoopStats& loop, const Evaluation& evaluation);

// The training loop's time on this thread, split (from the kernel's schedstat) into time on a
// CPU, time runnable but waiting for one, and the rest, blocked: with DDP, mostly waiting for the
// slowest rank. Empty when the kernel does not tell.
std::string LoopTimesJson(const absl::StatusOr<ThreadTimes>& start, const absl::StatusOr<ThreadTimes>& end,
                          double elapsed_s);

}  // namespace elrun::trainer::app
