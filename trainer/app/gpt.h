// A decoder-only transformer (GPT-2's shape) over byte tokens, for elrun-train's --model gpt:
// token + position embeddings, `layers` pre-norm blocks x + attn(ln1(x)), x + mlp(ln2(x)) with
// causal multi-head self-attention and a GELU MLP, a final LayerNorm and an untied linear head.
// Children embed, block0 ... block<layers-1>, head: each block is one FSDP unit and one
// activation-checkpointing region, as PyTorch users wrap a transformer with fully_shard per block.
// The head is untied from the token embedding: a tied weight would live in two FSDP units.
// Weights as GPT-2 initialises them: N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 x
// layers)), biases 0, LayerNorms 1 and 0; drawn from torch's default generator child by child.
// Thread-compatible, as every torch::nn::Module.
#ifndef ELRUN_TRAINER_APP_GPT_H_
#define ELRUN_TRAINER_APP_GPT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "absl/status/statusor.h"
#include "trainer/nn/module_hooks.h"

namespace elrun::trainer {

struct GptOptions {
  int64_t vocabulary = 256;  // Bytes.
  int64_t context = 128;     // The longest sequence; the position embedding's rows.
  int64_t layers = 4;
  int64_t width = 128;  // The residual stream; a multiple of heads.
  int64_t heads = 4;
  int64_t expansion = 4;  // The MLP's hidden width is expansion x width.
};

// Token ids [B, T] (int64, T <= context) -> [B, T, width]: token plus position embedding.
class GptEmbeddingImpl : public torch::nn::Module {
 public:
  explicit GptEmbeddingImpl(const GptOptions& options);
  torch::Tensor forward(const torch::Tensor& tokens);

 private:
  torch::nn::Embedding tokens_{nullptr}, positions_{nullptr};
};
TORCH_MODULE(GptEmbedding);

// [B, T, width] -> [B, T, width]: x + proj(attention(ln1(x))), then + fc2(gelu(fc1(ln2(x)))).
class GptBlockImpl : public torch::nn::Module {
 public:
  explicit GptBlockImpl(const GptOptions& options);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  const int64_t heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(GptBlock);

// [B, T, width] -> logits [B, T, vocabulary]: LayerNorm, then a linear map without bias.
class GptHeadImpl : public torch::nn::Module {
 public:
  explicit GptHeadImpl(const GptOptions& options);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear out_{nullptr};
};
TORCH_MODULE(GptHead);

// Next-token logits [B, T, vocabulary] of token ids [B, T]: a classifier of every position.
class GptImpl : public Classifier {
 public:
  explicit GptImpl(const GptOptions& options = {}, ChildSink* sink = nullptr);
  torch::Tensor forward(const torch::Tensor& tokens) override;
  const GptOptions& options() const { return options_; }

 private:
  const GptOptions options_;
  GptEmbedding embed_{nullptr};
  std::vector<GptBlock> blocks_;
  GptHead head_{nullptr};
};
TORCH_MODULE(Gpt);

// InvalidArgument naming the size for a size below 1, a width that the heads do not divide or a
// vocabulary above 2^31.
[[nodiscard]] absl::StatusOr<std::shared_ptr<Classifier>> MakeGpt(const GptOptions& options, ChildSink* sink = nullptr);

// Trainable parameters of the model `options` describes.
int64_t GptParameterCount(const GptOptions& options);
// Floating-point operations of one training step (forward and backward) per token at full
// context: 6 x parameters (the matrix products, embeddings excluded as lookups) plus the
// attention's 12 x layers x context x width, as PaLM's appendix counts them for MFU.
double GptTrainFlopsPerToken(const GptOptions& options);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_APP_GPT_H_
