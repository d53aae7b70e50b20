#include "agent/net/process_setup.h"

#include "absl/synchronization/mutex.h"

namespace elrun {

void SetUpProcess() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

}  // namespace elrun
