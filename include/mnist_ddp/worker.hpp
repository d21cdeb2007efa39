// A worker process: this binary started by a launcher (ours, torchrun or
// Slurm) to be one rank of the job, from its first tensor to its exit code.
#pragma once

#include "mnist_ddp/launcher.hpp"
#include "mnist_ddp/options.hpp"

namespace mnist_ddp {

// What the launcher checks before it starts any worker, so that a missing
// dataset, an unusable --path or a broken checkpoint is one message, not one
// per worker. Creates --path. Throws DataError, CheckpointError or
// std::runtime_error.
void preflight(const Options& opts);

// Sets up a worker process before its first tensor: intra-op threads that
// share the cores among `local_workers` processes (unless OMP_NUM_THREADS
// says otherwise), and an allocator that keeps freed memory for reuse.
void configure_worker_process(int local_workers);

// Runs this process as the worker `env` describes: joins the job, trains,
// and leaves. Returns 0, or 128 + the signal when SIGTERM or SIGUSR1 stopped
// training at a checkpointed step; on an error reports it as one line (to
// the launcher when one listens) and exits the process at once with 2 for
// a usage error, 1 for any other.
int run_worker(const Options& opts, const WorkerEnv& env);

}  // namespace mnist_ddp
