#include "trainer/checkpoint/checkpoint.h"
#include "tests/temp_dir.h"

#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace elrun::trainer {
namespace {

struct Net : torch::nn::Module {
  Net() {
    fc = register_module("fc", torch::nn::Linear(3, 2));
    bn = register_module("bn", torch::nn::BatchNorm1d(2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return bn->forward(fc->forward(x)); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

// A model and optimizer after two momentum steps, so that every piece of state is non-trivial.
void Train(Net& net, torch::optim::SGD& opt) {
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    net.forward(torch::randn({4, 3})).pow(2).sum().backward();
    opt.step();
  }
}

TEST_CASE("round trip: parameters, buffers, momentum and progress") {
  std::string path = CheckpointPath(testing::MakeTempDir("ckpt"));
  torch::manual_seed(1);
  Net a;
  torch::optim::SGD opt_a(a.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Train(a, opt_a);
  REQUIRE(SaveCheckpoint(path, a, opt_a, {12, 3, 640, 2}).ok());

  torch::manual_seed(2);
  Net b;
  torch::optim::SGD opt_b(b.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto progress = LoadCheckpoint(path, b, opt_b);
  REQUIRE(progress.ok());
  CHECK(progress->step == 12);
  CHECK(progress->epoch == 3);
  CHECK(progress->samples_seen == 640);
  CHECK(progress->world_size == 2);
  CHECK(torch::equal(a.fc->weight, b.fc->weight));
  CHECK(torch::equal(a.bn->running_var, b.bn->running_var));
  CHECK(b.bn->num_batches_tracked.item<int64_t>() == 2);

  // The same next step from both: momentum buffers were restored too.
  torch::manual_seed(3);
  Train(a, opt_a);
  torch::manual_seed(3);
  Train(b, opt_b);
  CHECK(torch::allclose(a.fc->weight, b.fc->weight, 0, 0));
}

TEST_CASE("missing, garbage and mismatched checkpoints") {
  std::string dir = testing::MakeTempDir("ckpt");
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
  CHECK(LoadCheckpoint(dir + "/none.pt", net, opt).status().code() == absl::StatusCode::kNotFound);
  std::ofstream(dir + "/garbage.pt") << "not a checkpoint";
  CHECK(LoadCheckpoint(dir + "/garbage.pt", net, opt).status().code() == absl::StatusCode::kInvalidArgument);

  struct Other : torch::nn::Module {
    Other() { register_module("fc", torch::nn::Linear(5, 2)); }
  } other;
  torch::optim::SGD other_opt(other.parameters(), torch::optim::SGDOptions(0.1));
  REQUIRE(SaveCheckpoint(dir + "/other.pt", other, other_opt, {}).ok());
  auto status = LoadCheckpoint(dir + "/other.pt", net, opt).status();
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(status.message()).find("fc.weight has another shape") != std::string::npos);
}

TEST_CASE("no temp file is left behind, and a save replaces the previous one") {
  std::string dir = testing::MakeTempDir("ckpt");
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
  REQUIRE(SaveCheckpoint(CheckpointPath(dir), net, opt, {1, 0, 0, 1}).ok());
  REQUIRE(SaveCheckpoint(CheckpointPath(dir), net, opt, {2, 0, 0, 1}).ok());
  CHECK(LoadCheckpoint(CheckpointPath(dir), net, opt)->step == 2);
  CHECK(std::system(("test $(ls " + dir + " | wc -l) -eq 1").c_str()) == 0);
}

TEST_CASE("Python's torch.load reads it") {
  std::string path = CheckpointPath(testing::MakeTempDir("ckpt"));
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Train(net, opt);
  REQUIRE(SaveCheckpoint(path, net, opt, {7, 1, 128, 2}).ok());
  float w00 = net.fc->weight[0][0].item<float>();
  std::string script =
      "import sys, torch\n"
      "d = torch.load(sys.argv[1], weights_only=True)\n"  // torch 2.11's default, said outright.
      "assert d['step'] == 7 and d['epoch'] == 1 and d['world_size'] == 2, d\n"
      "assert d['model']['fc.weight'].shape == (2, 3)\n"
      "assert 'fc.weight' in d['optimizer'] and 'bn.running_mean' in d['model']\n"
      "assert abs(d['model']['fc.weight'][0][0].item() - float(sys.argv[2])) < 1e-7\n";
  std::string script_path = path + ".check.py";
  std::ofstream(script_path) << script;
  std::ostringstream command;
  // The torch 2.11 environment's interpreter (.bazelrc passes it as PYTHON_EXEC).
  const char* python = std::getenv("PYTHON_EXEC");
  REQUIRE_MESSAGE(python != nullptr, "PYTHON_EXEC is not set (bazel test sets it from .bazelrc)");
  command << python << " " << script_path << " " << path << " " << std::setprecision(9) << w00;
  CHECK(std::system(command.str().c_str()) == 0);
}

}  // namespace
}  // namespace elrun::trainer
