#include "trainer/parallel/sharded_checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace elrun::trainer {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFormat = "elrun-sharded-v1";

std::string ShardFile(const std::string& step_dir, int k, int count) {
  return absl::StrCat(step_dir, "/shard-", k, "-of-", count, ".pt");
}

// True on every rank when `ok` is true on every rank.
bool AllOk(c10d::Backend& pg, bool ok) {
  std::vector<torch::Tensor> flag{torch::tensor({ok ? 0 : 1}, torch::kInt).to(CommDevice(pg))};
  pg.allreduce(flag)->wait();
  return flag[0].item<int>() == 0;
}

c10::impl::GenericDict StateDict(const ParamState& state) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [field, tensor] : state) dict.insert(field, tensor);
  return dict;
}

// A shard file's dict from its bytes; `origin` names them in errors.
absl::StatusOr<c10::impl::GenericDict> ParseDict(const std::vector<char>& bytes, const std::string& origin) {
  try {
    auto dict = torch::pickle_load(bytes).toGenericDict();
    if (!dict.contains("format") || dict.at("format").toStringRef() != kFormat) {
      return absl::InvalidArgumentError(absl::StrCat(origin, " is not an elrun sharded checkpoint"));
    }
    return dict;
  } catch (const c10::Error& error) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, " is not an elrun sharded checkpoint: ", error.what_without_backtrace()));
  }
}

absl::StatusOr<c10::impl::GenericDict> ReadDict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no shard file ", path));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return ParseDict(bytes, path);
}

// Copies elements [begin, begin + out.numel()) of the unpadded flat buffer that `shards` (the
// K saved shards, each `saved_shard` long) hold into `out`; positions past `numel` stay zero.
void CutFromShards(const std::vector<torch::Tensor>& shards, int64_t saved_shard, int64_t numel, int64_t begin,
                   torch::Tensor out) {
  out.zero_();
  const int64_t end = std::min(begin + out.numel(), numel);
  for (int64_t pos = begin; pos < end;) {
    const int64_t k = pos / saved_shard, within = pos % saved_shard;
    const int64_t take = std::min(saved_shard - within, end - pos);
    out.narrow(0, pos - begin, take).copy_(shards[k].narrow(0, within, take));
    pos += take;
  }
}

absl::StatusOr<TrainProgress> LoadFromDicts(const std::vector<c10::impl::GenericDict>& files, const std::string& where,
                                            FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer);

// The dict of this rank's shard file (every rank's is shard 0 of 1 for no_shard). Throws
// c10::Error.
c10::impl::GenericDict ShardDict(FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer,
                                 const TrainProgress& progress) {
  const int count = fsdp.shard_count();
  const int k = count == 1 ? 0 : fsdp.rank();
  c10::impl::GenericList units(c10::AnyType::get());
  for (size_t u = 0; u < fsdp.units().size(); ++u) {
    const FsdpUnitInfo& info = fsdp.units()[u];
    c10::impl::GenericDict unit(c10::StringType::get(), c10::AnyType::get());
    unit.insert("name", info.name);
    c10::List<std::string> names;
    for (const auto& name : info.param_names) names.push_back(name);
    unit.insert("param_names", names);
    unit.insert("numel", info.numel);
    unit.insert("shard_numel", info.shard_numel);
    unit.insert("shard", CpuCopy(fsdp.parameters()[u]));
    unit.insert("state", StateDict(ExportParamState(optimizer, fsdp.parameters()[u])));
    units.push_back(unit);
  }
  c10::Dict<std::string, torch::Tensor> buffers;
  if (k == 0) {
    for (const auto& b : fsdp.module().named_buffers()) buffers.insert(b.key(), CpuCopy(b.value()));
  }
  c10::impl::GenericDict file(c10::StringType::get(), c10::AnyType::get());
  file.insert("format", std::string(kFormat));
  file.insert("shard", static_cast<int64_t>(k));
  file.insert("shard_count", static_cast<int64_t>(count));
  file.insert("optimizer_kind", *OptimizerKind(optimizer));
  file.insert("units", units);
  file.insert("buffers", buffers);
  InsertProgress(file, progress);
  return file;
}

// The set LATEST names under `root` (dir/sharded), or "" when none is published.
std::string LatestSet(const std::string& root) {
  std::ifstream latest(root + "/LATEST");
  std::string step_name;
  if (!latest || !(latest >> step_name)) return "";
  return step_name;
}

absl::StatusOr<TrainProgress> LoadOwnShards(const std::string& dir, FullyShardedDataParallel& fsdp,
                                            torch::optim::Optimizer& optimizer) {
  const std::string root = dir + "/sharded";
  const std::string step_name = LatestSet(root);
  if (step_name.empty()) return absl::NotFoundError(absl::StrCat("no sharded checkpoint in ", dir));
  const std::string step_dir = absl::StrCat(root, "/", step_name);
  auto first = ReadDict(ShardFile(step_dir, 0, 1));  // A no_shard checkpoint has one file...
  int count = 1;
  if (!first.ok()) {
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(step_dir, error)) {  // ...others say how many.
      int k = 0, n = 0;
      if (std::sscanf(entry.path().filename().c_str(), "shard-%d-of-%d.pt", &k, &n) == 2 && k == 0) count = n;
    }
    first = ReadDict(ShardFile(step_dir, 0, count));
  }
  if (!first.ok()) return first.status();
  std::vector<c10::impl::GenericDict> files{*first};
  for (int k = 1; k < count; ++k) {
    auto file = ReadDict(ShardFile(step_dir, k, count));
    if (!file.ok()) return file.status();
    files.push_back(*file);
  }
  return LoadFromDicts(files, absl::StrCat(step_dir, ": "), fsdp, optimizer);
}

// Cuts `files` (a whole set, in shard order) for `fsdp`'s shards; `where` prefixes errors.
absl::StatusOr<TrainProgress> LoadFromDicts(const std::vector<c10::impl::GenericDict>& files, const std::string& where,
                                            FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer) {
  absl::StatusOr<std::string> kind = OptimizerKind(optimizer);
  if (!kind.ok()) return kind.status();
  try {
    if (files[0].at("optimizer_kind").toStringRef() != *kind) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "holds ", files[0].at("optimizer_kind").toStringRef(), " state; this run uses ", *kind));
    }
    torch::NoGradGuard no_grad;
    const auto& infos = fsdp.units();
    std::vector<c10::List<c10::IValue>> saved_units;
    for (const auto& file : files) saved_units.push_back(file.at("units").toList());
    if (saved_units[0].size() != infos.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, saved_units[0].size(), " units, the model has ", infos.size()));
    }
    const int64_t begin_unit = fsdp.shard_count() == 1 ? 0 : fsdp.rank();
    for (size_t u = 0; u < infos.size(); ++u) {
      auto saved = saved_units[0].get(u).toGenericDict();
      std::vector<std::string> names;
      for (const c10::IValue& n : saved.at("param_names").toList().vec()) names.push_back(n.toStringRef());
      if (names != infos[u].param_names || saved.at("numel").toInt() != infos[u].numel) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "unit ", u, " ('", infos[u].name, "') has other parameters than the model's"));
      }
      const int64_t saved_shard = saved.at("shard_numel").toInt();
      if (saved_shard <= 0 || saved_shard * static_cast<int64_t>(saved_units.size()) < infos[u].numel) {
        return absl::InvalidArgumentError(absl::StrCat(where, "unit ", u, " ('", infos[u].name, "') has shards of ",
                                                       saved_shard, " elements, too few for ", infos[u].numel));
      }
      const int64_t begin = begin_unit * infos[u].shard_numel;
      std::vector<torch::Tensor> shards;
      std::map<std::string, std::vector<torch::Tensor>> state_shards;
      for (const auto& units : saved_units) {
        auto unit = units.get(u).toGenericDict();
        shards.push_back(unit.at("shard").toTensor());
        for (const auto& entry : unit.at("state").toGenericDict()) {
          state_shards[entry.key().toStringRef()].push_back(entry.value().toTensor());
        }
      }
      torch::Tensor shard = fsdp.parameters()[u];
      CutFromShards(shards, saved_shard, infos[u].numel, begin, shard);
      ParamState state;
      for (const auto& [field, parts] : state_shards) {
        if (parts[0].dim() == 0) {  // Adam's step count: the same in every shard.
          state[field] = parts[0].clone();
          continue;
        }
        torch::Tensor cut = torch::zeros_like(shard);
        CutFromShards(parts, saved_shard, infos[u].numel, begin, cut);
        state[field] = cut;
      }
      if (absl::Status s = ImportParamState(optimizer, shard, state); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(where, s.message()));
      }
    }
    auto buffers = files[0].at("buffers").toGenericDict();
    for (auto& b : fsdp.module().named_buffers()) {
      auto it = buffers.find(b.key());
      if (it == buffers.end() || it->value().toTensor().sizes() != b.value().sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(where, "buffer ", b.key(), " missing or of another shape"));
      }
      b.value().copy_(it->value().toTensor());
    }
    fsdp.ShardsChanged();
    return ReadProgress(files[0]);
  } catch (const c10::Error& error) {
    return absl::InvalidArgumentError(absl::StrCat(where, error.what_without_backtrace()));
  }
}

}  // namespace

absl::Status SaveSharded(const std::string& dir, FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer,
                         const TrainProgress& progress) {
  c10d::Backend& pg = fsdp.process_group();
  const int count = fsdp.shard_count();
  const int k = count == 1 ? 0 : fsdp.rank();
  const std::string root = dir + "/sharded";
  // One directory per step and shard count: a set is never mixed with files of another count.
  const std::string step_name = absl::StrCat("step-", progress.step, "-of-", count);
  const std::string step_dir = absl::StrCat(root, "/", step_name);
  absl::Status status = OptimizerKind(optimizer).status();
  if (status.ok() && (count > 1 || fsdp.rank() == 0)) {
    std::error_code error;
    fs::create_directories(step_dir, error);
    if (error) status = absl::FailedPreconditionError(absl::StrCat("create ", step_dir, ": ", error.message()));
  }
  if (status.ok() && (count > 1 || fsdp.rank() == 0)) {
    try {
      const c10::impl::GenericDict file = ShardDict(fsdp, optimizer, progress);
      status = WriteAtomically(ShardFile(step_dir, k, count), SaveForPython(file));
    } catch (const c10::Error& error) {
      status = absl::InternalError(absl::StrCat("save shard: ", error.what_without_backtrace()));
    }
  }
  // A set that is not published is removed (by rank 0, once every rank is done with it), so a
  // full disk does not fill up further with sets that no LATEST names - unless it is the set
  // already current (the same step saved again, e.g. on SIGTERM), whose files were replaced
  // whole or not at all.
  auto drop_set = [&] {
    if (fsdp.rank() != 0 || LatestSet(root) == step_name) return;
    std::error_code ignored;
    fs::remove_all(step_dir, ignored);
  };
  if (!AllOk(pg, status.ok())) {
    drop_set();
    return status.ok() ? absl::AbortedError(absl::StrCat("sharded checkpoint ", step_dir,
                                                         " not made current: another rank failed to save"))
                       : status;
  }
  if (fsdp.rank() == 0) {
    std::string text = step_name + "\n";
    status = WriteAtomically(root + "/LATEST", std::vector<char>(text.begin(), text.end()));
    if (!status.ok()) drop_set();
    if (status.ok()) {  // Older sets are no longer reachable.
      std::error_code error;
      for (const auto& entry : fs::directory_iterator(root, error)) {
        const std::string name = entry.path().filename();
        if (entry.is_directory() && name.rfind("step-", 0) == 0 && name != step_name)
          fs::remove_all(entry.path(), error);
      }
    }
  }
  if (!AllOk(pg, status.ok()))
    return status.ok() ? absl::AbortedError("rank 0 failed to publish the checkpoint") : status;
  return absl::OkStatus();
}

absl::StatusOr<TrainProgress> LoadSharded(const std::string& dir, FullyShardedDataParallel& fsdp,
                                          torch::optim::Optimizer& optimizer) {
  absl::StatusOr<TrainProgress> result = LoadOwnShards(dir, fsdp, optimizer);
  // Ranks that go on while another could not load would wait for it in the next collective.
  if (!AllOk(fsdp.process_group(), result.ok()) && result.ok()) {
    return absl::AbortedError(absl::StrCat("sharded checkpoint in ", dir, ": another rank failed to load it"));
  }
  return result;
}

std::map<std::string, ParamState> FullOptimizerState(FullyShardedDataParallel& fsdp,
                                                     const torch::optim::Optimizer& optimizer) {
  std::map<std::string, ParamState> result;
  for (size_t u = 0; u < fsdp.units().size(); ++u) {
    const FsdpUnitInfo& info = fsdp.units()[u];
    for (auto& [field, tensor] : ExportParamState(optimizer, fsdp.parameters()[u])) {
      if (tensor.dim() == 0) {
        for (const auto& name : info.param_names) result[name][field] = tensor.clone();
        continue;
      }
      torch::Tensor full = tensor;
      if (fsdp.shard_count() > 1) {
        full = torch::empty({info.padded}, tensor.options());
        AllGather(fsdp.process_group(), tensor.contiguous(), full);
      }
      int64_t offset = 0;
      for (size_t i = 0; i < info.param_names.size(); ++i) {
        const int64_t numel = c10::multiply_integers(info.shapes[i]);
        result[info.param_names[i]][field] = full.narrow(0, offset, numel).view(info.shapes[i]).clone();
        offset += numel;
      }
    }
  }
  return result;
}

absl::Status ExportConsolidated(const std::string& path, FullyShardedDataParallel& fsdp,
                                torch::optim::Optimizer& optimizer, const TrainProgress& progress) {
  absl::StatusOr<std::string> kind = OptimizerKind(optimizer);
  if (!kind.ok()) return kind.status();
  std::map<std::string, torch::Tensor> tensors = fsdp.FullParameters();
  std::map<std::string, ParamState> state = FullOptimizerState(fsdp, optimizer);
  absl::Status status;
  if (fsdp.rank() == 0) {
    for (const auto& b : fsdp.module().named_buffers()) tensors[b.key()] = CpuCopy(b.value());
    status = WriteCheckpointFile(path, tensors, state, *kind, progress);
  }
  if (!AllOk(fsdp.process_group(), status.ok())) {
    return status.ok() ? absl::AbortedError(absl::StrCat("rank 0 failed to write ", path)) : status;
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardBytes> LiveShardBytes(FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer,
                                          const TrainProgress& progress) {
  try {
    ShardBytes result;
    result.count = fsdp.shard_count();
    result.shard = result.count == 1 ? 0 : fsdp.rank();
    result.step = progress.step;
    result.bytes = SaveForPython(ShardDict(fsdp, optimizer, progress));
    return result;
  } catch (const c10::Error& error) {
    return absl::InternalError(absl::StrCat("serialise shard: ", error.what_without_backtrace()));
  }
}

absl::StatusOr<TrainProgress> LoadShardSet(const std::vector<std::vector<char>>& files, const std::string& origin,
                                           FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer) {
  if (files.empty()) return absl::InvalidArgumentError(absl::StrCat(origin, ": no shard"));
  std::vector<c10::impl::GenericDict> dicts;
  for (size_t k = 0; k < files.size(); ++k) {
    const std::string name = absl::StrCat(origin, " (shard ", k, " of ", files.size(), ")");
    auto dict = ParseDict(files[k], name);
    if (!dict.ok()) return dict.status();
    try {
      if (dict->at("shard").toInt() != static_cast<int64_t>(k) ||
          dict->at("shard_count").toInt() != static_cast<int64_t>(files.size())) {
        return absl::InvalidArgumentError(absl::StrCat(name, " says it is shard ", dict->at("shard").toInt(), " of ",
                                                       dict->at("shard_count").toInt()));
      }
    } catch (const c10::Error& error) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", error.what_without_backtrace()));
    }
    dicts.push_back(*std::move(dict));
  }
  return LoadFromDicts(dicts, absl::StrCat(origin, ": "), fsdp, optimizer);
}

}  // namespace elrun::trainer
