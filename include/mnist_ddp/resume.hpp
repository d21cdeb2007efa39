// A run's checkpoints: what one holds besides the weights, how a run takes
// it back, and how a preemption signal becomes a step every rank stops at.
//
// Each call runs on the calling (training) thread. The ones marked
// "collective" go through the rank's collective stream and block until every
// rank has made the same call; call them from every rank in the same order.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>

#include "mnist_ddp/checkpoint.hpp"
#include "mnist_ddp/comm_hooks.hpp"
#include "mnist_ddp/dist.hpp"
#include "mnist_ddp/options.hpp"

namespace mnist_ddp {

// Where a run stands between two steps.
struct Position {
  int64_t epoch = 0;         // the epoch to continue in
  int64_t batch = 0;         // batches of it already trained
  int64_t step = 0;          // training steps finished
  double best_accuracy = 0;  // best test top-1 so far, in percent
};

// <path>/checkpoint.
std::string checkpoint_dir(const Options& opts);

// The checkpoint --resume names, or "" for a fresh start.
std::string resume_dir(const Options& opts);

// Collective. Rank 0 reads the checkpoint its --resume names (throws
// CheckpointError) and sends its files to every rank; each rank parses the
// same bytes. Rank 0 decides for all: nullopt on every rank when it starts
// afresh, whatever the other nodes' disks hold.
std::optional<Checkpoint> receive_checkpoint(const Options& opts, Dist& dist);

// What a checkpoint saves and restores besides the model's weights.
struct TrainingParts {
  torch::optim::SGD& optimizer;
  torch::OrderedDict<std::string, torch::Tensor> parameters;  // DDP's: "module.conv1.weight", ...
  CommHook& hook;
};

// Applies `c` to this rank: optimizer momentum; this rank's RNG streams and
// its own hook state when the world size is the checkpoint's; the shared
// hook state when the hook is. Logs what it resumes and what it cannot.
Position restore(const Checkpoint& c, const TrainingParts& parts, const Options& opts, const Dist& dist);

// Collective: every rank's RNG streams and own hook state go to rank 0,
// which returns the whole checkpoint of `model` at `at`; other ranks nullopt.
std::optional<Checkpoint> capture(const Position& at, const torch::nn::Module& model, const TrainingParts& parts,
                                  const Options& opts, const Dist& dist);

// Preemption. From catch_preemption_signals() on, SIGTERM and SIGUSR1 no
// longer end the process: they are noted, and a StopVote turns them into a
// step that every rank stops after.
void catch_preemption_signals();
// The preemption signal this process has caught, or 0.
int preemption_signal();

class StopVote {
 public:
  explicit StopVote(Dist& dist) : dist_(dist) {}
  // Collective, once after each training step on every rank: posts this
  // rank's vote (the signal it has seen, if any) and returns the signal the
  // ranks voted for a step earlier, or 0. The vote it reads was posted a
  // step ago, so no rank waits for another.
  int after_step();

 private:
  Dist& dist_;
  torch::Tensor votes_;  // [SIGTERM seen, SIGUSR1 seen], summed over ranks
  Collectives::Ticket ticket_ = 0;
};

}  // namespace mnist_ddp
