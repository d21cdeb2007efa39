#include "app/base/placement.hpp"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <thread>

#include "app/base/files.hpp"

namespace mnist_ddp {
namespace {

bool built_with_cuda() {
#ifdef MNIST_DDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// Whether CUDA takes `item` of CUDA_VISIBLE_DEVICES as a device.
bool names_a_device(const std::string& item) {
  if (item.rfind("GPU-", 0) == 0 || item.rfind("MIG-", 0) == 0) return item.size() > 4;
  return !item.empty() && std::all_of(item.begin(), item.end(), [](unsigned char c) { return std::isdigit(c); });
}

// "1.5 GiB", "63 MiB".
std::string fmt_gib(int64_t bytes) {
  char text[32];
  if (bytes >= (int64_t{1} << 30))
    std::snprintf(text, sizeof text, "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
  else
    std::snprintf(text, sizeof text, "%lld MiB", static_cast<long long>(bytes >> 20));
  return text;
}

int machine_cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

}  // namespace

int count_visible_gpus(const std::optional<std::string>& cuda_visible_devices, int present) {
  if (!cuda_visible_devices) return present;
  int listed = 0;
  const std::string& list = *cuda_visible_devices;
  for (size_t start = 0; start <= list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    if (!names_a_device(item)) break;
    ++listed;
    start = end + 1;
  }
  return std::min(listed, present);
}

int count_visible_gpus(const std::optional<std::string>& cuda_visible_devices) {
  int present = 0;
  for (const std::string& name : files::list_directory("/dev")) {
    if (name.size() > 6 && name.compare(0, 6, "nvidia") == 0 &&
        std::all_of(name.begin() + 6, name.end(), ::isdigit))
      ++present;
  }
  return count_visible_gpus(cuda_visible_devices, present);
}

Placement plan_placement(const Options& opts, int visible) {
  return plan_placement(opts, built_with_cuda(), built_with_cuda() ? visible : 0);
}

Placement plan_placement(const Options& opts, bool cuda_build, int visible) {
  Placement p;
  p.visible_gpus = visible;
  std::set<int> distinct(opts.gpus.begin(), opts.gpus.end());
  const bool shared = distinct.size() < opts.gpus.size();
  p.backend = opts.backend == "auto" ? (visible > 0 && !shared ? "nccl" : "gloo") : opts.backend;
  if (p.backend == "nccl" && !cuda_build)
    throw UsageError("--backend nccl: this mnist_ddp was built against a CPU-only LibTorch; use --backend gloo");
  if (p.backend == "nccl" && visible == 0)
    throw UsageError("--backend nccl: no CUDA device is visible; use --backend gloo");
  if (p.backend == "gloo" && opts.gpus.empty()) {
    p.local_workers = opts.nproc;
    return p;
  }
  if (opts.gpus.empty()) {
    for (int d = 0; d < visible; ++d) p.devices.push_back(d);
  } else {
    p.devices = opts.gpus;
  }
  std::set<int> seen;
  for (int d : p.devices) {
    if (d >= visible)
      throw UsageError("--gpus: device " + std::to_string(d) + " does not exist (" +
                       (visible == 0 ? std::string("no CUDA device is visible to this build")
                                     : std::to_string(visible) + " visible, ids 0.." + std::to_string(visible - 1)) +
                       ")");
    if (!seen.insert(d).second && p.backend == "nccl")
      throw UsageError("--gpus: device " + std::to_string(d) +
                       " is listed twice, but --backend nccl needs a GPU of its own per worker; use --backend gloo "
                       "to let workers share a GPU");
  }
  p.local_workers = static_cast<int>(p.devices.size());
  return p;
}

int device_of_local_rank(const Placement& p, int local_rank) {
  if (p.devices.empty()) return -1;
  if (local_rank < static_cast<int>(p.devices.size())) return p.devices[local_rank];
  if (p.visible_gpus == 1) return p.devices.front();
  throw UsageError("local rank " + std::to_string(local_rank) + " has no GPU: this node's --gpus (or visible " +
                   "GPUs) give " + std::to_string(p.devices.size()) + "; name one per local worker, " +
                   "repeat ids with --backend gloo, or train on the CPU with --backend gloo");
}

void check_workers_fit(const Options& opts, const Placement& p, int64_t bytes_per_worker, int cores,
                       int64_t available_bytes) {
  constexpr int kPerCore = 16;
  const int64_t by_memory = available_bytes / std::max<int64_t>(1, bytes_per_worker);
  const int64_t fit = std::max<int64_t>(1, std::min<int64_t>(int64_t{kPerCore} * std::max(1, cores), by_memory));
  if (p.local_workers <= fit) return;
  const auto gib = fmt_gib;
  const std::string flag = p.devices.empty() ? "--nproc " + std::to_string(opts.nproc)
                                             : "--gpus (" + std::to_string(p.local_workers) + " workers)";
  throw UsageError(flag + ": this machine has " + std::to_string(cores) + " cores and " + gib(available_bytes) +
                   " of memory available; " + std::to_string(p.local_workers) + " workers would need " +
                   gib(bytes_per_worker * p.local_workers) + " (" + gib(bytes_per_worker) +
                   " each, for the data set and the model)" +
                   (by_memory < p.local_workers ? "" : " and more than " + std::to_string(kPerCore) + " a core") +
                   "; at most " + std::to_string(fit) + " fit");
}

int64_t available_memory() {
  int64_t available = std::numeric_limits<int64_t>::max();
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    int64_t kib = 0;
    meminfo >> kib;
    if (key == "MemAvailable:") available = kib * 1024;
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  std::ifstream limit("/sys/fs/cgroup/memory.max");  // cgroup v2; "max" when none
  int64_t cgroup = 0;
  if (limit >> cgroup && cgroup > 0) {
    int64_t used = 0;
    std::ifstream("/sys/fs/cgroup/memory.current") >> used;
    available = std::min(available, std::max<int64_t>(0, cgroup - used));
  }
  return available;
}

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return machine_cores();  // more CPUs than a cpu_set_t holds
}

int threads_per_worker(int local_workers, int omp_num_threads) {
  if (omp_num_threads > 0) return omp_num_threads;
  // Its own cores where a launcher bound it (Slurm's or mpirun's binding), else its share of the machine's.
  return std::max(1, std::min(usable_cores(), machine_cores() / std::max(1, local_workers)));
}

}  // namespace mnist_ddp
