#include "trainer/app/gpt.h"

#include <cmath>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "absl/strings/str_format.h"

namespace elrun::trainer {
namespace {

constexpr double kInitStd = 0.02;

void InitLinear(torch::nn::Linear& linear, double std) {
  torch::nn::init::normal_(linear->weight, 0.0, std);
  if (linear->bias.defined()) torch::nn::init::zeros_(linear->bias);
}

}  // namespace

GptEmbeddingImpl::GptEmbeddingImpl(const GptOptions& options) {
  torch::NoGradGuard no_grad;
  tokens_ = register_module("tokens", torch::nn::Embedding(options.vocabulary, options.width));
  positions_ = register_module("positions", torch::nn::Embedding(options.context, options.width));
  torch::nn::init::normal_(tokens_->weight, 0.0, kInitStd);
  torch::nn::init::normal_(positions_->weight, 0.0, kInitStd);
}

torch::Tensor GptEmbeddingImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= positions_->weight.size(0),
              "gpt: tokens [B, T] with T <= ", positions_->weight.size(0), " expected, got ", tokens.sizes());
  torch::Tensor positions = torch::arange(tokens.size(1), tokens.options().dtype(torch::kLong));
  return tokens_->forward(tokens) + positions_->forward(positions);
}

GptBlockImpl::GptBlockImpl(const GptOptions& options) : heads_(options.heads) {
  torch::NoGradGuard no_grad;
  const int64_t w = options.width, hidden = options.expansion * options.width;
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
  qkv_ = register_module("qkv", torch::nn::Linear(w, 3 * w));
  proj_ = register_module("proj", torch::nn::Linear(w, w));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
  fc1_ = register_module("fc1", torch::nn::Linear(w, hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(hidden, w));
  const double residual_std = kInitStd / std::sqrt(2.0 * static_cast<double>(options.layers));
  InitLinear(qkv_, kInitStd);
  InitLinear(proj_, residual_std);
  InitLinear(fc1_, kInitStd);
  InitLinear(fc2_, residual_std);
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  const int64_t batch = x.size(0), time = x.size(1), width = x.size(2);
  // [B, T, 3W] -> three [B, heads, T, W / heads].
  torch::Tensor qkv = qkv_->forward(ln1_->forward(x)).view({batch, time, 3, heads_, width / heads_});
  qkv = qkv.permute({2, 0, 3, 1, 4});
  torch::Tensor attended = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{},
                                                            /*dropout_p=*/0.0, /*is_causal=*/true);
  torch::Tensor h = x + proj_->forward(attended.transpose(1, 2).reshape({batch, time, width}));
  return h + fc2_->forward(torch::gelu(fc1_->forward(ln2_->forward(h)), "tanh"));
}

GptHeadImpl::GptHeadImpl(const GptOptions& options) {
  torch::NoGradGuard no_grad;
  norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.width})));
  out_ = register_module("out",
                         torch::nn::Linear(torch::nn::LinearOptions(options.width, options.vocabulary).bias(false)));
  InitLinear(out_, kInitStd);
}

torch::Tensor GptHeadImpl::forward(const torch::Tensor& x) { return out_->forward(norm_->forward(x)); }

GptImpl::GptImpl(const GptOptions& options, ChildSink* sink) : options_(options) {
  auto built = [&](const std::string& name, torch::nn::Module& child) {
    if (sink != nullptr) sink->TakeChild(name, child);
  };
  embed_ = register_module("embed", GptEmbedding(options));
  built("embed", *embed_);
  for (int64_t b = 0; b < options.layers; ++b) {
    const std::string name = "block" + std::to_string(b);
    blocks_.push_back(register_module(name, GptBlock(options)));
    built(name, *blocks_.back());
  }
  head_ = register_module("head", GptHead(options));
  built("head", *head_);
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  torch::Tensor x = CallChild("embed", tokens, [this](const torch::Tensor& in) { return embed_->forward(in); });
  for (size_t b = 0; b < blocks_.size(); ++b) {
    x = CallChild("block" + std::to_string(b), x,
                  [this, b](const torch::Tensor& in) { return blocks_[b]->forward(in); });
  }
  return CallChild("head", x, [this](const torch::Tensor& in) { return head_->forward(in); });
}

absl::StatusOr<std::shared_ptr<Classifier>> MakeGpt(const GptOptions& options, ChildSink* sink) {
  for (const auto& [what, value] : std::vector<std::pair<const char*, int64_t>>{{"vocabulary", options.vocabulary},
                                                                                {"context", options.context},
                                                                                {"layers", options.layers},
                                                                                {"width", options.width},
                                                                                {"heads", options.heads},
                                                                                {"expansion", options.expansion}}) {
    if (value < 1) return absl::InvalidArgumentError(absl::StrFormat("gpt: %s is %d, need at least 1", what, value));
  }
  if (options.width % options.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("gpt: width %d is not a multiple of heads %d", options.width, options.heads));
  }
  if (options.vocabulary > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrFormat("gpt: vocabulary %d is above 2^31", options.vocabulary));
  }
  return std::shared_ptr<Classifier>(Gpt(options, sink).ptr());
}

int64_t GptParameterCount(const GptOptions& o) {
  const int64_t w = o.width, hidden = o.expansion * o.width;
  const int64_t block = 2 * 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * hidden + hidden) + (hidden * w + w);
  return o.vocabulary * w + o.context * w + o.layers * block + 2 * w + w * o.vocabulary;
}

double GptTrainFlopsPerToken(const GptOptions& o) {
  const double embeddings = static_cast<double>(o.vocabulary * o.width + o.context * o.width);
  const double matmul_params = static_cast<double>(GptParameterCount(o)) - embeddings;
  return 6.0 * matmul_params +
         12.0 * static_cast<double>(o.layers) * static_cast<double>(o.context) * static_cast<double>(o.width);
}

}  // namespace elrun::trainer
