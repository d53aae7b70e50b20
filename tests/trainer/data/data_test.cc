// Fashion-MNIST loading: the real Debian files, every malformed-file error, and the synthetic set.
#include "trainer/data/fashion_mnist.h"

#include <doctest/doctest.h>
#include <zlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace elrun::trainer {
namespace {

namespace fs = std::filesystem;

// A fresh directory under $TEST_TMPDIR.
std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  fs::path dir = fs::path(tmp != nullptr ? tmp : "/tmp") / ("data_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void WriteGzip(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  if (!bytes.empty()) REQUIRE(gzwrite(f, bytes.data(), bytes.size()) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

void WriteRaw(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

std::vector<uint8_t> ReadRaw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void Put32(std::vector<uint8_t>* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<uint8_t>(v >> shift));
}

// IDX images: `count` images of rows x cols, pixel p of image i = (i * 7 + p) % 256.
std::vector<uint8_t> Images(uint32_t count, uint32_t rows = 28, uint32_t cols = 28, uint32_t magic = 0x803) {
  std::vector<uint8_t> out;
  Put32(&out, magic);
  Put32(&out, count);
  Put32(&out, rows);
  Put32(&out, cols);
  for (uint32_t i = 0; i < count; ++i) {
    for (uint32_t p = 0; p < rows * cols; ++p) out.push_back(static_cast<uint8_t>((i * 7 + p) % 256));
  }
  return out;
}

std::vector<uint8_t> Labels(const std::vector<uint8_t>& labels, uint32_t magic = 0x801) {
  std::vector<uint8_t> out;
  Put32(&out, magic);
  Put32(&out, static_cast<uint32_t>(labels.size()));
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

// A test split in a fresh directory; returns the directory.
std::string WriteSplit(const std::string& name, const std::vector<uint8_t>& images,
                       const std::vector<uint8_t>& labels) {
  std::string dir = TempDir(name);
  WriteGzip(dir + "/t10k-images-idx3-ubyte.gz", images);
  WriteGzip(dir + "/t10k-labels-idx1-ubyte.gz", labels);
  return dir;
}

bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

// Checks code and message fragments; the message is one line.
void CheckError(const absl::StatusOr<Dataset>& got, absl::StatusCode code, const std::vector<std::string>& fragments) {
  REQUIRE_FALSE(got.ok());
  const absl::Status& s = got.status();
  CHECK_MESSAGE(s.code() == code, s.ToString());
  for (const std::string& f : fragments) CHECK_MESSAGE(Contains(s, f), s.ToString(), " lacks: ", f);
  CHECK(std::string(s.message()).find('\n') == std::string::npos);
}

TEST_CASE("the real test split: 10000 images, 1000 per class, normalised") {
  absl::StatusOr<Dataset> data = LoadFashionMnist(kFashionMnistDir, Split::kTest);
  REQUIRE_MESSAGE(data.ok(), data.status().ToString());
  CHECK(data->size() == 10000);
  CHECK(data->images.sizes() == torch::IntArrayRef({10000, 1, 28, 28}));
  CHECK((data->images.scalar_type() == torch::kFloat));
  CHECK((data->labels.scalar_type() == torch::kLong));
  torch::Tensor histogram = torch::bincount(data->labels);
  CHECK(torch::equal(histogram, torch::full({10}, 1000, torch::kLong)));
  const double mean = data->images.mean().item<double>();
  const double std = data->images.std().item<double>();
  CHECK(std::abs(mean) < 0.02);       // 0.0024 (the test split is a little brighter than train).
  CHECK(std::abs(std - 1.0) < 0.02);  // 0.9984
  // Pinned against Python's gzip reader: the first labels and the first image's pixel sum.
  CHECK(torch::equal(data->labels.slice(0, 0, 10), torch::tensor({9, 2, 1, 1, 6, 1, 4, 6, 5, 7}, torch::kLong)));
  torch::Tensor raw = ((data->images[0] * kFashionMnistStd + kFashionMnistMean) * 255).round();
  CHECK(raw.sum().item<double>() == 33456);
  CHECK(raw.min().item<double>() == 0);
  CHECK(raw.max().item<double>() <= 255);
}

TEST_CASE("the real train split: 60000 images with the mean and std the normalisation uses") {
  absl::StatusOr<Dataset> data = LoadFashionMnist(kFashionMnistDir, Split::kTrain);
  REQUIRE_MESSAGE(data.ok(), data.status().ToString());
  CHECK(data->size() == 60000);
  CHECK(torch::equal(torch::bincount(data->labels), torch::full({10}, 6000, torch::kLong)));
  CHECK(std::abs(data->images.mean().item<double>()) < 0.005);
  CHECK(std::abs(data->images.std().item<double>() - 1.0) < 0.005);
}

TEST_CASE("a small valid split round-trips pixels and labels") {
  std::string dir = WriteSplit("valid", Images(3), Labels({0, 9, 4}));
  absl::StatusOr<Dataset> data = LoadFashionMnist(dir, Split::kTest);
  REQUIRE_MESSAGE(data.ok(), data.status().ToString());
  CHECK(torch::equal(data->labels, torch::tensor({0, 9, 4}, torch::kLong)));
  // Image 1, pixel 0 is 7; image 2, pixel 35 is (14 + 35) % 256 = 49.
  CHECK(data->images[1][0][0][0].item<float>() == doctest::Approx((7 / 255.0 - 0.2860) / 0.3530));
  CHECK(data->images[2][0][1][7].item<float>() == doctest::Approx((49 / 255.0 - 0.2860) / 0.3530));
}

TEST_CASE("uncompressed IDX content is accepted too") {
  std::string dir = TempDir("raw");
  WriteRaw(dir + "/t10k-images-idx3-ubyte.gz", Images(2));
  WriteRaw(dir + "/t10k-labels-idx1-ubyte.gz", Labels({1, 2}));
  absl::StatusOr<Dataset> data = LoadFashionMnist(dir, Split::kTest);
  REQUIRE_MESSAGE(data.ok(), data.status().ToString());
  CHECK(data->size() == 2);
}

TEST_CASE("a missing directory is NotFound with the apt-get command") {
  std::string dir = TempDir("missing") + "/nowhere";
  CheckError(LoadFashionMnist(dir, Split::kTrain), absl::StatusCode::kNotFound,
             {dir + "/train-labels-idx1-ubyte.gz", "no such file", "apt-get install dataset-fashion-mnist"});
}

TEST_CASE("a missing image file is NotFound naming it") {
  std::string dir = TempDir("no_images");
  WriteGzip(dir + "/t10k-labels-idx1-ubyte.gz", Labels({1}));
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kNotFound,
             {dir + "/t10k-images-idx3-ubyte.gz", "apt-get install dataset-fashion-mnist"});
}

TEST_CASE("bad magic numbers") {
  SUBCASE("labels") {
    std::string dir = WriteSplit("magic_labels", Images(1), Labels({1}, 0x803));
    CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss,
               {"t10k-labels-idx1-ubyte.gz", "bad magic number 0x00000803, expected 0x00000801"});
  }
  SUBCASE("images") {
    std::string dir = WriteSplit("magic_images", Images(1, 28, 28, 0x12345678), Labels({1}));
    CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss,
               {"t10k-images-idx3-ubyte.gz", "bad magic number 0x12345678"});
  }
}

TEST_CASE("a file shorter than its header is truncated") {
  std::string dir = WriteSplit("short_header", Images(1), {0, 0, 8});
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss,
             {"t10k-labels-idx1-ubyte.gz", "truncated: 3 bytes, shorter than the 8-byte IDX header"});
}

TEST_CASE("a body shorter than the header says is truncated") {
  std::vector<uint8_t> images = Images(3);
  images.resize(images.size() - 100);
  std::string dir = WriteSplit("short_body", images, Labels({1, 2, 3}));
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss,
             {"t10k-images-idx3-ubyte.gz", "truncated: the header says 3 images (2352 bytes) but only 2252"});
}

TEST_CASE("trailing bytes are an error") {
  std::vector<uint8_t> labels = Labels({1, 2});
  labels.push_back(3);
  std::string dir = WriteSplit("trailing", Images(2), labels);
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss,
             {"t10k-labels-idx1-ubyte.gz", "1 unexpected trailing bytes after the 2 labels"});
}

TEST_CASE("images other than 28x28") {
  std::string dir = WriteSplit("dims", Images(1, 32, 32), Labels({1}));
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss,
             {"t10k-images-idx3-ubyte.gz", "images are 32x32, expected 28x28"});
}

TEST_CASE("a label outside [0, 10)") {
  std::string dir = WriteSplit("label_range", Images(3), Labels({1, 2, 10}));
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss,
             {"t10k-labels-idx1-ubyte.gz", "label 10 at index 2 is outside [0, 10)"});
}

TEST_CASE("image and label counts must agree") {
  std::string dir = WriteSplit("mismatch", Images(3), Labels({1, 2}));
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss,
             {"t10k-images-idx3-ubyte.gz has 3 images but", "t10k-labels-idx1-ubyte.gz has 2 labels"});
}

TEST_CASE("a cut-off gzip stream is truncated") {
  std::string dir = WriteSplit("cut_gzip", Images(20), Labels(std::vector<uint8_t>(20, 1)));
  const std::string path = dir + "/t10k-images-idx3-ubyte.gz";
  std::vector<uint8_t> gz = ReadRaw(path);
  gz.resize(gz.size() / 2);
  WriteRaw(path, gz);
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss, {path, "truncated gzip data"});
}

TEST_CASE("corrupt gzip data") {
  std::string dir = WriteSplit("bad_gzip", Images(1), Labels({1}));
  const std::string path = dir + "/t10k-labels-idx1-ubyte.gz";
  std::vector<uint8_t> gz = ReadRaw(path);
  // Keep the 10-byte gzip header, scribble over the deflate stream.
  for (size_t i = 10; i < gz.size(); ++i) gz[i] = 0xff;
  WriteRaw(path, gz);
  CheckError(LoadFashionMnist(dir, Split::kTest), absl::StatusCode::kDataLoss, {path, "corrupt gzip data"});
}

TEST_CASE("the synthetic set is deterministic per seed") {
  Dataset a = SyntheticDataset(200, 1);
  Dataset b = SyntheticDataset(200, 1);
  Dataset c = SyntheticDataset(200, 2);
  CHECK(a.images.sizes() == torch::IntArrayRef({200, 1, 28, 28}));
  CHECK(a.labels.sizes() == torch::IntArrayRef({200}));
  CHECK((a.images.scalar_type() == torch::kFloat));
  CHECK((a.labels.scalar_type() == torch::kLong));
  CHECK(torch::equal(a.images, b.images));
  CHECK(torch::equal(a.labels, b.labels));
  CHECK_FALSE(torch::equal(a.images, c.images));
  CHECK(a.labels.min().item<int64_t>() >= 0);
  CHECK(a.labels.max().item<int64_t>() < 10);
  CHECK(SyntheticDataset(0, 1).size() == 0);
}

TEST_CASE("the synthetic set is learnable: class means of one seed classify another") {
  Dataset train = SyntheticDataset(2000, 11, 1.0);
  Dataset test = SyntheticDataset(1000, 12, 1.0);
  CHECK(torch::equal(torch::bincount(train.labels) > 150, torch::ones({10}, torch::kBool)));
  torch::Tensor x = train.images.flatten(1);
  std::vector<torch::Tensor> means;
  for (int c = 0; c < 10; ++c) means.push_back(x.index({train.labels == c}).mean(0));
  torch::Tensor centroids = torch::stack(means);  // [10, 784]
  torch::Tensor predicted = torch::cdist(test.images.flatten(1), centroids).argmin(1);
  const double accuracy = (predicted == test.labels).to(torch::kDouble).mean().item<double>();
  CHECK(accuracy > 0.95);
}

}  // namespace
}  // namespace elrun::trainer
