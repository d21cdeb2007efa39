// The launcher: the parent process that starts and supervises one node's
// workers. It never initialises CUDA; each worker is this binary exec'ed
// (or, for mnist_ddp run, the user's program) with the environment
// worker_environment() builds (environment.hpp), which
// init_process_group() reads back.
//
// SIGINT/SIGHUP to the launcher print the reference's "KeyboardInterrupt
// received. Terminating processes..." and stop every worker (SIGTERM, then
// SIGKILL after a grace period); SIGTERM/SIGUSR1 (preemption) are passed on,
// and the workers get 60 s to checkpoint; a worker that fails stops the
// others, and the launcher prints the one line that says why. Every worker
// is reaped before the launcher returns (supervisor.hpp).
//
// Node 0's launcher hosts the job's store; every launcher starts its
// workers in rounds (0, then one more per --max-restarts restart), which
// every node agrees on through that store (restart_rounds.hpp).
#pragma once

#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "base/environment.hpp"
#include "app/base/files.hpp"
#include "app/base/options.hpp"
#include "app/base/placement.hpp"

namespace mnist_ddp {

// What the launcher checks before it starts any worker, so that a missing
// dataset, an unusable or busy --path or a broken checkpoint is one message,
// not one per worker. Creates --path, says so, and takes it for this job:
// the returned lock is held while it lives. Throws DataError,
// CheckpointError or std::runtime_error.
std::unique_ptr<files::DirectoryLock> preflight(const Options& opts);

// Runs the launcher on the calling thread until every worker has exited;
// block_launcher_signals() (supervisor.hpp) must have run, and
// `original_mask` is what it returned (the workers start with it). Returns
// the process exit code: 0 on success, the failed worker's exit code (128 +
// signal when it was killed), 128 + signal when the launcher was
// interrupted, 1 for its own errors.
int run_launcher(const Options& opts, const Placement& placement, const Environment& env,
                 const std::vector<std::string>& argv, const sigset_t& original_mask);

// The same for `mnist_ddp run`: `program` (PROGRAM and its arguments;
// PROGRAM found on $PATH unless it names a file) as every worker, with the
// environment init_process_group() reads. A restart starts PROGRAM again as
// it was given: resuming is the program's own.
int run_program(const Options& opts, const Placement& placement, const Environment& env,
                const std::vector<std::string>& program, const sigset_t& original_mask);

// The file `name` runs: itself when it holds a '/', else the first
// executable of that name on env's PATH. Throws UsageError for none.
std::string find_program(const std::string& name, const Environment& env);

}  // namespace mnist_ddp
