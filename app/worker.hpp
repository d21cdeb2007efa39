// A worker process: this binary started by a launcher (ours, torchrun,
// Slurm, mpirun, mpiexec, a Kubeflow pod) to be one rank of the job, from
// its first tensor to its exit code.
#pragma once

#include "base/environment.hpp"
#include "app/base/options.hpp"

namespace mnist_ddp {

// Sets up a worker process before its first tensor: `threads` intra-op
// threads (threads_per_worker(), placement.hpp), and an allocator that
// keeps freed memory for reuse.
void configure_worker_process(int threads);

// Runs this process as the worker `worker` describes (`env` is the
// process's environment, launched_worker() read it): joins the job, trains,
// and leaves. Returns 0, or 128 + the signal when SIGTERM or SIGUSR1
// stopped training at a checkpointed step; on an error reports it as one
// line (to the launcher when one listens) and exits the process at once
// with 2 for a usage error, 1 for any other.
int run_worker(const Options& opts, const Environment& env, const WorkerEnv& worker);

}  // namespace mnist_ddp
