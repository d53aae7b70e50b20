// The small MLP the sharded-state tests train: units of 130, 77 and 24 elements, uneven over 2
// and 3 ranks, built from a seed.
#ifndef ELRUN_TESTS_TRAINER_PARALLEL_SMALL_MLP_H_
#define ELRUN_TESTS_TRAINER_PARALLEL_SMALL_MLP_H_

#include <memory>
#include <mutex>

#include "trainer/app/models.h"

namespace elrun::trainer {

inline const MlpOptions kSmallMlp{12, {10, 7}, 3};

// A fresh model from `seed`. Safe from rank threads: the default generator is global.
inline std::shared_ptr<Classifier> SmallMlp(int seed) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  return *MakeModel("mlp", kSmallMlp);
}

}  // namespace elrun::trainer

#endif  // ELRUN_TESTS_TRAINER_PARALLEL_SMALL_MLP_H_
