// The GPT of --model gpt: shapes, its exact parameter count, causality (no position sees a later
// token), GPT-2's initialisation, the children a sink receives in order, the size checks, and a
// reference forward written out in plain tensor algebra (the same logits).
#include "trainer/app/gpt.h"

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace elrun::trainer {
namespace {

GptOptions Small() {
  GptOptions o;
  o.vocabulary = 256;
  o.context = 16;
  o.layers = 2;
  o.width = 32;
  o.heads = 4;
  return o;
}

std::shared_ptr<Classifier> Make(const GptOptions& o, ChildSink* sink = nullptr) {
  torch::manual_seed(7);
  auto made = MakeGpt(o, sink);
  REQUIRE(made.ok());
  return *made;
}

torch::Tensor Tokens(int64_t batch, int64_t time) { return torch::randint(0, 256, {batch, time}, torch::kLong); }

TEST_CASE("Logits [B, T, vocabulary] for tokens [B, T], any T up to the context") {
  auto gpt = Make(Small());
  CHECK(gpt->forward(Tokens(3, 16)).sizes() == torch::IntArrayRef({3, 16, 256}));
  CHECK(gpt->forward(Tokens(1, 1)).sizes() == torch::IntArrayRef({1, 1, 256}));
  CHECK_THROWS_WITH_AS(gpt->forward(Tokens(1, 17)), doctest::Contains("T <= 16"), c10::Error);
}

TEST_CASE("The parameter count matches GptParameterCount and the hand count") {
  const GptOptions o = Small();
  auto gpt = Make(o);
  int64_t n = 0;
  for (const auto& p : gpt->parameters()) n += p.numel();
  // embed 256*32 + 16*32 = 8,704; per block: ln 2*(32+32) = 128, qkv 32*96+96 = 3,168,
  // proj 32*32+32 = 1,056, fc1 32*128+128 = 4,224, fc2 128*32+32 = 4,128 -> 12,704;
  // head norm 64 + out 32*256 = 8,256. Total 8,704 + 2*12,704 + 8,256 = 42,368.
  CHECK(n == 42368);
  CHECK(GptParameterCount(o) == 42368);
  CHECK(gpt->named_parameters().contains("block1.fc2.weight"));
  CHECK_FALSE(gpt->named_parameters().contains("head.out.bias"));
  // 6 x the parameters outside the embeddings + 12 x layers x context x width.
  CHECK(GptTrainFlopsPerToken(o) == doctest::Approx(6.0 * (42368 - 8704) + 12.0 * 2 * 16 * 32));
}

TEST_CASE("Causal: changing a token changes no logits before it") {
  auto gpt = Make(Small());
  torch::NoGradGuard no_grad;
  torch::Tensor tokens = Tokens(2, 12);
  torch::Tensor changed = tokens.clone();
  changed.index_put_({torch::indexing::Slice(), 7}, (tokens.select(1, 7) + 1) % 256);
  torch::Tensor a = gpt->forward(tokens), b = gpt->forward(changed);
  CHECK(torch::equal(a.narrow(1, 0, 7), b.narrow(1, 0, 7)));
  CHECK_FALSE(torch::allclose(a.narrow(1, 7, 1), b.narrow(1, 7, 1)));
  // A prefix alone gives the same logits as the prefix inside the longer sequence.
  CHECK(torch::allclose(gpt->forward(tokens.narrow(1, 0, 5)), a.narrow(1, 0, 5), 1e-5, 1e-6));
}

TEST_CASE("GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 x layers)") {
  GptOptions o = Small();
  o.width = 256;
  o.heads = 8;
  o.layers = 8;
  auto gpt = Make(o);
  auto p = gpt->named_parameters();
  CHECK(p["embed.tokens.weight"].std().item<double>() == doctest::Approx(0.02).epsilon(0.05));
  CHECK(p["block0.qkv.weight"].std().item<double>() == doctest::Approx(0.02).epsilon(0.05));
  CHECK(p["block3.fc2.weight"].std().item<double>() == doctest::Approx(0.02 / 4.0).epsilon(0.05));
  CHECK(p["block3.proj.weight"].std().item<double>() == doctest::Approx(0.02 / 4.0).epsilon(0.05));
  CHECK(p["block0.qkv.bias"].abs().max().item<double>() == 0);
  CHECK(torch::equal(p["block0.ln1.weight"], torch::ones({256})));
}

// Records each child as the model hands it over, and what it held then.
class Recorder : public ChildSink {
 public:
  void TakeChild(const std::string& name, torch::nn::Module& child) override {
    names.push_back(name);
    int64_t n = 0;
    for (const auto& p : child.parameters()) n += p.numel();
    sizes.push_back(n);
  }
  std::vector<std::string> names;
  std::vector<int64_t> sizes;
};

TEST_CASE("A sink gets embed, every block and head in order, each as soon as it is built") {
  Recorder recorder;
  auto gpt = Make(Small(), &recorder);
  CHECK(recorder.names == std::vector<std::string>({"embed", "block0", "block1", "head"}));
  CHECK(recorder.sizes == std::vector<int64_t>({8704, 12704, 12704, 8256}));
  // The sink draws nothing: the same weights as without one.
  auto plain = Make(Small());
  for (const auto& p : gpt->named_parameters()) CHECK(torch::equal(p.value(), plain->named_parameters()[p.key()]));
}

TEST_CASE("The forward is GPT-2's, written out in tensor algebra") {
  const GptOptions o = Small();
  auto gpt = Make(o);
  auto p = gpt->named_parameters();
  torch::NoGradGuard no_grad;
  torch::Tensor tokens = Tokens(2, 10);
  const int64_t B = 2, T = 10, W = o.width, H = o.heads, D = W / H;
  auto ln = [&](const torch::Tensor& x, const std::string& name) {
    torch::Tensor mean = x.mean(-1, true), var = x.var(-1, /*unbiased=*/false, true);
    return (x - mean) / torch::sqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"];
  };
  auto linear = [&](const torch::Tensor& x, const std::string& name) {
    torch::Tensor y = x.matmul(p[name + ".weight"].t());
    return p.contains(name + ".bias") ? y + p[name + ".bias"] : y;
  };
  torch::Tensor x = p["embed.tokens.weight"].index_select(0, tokens.flatten()).view({B, T, W}) +
                    p["embed.positions.weight"].narrow(0, 0, T);
  const torch::Tensor mask = torch::ones({T, T}).triu(1).to(torch::kBool);
  for (int64_t b = 0; b < o.layers; ++b) {
    const std::string blk = "block" + std::to_string(b);
    torch::Tensor qkv = linear(ln(x, blk + ".ln1"), blk + ".qkv").view({B, T, 3, H, D}).permute({2, 0, 3, 1, 4});
    torch::Tensor scores = qkv[0].matmul(qkv[1].transpose(-1, -2)) / std::sqrt(static_cast<double>(D));
    torch::Tensor attended = torch::softmax(scores.masked_fill(mask, -INFINITY), -1).matmul(qkv[2]);
    x = x + linear(attended.transpose(1, 2).reshape({B, T, W}), blk + ".proj");
    torch::Tensor h = linear(ln(x, blk + ".ln2"), blk + ".fc1");
    h = 0.5 * h * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (h + 0.044715 * h.pow(3))));
    x = x + linear(h, blk + ".fc2");
  }
  torch::Tensor expected = linear(ln(x, "head.norm"), "head.out");
  CHECK(torch::allclose(gpt->forward(tokens), expected, 1e-4, 1e-5));
}

TEST_CASE("MakeGpt refuses sizes below 1 and heads that do not divide the width") {
  GptOptions o = Small();
  o.layers = 0;
  CHECK(MakeGpt(o).status().message() == "gpt: layers is 0, need at least 1");
  o = Small();
  o.heads = 5;
  CHECK(MakeGpt(o).status().message() == "gpt: width 32 is not a multiple of heads 5");
  o = Small();
  o.context = -3;
  CHECK(MakeGpt(o).status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace elrun::trainer
