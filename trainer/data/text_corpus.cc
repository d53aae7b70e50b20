#include "trainer/data/text_corpus.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include <ATen/ops/empty.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace elrun::trainer {
namespace {

namespace fs = std::filesystem;

// The regular *.py files directly in `dir`, sorted by name.
absl::StatusOr<std::vector<fs::path>> PythonFiles(const fs::path& dir) {
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    return absl::NotFoundError(absl::StrCat(dir.string(), ": no such folder"));
  }
  std::vector<fs::path> files;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    if (it->path().extension() == ".py" && it->is_regular_file(error)) files.push_back(it->path());
  }
  if (error) return absl::UnavailableError(absl::StrCat(dir.string(), ": cannot list: ", error.message()));
  std::sort(files.begin(), files.end());
  return files;
}

// Appends the bytes of `files` to one uint8 tensor.
absl::StatusOr<at::Tensor> Concatenate(const std::vector<fs::path>& files) {
  std::string text;
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream content;
    if (in) content << in.rdbuf();
    if (!in || in.bad()) return absl::UnavailableError(absl::StrCat(file.string(), ": cannot read"));
    text += content.str();
  }
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
  return bytes;
}

}  // namespace

absl::StatusOr<std::string> DefaultTextDir() {
  int best_minor = -1;
  std::string best;
  std::error_code error;
  for (fs::directory_iterator it("/usr/lib", error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    int minor = 0;
    if (name.rfind("python3.", 0) != 0 || !absl::SimpleAtoi(name.substr(8), &minor) || minor <= best_minor) continue;
    auto files = PythonFiles(it->path());
    if (files.ok() && static_cast<int>(files->size()) >= kValidationEvery) {
      best_minor = minor;
      best = it->path().string();
    }
  }
  if (best.empty()) {
    return absl::NotFoundError(
        "no Python standard library in /usr/lib/python3.N for the text corpus: install it with `apt-get install "
        "libpython3-stdlib`, or pass --data-dir with a folder of *.py files");
  }
  return best;
}

absl::StatusOr<TextCorpus> LoadTextCorpus(const std::string& dir) {
  auto files = PythonFiles(dir);
  if (!files.ok()) return files.status();
  if (static_cast<int>(files->size()) < kValidationEvery) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: %d *.py files; the text corpus needs at least %d (every %dth is validation)", dir,
                        files->size(), kValidationEvery, kValidationEvery));
  }
  std::vector<fs::path> train, validation;
  TextCorpus corpus;
  for (size_t i = 0; i < files->size(); ++i) {
    const bool held_out = (i + 1) % kValidationEvery == 0;
    (held_out ? validation : train).push_back((*files)[i]);
    (held_out ? corpus.validation_files : corpus.train_files).push_back((*files)[i].filename().string());
  }
  auto train_bytes = Concatenate(train);
  if (!train_bytes.ok()) return train_bytes.status();
  auto validation_bytes = Concatenate(validation);
  if (!validation_bytes.ok()) return validation_bytes.status();
  corpus.train = std::move(*train_bytes);
  corpus.validation = std::move(*validation_bytes);
  return corpus;
}

at::Tensor TextWindows(const at::Tensor& text, int64_t context) {
  const int64_t windows = std::max<int64_t>(0, (text.numel() - 1) / context);
  return text.contiguous().as_strided({windows, context + 1}, {context, 1});
}

}  // namespace elrun::trainer
