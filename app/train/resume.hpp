// A run's checkpoints: what one holds besides the weights, and how a run
// takes it back.
//
// Each call runs on the calling (training) thread. The ones marked
// "collective" go through the rank's collective stream and block until every
// rank has made the same call; call them from every rank in the same order.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>

#include "app/train/checkpoint.hpp"
#include "mnist_ddp/parallel/amp.hpp"
#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "app/base/options.hpp"

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

// The checkpoint --resume names, or "" for a fresh start: --resume auto
// starts afresh only when <path>/checkpoint does not exist or holds no
// manifest (nothing, or a first save cut short before its manifest);
// anything else is resumed from, or refused saying why.
std::string resume_dir(const Options& opts);

// Throws UsageError, naming the flag and the ways out, when this run cannot
// go on from `c` (read from `dir`): a checkpoint of another --dataset,
// whose position and best accuracy mean nothing here. Every other change
// is taken (restore() says how).
void check_resumable(const Checkpoint& c, const Options& opts, const std::string& dir);

// The batch of its epoch (a step's `accumulate` micro-batches of
// `batch_size` images per rank) at which a run with `world_size` ranks goes
// on from `c`: past as many of the epoch's images as the checkpoint's
// batches took, rounded up to a whole step. The checkpoint's own batch when
// nothing changed. May be at or past the epoch's last batch: the epoch is
// then complete.
int64_t resumed_batch(const Checkpoint& c, int64_t batch_size, int world_size, int accumulate = 1);

// Collective. Rank 0 reads the checkpoint its --resume names (throws
// CheckpointError) and sends its files to every rank; each rank parses the
// same bytes and checks them (check_resumable). Rank 0 decides for all:
// nullopt on every rank when it starts afresh, whatever the other nodes'
// disks hold.
std::optional<Checkpoint> receive_checkpoint(const Options& opts, ProcessGroup& group);

// What a checkpoint saves and restores besides the model's weights.
struct TrainingParts {
  torch::optim::SGD& optimizer;
  torch::OrderedDict<std::string, torch::Tensor> parameters;  // DDP's: "module.conv1.weight", ...
  hooks::CommHook& hook;
  GradScaler* scaler = nullptr;  // --amp fp16's loss scale
};

// Applies `c` to this rank: optimizer momentum; this rank's RNG streams and
// its own hook state when the world size is the checkpoint's; the shared
// hook state when the hook and its settings (PowerSGD's knobs, the bucket
// size) are. Returns the position to go on from, its batch as
// resumed_batch() maps it. Rank 0 logs what it resumes and what it cannot
// (another world size, batch size, seed or hook); docs/design.md,
// "Resuming under other settings", says what a resumed run trains.
Position restore(const Checkpoint& c, const TrainingParts& parts, const Options& opts, const ProcessGroup& group);

// Collective: every rank's RNG streams and own hook state go to rank 0,
// which returns the whole checkpoint of `model` (the module DDP wraps: its
// names are saved with "module." before them, as PyTorch's DDP has them) at
// `at`, recording the run's `arguments`; other ranks nullopt.
std::optional<Checkpoint> capture(const Position& at, const torch::nn::Module& model, const TrainingParts& parts,
                                  const Options& opts, const Arguments& arguments, const ProcessGroup& group);

}  // namespace mnist_ddp
