#include "mnist_ddp/placement.hpp"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>

#include "mnist_ddp/files.hpp"

namespace mnist_ddp {
namespace {

// GPUs a CUDA process would see, counted without initialising CUDA: the
// entries of CUDA_VISIBLE_DEVICES (up to the first invalid one, as CUDA reads
// it) or else the /dev/nvidiaN device files. A worker checks its device
// against CUDA's own count before using it.
int visible_gpu_count() {
  int present = 0;
  for (const std::string& name : files::list_directory("/dev")) {
    if (name.size() > 6 && name.compare(0, 6, "nvidia") == 0 &&
        std::all_of(name.begin() + 6, name.end(), ::isdigit))
      ++present;
  }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (!visible) return present;
  int listed = 0;
  std::string list = visible;
  for (size_t start = 0; start <= list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string item = list.substr(start, end - start);
    if (item.empty() || item[0] == '-') break;
    ++listed;
    start = end + 1;
  }
  return std::min(listed, present);
}

bool built_with_cuda() {
#ifdef MNIST_DDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

Placement plan_placement(const Options& opts) {
  return plan_placement(opts, built_with_cuda(), built_with_cuda() ? visible_gpu_count() : 0);
}

Placement plan_placement(const Options& opts, bool cuda_build, int visible) {
  Placement p;
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

int threads_per_worker(int local_workers) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  if (omp && std::atoi(omp) > 0) return std::atoi(omp);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, local_workers));
}

}  // namespace mnist_ddp
