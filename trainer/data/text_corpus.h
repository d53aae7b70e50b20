// A byte-level text corpus for language models that needs no download: the Python modules of the
// standard library every supported machine carries (/usr/lib/python3.N/*.py), or the *.py files
// of any folder. Bytes are the tokens (256 of them): no tokenizer. Stateless functions; safe to
// call from any thread.
#ifndef ELRUN_TRAINER_DATA_TEXT_CORPUS_H_
#define ELRUN_TRAINER_DATA_TEXT_CORPUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace elrun::trainer {

inline constexpr int64_t kByteVocabulary = 256;

// Every 10th file (sorted by name, the 10th, 20th, ...) is validation, the rest training: a
// deterministic split by file, so no text is in both.
inline constexpr int kValidationEvery = 10;

struct TextCorpus {
  at::Tensor train;       // uint8 [bytes]: the training files, concatenated in name order.
  at::Tensor validation;  // uint8 [bytes]: the validation files, likewise.
  std::vector<std::string> train_files, validation_files;  // Names, in order.
};

// The newest /usr/lib/python3.N that holds *.py files; NotFound (naming the package that
// installs it) when there is none.
[[nodiscard]] absl::StatusOr<std::string> DefaultTextDir();

// Reads the regular *.py files directly in `dir` (not its subfolders). Errors are one line:
// NotFound for a missing folder, FailedPrecondition for fewer than kValidationEvery files (no
// validation split), Unavailable for a file that cannot be read.
[[nodiscard]] absl::StatusOr<TextCorpus> LoadTextCorpus(const std::string& dir);

// The text cut into windows of context + 1 bytes that overlap by one byte, so that the inputs
// (window[:-1]) and next-byte targets (window[1:]) of consecutive windows cover every byte once:
// uint8 [(bytes - 1) / context, context + 1]. A view of `text` (index_select copies the rows).
at::Tensor TextWindows(const at::Tensor& text, int64_t context);

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_DATA_TEXT_CORPUS_H_
