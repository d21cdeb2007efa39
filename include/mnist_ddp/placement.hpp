// Where a node's workers run: which backend, which devices, how many.
// Decided from the options and what this build and machine offer, without
// initialising CUDA (the launcher forks after it).
#pragma once

#include <vector>

#include "mnist_ddp/options.hpp"

namespace mnist_ddp {

struct Placement {
  std::string backend;       // "nccl" or "gloo"
  // CUDA ids, one per local worker; empty: the workers train on the CPU. Under
  // Gloo an id may repeat: those workers share the GPU.
  std::vector<int> devices;
  int local_workers = 0;
};

// Resolves --backend, --gpus and --nproc for this build and the GPUs visible
// to it. Throws UsageError for a device that does not exist, NCCL without
// CUDA, or NCCL with a device listed twice.
Placement plan_placement(const Options& opts);
// The same for a build with or without CUDA and `visible_gpus` GPUs.
Placement plan_placement(const Options& opts, bool cuda_build, int visible_gpus);

// Intra-op threads for each of `local_workers` processes sharing this
// machine's cores: OMP_NUM_THREADS when it is set, else an equal share.
int threads_per_worker(int local_workers);

}  // namespace mnist_ddp
