// Fault injection for tests: named points at which a worker kills or holds
// itself, so that a crash test lands where it means to, however fast or slow
// the machine is, instead of after a delay.
//
// faults_from() reads them once from the process's environment; the trainer
// is handed the value and asks it at each point. An empty Faults
// (the default, and every real run) injects nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/environment.hpp"

namespace mnist_ddp {

struct Faults {
  // Step `step` of rank `rank` in the job's start `restart` of its workers
  // (0, then one more per restart).
  struct AtStep {
    int restart = 0;
    int rank = 0;
    int64_t step = 0;
  };
  // MNIST_DDP_KILL_AT_WRITE=N: rank 0 kills itself (SIGKILL) right after the
  // N-th file operation of checkpointing in this process; 0: never.
  int kill_at_write = 0;
  // MNIST_DDP_KILL_AFTER_STEP=R:K:S[,R:K:S...]: the rank kills itself
  // (SIGKILL) right after training that step.
  std::vector<AtStep> kill_after_step;
  // MNIST_DDP_PAUSE_AFTER_STEP=R:K:S[,...]: the rank waits after that step
  // (up to 5 minutes) until a preemption signal reaches it, so a preemption
  // test signals a job that is surely mid-run.
  std::vector<AtStep> pause_after_step;
  // MNIST_DDP_HOLD_WORKERS_UNTIL=PATH: the launcher, its store open, starts
  // nothing until PATH exists (up to 60 s), so that what a test does to
  // the store comes before any read of it.
  std::string hold_workers_until;
  // MNIST_DDP_WITHOUT_CGROUP=1: the launcher makes no cgroup, and its
  // watcher finds the job by its token alone, as where none can be made
  // (containment.hpp).
  bool without_cgroup = false;

  // The step of `points` for this start and rank; -1 when none.
  static int64_t step_for(const std::vector<AtStep>& points, int restart, int rank);
  // Parses "R:K:S[,R:K:S...]"; entries that do not parse are ignored.
  static std::vector<AtStep> parse_steps(const std::string& spec);
};

// The faults `env` asks for (MNIST_DDP_KILL_AT_WRITE, ...).
Faults faults_from(const Environment& env);

}  // namespace mnist_ddp
