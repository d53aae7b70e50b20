#include "trainer/dist/shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <sstream>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace elrun::trainer {
namespace {

constexpr uint64_t kMagic = 0x656c72756e736d31;  // "elrunsm1"
constexpr size_t kRanksOffset = 128;
constexpr size_t kRankStride = 64;
constexpr size_t kPage = 4096;
constexpr int64_t kAlign = 64;   // Bytes: slots and slices start on cache lines.
constexpr int kShortSpin = 200;  // Pauses: a few microseconds.
// The longest a barrier spins, yielding, before it sleeps (see the class comment).
constexpr std::chrono::milliseconds kSpin{10};

int64_t RoundUp(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// The identity of this process's PID namespace: peers' pids mean something only within it.
uint64_t PidNamespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// The CPUs this process may run on.
int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

std::exception_ptr Failure(const std::string& message) {
  return std::make_exception_ptr(c10::Error(c10::SourceLocation{__func__, __FILE__, __LINE__}, message));
}

std::string Text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> Bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

// Process `pid` has ended: gone, or a zombie not reaped yet (a worker whose launcher was killed
// stays one until whoever adopted it reaps it, and kill(pid, 0) still finds it).
bool Exited(int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // The name may hold ')': its last one ends it.
  return paren != nullptr && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

}  // namespace

struct ShmAllreduce::Header {
  struct alignas(kRankStride) RankState {
    std::atomic<uint64_t> seq;  // The last barrier this rank reached.
    std::atomic<int64_t> pid;
    std::atomic<uint64_t> pid_namespace;
  };
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");
  static_assert(sizeof(RankState) == kRankStride);

  uint64_t magic;
  uint64_t token;
  int64_t world;
  int64_t capacity_bytes;
  alignas(64) std::atomic<uint32_t> bell;  // Bumped (and futex-woken) at every arrival.

  RankState* ranks() const {
    return reinterpret_cast<RankState*>(reinterpret_cast<char*>(const_cast<Header*>(this)) + kRanksOffset);
  }
  static size_t Bytes(int world) { return RoundUp(kRanksOffset + kRankStride * world, kPage); }
};

class ShmAllreduce::Op : public c10d::Work {
 public:
  explicit Op(at::Tensor t) : c10d::Work(-1, c10d::OpType::ALLREDUCE), tensor(std::move(t)) {}
  void Complete(std::exception_ptr error) { finish(std::move(error)); }
  const at::Tensor tensor;
};

absl::StatusOr<std::unique_ptr<ShmAllreduce>> ShmAllreduce::Create(c10d::Store& store, const std::string& key_prefix,
                                                                   int rank, int world_size, int64_t capacity_bytes,
                                                                   std::chrono::milliseconds timeout) {
  if (world_size < 1 || rank < 0 || rank >= world_size || capacity_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("shared-memory all-reduce: rank %d of %d, capacity %d bytes",
                                                      rank, world_size, capacity_bytes));
  }
  const int64_t capacity = RoundUp(std::max<int64_t>(1, capacity_bytes), kAlign);
  const size_t bytes = Header::Bytes(world_size) + 2 * static_cast<size_t>(world_size) * capacity;
  const std::string segment_key = key_prefix + "/segment";
  std::string name, error;
  void* base = MAP_FAILED;
  try {
    if (rank == 0) {
      std::random_device random;
      const uint64_t token = (static_cast<uint64_t>(random()) << 32) ^ random();
      name = absl::StrFormat("/elrun-allreduce-%d-%016x", ::getpid(), token);
      int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        error = absl::StrCat("shm_open ", name, ": ", std::strerror(errno));
        name.clear();
      } else {
        if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
          error = absl::StrCat("ftruncate ", name, " to ", bytes, " bytes: ", std::strerror(errno));
        } else {
          base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
          if (base == MAP_FAILED) error = absl::StrCat("mmap ", name, ": ", std::strerror(errno));
        }
        ::close(fd);
      }
      if (base != MAP_FAILED) {
        auto* header = new (base) Header{kMagic, token, world_size, capacity, {0}};
        for (int r = 0; r < world_size; ++r) new (&header->ranks()[r]) Header::RankState{{0}, {0}, {0}};
      }
      store.set(segment_key, Bytes(error.empty() ? absl::StrFormat("%s %d %d", name, token, bytes) : "-"));
    } else {
      std::vector<std::string> fields = absl::StrSplit(Text(store.get(segment_key)), ' ');
      uint64_t token = 0, expected_bytes = 0;
      if (fields.size() != 3 || !absl::SimpleAtoi(fields[1], &token) || !absl::SimpleAtoi(fields[2], &expected_bytes)) {
        error = "rank 0 has no segment";
      } else if (expected_bytes != bytes) {
        error = absl::StrCat("rank 0's segment has ", expected_bytes, " bytes, this rank expects ", bytes,
                             " (different capacities)");
      } else {
        int fd = ::shm_open(fields[0].c_str(), O_RDWR, 0);
        struct stat st {};
        if (fd < 0) {
          error = absl::StrCat("shm_open ", fields[0], ": ", std::strerror(errno), " (rank 0 on another host?)");
        } else {
          if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
            error = absl::StrCat(fields[0], " is not rank 0's segment (size ", st.st_size, ")");
          } else {
            base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (base == MAP_FAILED) error = absl::StrCat("mmap ", fields[0], ": ", std::strerror(errno));
          }
          ::close(fd);
        }
        if (base != MAP_FAILED) {
          auto* header = static_cast<Header*>(base);
          if (header->magic != kMagic || header->token != token || header->world != world_size ||
              header->capacity_bytes != capacity) {
            error = absl::StrCat(fields[0], " is not rank 0's segment (another host's /dev/shm?)");
          }
        }
      }
    }
    if (error.empty()) {
      Header::RankState& me = static_cast<Header*>(base)->ranks()[rank];
      me.pid.store(::getpid());
      me.pid_namespace.store(PidNamespace());
    }
    // Every rank reports; every rank reads all reports, so all decide alike.
    store.set(absl::StrCat(key_prefix, "/ok/", rank), Bytes(error.empty() ? "ok" : error));
    std::string failure;
    for (int r = 0; r < world_size; ++r) {
      std::string report = Text(store.get(absl::StrCat(key_prefix, "/ok/", r)));
      if (report != "ok" && failure.empty()) failure = absl::StrCat("rank ", r, ": ", report);
    }
    if (!name.empty()) ::shm_unlink(name.c_str());  // Rank 0, once every rank has mapped it or given up.
    name.clear();
    if (!failure.empty()) error = failure;
  } catch (const std::exception& e) {  // The store timed out or failed.
    error = absl::StrCat("store: ", e.what());
  }
  if (!name.empty()) ::shm_unlink(name.c_str());
  if (!error.empty()) {
    if (base != MAP_FAILED) ::munmap(base, bytes);
    return absl::UnavailableError(absl::StrCat("shared-memory all-reduce unavailable: ", error));
  }
  return std::unique_ptr<ShmAllreduce>(new ShmAllreduce(rank, world_size, capacity, base, bytes, timeout));
}

ShmAllreduce::ShmAllreduce(int rank, int world, int64_t capacity_bytes, void* base, size_t bytes,
                           std::chrono::milliseconds timeout)
    : rank_(rank),
      world_(world),
      capacity_bytes_(capacity_bytes),
      base_(base),
      bytes_(bytes),
      timeout_(timeout),
      header_(static_cast<Header*>(base)),
      may_spin_(world <= UsableCpus()),
      thread_([this] { Loop(); }) {}

ShmAllreduce::~ShmAllreduce() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  wake_.SignalAll();
  thread_.join();
  ::munmap(base_, bytes_);
}

bool ShmAllreduce::Fits(const at::Tensor& tensor) const {
  return tensor.defined() && tensor.device().is_cpu() &&
         (tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kDouble) && tensor.is_contiguous() &&
         tensor.nbytes() <= static_cast<size_t>(capacity_bytes_);
}

c10::intrusive_ptr<c10d::Work> ShmAllreduce::Allreduce(at::Tensor tensor) {
  TORCH_CHECK(Fits(tensor), "shared-memory all-reduce takes contiguous float32 or float64 CPU tensors of at most ",
              capacity_bytes_, " bytes; got ", tensor.defined() ? tensor.toString() : "undefined", " of ",
              tensor.defined() ? tensor.nbytes() : 0, " bytes");
  auto op = c10::make_intrusive<Op>(std::move(tensor));
  {
    absl::MutexLock lock(&mutex_);
    queue_.push_back(op);
  }
  wake_.Signal();
  return op;
}

void ShmAllreduce::Loop() {
  for (;;) {
    c10::intrusive_ptr<Op> op;
    {
      absl::MutexLock lock(&mutex_);
      while (!stopping_ && queue_.empty()) wake_.Wait(&mutex_);
      if (queue_.empty()) return;
      op = queue_.front();
      queue_.pop_front();
      if (stopping_ && broken_.empty()) broken_ = "shared-memory all-reduce: shut down with ops pending";
    }
    if (!broken_.empty()) {
      op->Complete(Failure(broken_));
      continue;
    }
    try {
      Run(*op, ++generation_);
      op->Complete(nullptr);
    } catch (const std::exception& e) {
      broken_ = e.what();
      op->Complete(Failure(broken_));
    }
  }
}

char* ShmAllreduce::Slot(uint64_t generation, int rank) const {
  char* data = static_cast<char*>(base_) + Header::Bytes(world_);
  const size_t set = generation % 2;  // Alternate sets: see Run.
  return data + (set * world_ + rank) * capacity_bytes_;
}

// Op g: (1) copy in, barrier 2g-1; (2) sum slice `rank` of every slot into slot 0, barrier 2g;
// (3) copy slot 0 out. Op g+1 writes the other set, so (3) of op g may overlap it; op g+2 reuses
// this set only after barrier 2g+1, which every rank reaches after its (3) of op g.
void ShmAllreduce::Run(Op& op, uint64_t generation) {
  const int64_t n = op.tensor.numel(), size = op.tensor.element_size();
  const at::ScalarType type = op.tensor.scalar_type();
  char* data = static_cast<char*>(op.tensor.data_ptr());
  std::memcpy(Slot(generation, rank_), data, n * size);
  Barrier(2 * generation - 1);
  const int64_t slice = RoundUp((n + world_ - 1) / world_, kAlign / size);  // Elements.
  const int64_t begin = std::min(n, rank_ * slice), end = std::min(n, begin + slice);
  if (end > begin) {
    at::Tensor sum = at::from_blob(Slot(generation, 0) + begin * size, {end - begin}, type);
    for (int r = 1; r < world_; ++r) sum.add_(at::from_blob(Slot(generation, r) + begin * size, {end - begin}, type));
  }
  Barrier(2 * generation);
  std::memcpy(data, Slot(generation, 0), n * size);
}

void ShmAllreduce::Barrier(uint64_t target) {
  Header::RankState* ranks = header_->ranks();
  auto* bell = reinterpret_cast<uint32_t*>(&header_->bell);
  ranks[rank_].seq.store(target, std::memory_order_release);
  header_->bell.fetch_add(1, std::memory_order_acq_rel);
  ::syscall(SYS_futex, bell, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  // Spin before sleeping: a few microseconds for peers about to arrive, then, when the ranks have
  // a CPU each, up to kSpin while yielding the CPU to any thread that wants it (see the class
  // comment). Yielding, the spin costs a computing thread on this CPU little.
  const auto spin_start = std::chrono::steady_clock::now();
  for (int spin = 0;; ++spin) {
    if (AllArrived(target)) return;
    if (spin < kShortSpin) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    if (!may_spin_ || stopping_ || std::chrono::steady_clock::now() - spin_start >= kSpin) break;
    ::sched_yield();
  }
  const uint64_t my_namespace = ranks[rank_].pid_namespace.load();
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    const uint32_t rung = header_->bell.load(std::memory_order_acquire);
    if (AllArrived(target)) return;
    std::vector<int> late;
    for (int r = 0; r < world_; ++r) {
      if (ranks[r].seq.load(std::memory_order_acquire) < target) late.push_back(r);
    }
    if (stopping_) {
      throw std::runtime_error("shared-memory all-reduce: shut down while waiting for the other ranks");
    }
    for (int r : late) {
      const int64_t pid = ranks[r].pid.load();
      if (pid > 0 && pid != ::getpid() && ranks[r].pid_namespace.load() == my_namespace && Exited(pid)) {
        throw std::runtime_error(
            absl::StrFormat("shared-memory all-reduce: rank %d (pid %d) exited during the all-reduce", r, pid));
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::ostringstream names;
      for (size_t i = 0; i < late.size(); ++i) names << (i ? ", " : "") << late[i];
      throw std::runtime_error(absl::StrFormat("shared-memory all-reduce: rank(s) %s did not arrive within %.3g s",
                                               names.str(), timeout_.count() / 1000.0));
    }
    struct timespec slice {
      0, 50 * 1000 * 1000
    };  // Re-check liveness and the deadline every 50 ms.
    ::syscall(SYS_futex, bell, FUTEX_WAIT, rung, &slice, nullptr, 0);
  }
}

bool ShmAllreduce::AllArrived(uint64_t target) const {
  const Header::RankState* ranks = header_->ranks();
  for (int r = 0; r < world_; ++r) {
    if (ranks[r].seq.load(std::memory_order_acquire) < target) return false;
  }
  return true;
}

c10::intrusive_ptr<c10d::Work> AllreduceSum(c10d::Backend& pg, ShmAllreduce* shm, at::Tensor tensor) {
  if (shm != nullptr && shm->Fits(tensor)) return shm->Allreduce(std::move(tensor));
  std::vector<at::Tensor> tensors{std::move(tensor)};
  return pg.allreduce(tensors);
}

}  // namespace elrun::trainer
