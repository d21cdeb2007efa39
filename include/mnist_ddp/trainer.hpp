// One worker's run, from rendezvous to the last epoch.
#pragma once

#include "mnist_ddp/launcher.hpp"
#include "mnist_ddp/options.hpp"

namespace mnist_ddp {

// What the launcher checks before it starts any worker, so that a missing
// dataset or an unusable --path is one message, not one per worker. Creates
// --path. Throws DataError or std::runtime_error.
void preflight(const Options& opts);

// Sets up a worker process before its first tensor: intra-op threads that
// share the cores among `local_workers` processes (unless OMP_NUM_THREADS
// says otherwise), and an allocator that keeps freed memory for reuse.
void configure_worker_process(int local_workers);

// Runs this process as the worker `env` describes. Returns the exit code:
// 0, 2 for a usage error, 1 for any other error, which is reported as one
// line first.
int run_worker(const Options& opts, const WorkerEnv& env);

}  // namespace mnist_ddp
