#include "app/train/trainer.hpp"

#include <signal.h>
#include <spdlog/spdlog.h>

#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <thread>

#include "base/environment.hpp"
#include "app/base/files.hpp"
#include "app/base/logging.hpp"
#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "app/train/model.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "comm/group.hpp"
#include "comm/runtime.hpp"

namespace mnist_ddp {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
double seconds_since(Clock::time_point start) { return seconds_between(start, Clock::now()); }

// Throws, naming where, when the loss is NaN or infinite.
void check_finite(double loss, const Options& opts, const Position& at) {
  if (std::isfinite(loss)) return;
  const std::string dir = checkpoint_dir(opts);
  throw std::runtime_error(fmt::format(
      "the loss is {} at epoch {}, step {} (batch {}): training diverged; try a smaller --lr{}", loss, at.epoch, at.step,
      at.batch, has_checkpoint(dir) ? "; the last checkpoint in " + dir + " is intact" : ""));
}

// Samples whose label is the top prediction, and among the top five.
std::pair<torch::Tensor, torch::Tensor> correct_counts(const torch::Tensor& output, const torch::Tensor& target) {
  const auto top = std::get<1>(output.topk(std::min<int64_t>(5, output.size(1)), 1));
  const auto hit = top.eq(target.view({-1, 1}));
  return {hit.select(1, 0).sum(), hit.sum()};
}

// A run that starts afresh never writes over an earlier run's best model:
// it keeps it beside its own, under the first free mnist_model.kept-<n>.pt.
void keep_earlier_model(const files::Directory& dir) {
  if (!dir.has("mnist_model.pt")) return;
  std::string kept;
  for (int n = 1; kept.empty() || dir.has(kept); ++n) kept = "mnist_model.kept-" + std::to_string(n) + ".pt";
  dir.rename("mnist_model.pt", kept);
  spdlog::warn("{} holds an earlier run's best model, and this run starts afresh: it is kept as {}",
               dir.path_of("mnist_model.pt"), dir.path_of(kept));
}

// Cosine annealing to 0 over --epochs, stepped once per epoch.
double cosine_lr(const Options& opts, int64_t epoch) {
  return opts.lr * (1 + std::cos(M_PI * static_cast<double>(epoch) / static_cast<double>(opts.epochs))) / 2;
}

double current_lr(torch::optim::SGD& optimizer) { return optimizer.param_groups()[0].options().get_lr(); }

void pause_until_preempted(int64_t step) {
  spdlog::info("Paused after step {} until a preemption signal (MNIST_DDP_PAUSE_AFTER_STEP)", step);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  while (!preemption_signal() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

// The reference's Net with the checkpoint's weights (DDP then broadcasts
// rank 0's), BatchNorm made synchronous, then DDP and its hook. Leaves the
// default generator seeded for this rank's dropout.
// SyncBatchNorm keeps the buffers identical on every rank (exact math), so
// DDP need not broadcast them before each forward.
NetDdp build_model(const Options& opts, ProcessGroup& group, const std::optional<Checkpoint>& resumed) {
  torch::manual_seed(opts.seed);
  Net net;
  if (resumed) load_state_dict(*net, resumed->model, "module.", "checkpoint " + resume_dir(opts));
  convert_sync_batchnorm(net, group);
  net->to(group.device());
  NetDdp ddp(net, group, DdpOptions().bucket_cap_mb(opts.bucket_cap_mb).broadcast_buffers(false));
  ddp.register_comm_hook(make_comm_hook(opts.compression, opts.powersgd));
  for (const auto& line : ddp.describe_buckets()) spdlog::info("DDP {}", line);
  spdlog::info("Communication hook: {}", ddp.comm_hook().name());
  if (opts.compression.find("powersgd") != std::string::npos) {
    const auto& p = opts.powersgd;
    spdlog::info(
        "PowerSGD config: matrix_approximation_rank = {}; start_powerSGD_iter = {}; min_compression_rate = {}; "
        "use_error_feedback = {}; warm_start = {}; orthogonalization_epsilon = {}; random_seed = {}",
        p.matrix_approximation_rank(), p.start_powersgd_iter(), p.min_compression_rate(), p.use_error_feedback(),
        p.warm_start(), p.orthogonalization_epsilon(), p.random_seed());
  }
  // Dropout draws differ across ranks, as they would in separate processes.
  torch::manual_seed(opts.seed + 1000 * static_cast<uint64_t>(group.rank() + 1));
  return ddp;
}

// Evaluation on the CPU forwards at most this many images at once. In
// eval mode each image's output is its own, so slicing changes no result;
// it does change the time: a 256-image forward of Net on one thread costs
// 12x the same images in 64s (LibTorch 1.13, docs/performance.md).
constexpr int64_t kCpuEvalImages = 64;

// The whole test set's loss, top-1 and top-5 in percent: each rank passes
// over its shard in `batch`es, then one allreduce adds the shards' sums
// (disjoint shards, so every image counts once).
std::array<double, 3> test_metrics(NetDdp& ddp, const Dataset& data, const torch::Tensor& indices,
                                   int64_t batch, ProcessGroup& group) {
  if (group.device().is_cpu()) batch = std::min(batch, kCpuEvalImages);
  ddp.eval();
  torch::NoGradGuard no_grad;
  double local[4] = {0, 0, 0, 0};  // loss, top-1 hits, top-5 hits, images
  for (int64_t b = 0; b < num_batches(indices.size(0), batch); ++b) {
    auto [x, y] = get_batch(data, indices, b, batch);
    x = x.to(group.device(), true);
    y = y.to(group.device(), true);
    const torch::Tensor output = ddp.forward(x);
    const auto [top1, top5] = correct_counts(output, y);
    local[0] += torch::nll_loss(output, y, {}, at::Reduction::Sum).item<double>();
    local[1] += static_cast<double>(top1.item<int64_t>());
    local[2] += static_cast<double>(top5.item<int64_t>());
    local[3] += static_cast<double>(y.size(0));
  }
  auto sums = torch::tensor({local[0], local[1], local[2], local[3]}, torch::kFloat64).to(group.device());
  quick_stream(group)->allreduce_sum(sums, "the test metrics");
  sums = sums.cpu();
  const auto s = sums.accessor<double, 1>();
  return {s[0] / s[3], 100.0 * s[1] / s[3], 100.0 * s[2] / s[3]};
}

}  // namespace

c10::ScalarType amp_dtype(const Options& opts) { return opts.amp == "bf16" ? torch::kBFloat16 : torch::kHalf; }

void check_amp(const Options& opts, const torch::Device& device) {
  if (opts.amp == "none") return;
  if (const std::string why = autocast_unsupported(device, amp_dtype(opts)); !why.empty())
    throw UsageError("--amp " + opts.amp + ": " + why + "; " +
                     (opts.amp == "fp16" ? (device.is_cuda() ? "use --amp bf16" : "use --amp bf16, or a GPU")
                                         : "use --amp fp16") +
                     ", or --amp none");
}

Trainer::Trainer(const Options& opts, const RunContext& run, ProcessGroup& group)
    : opts_(opts),
      run_(run),
      group_(group),
      stop_vote_(group),
      train_(load_dataset(opts.data_dir, opts.dataset, /*train=*/true)),
      test_(load_dataset(opts.data_dir, opts.dataset, /*train=*/false)),
      sampler_(train_.size(), group.world_size(), group.rank(), /*shuffle=*/true, opts.seed),
      test_indices_(shard_indices(test_.size(), group.world_size(), group.rank())),
      kill_after_step_(Faults::step_for(run.faults.kill_after_step, group.restart(), group.rank())),
      pause_after_step_(Faults::step_for(run.faults.pause_after_step, group.restart(), group.rank())) {
  spdlog::info("Arguments:");
  for (const auto& [name, value] : run.arguments) spdlog::info("{}: {}", name, value);
  spdlog::info("Runtime: {}", runtime_of(group.device()).describe());
  spdlog::info("Process group: {} over {} rank(s){}, device {}, {} intra-op thread(s) on rank 0", group.backend(),
               group.world_size(), bulk_stream(group)->shares_memory() ? ", sums through shared memory" : "", group.device().str(),
               at::get_num_threads());
  spdlog::info("Data: {} training and {} test images from {}", train_.size(), test_.size(),
               raw_dir(opts.data_dir, opts.dataset));

  if (opts.amp != "none") {
    const c10::ScalarType dtype = amp_dtype(opts);
    check_amp(opts, group.device());
    amp_dtype_ = dtype;
    if (dtype == torch::kHalf) scaler_.emplace(group);
    spdlog::info("Mixed precision: forward and loss under autocast to {}{}", opts.amp,
                 scaler_ ? ", the loss scaled as every rank agrees (GradScaler)" : "");
  }
  if (opts.accumulate > 1)
    spdlog::info("Gradient accumulation: {} micro-batches of {} per optimizer step, communicating on the last",
                 opts.accumulate, opts.batch_size);
  const std::optional<Checkpoint> resumed = receive_checkpoint(opts, group);
  ddp_.emplace(build_model(opts, group, resumed));
  // SGD with momentum and weight decay.
  optimizer_ = std::make_unique<torch::optim::SGD>(
      ddp_->module()->parameters(), torch::optim::SGDOptions(opts.lr).momentum(opts.momentum).weight_decay(opts.weight_decay));
  if (resumed) at_ = restore(*resumed, parts(), opts, group);
  // A finished run resumed trains nothing, and touches none of its files.
  finished_ = resumed && (at_.epoch >= opts.epochs || max_steps_reached());
  lineage_ = resumed && !resumed->lineage.empty() ? resumed->lineage : new_lineage();
  if (group.rank() == 0 && !finished_) {
    dir_.emplace(opts.path);
    if (!resumed) keep_earlier_model(*dir_);
    metrics_.emplace(*dir_, resumed ? at_.step : -1);
    std::optional<ResumedFrom> from;
    if (resumed) from = ResumedFrom{resume_dir(opts), at_.epoch, at_.batch, at_.step};
    summary_.emplace(*dir_, summary_head(run.arguments, runtime_of(group.device()), group, run.nnodes, from),
                     resumed ? at_.epoch : -1);
  }
}

int Trainer::run() {
  catch_preemption_signals();
  if (finished_) {
    spdlog::info("Nothing to train: the checkpoint in {} has finished {}; no file is written but this log",
                 resume_dir(opts_),
                 at_.epoch >= opts_.epochs ? "all " + std::to_string(opts_.epochs) + " epochs"
                                           : "its --max-steps " + std::to_string(opts_.max_steps) + " steps");
    quick_stream(group_)->barrier("the end of training");
    return 0;
  }
  for (int64_t epoch = at_.epoch; epoch < opts_.epochs && !max_steps_reached(); ++epoch) {
    static_cast<torch::optim::SGDOptions&>(optimizer_->param_groups()[0].options()).lr(cosine_lr(opts_, epoch));
    EpochReport report = train_epoch(epoch);
    if (stop_signal_) return stop(stop_signal_);
    test(report);
    ddp_->check_replicas("after epoch " + std::to_string(epoch));
    ++replica_checks_;
    if (summary_) {
      summary_->add_epoch(report, at_.best_accuracy);
      summary_->write();
    }
    const bool complete = at_.epoch > epoch;
    if (opts_.checkpoint_every > 0 && (!complete || at_.epoch % opts_.checkpoint_every == 0 || at_.epoch == opts_.epochs))
      save_checkpoint();
  }
  finish();
  return 0;
}

int Trainer::stop(int sig) {
  save_checkpoint();
  spdlog::info("Preempted by {}: every rank stopped after step {} (epoch {}, batch {}); --resume auto continues from "
               "its checkpoint",
               signal_name(sig), at_.step, at_.epoch, at_.batch);
  if (summary_) {
    summary_->set("preempted", Json(signal_name(sig)));
    summary_->write();
  }
  quick_stream(group_)->barrier("the end of training");  // nobody leaves while a peer still needs the store
  return sig;
}

EpochReport Trainer::train_epoch(int64_t epoch) {
  ddp_->train();
  sampler_.set_epoch(epoch);
  const torch::Tensor indices = sampler_.indices();
  // A step takes --accumulate micro-batches of --batch-size: one batch of theirs here.
  const int64_t step_images = static_cast<int64_t>(opts_.batch_size) * opts_.accumulate;
  const int64_t batches = num_batches(indices.size(0), step_images);
  EpochReport report;
  report.epoch = epoch;
  report.lr = current_lr(*optimizer_);
  const auto start = Clock::now();
  if (metrics_) metrics_->restart_rows();
  const int64_t bytes_at_start = ddp_->wire_stats().bytes, elements_at_start = ddp_->wire_stats().elements;
  int64_t images = 0;
  double smoothed_loss = 0;  // rank 0's own, for the progress line
  auto drawn = Clock::now() - std::chrono::seconds(1);
  at_.epoch = epoch;
  if (at_.batch >= batches)  // resumed past the end of the epoch as this run cuts it (resume.hpp)
    spdlog::info("Epoch {} was trained to its end ({} of this run's {} batches) before the checkpoint: it is complete",
                 epoch, at_.batch, batches);
  for (int64_t b = at_.batch; b < batches; ++b) {
    if (max_steps_reached()) {
      spdlog::info("Stopping after --max-steps {} steps", opts_.max_steps);
      break;
    }
    auto [x, y] = get_batch(train_, indices, b, step_images);
    x = x.to(group_.device(), /*non_blocking=*/true);
    y = y.to(group_.device(), /*non_blocking=*/true);
    if (stats_.steps == 0) {
      const double startup = unix_seconds() - run_.launch_time;
      spdlog::info("Startup: first step {:.2f} s after launch", startup);
      if (summary_) summary_->set("startup_s", startup);
    }
    const int64_t bytes_before = ddp_->wire_stats().bytes;
    torch::Tensor output, labels;
    const torch::Tensor loss = step(x, y, output, labels);
    if (at_.step == kill_after_step_) raise(SIGKILL);
    if (at_.step == pause_after_step_) pause_until_preempted(at_.step);
    at_.batch = b + 1;
    ++report.steps;
    images += y.size(0) * group_.world_size();
    if (metrics_) metrics_->count_step(y.size(0) * group_.world_size(), ddp_->wire_stats().bytes - bytes_before);
    if (b % opts_.log_interval == 0) log_train(report, b, batches, loss, output, labels);
    if ((stop_signal_ = stop_vote_.after_step())) break;
    if (opts_.checkpoint_steps > 0 && at_.step % opts_.checkpoint_steps == 0) save_checkpoint();
    if (progress_shown()) {
      const double value = loss.item<double>();
      smoothed_loss = report.steps == 1 ? value : 0.9 * smoothed_loss + 0.1 * value;
      if (Clock::now() - drawn > std::chrono::milliseconds(100) || b + 1 == batches) {
        drawn = Clock::now();
        const double elapsed = seconds_since(start);
        show_progress(progress_line(epoch, b + 1, batches, images / elapsed, smoothed_loss,
                                    elapsed / report.steps * static_cast<double>(batches - b - 1)));
      }
    }
  }
  show_progress("");
  // The epoch is done once trained; a preemption at its last step leaves
  // its test pass to the resumed run.
  if (at_.batch >= batches && !stop_signal_) at_ = {epoch + 1, 0, at_.step, at_.best_accuracy};
  report.end_step = at_.step;
  report.seconds = seconds_since(start);
  report.images_per_s = images / report.seconds;
  stats_.images += images;
  stats_.seconds += report.seconds;
  const int64_t per_step = std::max<int64_t>(1, report.steps);
  report.wire_bytes_per_step = (ddp_->wire_stats().bytes - bytes_at_start) / per_step;
  spdlog::info("Epoch {}: {} steps in {:.1f} s, {:.0f} images/s; per step on the wire: {} elements, {} bytes", epoch,
               report.steps, report.seconds, report.images_per_s,
               (ddp_->wire_stats().elements - elements_at_start) / per_step, report.wire_bytes_per_step);
  return report;
}

torch::Tensor Trainer::step(const torch::Tensor& x, const torch::Tensor& y, torch::Tensor& output, torch::Tensor& labels) {
  const bool compressed = ddp_->comm_hook().compression_started();
  if (compressed && stats_.compression_started_at < 0) {
    stats_.compression_started_at = at_.step;
    if (opts_.compression.find("powersgd") != std::string::npos)
      spdlog::info("Start to apply PowerSGD after {} iterations.", at_.step);
  }
  const int64_t bytes_before = ddp_->wire_stats().bytes;
  const double waiting_before = ddp_->communication_wait_seconds();
  double forward_s = 0, backward_s = 0;
  optimizer_->zero_grad();
  // --accumulate micro-batches: every one but the last under no_sync, each
  // loss a share of the step's (a mean over the step's images, as one batch
  // of them gives), so the last backward averages their sum over ranks.
  const std::vector<torch::Tensor> xs = x.split(opts_.batch_size), ys = y.split(opts_.batch_size);
  const auto micro = static_cast<int64_t>(xs.size());
  torch::Tensor loss;
  for (int64_t j = 0; j < micro; ++j) {
    std::optional<NetDdp::NoSync> no_sync;
    if (j + 1 < micro) no_sync.emplace(ddp_->no_sync());
    const auto t0 = Clock::now();
    torch::Tensor micro_loss;
    {
      std::optional<Autocast> autocast;
      if (amp_dtype_) autocast.emplace(group_.device(), *amp_dtype_);
      output = ddp_->forward(xs[j]);
      // The model ends in log_softmax, so the reference's cross-entropy on
      // its output equals the negative log-likelihood of that output.
      micro_loss = torch::nll_loss(output, ys[j]);
    }
    // Under float16 an inf is the loss scale's to handle (GradScaler).
    if (!scaler_) check_finite(micro_loss.item<double>(), opts_, at_);
    if (micro > 1) micro_loss = micro_loss / micro;
    const auto t1 = Clock::now();
    (scaler_ ? scaler_->scale(micro_loss) : micro_loss).backward();
    forward_s += seconds_between(t0, t1);
    backward_s += seconds_between(t1, Clock::now());
    loss = j == 0 ? micro_loss.detach() : loss + micro_loss.detach();
  }
  labels = ys.back();
  const auto t2 = Clock::now();
  if (scaler_) {
    scaler_->step(*optimizer_);
    scaler_->update();
  } else {
    optimizer_->step();
  }
  stats_.add_step(forward_s, backward_s, seconds_since(t2),
                  ddp_->communication_wait_seconds() - waiting_before, ddp_->wire_stats().bytes - bytes_before, compressed);
  ++at_.step;
  return loss;
}

void Trainer::log_train(EpochReport& report, int64_t batch, int64_t batches, const torch::Tensor& loss,
                        const torch::Tensor& output, const torch::Tensor& labels) {
  const auto [top1, top5] = correct_counts(output.detach(), labels);
  const double percent = 100.0 / static_cast<double>(labels.size(0));
  // Every rank's loss and accuracies, averaged over ranks as the reference does.
  auto metrics = torch::stack({loss.detach().to(torch::kFloat64), top1.to(torch::kFloat64) * percent,
                               top5.to(torch::kFloat64) * percent});
  quick_stream(group_)->allreduce_sum(metrics, "the training metrics");
  metrics = (metrics / group_.world_size()).cpu();
  const auto m = metrics.accessor<double, 1>();
  report.train_loss = m[0];
  report.train_top1 = m[1];
  report.train_top5 = m[2];
  spdlog::info("Train Epoch: {} [{}/{}\t({:.0f}%)]\tLoss: {:.6f}\tTop 1 Acc: {:.2f}%\tTop 5 Acc: {:.2f}%", report.epoch,
               batch, batches, 100.0 * static_cast<double>(batch) / static_cast<double>(batches), m[0], m[1], m[2]);
  if (metrics_) metrics_->train(report.epoch, at_.step, m[0], m[1], m[2], report.lr);
}

void Trainer::test(EpochReport& report) {
  const auto [loss, top1, top5] = test_metrics(*ddp_, test_, test_indices_, opts_.test_batch_size, group_);
  report.test_loss = loss;
  report.test_top1 = top1;
  report.test_top5 = top5;
  spdlog::info("Test Epoch: {}: Average loss: {:.4f}, Top 1 Acc: {:.2f}%, Top 5 Acc: {:.2f}%\n", report.epoch,
               report.test_loss, report.test_top1, report.test_top5);
  if (metrics_)
    metrics_->test(report.epoch, at_.step, report.test_loss, report.test_top1, report.test_top5, report.lr);
  if (report.test_top1 > at_.best_accuracy) {
    at_.best_accuracy = report.test_top1;
    spdlog::info("Save model with best accuracy: {:.4f}%", at_.best_accuracy);
    if (dir_) dir_->write_atomically("mnist_model.pt", serialize(state_dict(*ddp_->module(), "module.")));
  }
  spdlog::info("Current best test accuracy: {:.4f}%", at_.best_accuracy);
}

void Trainer::save_checkpoint() {
  std::optional<Checkpoint> c = capture(at_, *ddp_->module(), parts(), opts_, run_.arguments, group_);
  if (!c) return;  // not rank 0
  c->lineage = lineage_;
  const std::string dir = checkpoint_dir(opts_);
  std::function<void(const std::string&)> after_each_write;
  if (run_.faults.kill_at_write > 0)
    after_each_write = [this](const std::string&) {
      if (++checkpoint_writes_ == run_.faults.kill_at_write) raise(SIGKILL);
    };
  mnist_ddp::save_checkpoint(dir, *c, after_each_write);
  spdlog::info("Checkpoint saved to {} (epoch {}, batch {}, step {})", dir, at_.epoch, at_.batch, at_.step);
}

TrainingParts Trainer::parts() {
  torch::OrderedDict<std::string, torch::Tensor> named;  // as the checkpoint names them
  for (const auto& p : ddp_->module()->named_parameters()) named.insert("module." + p.key(), p.value());
  return {*optimizer_, std::move(named), ddp_->comm_hook(), scaler_ ? &*scaler_ : nullptr};
}

void Trainer::finish() {
  int64_t uncompressed = 0;  // what `none` sends each step
  for (const auto& p : ddp_->module()->parameters())
    if (p.requires_grad()) uncompressed += p.numel() * static_cast<int64_t>(p.element_size());
  log_training(stats_, uncompressed, ddp_->comm_hook().name(), opts_.powersgd.start_powersgd_iter());
  if (summary_) {
    summary_->finish(stats_, uncompressed, ddp_->comm_hook().name(), group_.world_size(), replica_checks_);
    summary_->write();
  }
  // Checked after each epoch; no epoch run: as DDP broadcast them.
  spdlog::info("Replicas: all {} ranks hold identical parameters", group_.world_size());
  quick_stream(group_)->barrier("the end of training");  // nobody leaves while a peer still needs the store
}

}  // namespace mnist_ddp
