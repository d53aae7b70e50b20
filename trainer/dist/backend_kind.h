// Which c10d backend a worker's process group uses. Header-only and free of LibTorch, so option
// and placement logic can name it without the process group's dependencies.
#ifndef ELRUN_TRAINER_DIST_BACKEND_KIND_H_
#define ELRUN_TRAINER_DIST_BACKEND_KIND_H_

namespace elrun::trainer {

enum class BackendKind { kGloo, kNccl };

inline const char* BackendName(BackendKind kind) { return kind == BackendKind::kNccl ? "nccl" : "gloo"; }

}  // namespace elrun::trainer

#endif  // ELRUN_TRAINER_DIST_BACKEND_KIND_H_
