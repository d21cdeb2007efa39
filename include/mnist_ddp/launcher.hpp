// The launcher: the parent process that starts and supervises the workers.
//
// A worker is this same binary, exec'ed with the environment torchrun would
// give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT). So a worker started by us and one started by an external
// launcher run the same code, and the launcher itself never initialises CUDA,
// thread pools or LibTorch state before it forks.
//
// Supervision: SIGINT/SIGTERM/SIGHUP to the launcher print the reference's
// "KeyboardInterrupt received. Terminating processes..." and stop every
// worker (SIGTERM, then SIGKILL after a grace period); a worker that fails
// stops the others; workers get SIGKILL when the launcher dies
// (PR_SET_PDEATHSIG). Every worker is reaped before the launcher returns.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mnist_ddp/options.hpp"

namespace mnist_ddp {

// Where the local workers run.
struct Placement {
  std::string backend;       // "nccl" or "gloo"
  // CUDA ids, one per local worker; empty: the workers train on the CPU. Under
  // Gloo an id may repeat: those workers share the GPU.
  std::vector<int> devices;
  int local_workers = 0;
};

// Resolves --backend, --gpus and --nproc without initialising CUDA, for this
// build and the GPUs visible to it. Throws UsageError for a device that does
// not exist, NCCL without CUDA, or NCCL with a device listed twice.
Placement plan_placement(const Options& opts);
// The same for a build with or without CUDA and `visible_gpus` GPUs.
Placement plan_placement(const Options& opts, bool cuda_build, int visible_gpus);

// A worker's place in the job, as read from its environment: torchrun's
// variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK),
// Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; node 0 is the first
// host of SLURM_JOB_NODELIST unless MASTER_ADDR says), or our launcher's,
// which leaves RANK and WORLD_SIZE to be agreed through the store.
struct WorkerEnv {
  int rank = -1;        // -1: agreed through the store (see dist.hpp)
  int world_size = -1;  // likewise
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  int nnodes = 1;
  std::string master_addr;
  int master_port = 0;
  // Set by our launcher on rank 0 when --master-port is 0: rank 0 binds a free
  // port and writes its number to this file descriptor.
  int port_report_fd = -1;
  // Set by our launcher: a failing worker writes "<rank>\t<message>\n" here
  // instead of printing it, so the user reads one line, not one per worker.
  int error_report_fd = -1;
};

// The first host of a Slurm node list: "gpu[003-005,010],cpu7" -> "gpu003".
std::string first_slurm_host(const std::string& nodelist);

// Reports a worker's fatal error, naming it by `rank` when the job has
// agreed on ranks (-1 before): to the launcher when it listens, else on stderr.
// `echo`: the error only follows from another process's failure (PeerLost).
void report_worker_error(const WorkerEnv& env, int rank, const std::string& message, bool echo);

// The worker identity when this process was started as a worker (by our
// launcher or an external one); nullopt when it should be the launcher.
// Throws UsageError for a malformed environment.
std::optional<WorkerEnv> worker_env_from_environment();

// Runs the launcher: starts the workers, supervises them, reaps them.
// Returns the process exit code: 0 on success, the failed worker's exit code
// (128 + signal when it was killed), 128 + signal when the launcher was
// interrupted, 1 for its own errors.
int run_launcher(const Options& opts, const Placement& placement, const std::vector<std::string>& argv);

}  // namespace mnist_ddp
