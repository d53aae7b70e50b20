#include "trainer/app/train_report.h"

#include <algorithm>
#include <cmath>
#include <iostream>

#include "absl/strings/str_format.h"
#include "trainer/dist/collectives.h"
#include "trainer/memory/cuda_memory.h"
#include "trainer/memory/memory.h"

namespace elrun::trainer::app {

namespace {

std::string MemoryJson(const MemoryReport& m) {
  std::string json =
      absl::StrFormat(R"("params_bytes":%d,"grads_bytes":%d,"optimizer_bytes":%d,"state_bytes":%d,"peak_bytes":%d,)"
                      R"("peak_rss_bytes":%d,"baseline_rss_bytes":%d)",
                      m.params, m.grads, m.optimizer_state, m.state(), m.peak, m.peak_rss, m.baseline_rss);
  if (m.on_cuda) {
    json += absl::StrFormat(R"(,"cuda_allocated_bytes":%d,"cuda_reserved_bytes":%d,"cuda_peak_allocated_bytes":%d,)"
                            R"("cuda_peak_reserved_bytes":%d)",
                            m.cuda.allocated, m.cuda.reserved, m.cuda.peak_allocated, m.cuda.peak_reserved);
  }
  return json;
}

// The q-quantile (0..1, nearest rank) of `values`, 0 when empty. Reorders `values`.
double Quantile(std::vector<double>& values, double q) {
  if (values.empty()) return 0;
  const size_t k = std::min(values.size() - 1, static_cast<size_t>(q * static_cast<double>(values.size())));
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(k), values.end());
  return values[k];
}

MemoryReport Memory(Job& job) {
  MemoryReport memory = job.dp->Memory(*job.optimizer);
  memory.baseline_rss = job.baseline_rss;
  if (job.placement.cuda) {
    memory.on_cuda = true;
    memory.cuda = CudaMemoryStats(job.placement.cuda_device);
  }
  return memory;
}

}  // namespace

std::string LoopTimesJson(const absl::StatusOr<ThreadTimes>& start, const absl::StatusOr<ThreadTimes>& end,
                          double elapsed_s) {
  if (!start.ok() || !end.ok()) return "";
  const double cpu = end->cpu_s - start->cpu_s, runqueue = end->runqueue_s - start->runqueue_s;
  return absl::StrFormat(R"("loop_cpu_s":%.3f,"loop_runqueue_s":%.3f,"loop_blocked_s":%.3f,)", cpu, runqueue,
                         std::max(0.0, elapsed_s - cpu - runqueue));
}

Evaluation Evaluate(Job& job) {
  torch::NoGradGuard no_grad;
  job.model->eval();
  const int64_t available = job.text() ? job.text_validation.size(0) : job.test.size();
  const int64_t n = job.text() && job.o.eval_samples > 0 ? std::min(available, job.o.eval_samples) : available;
  const int64_t chunk = job.text() ? 64 : 1000;
  const int64_t most = (n + job.world() - 1) / job.world();  // Rank 0's share, the largest.
  std::vector<int64_t> shard;
  for (int64_t i = job.rank(); i < n; i += job.world()) shard.push_back(i);
  double correct = 0, loss_sum = 0, total = 0;
  for (int64_t begin = 0; begin < most; begin += chunk) {
    const auto from = std::min<size_t>(shard.size(), begin), to = std::min<size_t>(shard.size(), begin + chunk);
    const bool empty = from == to;
    std::vector<int64_t> indices = empty ? std::vector<int64_t>{0}
                                         : std::vector<int64_t>(shard.begin() + static_cast<std::ptrdiff_t>(from),
                                                                shard.begin() + static_cast<std::ptrdiff_t>(to));
    auto [inputs, targets] = Examples(job, /*train=*/false, indices);
    torch::Tensor logits = Forward(job, inputs);
    if (empty) continue;
    if (job.text()) {
      loss_sum += Loss(logits, targets, torch::kSum).item<double>();
      total += static_cast<double>(targets.numel());
    } else {
      correct += logits.argmax(1).eq(targets).sum().item<double>();
      total += static_cast<double>(indices.size());
    }
  }
  std::vector<torch::Tensor> sums{
      torch::tensor({correct, loss_sum, total}, torch::kDouble).to(CommDevice(*job.dist.pg))};
  job.dist.pg->allreduce(sums)->wait();
  job.model->train();
  torch::Tensor totals = sums[0].cpu();
  Evaluation result;
  const double count = std::max(1.0, totals[2].item<double>());
  result.accuracy = totals[0].item<double>() / count;
  result.loss = totals[1].item<double>() / count;
  result.samples = n;
  return result;
}

void PrintSample(Job& job) {
  const TrainOptions& o = job.o;
  if (!job.text() || o.sample_bytes == 0) return;
  torch::NoGradGuard no_grad;
  job.model->eval();
  // The validation text's first window holds its first context + 1 bytes.
  const torch::Tensor first = job.text_validation[0].contiguous();
  const auto* bytes = first.data_ptr<uint8_t>();
  const int64_t limit = std::min<int64_t>(first.numel(), std::max<int64_t>(1, o.gpt_context / 2));
  std::vector<int64_t> text;
  for (int64_t i = 0; i < limit && (i == 0 || bytes[i - 1] != '\n'); ++i) text.push_back(bytes[i]);
  const size_t prompt = text.size();
  at::Generator generator = at::detail::createCPUGenerator(o.seed);
  for (int64_t i = 0; i < o.sample_bytes; ++i) {
    const int64_t window = std::min<int64_t>(static_cast<int64_t>(text.size()), o.gpt_context);
    torch::Tensor context = torch::tensor(std::vector<int64_t>(text.end() - window, text.end()), torch::kLong);
    torch::Tensor logits = Forward(job, context.unsqueeze(0).to(job.device)).select(1, window - 1)[0];
    torch::Tensor probabilities = torch::softmax(logits.to(torch::kCPU, torch::kFloat), 0);
    text.push_back(torch::multinomial(probabilities, 1, /*replacement=*/false, generator).item<int64_t>());
  }
  job.model->train();
  if (job.rank() != 0) return;
  std::string shown;
  for (size_t i = 0; i < text.size(); ++i) {
    const int64_t c = text[i];
    shown += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? static_cast<char>(c) : '?';
    if (i + 1 == prompt) shown += "»";  // Where the prompt ends.
  }
  std::cout << absl::StrFormat("sample (%d prompt bytes, then %d sampled):\n%s", prompt, o.sample_bytes, shown)
            << std::endl;
}

void ReportMemory(Job& job, const LoopStats& loop) {
  const TrainOptions& o = job.o;
  const MemoryReport memory = Memory(job);
  std::string expected;
  if (o.optimizer != OptimizerChoice::kSgd) {
    int64_t params = 0;
    for (const auto& p : job.model->parameters()) params += p.numel();
    const std::string strategy = o.strategy == Strategy::kNoShard ? "ddp" : StrategyName(o.strategy);
    expected = absl::StrFormat("  (ZeRO formula for fp32 Adam(W): %.2f MiB)",
                               ExpectedAdamStateBytes(strategy, params, job.world()) / (1024.0 * 1024.0));
  }
  const int64_t steps = loop.samples / std::max<int64_t>(1, o.batch_size * job.world());
  std::cout << absl::StrFormat("memory rank %d %s: %s%s", job.rank(), StrategyName(o.strategy),
                               FormatMemoryReport(memory), expected)
            << std::endl;
  std::cout << absl::StrFormat(R"(memory-json {"rank":%d,"strategy":"%s",%s,"step_time_s":%.6f})", job.rank(),
                               StrategyName(o.strategy), MemoryJson(memory),
                               loop.elapsed_s / std::max<int64_t>(1, steps))
            << std::endl;
}

void Report(Job& job, LoopStats& loop, const Evaluation& evaluation) {
  const TrainOptions& o = job.o;
  if (job.rank() != 0) return;
  const double rate = loop.samples / std::max(loop.elapsed_s, 1e-9);
  const int64_t steps = loop.samples / std::max<int64_t>(1, o.batch_size * job.world());
  std::string quality;  // What the summary line and the metrics say about the held-out split.
  if (job.text()) {
    const double tokens_per_s = rate * static_cast<double>(o.gpt_context);
    std::cout << absl::StrFormat(
                     "done: %d steps, %d epochs, %.1f s, %.0f samples/s (%.0f tokens/s), validation loss %.4f, "
                     "perplexity %.3f (%d sequences)",
                     job.progress.step, o.epochs, loop.elapsed_s, rate, tokens_per_s, evaluation.loss,
                     std::exp(evaluation.loss), evaluation.samples)
              << std::endl;
    quality = absl::StrFormat(R"("validation_loss":%.6f,"perplexity":%.6f,"tokens_per_s":%.1f)", evaluation.loss,
                              std::exp(evaluation.loss), tokens_per_s);
  } else {
    std::cout << absl::StrFormat("done: %d steps, %d epochs, %.1f s, %.0f samples/s, test accuracy %.4f",
                                 job.progress.step, o.epochs, loop.elapsed_s, rate, evaluation.accuracy)
              << std::endl;
    quality = absl::StrFormat(R"("test_accuracy":%.6f)", evaluation.accuracy);
  }
  quality += absl::StrFormat(R"(,"precision":"%s")",
                             PrecisionName(o.precision != PrecisionChoice::kFp32 ? o.precision : o.param_dtype));
  if (job.scaler) {
    std::cout << absl::StrFormat("fp16: %d of %d steps skipped for inf/NaN gradients, loss scale %g",
                                 job.scaler->skipped_steps(), steps, job.scaler->scale())
              << std::endl;
    quality +=
        absl::StrFormat(R"(,"loss_scale":%.17g,"skipped_steps":%d)", job.scaler->scale(), job.scaler->skipped_steps());
  }
  job.metrics->Write(absl::StrFormat(
      R"({"event":"end",%s,"samples_per_s":%.1f,"steps":%d,"epochs":%d,"seconds":%.2f,)"
      R"("world_size":%d,"strategy":"%s","optimizer":"%s","linear":"%s","allreduce":"%s","device":"%s",)"
      R"("backend":"%s","memory_format":"%s","step_time_s":%.6f,"step_ms_p10":%.3f,"step_ms_p50":%.3f,)"
      R"("step_ms_p90":%.3f,%s%s})",
      quality, rate, job.progress.step, o.epochs, loop.elapsed_s, job.world(), StrategyName(o.strategy),
      OptimizerName(o.optimizer), LinearKernelName(job.linear), job.allreduce, job.device.str(),
      BackendName(job.dist.backend), job.channels_last ? "channels-last" : "contiguous",
      loop.elapsed_s / std::max<int64_t>(1, steps), Quantile(loop.step_ms, 0.1), Quantile(loop.step_ms, 0.5),
      Quantile(loop.step_ms, 0.9), loop.loop_times, MemoryJson(Memory(job))));
}

}  // namespace elrun::trainer::app
