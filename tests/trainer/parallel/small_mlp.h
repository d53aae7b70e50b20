// The small MLP the sharded-state tests train: units of 130, 77 and 24 elements, uneven over 2
// and 3 ranks, built from a seed, and their training steps.
#ifndef ELRUN_TESTS_TRAINER_PARALLEL_SMALL_MLP_H_
#define ELRUN_TESTS_TRAINER_PARALLEL_SMALL_MLP_H_

#include <memory>
#include <mutex>

#include "trainer/app/models.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/parallel/fsdp.h"

namespace elrun::trainer {

inline const MlpOptions kSmallMlp{12, {10, 7}, 3};

// A fresh model from `seed`. Safe from rank threads: the default generator is global.
inline std::shared_ptr<Classifier> SmallMlp(int seed) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  return *MakeModel("mlp", kSmallMlp);
}

// `steps` optimizer steps of `fsdp` on random batches of 4 from `gen`, counted in `progress`.
inline void TrainSmallMlp(FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer, at::Generator& gen,
                          int steps, TrainProgress& progress) {
  for (int s = 0; s < steps; ++s) {
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(fsdp.forward(torch::randn({4, 12}, gen)), torch::randint(0, 3, {4}, gen))
        .backward();
    optimizer.step();
    ++progress.step;
  }
}

}  // namespace elrun::trainer

#endif  // ELRUN_TESTS_TRAINER_PARALLEL_SMALL_MLP_H_
