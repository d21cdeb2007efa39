// One worker's run, from rendezvous to the last epoch.
#pragma once

#include "mnist_ddp/launcher.hpp"
#include "mnist_ddp/options.hpp"

namespace mnist_ddp {

// What the launcher checks before it starts any worker, so that a missing
// dataset or an unusable --path is one message, not one per worker. Creates
// --path. Throws DataError or std::runtime_error.
void preflight(const Options& opts);

// Runs this process as the worker `env` describes. Returns the exit code:
// 0, 2 for a usage error, 1 for any other error, which is reported as one
// line first.
int run_worker(const Options& opts, const WorkerEnv& env);

}  // namespace mnist_ddp
