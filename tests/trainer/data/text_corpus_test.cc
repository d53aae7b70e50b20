// The byte-level text corpus: the split by file, the bytes in name order, the windows that cover
// every byte once, each error, and the Python standard library this machine carries.
#include "trainer/data/text_corpus.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <torch/torch.h>

#include "tests/temp_dir.h"

namespace elrun::trainer {
namespace {

namespace fs = std::filesystem;

void Write(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::string Bytes(const at::Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<size_t>(t.numel()));
}

TEST_CASE("Every 10th *.py file by name is validation; the bytes are the files in name order") {
  const fs::path dir = elrun::testing::MakeTempDir("text");
  // Names written out of order; f01..f20, plus files the corpus must skip.
  std::string train, validation;
  for (int i = 20; i >= 1; --i) {
    const std::string name = (i < 10 ? "f0" : "f") + std::to_string(i) + ".py";
    Write(dir / name, "# file " + std::to_string(i) + "\n");
  }
  for (int i = 1; i <= 20; ++i) {
    (i % 10 == 0 ? validation : train) += "# file " + std::to_string(i) + "\n";
  }
  Write(dir / "notes.txt", "not python\n");
  fs::create_directories(dir / "pkg.py");  // A folder named like a module: skipped.
  fs::create_directories(dir / "sub");
  Write(dir / "sub" / "inner.py", "# nested: skipped\n");

  auto corpus = LoadTextCorpus(dir.string());
  REQUIRE(corpus.ok());
  CHECK(corpus->train_files.size() == 18);
  CHECK(corpus->validation_files == std::vector<std::string>({"f10.py", "f20.py"}));
  CHECK(corpus->train_files.front() == "f01.py");
  CHECK(corpus->train.scalar_type() == at::kByte);
  CHECK(Bytes(corpus->train) == train);
  CHECK(Bytes(corpus->validation) == validation);
}

TEST_CASE("Windows of context + 1 bytes overlap by one: inputs and next-byte targets cover the text once") {
  std::string text = "abcdefghijk";  // 11 bytes: (11 - 1) / 3 = 3 windows.
  at::Tensor bytes = torch::from_blob(text.data(), {11}, torch::kByte).clone();
  at::Tensor windows = TextWindows(bytes, 3);
  REQUIRE(windows.sizes() == at::IntArrayRef({3, 4}));
  CHECK(Bytes(windows[0].contiguous()) == "abcd");
  CHECK(Bytes(windows[1].contiguous()) == "defg");
  CHECK(Bytes(windows[2].contiguous()) == "ghij");
  // Rows as the trainer takes them: a copy.
  at::Tensor rows = windows.index_select(0, torch::tensor({2, 0}));
  CHECK(Bytes(rows.contiguous()) == "ghijabcd");
  CHECK(TextWindows(bytes.narrow(0, 0, 3), 3).size(0) == 0);  // Too short for one window.
  CHECK(TextWindows(bytes.narrow(0, 2, 5), 2).sizes() == at::IntArrayRef({2, 3}));
  CHECK(Bytes(TextWindows(bytes.narrow(0, 2, 5), 2)[1].contiguous()) == "efg");
}

TEST_CASE("Errors: a missing folder, too few files for a validation split") {
  auto missing = LoadTextCorpus("/nonexistent/elrun-text");
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK(std::string(missing.status().message()).find("/nonexistent/elrun-text") != std::string::npos);

  const fs::path dir = elrun::testing::MakeTempDir("text_few");
  for (int i = 0; i < kValidationEvery - 1; ++i) Write(dir / ("m" + std::to_string(i) + ".py"), "x = 1\n");
  auto few = LoadTextCorpus(dir.string());
  CHECK(few.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(few.status().message()).find("9 *.py files") != std::string::npos);
}

TEST_CASE("This machine's Python standard library is a corpus of megabytes") {
  auto dir = DefaultTextDir();
  REQUIRE_MESSAGE(dir.ok(), dir.status().message());
  CHECK(dir->rfind("/usr/lib/python3.", 0) == 0);
  auto corpus = LoadTextCorpus(*dir);
  REQUIRE(corpus.ok());
  CHECK(corpus->train.numel() > 1'000'000);
  CHECK(corpus->validation.numel() > 100'000);
  // Deterministic: a second read is the same bytes.
  auto again = LoadTextCorpus(*dir);
  REQUIRE(again.ok());
  CHECK(torch::equal(corpus->train, again->train));
}

}  // namespace
}  // namespace elrun::trainer
