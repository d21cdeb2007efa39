#include "comm/shared_memory.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {
namespace {

// The segment: a futex word, each rank's barrier count and pid (a cache line
// each, so ranks do not write to one line), then two sets of one slot per
// rank. A piece of a tensor uses one set; the next piece, or the next
// collective, the other: a rank still reading set s is done with it before
// anyone passes the barrier of the piece after next, the first that writes
// set s again.
constexpr size_t kLine = 64;
constexpr size_t kDataBudget = 16u << 20;       // both sets, all ranks
constexpr size_t kMaxSlot = 4u << 20, kMinSlot = 64u << 10;
// Up to this many bytes per rank, every rank adds all the slots itself (one
// barrier); above, each rank adds its share into slot 0 and all copy the
// result out (two barriers, but each byte is added once).
constexpr size_t kAddEverything = 64u << 10;
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kCheckEvery = std::chrono::milliseconds(5);

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

std::atomic<uint32_t>& wake_word(char* base) { return *reinterpret_cast<std::atomic<uint32_t>*>(base); }
std::atomic<uint64_t>& arrived(char* base, int rank) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(base + kLine * (1 + rank));
}
std::atomic<int32_t>& pid_of(char* base, int world, int rank) {
  return *reinterpret_cast<std::atomic<int32_t>*>(base + kLine * (1 + world + rank));
}
size_t data_offset(int world) { return round_up(kLine * (1 + 2 * static_cast<size_t>(world)), 4096); }

void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1'000'000'000), static_cast<long>(timeout.count() % 1'000'000'000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Whether process `pid` still runs: it exists and is not a zombie that its
// parent has yet to reap.
bool running(pid_t pid) {
  if (pid <= 0) return true;  // not yet recorded: never probe 0 or -1 (our group, everyone)
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* file = std::fopen(path, "r");
  if (!file) return errno != ENOENT;
  char text[512] = {};
  const size_t n = std::fread(text, 1, sizeof text - 1, file);
  std::fclose(file);
  const char* state = std::strrchr(text, ')');  // "pid (name) S ...": the name may hold spaces
  return !(n > 0 && state && state[1] == ' ' && (state[2] == 'Z' || state[2] == 'X'));
}

std::string segment_name() {
  std::random_device device;
  char name[64];
  std::snprintf(name, sizeof name, "/mnist_ddp.%d.%08x", static_cast<int>(getpid()), device());
  return name;
}

// Whether `name` is one segment_name() makes: "/mnist_ddp.<pid>.<8 hex digits>".
bool is_segment_name(const std::string& name) {
  const std::string head = "/mnist_ddp.";
  if (name.compare(0, head.size(), head) != 0 || name.size() > 64) return false;
  const size_t dot = name.find('.', head.size());
  if (dot == std::string::npos || dot == head.size() || name.size() - dot - 1 != 8) return false;
  for (size_t i = head.size(); i < name.size(); ++i)
    if (i != dot && !std::isxdigit(static_cast<unsigned char>(name[i]))) return false;
  return std::all_of(name.begin() + static_cast<long>(head.size()), name.begin() + static_cast<long>(dot), ::isdigit);
}

std::runtime_error foreign_segment(const std::string& value) {
  std::string shown;
  for (char c : value.substr(0, 40)) shown += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  return std::runtime_error("the store holds '" + shown + "' for the ranks' shared memory, which no mnist_ddp "
                            "wrote: another process is writing into this job's store");
}

std::runtime_error segment_error(const std::string& what, const std::string& name, int error) {
  return std::runtime_error("shared memory for the ranks on this host: " + what + " /dev/shm" + name + ": " +
                            std::strerror(error));
}

at::Tensor flat_view(char* at, int64_t numel, at::ScalarType dtype) {
  return at::from_blob(at, {numel}, at::TensorOptions().dtype(dtype));
}

// out = parts[0] + parts[1] + ..., element by element in that order; float16
// and bfloat16 in float32, rounded once. `out` may be parts[0].
void add_in_order(at::Tensor out, const std::vector<at::Tensor>& parts) {
  if (out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) {
    at::Tensor sum = parts[0].to(at::kFloat);
    for (size_t r = 1; r < parts.size(); ++r) sum.add_(parts[r]);
    out.copy_(sum);
    return;
  }
  if (parts.size() == 1) {
    out.copy_(parts[0]);
    return;
  }
  at::add_out(out, parts[0], parts[1]);
  for (size_t r = 2; r < parts.size(); ++r) out.add_(parts[r]);
}

}  // namespace

SharedMemoryReducer::SharedMemoryReducer(c10d::Store& store, int rank, int world_size,
                                         std::chrono::milliseconds timeout, const std::function<void()>& barrier,
                                         RankNames names)
    : rank_(rank), world_size_(world_size), timeout_(timeout), names_(std::move(names)) {
  slot_bytes_ = std::clamp(kDataBudget / (2 * static_cast<size_t>(world_size)), kMinSlot, kMaxSlot) / kLine * kLine;
  size_ = data_offset(world_size) + 2 * static_cast<size_t>(world_size) * slot_bytes_;
  std::string name;
  int fd = -1;
  if (rank == 0) {
    name = segment_name();
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw segment_error("cannot create", name, errno);
    // Reserve the pages now: a tmpfs that is full would otherwise answer
    // the first touch of a page with SIGBUS.
    if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(size_)); err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      throw segment_error("cannot reserve " + std::to_string(size_ >> 20) + " MB in", name, err);
    }
    store.set("shared_memory", bytes_of(name));
  } else {
    store.wait({"shared_memory"}, timeout);
    name = text_of(store.get("shared_memory"));
    if (!is_segment_name(name)) throw foreign_segment(name);
    fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0600);
    if (fd < 0) throw segment_error("cannot open", name, errno);
    // Rank 0's: this user's, of the size it made.
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_uid != geteuid() || static_cast<size_t>(st.st_size) != size_) {
      close(fd);
      throw foreign_segment(name);
    }
  }
  void* mapped = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mmap_errno = errno;
  close(fd);
  if (mapped == MAP_FAILED) {
    if (rank == 0) shm_unlink(name.c_str());
    throw segment_error("cannot map", name, mmap_errno);
  }
  base_ = static_cast<char*>(mapped);
  pid_of(base_, world_size, rank).store(static_cast<int32_t>(getpid()));
  try {
    barrier();
  } catch (...) {
    if (rank == 0) shm_unlink(name.c_str());
    throw;
  }
  if (rank == 0) shm_unlink(name.c_str());
}

SharedMemoryReducer::~SharedMemoryReducer() { munmap(base_, size_); }

char* SharedMemoryReducer::slot(int set, int rank) const {
  return base_ + data_offset(world_size_) + (static_cast<size_t>(set) * world_size_ + rank) * slot_bytes_;
}

bool SharedMemoryReducer::all_arrived(uint64_t barrier) const {
  for (int r = 0; r < world_size_; ++r)
    if (arrived(base_, r).load() < barrier) return false;
  return true;
}

void SharedMemoryReducer::check_peers(uint64_t barrier, std::chrono::steady_clock::time_point deadline) const {
  std::vector<int> missing;
  for (int r = 0; r < world_size_; ++r) {
    if (arrived(base_, r).load() >= barrier) continue;
    if (!running(pid_of(base_, world_size_, r).load()))
      throw PeerLost(names_.line("lost " + names_.rank(r) + ": its process ended during a collective"));
    missing.push_back(r);
  }
  if (std::chrono::steady_clock::now() < deadline || missing.empty()) return;
  throw Timeout(names_.line(names_.list(missing) + " did not reach a collective within " +
                            std::to_string(timeout_.count() / 1000) + " s (--timeout)"));
}

// Every rank enters barriers in the same sequence; barrier n is passed once
// every rank's count reaches n. The rank that completes it wakes the
// sleepers. A waiter spins briefly (its peers usually arrive within
// microseconds, and its own compute thread is waiting on it), then sleeps
// on the futex, looking at its peers every few milliseconds.
void SharedMemoryReducer::barrier(const std::function<void()>& stalled) {
  const uint64_t n = ++barriers_;
  arrived(base_, rank_).store(n);
  std::atomic<uint32_t>& wake = wake_word(base_);
  if (all_arrived(n)) {
    wake.fetch_add(1);
    futex_wake_all(wake);
    return;
  }
  using Clock = std::chrono::steady_clock;
  const auto spin_until = Clock::now() + kSpin;
  while (Clock::now() < spin_until) {
    for (int i = 0; i < 64; ++i) cpu_relax();
    if (all_arrived(n)) return;
  }
  // A caller that watches its own wait (`stalled`) names a timeout itself,
  // with where every rank waits (watch.hpp).
  const auto deadline = stalled ? Clock::time_point::max() : Clock::now() + timeout_;
  for (;;) {
    const uint32_t seen = wake.load();
    if (all_arrived(n)) return;
    futex_wait(wake, seen, kCheckEvery);
    if (all_arrived(n)) return;
    if (stalled) stalled();
    check_peers(n, deadline);
  }
}

void SharedMemoryReducer::allreduce_sum(at::Tensor& tensor, const std::function<void()>& stalled) {
  TORCH_CHECK(tensor.is_cpu() && tensor.is_contiguous(), "shared-memory allreduce: needs a contiguous CPU tensor");
  const at::ScalarType dtype = tensor.scalar_type();
  const int64_t element = static_cast<int64_t>(tensor.element_size());
  const int64_t per_piece = static_cast<int64_t>(slot_bytes_) / element;
  at::Tensor flat = tensor.view({-1});
  for (int64_t offset = 0; offset < flat.numel(); offset += per_piece) {
    const int64_t n = std::min(per_piece, flat.numel() - offset);
    at::Tensor piece = flat.slice(0, offset, offset + n);
    std::memcpy(slot(set_, rank_), piece.data_ptr(), static_cast<size_t>(n * element));
    barrier(stalled);
    std::vector<at::Tensor> parts;
    if (static_cast<size_t>(n * element) <= kAddEverything) {
      for (int r = 0; r < world_size_; ++r) parts.push_back(flat_view(slot(set_, r), n, dtype));
      add_in_order(piece, parts);
    } else {
      const int64_t lo = n * rank_ / world_size_, hi = n * (rank_ + 1) / world_size_;
      for (int r = 0; r < world_size_; ++r) parts.push_back(flat_view(slot(set_, r) + lo * element, hi - lo, dtype));
      add_in_order(parts[0], parts);
      barrier();
      std::memcpy(piece.data_ptr(), slot(set_, 0), static_cast<size_t>(n * element));
    }
    set_ ^= 1;
  }
}

// The root writes each piece into its slot; the others copy it out after
// the piece's barrier.
void SharedMemoryReducer::broadcast(at::Tensor& tensor, int root, const std::function<void()>& stalled) {
  TORCH_CHECK(tensor.is_cpu() && tensor.is_contiguous(), "shared-memory broadcast: needs a contiguous CPU tensor");
  TORCH_CHECK(root >= 0 && root < world_size_, "shared-memory broadcast: no rank ", root);
  char* data = static_cast<char*>(tensor.data_ptr());
  const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  for (size_t offset = 0; offset < bytes; offset += slot_bytes_) {
    const size_t n = std::min(slot_bytes_, bytes - offset);
    if (rank_ == root) std::memcpy(slot(set_, root), data + offset, n);
    barrier(stalled);
    if (rank_ != root) std::memcpy(data + offset, slot(set_, root), n);
    set_ ^= 1;
  }
}

}  // namespace mnist_ddp
