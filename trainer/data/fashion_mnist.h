// Fashion-MNIST as tensors, read straight from Debian's dataset-fashion-mnist (gzip IDX files in
// /usr/share/datasets/fashion-mnist), and a small synthetic stand-in for tests. Stateless
// functions; safe to call from any thread.
#ifndef ELRUN_TRAINER_DATA_FASHION_MNIST_H_
#define ELRUN_TRAINER_DATA_FASHION_MNIST_H_

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>  // at::Tensor is torch::Tensor; the full torch API is not needed here.

#include "absl/status/statusor.h"

namespace elrun::trainer {

inline constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";
// Per-pixel statistics of the training split (pixels scaled to [0, 1]), used to normalise both
// splits as torchvision examples do.
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;
inline constexpr int64_t kFashionMnistClasses = 10;
inline constexpr int64_t kFashionMnistSide = 28;

enum class Split { kTrain, kTest };

struct Dataset {
  at::Tensor images;  // float32 [N, 1, 28, 28], (pixel / 255 - kFashionMnistMean) / kFashionMnistStd.
  at::Tensor labels;  // int64 [N], in [0, 10).
  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
};

// Reads <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (uncompressed IDX content is read
// too: zlib passes it through). Errors are one line naming the file and the problem:
// NotFound for a missing file (with the apt-get command that installs it); DataLoss for
// corrupt gzip, a bad magic number, images other than 28x28, a truncated file or trailing bytes,
// a label outside [0, 10), or image and label files that disagree on the count;
// PermissionDenied / Unavailable for other open or read failures.
[[nodiscard]] absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, Split split);

// The file LoadFashionMnist reads for `split`, e.g. "train-images-idx3-ubyte.gz".
std::string FashionMnistImagesFile(Split split);
std::string FashionMnistLabelsFile(Split split);

// `n` Fashion-MNIST-shaped samples that a model can learn: class c is a fixed pattern of bright
// and dark 7x7 blocks (the same patterns for every seed, so sets from different seeds are a
// train and test split of one task), plus Gaussian pixel noise of standard deviation `noise`;
// labels are uniform over the 10 classes. Deterministic in (n, seed, noise) on every platform.
Dataset SyntheticDataset(int64_t n, uint64_t seed, double noise = 0.5);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_DATA_FASHION_MNIST_H_
