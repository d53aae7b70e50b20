// A model of the user's own, trained fully sharded under elrun (the README's "Your own model").
//   elrun --standalone --nproc-per-node 2 --no-python
//     bazel-bin/examples/custom_model/train_custom_model /tmp/ckpt 300   (one command line)
// Resumes from /tmp/ckpt at any world size; ends with a consolidated /tmp/ckpt/model.pt.
#include <iostream>
#include <string>

#include <torch/torch.h>

#include "trainer/dist/process_group.h"
#include "trainer/parallel/fully_shard.h"
#include "trainer/parallel/sharded_checkpoint.h"

using namespace elrun::trainer;

struct BlockImpl : torch::nn::Module {  // A pre-norm residual MLP; `keep` scales each row's update.
  explicit BlockImpl(int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        up(register_module("up", torch::nn::Linear(width, 4 * width))),
        down(register_module("down", torch::nn::Linear(4 * width, width))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& keep) {
    return x + keep * down(torch::gelu(up(norm(x))));
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {  // Each block is sharded as soon as it is built.
  NetImpl(int64_t in, int64_t width, int depth, int64_t classes, const ShardGroup& group) {
    embed = register_module("embed", torch::nn::Linear(in, width));
    for (int i = 0; i < depth; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), FullyShard(Block(width), group)));
    }
    head = register_module("head", torch::nn::Linear(width, classes));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& keep) {
    torch::Tensor h = embed(x);
    for (auto& block : blocks) h = block->forward(h, keep);
    return head(h);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  std::vector<Sharded<BlockImpl>> blocks;
};

int main(int argc, char** argv) {
  auto dist = InitProcessGroupFromEnvironment(BackendKind::kGloo, std::chrono::minutes(5));
  if (!dist.ok()) return std::cerr << "error: " << dist.status().message() << "\n", 2;
  const std::string dir = argc > 1 ? argv[1] : "";
  const int64_t steps = argc > 2 ? std::stoll(argv[2]) : 300, rank = dist->env.rank;
  ShardGroup group(dist->pg, FsdpOptions{Strategy::kFsdp});
  torch::manual_seed(0);  // Every rank draws the same initial values (checked when sharding).
  Sharded<NetImpl> model = FullyShard(std::make_shared<NetImpl>(16, 64, 4, 4, group), group);
  torch::optim::AdamW optimizer(model->fsdp().parameters(), torch::optim::AdamWOptions(3e-3));
  TrainProgress progress;  // Resume where a checkpoint in `dir` left off, whatever its world size.
  absl::StatusOr<TrainProgress> loaded =
      dir.empty() ? absl::NotFoundError("") : LoadSharded(dir, model->fsdp(), optimizer);
  if (loaded.ok()) progress = *loaded;
  if (!loaded.ok() && !absl::IsNotFound(loaded.status())) return std::cerr << loaded.status() << "\n", 1;
  const torch::Tensor teacher = torch::randn({16, 4}, at::detail::createCPUGenerator(7));
  for (; progress.step < steps; ++progress.step) {  // Each rank its own batch of 32.
    auto gen = at::detail::createCPUGenerator(1000 + progress.step * dist->env.world_size + rank);
    torch::Tensor x = torch::randn({32, 16}, gen), keep = torch::rand({32, 1}, gen) + 0.5;
    torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(x, keep), x.matmul(teacher).argmax(1));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    if (rank == 0 && progress.step % 50 == 0)
      std::cout << "step " << progress.step << " loss " << loss.item<float>() << std::endl;
  }
  progress.world_size = dist->env.world_size;
  if (!dir.empty()) {
    if (auto s = SaveSharded(dir, model->fsdp(), optimizer, progress); !s.ok()) return std::cerr << s << "\n", 1;
    if (auto s = ExportConsolidated(dir + "/model.pt", model->fsdp(), optimizer, progress); !s.ok())
      return std::cerr << s << "\n", 1;
  }
  if (rank == 0)
    std::cout << "done: " << progress.step << " steps on " << dist->env.world_size << " ranks" << std::endl;
}
