#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace elrun::trainer {
namespace {

// How LibTorch's optimizers key their per-parameter state.
std::string StateKey(const torch::Tensor& param) {
  return c10::guts::to_string(param.unsafeGetTensorImpl());
}

absl::Status WriteAtomically(const std::string& path, const std::vector<char>& bytes) {
  std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::FailedPreconditionError(absl::StrCat("open ", tmp, ": ", std::strerror(errno)));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int error = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::FailedPreconditionError(absl::StrCat("write ", tmp, ": ", std::strerror(error)));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    int error = errno;
    ::unlink(tmp.c_str());
    return absl::FailedPreconditionError(absl::StrCat("save ", path, ": ", std::strerror(error)));
  }
  return absl::OkStatus();
}

}  // namespace

std::string CheckpointPath(const std::string& dir) { return dir + "/checkpoint.pt"; }

absl::Status SaveCheckpoint(const std::string& path, torch::nn::Module& module,
                            torch::optim::SGD& optimizer, const TrainProgress& progress) {
  try {
    c10::Dict<std::string, torch::Tensor> model;
    for (const auto& p : module.named_parameters()) model.insert(p.key(), p.value().detach().clone());
    for (const auto& b : module.named_buffers()) model.insert(b.key(), b.value().detach().clone());

    c10::Dict<std::string, torch::Tensor> momentum;
    auto& state = optimizer.state();
    for (const auto& p : module.named_parameters()) {
      auto it = state.find(StateKey(p.value()));
      if (it == state.end()) continue;
      auto& sgd = static_cast<torch::optim::SGDParamState&>(*it->second);
      if (sgd.momentum_buffer().defined()) momentum.insert(p.key(), sgd.momentum_buffer().clone());
    }
    c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
    root.insert("model", model);
    root.insert("optimizer", momentum);
    root.insert("step", progress.step);
    root.insert("epoch", progress.epoch);
    root.insert("samples_seen", progress.samples_seen);
    root.insert("world_size", progress.world_size);
    return WriteAtomically(path, torch::pickle_save(root));
  } catch (const c10::Error& error) {
    return absl::InternalError(absl::StrCat("save ", path, ": ", error.what_without_backtrace()));
  }
}

absl::StatusOr<TrainProgress> LoadCheckpoint(const std::string& path, torch::nn::Module& module,
                                             torch::optim::SGD& optimizer) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no checkpoint at ", path));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    auto root = torch::pickle_load(bytes).toGenericDict();
    auto model = root.at("model").toGenericDict();
    torch::NoGradGuard no_grad;
    auto restore = [&](const std::string& name, torch::Tensor& target) -> absl::Status {
      auto it = model.find(name);
      if (it == model.end()) return absl::InvalidArgumentError(absl::StrCat(path, ": no tensor ", name));
      torch::Tensor saved = it->value().toTensor();
      if (saved.sizes() != target.sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": ", name, " has another shape"));
      }
      target.copy_(saved);
      return absl::OkStatus();
    };
    for (auto& p : module.named_parameters()) {
      if (absl::Status s = restore(p.key(), p.value()); !s.ok()) return s;
    }
    for (auto& b : module.named_buffers()) {
      if (absl::Status s = restore(b.key(), b.value()); !s.ok()) return s;
    }
    auto momentum = root.at("optimizer").toGenericDict();
    for (auto& p : module.named_parameters()) {
      auto it = momentum.find(p.key());
      if (it == momentum.end()) continue;
      auto state = std::make_unique<torch::optim::SGDParamState>();
      state->momentum_buffer(it->value().toTensor().clone());
      optimizer.state()[StateKey(p.value())] = std::move(state);
    }
    TrainProgress progress;
    progress.step = root.at("step").toInt();
    progress.epoch = root.at("epoch").toInt();
    progress.samples_seen = root.at("samples_seen").toInt();
    progress.world_size = root.at("world_size").toInt();
    return progress;
  } catch (const c10::Error& error) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not an elrun checkpoint: ",
                                                   error.what_without_backtrace()));
  }
}

}  // namespace elrun::trainer
