// The launcher: the parent process that starts and supervises one node's
// workers. It never initialises CUDA, and a forked child only execs: each worker is this binary
// exec'ed with the environment worker_environment() builds (worker_env.hpp).
//
// Supervision: SIGINT/SIGHUP to the launcher print the reference's
// "KeyboardInterrupt received. Terminating processes..." and stop every
// worker (SIGTERM, then SIGKILL after a grace period); SIGTERM/SIGUSR1
// (preemption) are passed on, and the workers get 60 s to checkpoint; a worker that fails
// stops the others, and the launcher prints the one line that says why
// (the worker's own report, preferring a cause over an echo of it); workers
// get SIGKILL when the launcher dies (PR_SET_PDEATHSIG). Every worker is
// reaped before the launcher returns.
//
// Node 0's launcher hosts the job's store; every launcher starts its workers
// in rounds (0, then one more per --max-restarts restart), which every node
// joins through that store before its workers start again.
#pragma once

#include <signal.h>

#include <string>
#include <vector>

#include "mnist_ddp/options.hpp"
#include "mnist_ddp/placement.hpp"
#include "mnist_ddp/worker_env.hpp"

namespace mnist_ddp {

// Blocks, in the calling thread, the signals the launcher reads from its
// signalfd (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGCHLD), and returns the mask
// it had. Called first thing in main(): every thread started later (the
// OpenMP pool a checkpoint's tensors are copied on, the store's) inherits
// the block, so none of them can take a signal and drop it.
sigset_t block_launcher_signals();

// Runs the launcher on the calling thread until every worker has exited;
// block_launcher_signals() must have run, `original_mask` is what it returned
// (the workers start with it). Returns the process exit code: 0 on success,
// the failed worker's exit code (128 + signal when it was killed), 128 +
// signal when the launcher was interrupted, 1 for its own errors.
int run_launcher(const Options& opts, const Placement& placement, const std::vector<std::string>& argv,
                 const sigset_t& original_mask);

}  // namespace mnist_ddp
