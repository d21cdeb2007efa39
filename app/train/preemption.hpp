// Preemption: a SIGTERM, SIGHUP or SIGUSR1 (from a scheduler, or passed on
// by the launcher) becomes a step that every rank stops after, and rank 0
// checkpoints. The votes travel on the job's quick lane.
//
// From catch_preemption_signals() on, those signals no longer end the
// process: they are noted. After each step every rank posts its note to a
// small allreduce (StopVote) and reads the result of the one posted a step
// earlier, so no rank waits for another and all stop after the same step.
#pragma once

#include <torch/torch.h>

#include <string>

#include "mnist_ddp/comm/process_group.hpp"
#include "comm/collectives.hpp"

namespace mnist_ddp {

void catch_preemption_signals();
// The preemption signal this process has caught, or 0.
int preemption_signal();
// "SIGTERM", "SIGHUP", "SIGUSR1", or "signal N".
std::string signal_name(int sig);

class StopVote {
 public:
  explicit StopVote(ProcessGroup& group) : group_(group) {}
  // Collective, once after each training step on every rank: posts this
  // rank's vote (the signal it has seen, if any) and returns the signal the
  // ranks voted for a step earlier, or 0. The vote it reads was posted a
  // step ago, so no rank waits for another.
  int after_step();

 private:
  ProcessGroup& group_;
  torch::Tensor votes_;  // [SIGTERM seen, SIGHUP seen, SIGUSR1 seen], summed over ranks
  CollectiveStream::Ticket ticket_ = 0;
};

}  // namespace mnist_ddp
