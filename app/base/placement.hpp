// Where a node's workers run: which backend, which devices, how many.
// Decided once, from the options, this build and the GPUs the environment
// shows, without initialising CUDA (the launcher forks after it): by our
// launcher for all its workers, or by a worker that another launcher
// (torchrun, Slurm) started, for itself.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "app/base/options.hpp"

namespace mnist_ddp {

struct Placement {
  std::string backend;       // "nccl" or "gloo"
  // CUDA ids, one per local worker; empty: the workers train on the CPU. Under
  // Gloo an id may repeat: those workers share the GPU.
  std::vector<int> devices;
  int local_workers = 0;
  int visible_gpus = 0;      // what this process sees
};

// GPUs a CUDA process would see, counted without initialising CUDA:
// `present` device files (/dev/nvidiaN), narrowed by CUDA_VISIBLE_DEVICES
// when it is set: its entries up to the first one that is not a device
// (an index, GPU-<uuid> or MIG-<uuid>), as CUDA reads it, so "", "-1" and
// Slurm's "NoDevFiles" mean none. A worker checks its device against CUDA's
// own count before using it.
int count_visible_gpus(const std::optional<std::string>& cuda_visible_devices, int present);
// The same for this machine: its /dev/nvidiaN files.
int count_visible_gpus(const std::optional<std::string>& cuda_visible_devices);

// Resolves --backend, --gpus and --nproc for this build and `visible_gpus`.
// Throws UsageError for a device that does not exist, NCCL without CUDA, or
// NCCL with a device listed twice.
Placement plan_placement(const Options& opts, int visible_gpus);
// The same for a build with or without CUDA.
Placement plan_placement(const Options& opts, bool cuda_build, int visible_gpus);

// The CUDA id local rank `local_rank` trains on, -1 for the CPU. A rank that
// sees exactly one GPU uses it whatever its local rank (Slurm's
// --gpus-per-task=1, one-GPU pods, CUDA_VISIBLE_DEVICES narrowed per task).
// Throws UsageError when the placement gives that rank no GPU.
int device_of_local_rank(const Placement& placement, int local_rank);

// Throws UsageError, naming the flag that set the number of workers
// (--nproc, or --gpus and the GPUs visible), when `p.local_workers`
// workers, each holding `bytes_per_worker` of memory, do not fit a machine
// of `cores` cores and `available_bytes` of available memory: more than 16
// workers a core, or more memory than is available.
void check_workers_fit(const Options& opts, const Placement& p, int64_t bytes_per_worker, int cores,
                       int64_t available_bytes);

// This machine's memory available to new processes: MemAvailable, or the
// cgroup's limit when that is less.
int64_t available_memory();

// The cores this process may run on: its CPU affinity (taskset, a Slurm
// or container cpuset), not every core of the machine; at least 1.
int usable_cores();

// Intra-op threads for a worker, one of `local_workers` on this machine,
// where no launcher of ours set them: `omp_num_threads` when positive
// ($OMP_NUM_THREADS), else its equal share of the machine's cores, at most
// the cores it may run on (a launcher that binds each worker to its own
// cores, or one whose workers share a cpuset, cannot be told apart here).
// Our launcher gives its workers their share of its own usable cores.
int threads_per_worker(int local_workers, int omp_num_threads);

}  // namespace mnist_ddp
