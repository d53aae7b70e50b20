#include "trainer/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>

#include "absl/strings/str_cat.h"
#include "trainer/checkpoint/optimizer_state.h"

namespace elrun::trainer {

void InsertProgress(c10::impl::GenericDict& dict, const TrainProgress& progress) {
  dict.insert("step", progress.step);
  dict.insert("epoch", progress.epoch);
  dict.insert("samples_seen", progress.samples_seen);
  dict.insert("world_size", progress.world_size);
  if (progress.loss_scale > 0) {
    dict.insert("loss_scale", progress.loss_scale);
    dict.insert("loss_scale_growth_tracker", progress.loss_scale_growth_tracker);
  }
}

TrainProgress ReadProgress(const c10::impl::GenericDict& dict) {
  TrainProgress progress;
  progress.step = dict.at("step").toInt();
  progress.epoch = dict.at("epoch").toInt();
  progress.samples_seen = dict.at("samples_seen").toInt();
  progress.world_size = dict.at("world_size").toInt();
  if (dict.contains("loss_scale")) {
    progress.loss_scale = dict.at("loss_scale").toDouble();
    progress.loss_scale_growth_tracker = dict.at("loss_scale_growth_tracker").toInt();
    TORCH_CHECK(progress.loss_scale > 0 && progress.loss_scale_growth_tracker >= 0,
                "checkpoint: bad loss scale state (", progress.loss_scale, ", ", progress.loss_scale_growth_tracker,
                ")");
  }
  return progress;
}

std::vector<char> SaveForPython(const c10::IValue& value) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* bytes, size_t n) { pickle.insert(pickle.end(), bytes, bytes + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    const char* begin = static_cast<const char*>(bytes);
    archive.insert(archive.end(), begin, begin + n);
    return n;
  });
  // The layout torch::pickle_save writes: the storages as data/<i> in the order the pickle
  // names them, then data.pkl.
  const std::vector<at::Tensor>& tensors = pickler.tensorData();
  for (size_t i = 0; i < tensors.size(); ++i) {
    torch::jit::WriteableTensorData data = torch::jit::getWriteableTensorData(tensors[i]);
    writer.writeRecord("data/" + std::to_string(i), data.data(), data.sizeInBytes());
  }
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
  return archive;
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

namespace {

// SGD momentum under the parameter's name; Adam's tensors under "<name>.<field>".
std::string StateName(const std::string& param, const std::string& field) {
  return field == "momentum_buffer" ? param : absl::StrCat(param, ".", field);
}

}  // namespace

std::string CheckpointPath(const std::string& dir) { return dir + "/checkpoint.pt"; }

namespace {

// The checkpoint dict of WriteCheckpointFile, in torch.save's format.
absl::StatusOr<std::vector<char>> CheckpointFileBytes(const std::map<std::string, torch::Tensor>& tensors,
                                                      const std::map<std::string, ParamState>& optimizer_state,
                                                      const std::string& optimizer_kind,
                                                      const TrainProgress& progress) {
  try {
    c10::Dict<std::string, torch::Tensor> model;
    // Python's torch.load opens CPU tensors anywhere; CUDA ones only where that device exists.
    auto on_cpu = [](const torch::Tensor& t) { return t.device().is_cpu() ? t : CpuCopy(t); };
    for (const auto& [name, tensor] : tensors) model.insert(name, on_cpu(tensor));
    c10::Dict<std::string, torch::Tensor> state;
    for (const auto& [param, fields] : optimizer_state) {
      for (const auto& [field, tensor] : fields) state.insert(StateName(param, field), on_cpu(tensor));
    }
    c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
    root.insert("model", model);
    root.insert("optimizer", state);
    root.insert("optimizer_kind", optimizer_kind);
    InsertProgress(root, progress);
    return SaveForPython(root);
  } catch (const c10::Error& error) {
    return absl::InternalError(error.what_without_backtrace());
  }
}

}  // namespace

absl::Status WriteCheckpointFile(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                                 const std::map<std::string, ParamState>& optimizer_state,
                                 const std::string& optimizer_kind, const TrainProgress& progress) {
  absl::StatusOr<std::vector<char>> bytes = CheckpointFileBytes(tensors, optimizer_state, optimizer_kind, progress);
  if (!bytes.ok()) return absl::InternalError(absl::StrCat("save ", path, ": ", bytes.status().message()));
  return WriteAtomically(path, *bytes);
}

absl::StatusOr<std::vector<char>> CheckpointBytes(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                                  const TrainProgress& progress) {
  absl::StatusOr<std::string> kind = OptimizerKind(optimizer);
  if (!kind.ok()) return kind.status();
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, ParamState> state;
  for (const auto& p : module.named_parameters()) {
    tensors[p.key()] = CpuCopy(p.value());
    ParamState fields = ExportParamState(optimizer, p.value());
    if (!fields.empty()) state[p.key()] = std::move(fields);
  }
  for (const auto& b : module.named_buffers()) tensors[b.key()] = CpuCopy(b.value());
  return CheckpointFileBytes(tensors, state, *kind, progress);
}

absl::Status SaveCheckpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                            const TrainProgress& progress) {
  absl::StatusOr<std::vector<char>> bytes = CheckpointBytes(module, optimizer, progress);
  if (!bytes.ok()) {
    return bytes.status().code() == absl::StatusCode::kInternal
               ? absl::InternalError(absl::StrCat("save ", path, ": ", bytes.status().message()))
               : bytes.status();
  }
  return WriteAtomically(path, *bytes);
}

absl::StatusOr<TrainProgress> LoadCheckpoint(const std::string& path, torch::nn::Module& module,
                                             torch::optim::Optimizer& optimizer) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no checkpoint at ", path));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return LoadCheckpointBytes(bytes, path, module, optimizer);
}

absl::StatusOr<TrainProgress> LoadCheckpointBytes(const std::vector<char>& bytes, const std::string& path,
                                                  torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  absl::StatusOr<std::string> kind = OptimizerKind(optimizer);
  if (!kind.ok()) return kind.status();
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
    const std::string saved_kind = root.contains("optimizer_kind") ? root.at("optimizer_kind").toStringRef() : "sgd";
    if (saved_kind != *kind) {
      return absl::InvalidArgumentError(absl::StrCat(path, " holds ", saved_kind, " state; this run uses ", *kind));
    }
    auto saved_state = root.at("optimizer").toGenericDict();
    for (auto& p : module.named_parameters()) {
      ParamState state;
      for (const std::string field : {"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"}) {
        auto it = saved_state.find(StateName(p.key(), field));
        if (it != saved_state.end()) state[field] = it->value().toTensor();
      }
      if (state.empty()) continue;
      if (absl::Status s = ImportParamState(optimizer, p.value(), state); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": ", p.key(), ": ", s.message()));
      }
    }
    return ReadProgress(root);
  } catch (const c10::Error& error) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not an elrun checkpoint: ", error.what_without_backtrace()));
  }
}

}  // namespace elrun::trainer
