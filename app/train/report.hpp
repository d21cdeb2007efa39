// What a run reports besides its log lines, all on rank 0 and all on the
// calling thread, none of it blocking on other ranks:
//   <path>/metrics.csv   a row per logged training step and per test pass,
//                        flushed as it is written, for plots;
//   <path>/summary.json  the run as data (docs/summary-json.md), rewritten
//                        atomically after every epoch and at the end, for
//                        scripts and tests: numbers at full precision, never
//                        read back from the log;
//   the progress line    under the log on a terminal (logging.hpp).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "app/base/files.hpp"
#include "app/base/options.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "comm/runtime.hpp"

namespace mnist_ddp {

// summary.json's values: objects keep their keys in insertion order.
using Json = nlohmann::ordered_json;

// <path>/metrics.csv on rank 0. A resumed run keeps the rows up to the step
// it resumes from. A training row's speed and bytes cover the steps counted
// since the previous row (or since restart_rows()).
class MetricsFile {
 public:
  static constexpr const char* kHeader = "epoch,step,split,loss,top1,top5,lr,images_per_s,wire_bytes_per_step";

  static constexpr const char* kFile = "metrics.csv";

  // `resumed_step` < 0: a fresh run, the file starts empty.
  MetricsFile(const files::Directory& dir, int64_t resumed_step);
  void restart_rows();  // at the start of an epoch
  void count_step(int64_t images, int64_t wire_bytes);
  void train(int64_t epoch, int64_t step, double loss, double top1, double top5, double lr);
  void test(int64_t epoch, int64_t step, double loss, double top1, double top5, double lr);

 private:
  files::AppendFile out_;
  std::chrono::steady_clock::time_point row_start_ = std::chrono::steady_clock::now();
  int64_t row_images_ = 0, row_steps_ = 0, row_bytes_ = 0;  // all ranks' images; this rank's bytes
};

// "Epoch 3 [=======>            ] 640/1875  1234 images/s  loss 0.2345  ETA 1:05"
std::string progress_line(int64_t epoch, int64_t done, int64_t total, double images_per_s, double loss,
                          double eta_seconds);

// Where the training steps' time went, and what they sent: this run's
// steps only, not those before the checkpoint it resumed from.
struct StepStats {
  int64_t steps = 0;
  int64_t images = 0;  // over all ranks
  double seconds = 0, forward = 0, backward = 0, waiting = 0, optimizer = 0;
  int64_t wire_bytes = 0;        // all steps
  int64_t compressed_steps = 0;  // once the hook compressed fully...
  int64_t compressed_bytes = 0;  // ...and what those steps sent
  int64_t compression_started_at = -1;  // the step it started at; -1: not in this run

  // Counts a step: its seconds in forward, backward and the optimizer, of
  // which `waiting` on communication, and what it sent.
  void add_step(double forward_s, double backward_s, double optimizer_s, double waiting_s, int64_t sent,
                bool compressed);
  // Bytes on the wire per step once compression started; if it never did,
  // over every step (what the plain allreduce sends).
  double bytes_per_step() const;
};

// The end-of-run log lines: where a step's time went, and what the hook
// `hook` sent against `uncompressed_bytes_per_step` (what `none` sends).
// Nothing when no step ran.
void log_training(const StepStats& s, int64_t uncompressed_bytes_per_step, const std::string& hook,
                  int64_t start_powersgd_iter);

// A training epoch's (or, cut short by --max-steps, part epoch's) figures.
struct EpochReport {
  int64_t epoch = 0;
  int64_t steps = 0;    // steps of this epoch trained in this run
  int64_t end_step = 0; // the global step count when it ended
  double seconds = 0;
  double images_per_s = 0;
  double lr = 0;
  int64_t wire_bytes_per_step = 0;
  double train_loss = 0, train_top1 = 0, train_top5 = 0;  // the last logged step's, averaged over ranks
  double test_loss = 0, test_top1 = 0, test_top5 = 0;     // the whole test set
};

// Where a resumed run took up: its checkpoint and position.
struct ResumedFrom {
  std::string dir;
  int64_t epoch = 0, batch = 0, step = 0;
};

// summary.json's opening: the run's arguments (as in effect), runtime and
// world (`nnodes` machines), and where it resumed from (null for a fresh
// start).
Json summary_head(const Arguments& arguments, const Runtime& runtime, const ProcessGroup& group, int nnodes,
                  const std::optional<ResumedFrom>& resumed);

// summary.json: starts with what is known at start-up, gains an entry per
// epoch, ends with the step-time split and the compression figures. Rank 0
// holds one; write() replaces the file atomically.
class RunSummary {
 public:
  // A resumed run (`resumed_epoch` >= 0) keeps the earlier run's epochs
  // before `resumed_epoch` from the summary.json already in `path`.
  static constexpr const char* kFile = "summary.json";

  // `dir` (the run's, --path) outlives the summary.
  RunSummary(const files::Directory& dir, Json head, int64_t resumed_epoch);
  void set(const std::string& key, Json value) { root_[key] = std::move(value); }
  void add_epoch(const EpochReport& e, double best_test_top1);
  void finish(const StepStats& s, int64_t uncompressed_bytes_per_step, const std::string& hook, int world_size,
              int replica_checks);
  void write() const;

 private:
  const files::Directory& dir_;
  Json root_ = Json::object();
};

}  // namespace mnist_ddp
