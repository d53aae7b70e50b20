#include "trainer/data/fashion_mnist.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

// Only the one ATen operator used: compiles in seconds, where torch/torch.h takes half a minute.
#include <ATen/ops/empty.h>

#include "absl/strings/str_format.h"

namespace elrun::trainer {
namespace {

constexpr uint32_t kImagesMagic = 0x00000803;  // IDX: unsigned bytes, 3 dimensions.
constexpr uint32_t kLabelsMagic = 0x00000801;  // IDX: unsigned bytes, 1 dimension.
constexpr int64_t kPixels = kFashionMnistSide * kFashionMnistSide;

// The whole decompressed content of `path`.
absl::StatusOr<std::vector<uint8_t>> ReadGzip(const std::string& path) {
  errno = 0;
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    const int error = errno;
    if (error == ENOENT) {
      return absl::NotFoundError(
          absl::StrFormat("%s: no such file; install Fashion-MNIST with `apt-get install dataset-fashion-mnist` "
                          "(it goes to %s) or pass the directory that holds it",
                          path, kFashionMnistDir));
    }
    const std::string reason = error == 0 ? "out of memory" : std::strerror(error);
    if (error == EACCES) return absl::PermissionDeniedError(absl::StrFormat("%s: %s", path, reason));
    return absl::UnavailableError(absl::StrFormat("%s: cannot open: %s", path, reason));
  }
  gzbuffer(file, 1 << 18);
  std::vector<uint8_t> data;
  constexpr unsigned kChunk = 1 << 20;
  for (;;) {
    const size_t old_size = data.size();
    data.resize(old_size + kChunk);
    errno = 0;
    const int n = gzread(file, data.data() + old_size, kChunk);
    if (n < 0) {
      int code = Z_OK;
      const char* message = gzerror(file, &code);
      const std::string reason = code == Z_ERRNO ? std::strerror(errno) : message;
      gzclose_r(file);
      if (code == Z_ERRNO) return absl::UnavailableError(absl::StrFormat("%s: read failed: %s", path, reason));
      return absl::DataLossError(absl::StrFormat("%s: corrupt gzip data (%s)", path, reason));
    }
    data.resize(old_size + n);
    if (n == 0) break;
  }
  // gzread reports a stream cut short only here: it returns what it got, then 0.
  if (gzclose_r(file) == Z_BUF_ERROR) {
    return absl::DataLossError(
        absl::StrFormat("%s: truncated gzip data (unexpected end of file after %d bytes)", path, data.size()));
  }
  return data;
}

uint32_t BigEndian32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | uint32_t{p[3]};
}

// Checks an IDX header of `header_size` bytes with `magic`, then that the body holds exactly
// `count` items of `item_size` bytes (count read from bytes 4..7).
absl::StatusOr<int64_t> CheckIdx(const std::string& path, const std::vector<uint8_t>& data, uint32_t magic,
                                 size_t header_size, const char* what) {
  if (data.size() < header_size) {
    return absl::DataLossError(absl::StrFormat("%s: truncated: %d bytes, shorter than the %d-byte IDX header", path,
                                               data.size(), header_size));
  }
  const uint32_t got = BigEndian32(data.data());
  if (got != magic) {
    return absl::DataLossError(
        absl::StrFormat("%s: bad magic number 0x%08x, expected 0x%08x (IDX %s); not a Fashion-MNIST %s file", path, got,
                        magic, what, what));
  }
  return int64_t{BigEndian32(data.data() + 4)};
}

absl::Status CheckBodySize(const std::string& path, const std::vector<uint8_t>& data, size_t header_size, int64_t count,
                           int64_t item_size, const char* what) {
  const int64_t body = static_cast<int64_t>(data.size() - header_size);
  const int64_t expected = count * item_size;
  if (body < expected) {
    return absl::DataLossError(
        absl::StrFormat("%s: truncated: the header says %d %s (%d bytes) but only %d bytes follow it", path, count,
                        what, expected, body));
  }
  if (body > expected) {
    return absl::DataLossError(absl::StrFormat("%s: %d unexpected trailing bytes after the %d %s the header announces",
                                               path, body - expected, count, what));
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> ParseImages(const std::string& path, const std::vector<uint8_t>& data) {
  constexpr size_t kHeader = 16;
  absl::StatusOr<int64_t> count = CheckIdx(path, data, kImagesMagic, kHeader, "images");
  if (!count.ok()) return count.status();
  const uint32_t rows = BigEndian32(data.data() + 8);
  const uint32_t cols = BigEndian32(data.data() + 12);
  if (rows != kFashionMnistSide || cols != kFashionMnistSide) {
    return absl::DataLossError(absl::StrFormat("%s: images are %dx%d, expected 28x28", path, rows, cols));
  }
  if (absl::Status s = CheckBodySize(path, data, kHeader, *count, kPixels, "images"); !s.ok()) return s;

  std::array<float, 256> normalized;
  for (int v = 0; v < 256; ++v) {
    normalized[v] = static_cast<float>((v / 255.0 - kFashionMnistMean) / kFashionMnistStd);
  }
  at::Tensor images = at::empty({*count, 1, kFashionMnistSide, kFashionMnistSide}, at::kFloat);
  float* out = images.data_ptr<float>();
  const uint8_t* in = data.data() + kHeader;
  for (int64_t i = 0, n = *count * kPixels; i < n; ++i) out[i] = normalized[in[i]];
  return images;
}

absl::StatusOr<at::Tensor> ParseLabels(const std::string& path, const std::vector<uint8_t>& data) {
  constexpr size_t kHeader = 8;
  absl::StatusOr<int64_t> count = CheckIdx(path, data, kLabelsMagic, kHeader, "labels");
  if (!count.ok()) return count.status();
  if (absl::Status s = CheckBodySize(path, data, kHeader, *count, 1, "labels"); !s.ok()) return s;
  at::Tensor labels = at::empty({*count}, at::kLong);
  int64_t* out = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < *count; ++i) {
    const uint8_t label = data[kHeader + i];
    if (label >= kFashionMnistClasses) {
      return absl::DataLossError(
          absl::StrFormat("%s: label %d at index %d is outside [0, %d)", path, label, i, kFashionMnistClasses));
    }
    out[i] = label;
  }
  return labels;
}

// Standard normal from two uniform draws (Box-Muller): the same on every platform, unlike
// std::normal_distribution.
class Gaussian {
 public:
  explicit Gaussian(uint64_t seed) : gen_(seed) {}
  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - Uniform();  // (0, 1]: log() stays finite.
    const double u2 = Uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * M_PI * u2);
  }
  std::mt19937_64& engine() { return gen_; }

 private:
  double Uniform() { return static_cast<double>(gen_() >> 11) * 0x1.0p-53; }  // [0, 1)
  std::mt19937_64 gen_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace

std::string FashionMnistImagesFile(Split split) {
  return split == Split::kTrain ? "train-images-idx3-ubyte.gz" : "t10k-images-idx3-ubyte.gz";
}

std::string FashionMnistLabelsFile(Split split) {
  return split == Split::kTrain ? "train-labels-idx1-ubyte.gz" : "t10k-labels-idx1-ubyte.gz";
}

absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, Split split) {
  const std::string images_path = dir + "/" + FashionMnistImagesFile(split);
  const std::string labels_path = dir + "/" + FashionMnistLabelsFile(split);
  // Labels first: small, so a missing or broken dataset is reported without inflating 47 MB.
  absl::StatusOr<std::vector<uint8_t>> label_bytes = ReadGzip(labels_path);
  if (!label_bytes.ok()) return label_bytes.status();
  absl::StatusOr<at::Tensor> labels = ParseLabels(labels_path, *label_bytes);
  if (!labels.ok()) return labels.status();
  absl::StatusOr<std::vector<uint8_t>> image_bytes = ReadGzip(images_path);
  if (!image_bytes.ok()) return image_bytes.status();
  absl::StatusOr<at::Tensor> images = ParseImages(images_path, *image_bytes);
  if (!images.ok()) return images.status();
  if (images->size(0) != labels->size(0)) {
    return absl::DataLossError(absl::StrFormat("%s has %d images but %s has %d labels", images_path, images->size(0),
                                               labels_path, labels->size(0)));
  }
  return Dataset{*std::move(images), *std::move(labels)};
}

Dataset SyntheticDataset(int64_t n, uint64_t seed, double noise) {
  constexpr int kBlock = 7;
  constexpr int kBlocksPerSide = kFashionMnistSide / kBlock;  // 4 x 4 blocks.
  // One fixed pattern per class, independent of `seed`: bit b of patterns[c] lights block b.
  // Distinct by construction: the low 4 bits are the class, the rest come from a fixed generator.
  std::array<uint32_t, kFashionMnistClasses> patterns;
  std::mt19937_64 fixed(0x5eed'f00d);
  for (int c = 0; c < kFashionMnistClasses; ++c) {
    patterns[c] = static_cast<uint32_t>(c) | (static_cast<uint32_t>(fixed()) & 0xfff0u);
  }

  n = std::max<int64_t>(n, 0);
  Dataset data{at::empty({n, 1, kFashionMnistSide, kFashionMnistSide}, at::kFloat), at::empty({n}, at::kLong)};
  float* images = data.images.data_ptr<float>();
  int64_t* labels = data.labels.data_ptr<int64_t>();
  Gaussian gaussian(seed);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t label = static_cast<int64_t>(gaussian.engine()() % kFashionMnistClasses);
    labels[i] = label;
    float* image = images + i * kPixels;
    for (int y = 0; y < kFashionMnistSide; ++y) {
      for (int x = 0; x < kFashionMnistSide; ++x) {
        const int block = (y / kBlock) * kBlocksPerSide + x / kBlock;
        const double base = (patterns[label] >> block & 1u) ? 1.0 : -1.0;
        image[y * kFashionMnistSide + x] = static_cast<float>(base + noise * gaussian.Next());
      }
    }
  }
  return data;
}

}  // namespace elrun::trainer
