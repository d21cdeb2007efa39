// One worker's training run, once it has joined the job: the reference's
// loop (train an epoch, test, checkpoint) over our DDP, SyncBatchNorm and
// communication hook.
//
// Everything runs on the calling thread, and every call below talks to the
// other ranks through the collective stream: every rank constructs a Trainer
// and calls run() together.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>

#include "app/base/faults.hpp"
#include "app/base/files.hpp"
#include "app/base/options.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "app/train/data.hpp"
#include "mnist_ddp/parallel/amp.hpp"
#include "mnist_ddp/parallel/distributed.hpp"
#include "app/train/model.hpp"
#include "app/train/preemption.hpp"
#include "app/train/report.hpp"
#include "app/train/resume.hpp"

namespace mnist_ddp {

using NetDdp = DistributedDataParallel<NetImpl>;

// What a worker knows of its run besides the options.
struct RunContext {
  // The options as the run uses them: the command line, with what a
  // launcher's environment decided in place (options.hpp). Logged, and
  // kept in summary.json and in checkpoints.
  Arguments arguments;
  int nnodes = 1;          // machines in the job
  double launch_time = 0;  // when the job was launched, seconds since the Unix epoch
  Faults faults;           // the tests' fault injection; none in a real run
};

// --amp's dtype (bf16: bfloat16, fp16: float16).
c10::ScalarType amp_dtype(const Options& opts);
// Throws UsageError, naming what would work, when this LibTorch cannot run
// --amp on `device` (fp16 autocast on a CPU LibTorch without it).
void check_amp(const Options& opts, const torch::Device& device);

class Trainer {
 public:
  // Loads the data, builds the model, DDP and the optimizer, and resumes
  // from the checkpoint --resume names. Logs the reference's start-up lines.
  Trainer(const Options& opts, const RunContext& run, ProcessGroup& group);
  // Trains to --epochs (or --max-steps), then reports and waits for every
  // rank. Returns 0; or, when a preemption signal (SIGTERM, SIGUSR1) reached
  // any rank, that signal, once every rank has finished the same step and a
  // checkpoint of that step is written.
  int run();

 private:
  EpochReport train_epoch(int64_t epoch);
  // One step on the batch; returns the loss, still on the device.
  // One optimizer step on the step's images x, y (--accumulate micro-batches
  // of them); returns the loss, still on the device, and the last
  // micro-batch's output and labels.
  torch::Tensor step(const torch::Tensor& x, const torch::Tensor& y, torch::Tensor& output, torch::Tensor& labels);
  void log_train(EpochReport& report, int64_t batch, int64_t batches, const torch::Tensor& loss,
                 const torch::Tensor& output, const torch::Tensor& labels);
  void test(EpochReport& report);
  void save_checkpoint();
  // Checkpoints the current step and logs why: preempted by `sig`. Returns it.
  int stop(int sig);
  void finish();
  bool max_steps_reached() const { return opts_.max_steps > 0 && at_.step >= opts_.max_steps; }
  TrainingParts parts();

  const Options& opts_;
  const RunContext& run_;
  ProcessGroup& group_;
  StopVote stop_vote_;
  Dataset train_, test_;
  DistributedSampler sampler_;
  torch::Tensor test_indices_;
  std::optional<NetDdp> ddp_;
  std::unique_ptr<torch::optim::SGD> optimizer_;
  std::optional<c10::ScalarType> amp_dtype_;  // --amp: autocast to it over forward and loss
  std::optional<GradScaler> scaler_;          // --amp fp16
  const int64_t kill_after_step_, pause_after_step_;  // run_.faults for this rank; -1: none
  int checkpoint_writes_ = 0;  // file operations of checkpointing, for run_.faults.kill_at_write
  Position at_;
  StepStats stats_;
  int replica_checks_ = 0;
  int stop_signal_ = 0;  // the preemption signal the ranks agreed to stop on
  bool finished_ = false;  // resumed from a checkpoint that has nothing left to train
  std::string lineage_;    // its checkpoint files' (checkpoint.hpp): the resumed manifest's, or a new one
  std::optional<files::RunDirectory> dir_;  // rank 0: --path
  std::optional<MetricsFile> metrics_;  // rank 0
  std::optional<RunSummary> summary_;   // rank 0
};

}  // namespace mnist_ddp
