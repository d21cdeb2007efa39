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

#include "mnist_ddp/data.hpp"
#include "mnist_ddp/ddp.hpp"
#include "mnist_ddp/dist.hpp"
#include "mnist_ddp/options.hpp"
#include "mnist_ddp/report.hpp"
#include "mnist_ddp/resume.hpp"

namespace mnist_ddp {

class Trainer {
 public:
  // Loads the data, builds the model, DDP and the optimizer, and resumes
  // from the checkpoint --resume names. Logs the reference's start-up lines.
  Trainer(const Options& opts, Dist& dist);
  // Trains to --epochs (or --max-steps), then reports and waits for every
  // rank. Returns 0; or, when a preemption signal (SIGTERM, SIGUSR1) reached
  // any rank, that signal, once every rank has finished the same step and a
  // checkpoint of that step is written.
  int run();

 private:
  EpochReport train_epoch(int64_t epoch);
  // One step on the batch; returns the loss, still on the device.
  torch::Tensor step(const torch::Tensor& x, const torch::Tensor& y, torch::Tensor& output);
  void log_train(EpochReport& report, int64_t batch, int64_t batches, const torch::Tensor& loss,
                 const torch::Tensor& output, const torch::Tensor& labels);
  void test(EpochReport& report);
  void save_checkpoint();
  // Checkpoints the current step and logs why: preempted by `sig`. Returns it.
  int stop(int sig);
  void finish();
  bool max_steps_reached() const { return opts_.max_steps > 0 && at_.step >= opts_.max_steps; }
  TrainingParts parts() { return {*optimizer_, ddp_->named_parameters(), ddp_->hook()}; }

  const Options& opts_;
  Dist& dist_;
  StopVote stop_vote_;
  Dataset train_, test_;
  DistributedSampler sampler_;
  torch::Tensor test_indices_;
  DistributedDataParallel ddp_{nullptr};
  std::unique_ptr<torch::optim::SGD> optimizer_;
  const int64_t kill_after_step_, pause_after_step_;  // tests' fault injection (trainer.cpp); -1: none
  Position at_;
  StepStats stats_;
  int replica_checks_ = 0;
  int stop_signal_ = 0;  // the preemption signal the ranks agreed to stop on
  std::optional<MetricsFile> metrics_;  // rank 0
  std::optional<RunSummary> summary_;   // rank 0
};

}  // namespace mnist_ddp
