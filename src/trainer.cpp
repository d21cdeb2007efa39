#include "mnist_ddp/trainer.hpp"

#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "mnist_ddp/checkpoint.hpp"
#include "mnist_ddp/comm_hooks.hpp"
#include "mnist_ddp/data.hpp"
#include "mnist_ddp/ddp.hpp"
#include "mnist_ddp/dist.hpp"
#include "mnist_ddp/files.hpp"
#include "mnist_ddp/logging.hpp"
#include "mnist_ddp/model.hpp"
#include "mnist_ddp/sync_batch_norm.hpp"

#include <ATen/core/Generator.h>
#include <gloo/common/error.h>
#include <ATen/CPUGeneratorImpl.h>
#include <type_traits>

namespace mnist_ddp {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void prepare_output_dir(const std::string& path, bool announce) {
  const bool existed = files::is_directory(path);
  if (!existed) {
    try {
      files::make_directories(path);
    } catch (const std::exception& e) {
      throw std::runtime_error("--path " + path + ": " + e.what());
    }
  }
  if (access(path.c_str(), W_OK | X_OK) != 0)
    throw std::runtime_error("--path " + path + ": the directory is not writable");
  if (announce) std::cout << "The folder '" << path << "' " << (existed ? "already exists." : "was created.") << std::endl;
}

// Samples whose label is the top prediction, and among the top five.
std::pair<torch::Tensor, torch::Tensor> correct_counts(const torch::Tensor& output, const torch::Tensor& target) {
  const auto top = std::get<1>(output.topk(std::min<int64_t>(5, output.size(1)), 1));
  const auto hit = top.eq(target.view({-1, 1}));
  return {hit.select(1, 0).sum(), hit.sum()};
}

std::string checkpoint_dir(const Options& opts) { return files::join(opts.path, "checkpoint"); }

// Fault injection for tests: with MNIST_DDP_KILL_AT_WRITE=N in its
// environment, rank 0 kills itself with SIGKILL right after the N-th file
// operation of checkpointing in this run (see save_checkpoint's
// after_each_write), so a crash test lands on a named point, not a delay.
std::function<void(const std::string&)> kill_point() {
  const char* at = std::getenv("MNIST_DDP_KILL_AT_WRITE");
  if (!at) return nullptr;
  return [n = std::atoi(at)](const std::string&) {
    static int done = 0;
    if (++done == n) raise(SIGKILL);
  };
}

// The checkpoint --resume names, or "" for a fresh start.
std::string resume_dir(const Options& opts) {
  if (opts.resume != "auto") return opts.resume;
  const std::string dir = checkpoint_dir(opts);
  return has_checkpoint(dir) ? dir : "";
}

// The optimizer keys its state by parameter: by a string in LibTorch 1.x,
// by a pointer in 2.x.
template <typename Map>
typename Map::key_type optimizer_key(const Map&, const torch::Tensor& parameter) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;  // as LibTorch 1.x writes it: the TensorImpl's address
    key << parameter.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<typename Map::key_type>(parameter.unsafeGetTensorImpl());
  }
}

std::string error_line(const std::exception& e) {
  std::string msg = e.what();
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) msg = c10e->what_without_backtrace();
  return msg.substr(0, msg.find('\n'));
}

// Seconds since the Unix epoch, as the launcher hands it to the workers.
double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// When the job was launched: by our launcher (MNIST_DDP_LAUNCH_TIME), else
// when this worker started.
double launch_time() {
  static const double started = unix_seconds();
  const char* launched = std::getenv("MNIST_DDP_LAUNCH_TIME");
  return launched ? std::atof(launched) : started;
}

// <path>/metrics.csv on rank 0: a row per logged training step and per test,
// flushed as it is written. A resumed run keeps the rows up to its checkpoint.
class MetricsFile {
 public:
  static constexpr const char* kHeader = "epoch,step,split,loss,top1,top5,lr,images_per_s,wire_bytes_per_step";

  MetricsFile(const std::string& file, int64_t resumed_step) {
    std::vector<std::string> kept;
    if (resumed_step >= 0) {
      std::ifstream in(file);
      std::string line;
      std::getline(in, line);
      while (std::getline(in, line)) {
        const size_t comma = line.find(',');
        if (comma != std::string::npos && std::atoll(line.c_str() + comma + 1) <= resumed_step) kept.push_back(line);
      }
    }
    out_.open(file, std::ios::trunc);
    if (!out_) throw std::runtime_error("cannot write " + file);
    out_ << kHeader << "\n";
    for (const auto& line : kept) out_ << line << "\n";
    out_.flush();
  }

  void train(int64_t epoch, int64_t step, double loss, double top1, double top5, double lr, double images_per_s,
             double bytes_per_step) {
    out_ << fmt::format("{},{},train,{:.6f},{:.4f},{:.4f},{:.6g},{:.1f},{:.0f}\n", epoch, step, loss, top1, top5, lr,
                        images_per_s, bytes_per_step);
    out_.flush();
  }

  void test(int64_t epoch, int64_t step, double loss, double top1, double top5, double lr) {
    out_ << fmt::format("{},{},test,{:.6f},{:.4f},{:.4f},{:.6g},,\n", epoch, step, loss, top1, top5, lr);
    out_.flush();
  }

 private:
  std::ofstream out_;
};

// "Epoch 3 [=======>            ] 640/1875  1234 images/s  loss 0.2345  ETA 1:05"
std::string progress_line(int64_t epoch, int64_t done, int64_t total, double images_per_s, double loss,
                          double eta_seconds) {
  constexpr int kWidth = 20;
  const int filled = static_cast<int>(kWidth * done / std::max<int64_t>(1, total));
  std::string bar(kWidth, ' ');
  for (int i = 0; i < filled; ++i) bar[i] = '=';
  if (filled < kWidth) bar[filled] = '>';
  const auto eta = static_cast<int64_t>(eta_seconds + 0.5);
  return fmt::format("Epoch {} [{}] {}/{}  {:.0f} images/s  loss {:.4f}  ETA {}:{:02d}", epoch, bar, done, total,
                     images_per_s, loss, eta / 60, eta % 60);
}

// Where the training steps' time went, and what they sent.
struct StepStats {
  int64_t steps = 0;
  int64_t images = 0;  // over all ranks
  double seconds = 0, forward = 0, backward = 0, waiting = 0, optimizer = 0;
  // Over the steps taken once compression had started.
  int64_t compressed_steps = 0;
  int64_t wire_bytes = 0;
};

class Trainer {
 public:
  Trainer(const Options& opts, Dist& dist);
  void run();

 private:
  // Trains `epoch` from batch `first`; returns the batches of it done so far
  // (fewer than all when --max-steps stopped it).
  int64_t train_epoch(int64_t epoch, int64_t first);
  bool max_steps_reached() const { return opts_.max_steps > 0 && step_ >= opts_.max_steps; }
  void log_train(int64_t epoch, int64_t batch, int64_t batches, const torch::Tensor& loss, const torch::Tensor& output,
                 const torch::Tensor& labels);
  void evaluate(int64_t epoch);
  double current_lr() const { return optimizer_->param_groups()[0].options().get_lr(); }
  void log_summary() const;
  void restore(const TensorDict& training);
  void save_checkpoint(int64_t epoch, int64_t batch);
  TensorDict own_state() const;  // what only this rank has: RNG, hook error

  const Options& opts_;
  Dist& dist_;
  Net net_;
  DistributedDataParallel ddp_{nullptr};
  Dataset train_;
  Dataset test_;
  DistributedSampler sampler_;
  torch::Tensor test_indices_;
  std::unique_ptr<torch::optim::SGD> optimizer_;
  int64_t step_ = 0;
  int64_t start_epoch_ = 0, start_batch_ = 0;
  double best_accuracy_ = 0;
  StepStats stats_;
  std::optional<MetricsFile> metrics_;  // rank 0
  // Since the last metrics row: when, how many images (all ranks), steps and bytes.
  Clock::time_point row_time_ = Clock::now();
  int64_t row_images_ = 0, row_steps_ = 0, row_bytes_ = 0;
};

Trainer::Trainer(const Options& opts, Dist& dist)
    : opts_(opts),
      dist_(dist),
      train_(load_dataset(opts.data_dir, opts.dataset, /*train=*/true)),
      test_(load_dataset(opts.data_dir, opts.dataset, /*train=*/false)),
      sampler_(train_.size(), dist.world_size, dist.rank, /*shuffle=*/true, opts.seed),
      test_indices_(shard_indices(test_.size(), dist.world_size, dist.rank)) {
  spdlog::info("Arguments:");
  for (const auto& [name, value] : opts.arguments) spdlog::info("{}: {}", name, value);
  spdlog::info("Runtime: {}", describe_runtime(dist.device));
  spdlog::info("Process group: {} over {} rank(s), device {}, {} intra-op thread(s) on rank 0", dist.backend,
               dist.world_size, dist.device.str(), at::get_num_threads());
  spdlog::info("Data: {} training and {} test images from {}", train_.size(), test_.size(),
               raw_dir(opts.data_dir, opts.dataset));

  // ---- Model: the reference's Net, BatchNorm made synchronous, then DDP. ----
  torch::manual_seed(opts.seed);
  net_ = Net();

  // ---- Resume: rank 0 reads the checkpoint into the model (DDP then
  // broadcasts it) and sends the rest to every rank. ----
  TensorDict resumed;
  if (const std::string dir = resume_dir(opts); !dir.empty()) {
    std::vector<char> bytes;
    if (dist.rank == 0) {
      const Checkpoint c = load_checkpoint(dir);
      load_state_dict(*net_, c.model, "module.", "checkpoint " + dir);
      TensorDict t = c.training;
      t.insert("meta/epoch", torch::tensor(c.epoch));
      t.insert("meta/batch", torch::tensor(c.batch));
      t.insert("meta/step", torch::tensor(c.step));
      t.insert("meta/best_accuracy", torch::tensor(c.best_accuracy, torch::kFloat64));
      t.insert("meta/same_world", torch::tensor(c.world_size == dist.world_size));
      t.insert("meta/same_hook", torch::tensor(c.compression == opts.compression));
      bytes = serialize(t);
      spdlog::info("Resuming from {}: epoch {}, batch {}, step {}, best test accuracy {:.4f}%", dir, c.epoch, c.batch,
                   c.step, c.best_accuracy);
      if (c.world_size != dist.world_size)
        spdlog::warn("The checkpoint was written by {} ranks and this run has {}: every rank's dropout stream and "
                     "PowerSGD error feedback start afresh",
                     c.world_size, dist.world_size);
      if (c.compression != opts.compression)
        spdlog::warn("The checkpoint was written with --compression {}: its hook state is not used by {}",
                     c.compression, opts.compression);
    }
    dist.comm->broadcast_bytes(bytes);
    resumed = deserialize(bytes, "the checkpoint rank 0 sent");
  } else if (opts.resume == "auto") {
    spdlog::info("No checkpoint in {}: starting afresh", checkpoint_dir(opts));
  }

  convert_sync_batchnorm(*net_, dist.comm);
  net_->to(dist.device);
  ddp_ = DistributedDataParallel(torch::nn::AnyModule(net_), dist, make_comm_hook(opts.compression, opts.powersgd), opts.bucket_cap_mb);
  for (const auto& line : ddp_->describe_buckets()) spdlog::info("DDP {}", line);
  spdlog::info("Communication hook: {}", ddp_->hook().name());
  if (opts.compression.find("powersgd") != std::string::npos) {
    const auto& p = opts.powersgd;
    spdlog::info(
        "PowerSGD config: matrix_approximation_rank = {}; start_powerSGD_iter = {}; min_compression_rate = {}; "
        "use_error_feedback = {}; warm_start = {}; orthogonalization_epsilon = {}; random_seed = {}",
        p.rank, p.start_iter, p.min_compression_rate, p.error_feedback, p.warm_start, p.orthogonalization_epsilon,
        p.seed);
  }
  // Dropout draws differ across ranks, as they would in separate processes.
  torch::manual_seed(opts.seed + 1000 * static_cast<uint64_t>(dist.rank + 1));

  // ---- Optimiser: SGD with momentum and weight decay. ----
  optimizer_ = std::make_unique<torch::optim::SGD>(
      ddp_->parameters(), torch::optim::SGDOptions(opts.lr).momentum(opts.momentum).weight_decay(opts.weight_decay));
  if (!resumed.empty()) restore(resumed);
  if (dist.rank == 0)
    metrics_.emplace(files::join(opts.path, "metrics.csv"), resumed.empty() ? -1 : step_);
}

void Trainer::restore(const TensorDict& t) {
  start_epoch_ = t.at("meta/epoch").item<int64_t>();
  start_batch_ = t.at("meta/batch").item<int64_t>();
  step_ = t.at("meta/step").item<int64_t>();
  best_accuracy_ = t.at("meta/best_accuracy").item<double>();
  const bool same_world = t.at("meta/same_world").item<bool>();
  const bool same_hook = t.at("meta/same_hook").item<bool>();

  auto& state = optimizer_->state();
  for (const auto& p : ddp_->named_parameters()) {
    const std::string key = "optimizer/momentum/" + p.key();
    if (!t.contains(key)) continue;  // no momentum buffer yet
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(t.at(key).to(p.value().device()).clone());
    state[optimizer_key(state, p.value())] = std::move(s);
  }
  const std::string own = "rank/" + std::to_string(dist_.rank) + "/";
  if (same_world) {
    auto cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(t.at(own + "rng/cpu"));
    if (dist_.device.is_cuda()) {
      auto cuda = at::globalContext().defaultGenerator(dist_.device);
      std::lock_guard<std::mutex> cuda_lock(cuda.mutex());
      cuda.set_state(t.at(own + "rng/cuda"));
    }
  }
  if (same_hook) {
    HookState hook;
    for (const auto& item : t) {
      const std::string& key = item.key();
      if (key.rfind("hook/", 0) == 0) hook[key.substr(5)] = item.value();
      if (same_world && key.rfind(own + "hook/", 0) == 0) hook["rank/" + key.substr(own.size() + 5)] = item.value();
    }
    if (!hook.empty()) ddp_->hook().load_state(hook);
  }
}

TensorDict Trainer::own_state() const {
  TensorDict t;
  {
    auto cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    t.insert("rng/cpu", cpu.get_state());
  }
  if (dist_.device.is_cuda()) {
    auto cuda = at::globalContext().defaultGenerator(dist_.device);
    std::lock_guard<std::mutex> lock(cuda.mutex());
    t.insert("rng/cuda", cuda.get_state());
  }
  for (const auto& [key, value] : ddp_->hook().state())
    if (key.rfind("rank/", 0) == 0) t.insert("hook/" + key.substr(5), value);
  return t;
}

void Trainer::save_checkpoint(int64_t epoch, int64_t batch) {
  // Every rank's own state on rank 0: the same keys in the same order everywhere.
  const TensorDict own = own_state();
  std::vector<std::pair<std::string, std::vector<torch::Tensor>>> gathered;
  for (const auto& item : own)
    gathered.emplace_back(item.key(), dist_.comm->gather_to_rank0(item.value()));
  if (dist_.rank != 0) return;

  Checkpoint c;
  c.epoch = epoch;
  c.batch = batch;
  c.step = step_;
  c.best_accuracy = best_accuracy_;
  c.world_size = dist_.world_size;
  c.compression = opts_.compression;
  c.arguments = opts_.arguments;
  c.model = state_dict(*ddp_);
  const auto& state = optimizer_->state();
  for (const auto& p : ddp_->named_parameters()) {
    const auto it = state.find(optimizer_key(state, p.value()));
    if (it == state.end()) continue;
    const auto& buffer = static_cast<const torch::optim::SGDParamState&>(*it->second).momentum_buffer();
    if (buffer.defined()) c.training.insert("optimizer/momentum/" + p.key(), buffer.detach().cpu().clone());
  }
  for (const auto& [key, value] : ddp_->hook().state())
    if (key.rfind("rank/", 0) != 0) c.training.insert("hook/" + key, value);
  for (const auto& [key, per_rank] : gathered)
    for (size_t r = 0; r < per_rank.size(); ++r) c.training.insert("rank/" + std::to_string(r) + "/" + key, per_rank[r]);
  const std::string dir = checkpoint_dir(opts_);
  mnist_ddp::save_checkpoint(dir, c, kill_point());
  spdlog::info("Checkpoint saved to {} (epoch {}, batch {}, step {})", dir, epoch, batch, step_);
}

void Trainer::run() {
  if (start_epoch_ >= opts_.epochs) spdlog::info("The checkpoint has finished all {} epochs: nothing to train", opts_.epochs);
  const int64_t batches = num_batches(sampler_.num_samples(), opts_.batch_size);
  for (int64_t epoch = start_epoch_; epoch < opts_.epochs && !max_steps_reached(); ++epoch) {
    // Cosine annealing to 0 over --epochs, stepped once per epoch.
    const double lr = opts_.lr * (1 + std::cos(M_PI * static_cast<double>(epoch) / opts_.epochs)) / 2;
    static_cast<torch::optim::SGDOptions&>(optimizer_->param_groups()[0].options()).lr(lr);
    const int64_t done = train_epoch(epoch, epoch == start_epoch_ ? start_batch_ : 0);
    evaluate(epoch);
    ddp_->check_replicas("after epoch " + std::to_string(epoch));
    const bool complete = done == batches;
    if (opts_.checkpoint_every > 0 &&
        (!complete || (epoch + 1) % opts_.checkpoint_every == 0 || epoch + 1 == opts_.epochs))
      save_checkpoint(complete ? epoch + 1 : epoch, complete ? 0 : done);
  }
  log_summary();
  // Checked after each epoch above; no epoch run: as DDP broadcast them.
  spdlog::info("Replicas: all {} ranks hold identical parameters", dist_.world_size);
  dist_.comm->barrier();  // nobody leaves while a peer still needs the store
}

int64_t Trainer::train_epoch(int64_t epoch, int64_t first) {
  ddp_->train();
  sampler_.set_epoch(epoch);
  const torch::Tensor indices = sampler_.indices();
  const int64_t batches = num_batches(indices.size(0), opts_.batch_size);
  const auto start = Clock::now();
  row_time_ = start;
  row_images_ = row_steps_ = row_bytes_ = 0;
  const int64_t bytes_at_start = ddp_->wire().bytes, elements_at_start = ddp_->wire().elements;
  int64_t steps = 0, images = 0, b = first;
  double smoothed_loss = 0;  // rank 0's own, for the progress line
  auto drawn = Clock::now() - std::chrono::seconds(1);
  for (; b < batches; ++b) {
    if (max_steps_reached()) {
      spdlog::info("Stopping after --max-steps {} steps", opts_.max_steps);
      break;
    }
    auto [x, y] = get_batch(train_, indices, b, opts_.batch_size);
    x = x.to(dist_.device, /*non_blocking=*/true);
    y = y.to(dist_.device, /*non_blocking=*/true);
    const bool compressed = ddp_->hook().compression_started();
    if (compressed && stats_.compressed_steps == 0 && opts_.compression.find("powersgd") != std::string::npos)
      spdlog::info("Start to apply PowerSGD after {} iterations.", step_);
    const int64_t bytes_before = ddp_->wire().bytes;
    const double waiting_before = ddp_->communication_wait_seconds();

    if (stats_.steps + steps == 0)
      spdlog::info("Startup: first step {:.2f} s after launch", unix_seconds() - launch_time());
    const auto t0 = Clock::now();
    optimizer_->zero_grad();
    const torch::Tensor output = ddp_->forward(x);
    // The model ends in log_softmax, so the reference's cross-entropy on its
    // output equals the negative log-likelihood of that output.
    const torch::Tensor loss = torch::nll_loss(output, y);
    const double value = loss.item<double>();
    if (!std::isfinite(value))
      throw std::runtime_error(fmt::format(
          "the loss is {} at epoch {}, step {} (batch {}): training diverged; try a smaller --lr{}", value, epoch,
          step_, b,
          has_checkpoint(checkpoint_dir(opts_)) ? "; the last checkpoint in " + checkpoint_dir(opts_) + " is intact" : ""));
    const auto t1 = Clock::now();
    loss.backward();
    const auto t2 = Clock::now();
    optimizer_->step();
    const auto t3 = Clock::now();

    stats_.forward += std::chrono::duration<double>(t1 - t0).count();
    stats_.backward += std::chrono::duration<double>(t2 - t1).count();
    stats_.optimizer += std::chrono::duration<double>(t3 - t2).count();
    stats_.waiting += ddp_->communication_wait_seconds() - waiting_before;
    if (compressed) {
      ++stats_.compressed_steps;
      stats_.wire_bytes += ddp_->wire().bytes - bytes_before;
    }
    ++step_;
    ++steps;
    images += y.size(0) * dist_.world_size;
    row_images_ += y.size(0) * dist_.world_size;
    ++row_steps_;
    row_bytes_ += ddp_->wire().bytes - bytes_before;
    if (b % opts_.log_interval == 0) log_train(epoch, b, batches, loss, output, y);
    smoothed_loss = steps == 1 ? value : 0.9 * smoothed_loss + 0.1 * value;
    if (progress_shown() && (Clock::now() - drawn > std::chrono::milliseconds(100) || b + 1 == batches)) {
      drawn = Clock::now();
      const double elapsed = seconds_since(start);
      show_progress(progress_line(epoch, b + 1, batches, images / elapsed, smoothed_loss,
                                  elapsed / steps * static_cast<double>(batches - b - 1)));
    }
  }
  show_progress("");
  const double seconds = seconds_since(start);
  stats_.steps += steps;
  stats_.images += images;
  stats_.seconds += seconds;
  const int64_t per_step = std::max<int64_t>(1, steps);
  spdlog::info("Epoch {}: {} steps in {:.1f} s, {:.0f} images/s; per step on the wire: {} elements, {} bytes", epoch,
               steps, seconds, images / seconds, (ddp_->wire().elements - elements_at_start) / per_step,
               (ddp_->wire().bytes - bytes_at_start) / per_step);
  return b;
}

void Trainer::log_train(int64_t epoch, int64_t batch, int64_t batches, const torch::Tensor& loss,
                        const torch::Tensor& output, const torch::Tensor& labels) {
  const auto [top1, top5] = correct_counts(output.detach(), labels);
  const double percent = 100.0 / static_cast<double>(labels.size(0));
  // Every rank's loss and accuracies, averaged over ranks as the reference does.
  auto metrics = torch::stack({loss.detach().to(torch::kFloat64), top1.to(torch::kFloat64) * percent,
                               top5.to(torch::kFloat64) * percent});
  dist_.comm->allreduce_sum(metrics);
  metrics = (metrics / dist_.world_size).cpu();
  const auto m = metrics.accessor<double, 1>();
  spdlog::info("Train Epoch: {} [{}/{}\t({:.0f}%)]\tLoss: {:.6f}\tTop 1 Acc: {:.2f}%\tTop 5 Acc: {:.2f}%", epoch,
               batch, batches, 100.0 * static_cast<double>(batch) / static_cast<double>(batches), m[0], m[1], m[2]);
  if (metrics_) {
    const double seconds = seconds_since(row_time_);
    metrics_->train(epoch, step_, m[0], m[1], m[2], current_lr(), static_cast<double>(row_images_) / seconds,
                    static_cast<double>(row_bytes_) / static_cast<double>(std::max<int64_t>(1, row_steps_)));
  }
  row_time_ = Clock::now();
  row_images_ = row_steps_ = row_bytes_ = 0;
}

void Trainer::evaluate(int64_t epoch) {
  ddp_->eval();
  torch::NoGradGuard no_grad;
  // Sums over this rank's shard: loss, top-1 hits, top-5 hits, images.
  double local[4] = {0, 0, 0, 0};
  const int64_t batches = num_batches(test_indices_.size(0), opts_.test_batch_size);
  for (int64_t b = 0; b < batches; ++b) {
    auto [x, y] = get_batch(test_, test_indices_, b, opts_.test_batch_size);
    x = x.to(dist_.device, true);
    y = y.to(dist_.device, true);
    const torch::Tensor output = ddp_->forward(x);
    const auto [top1, top5] = correct_counts(output, y);
    local[0] += torch::nll_loss(output, y, {}, at::Reduction::Sum).item<double>();
    local[1] += static_cast<double>(top1.item<int64_t>());
    local[2] += static_cast<double>(top5.item<int64_t>());
    local[3] += static_cast<double>(y.size(0));
  }
  // The shards are disjoint, so the sums count every test image once.
  auto sums = torch::tensor({local[0], local[1], local[2], local[3]}, torch::kFloat64).to(dist_.device);
  dist_.comm->allreduce_sum(sums);
  sums = sums.cpu();
  const auto s = sums.accessor<double, 1>();
  const double accuracy = 100.0 * s[1] / s[3];
  spdlog::info("Test Epoch: {}: Average loss: {:.4f}, Top 1 Acc: {:.2f}%, Top 5 Acc: {:.2f}%\n", epoch, s[0] / s[3],
               accuracy, 100.0 * s[2] / s[3]);
  if (metrics_) metrics_->test(epoch, step_, s[0] / s[3], accuracy, 100.0 * s[2] / s[3], current_lr());
  if (accuracy > best_accuracy_) {
    best_accuracy_ = accuracy;
    spdlog::info("Save model with best accuracy: {:.4f}%", best_accuracy_);
    if (dist_.rank == 0) save_state_dict(files::join(opts_.path, "mnist_model.pt"), state_dict(*ddp_));
  }
  spdlog::info("Current best test accuracy: {:.4f}%", best_accuracy_);
}

void Trainer::log_summary() const {
  const StepStats& s = stats_;
  if (s.steps == 0) return;
  const double ms = 1000.0 / static_cast<double>(s.steps);
  spdlog::info("Training: {} steps in {:.1f} s, {:.0f} images/s, {:.1f} ms/step (forward {:.1f}, backward {:.1f} of "
               "which {:.1f} waiting on communication, optimizer {:.1f})",
               s.steps, s.seconds, s.images / s.seconds, s.seconds * ms, s.forward * ms, s.backward * ms,
               s.waiting * ms, s.optimizer * ms);
  int64_t uncompressed = 0;  // what `none` sends each step
  for (const auto& b : ddp_->buckets()) uncompressed += b.buffer.numel() * b.buffer.element_size();
  double bytes = static_cast<double>(s.wire_bytes) / static_cast<double>(std::max<int64_t>(1, s.compressed_steps));
  if (s.compressed_steps == 0) {
    spdlog::warn("PowerSGD never started: --start-powersgd-iter {} is beyond the {} steps run; the next line is "
                 "the plain allreduce's",
                 opts_.powersgd.start_iter, s.steps);
    bytes = static_cast<double>(ddp_->wire().bytes) / static_cast<double>(s.steps);
  }
  spdlog::info("Compression: {} {:.0f} bytes/step on the wire, {:.2f}x less than none", ddp_->hook().name(), bytes,
               uncompressed / bytes);
}

}  // namespace

void configure_worker_process(int local_workers) {
  // A step allocates and frees activations of several MB. By default glibc
  // maps each one afresh and unmaps it on free, so every step page-faults
  // them in again; those faults serialise on the process's memory map while
  // the communication threads allocate too, and cost more than half a step
  // on 2 CPU workers (182 -> 81 ms per step measured). Keep freed memory.
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(omp && std::atoi(omp) > 0 ? std::atoi(omp) : std::max(1, cores / std::max(1, local_workers)));
  at::set_num_interop_threads(1);
}

void preflight(const Options& opts) {
  check_dataset_files(opts.data_dir, opts.dataset);
  prepare_output_dir(opts.path, /*announce=*/true);
  if (const std::string dir = resume_dir(opts); !dir.empty()) {
    const Checkpoint c = load_checkpoint(dir);
    Net net;
    load_state_dict(*net, c.model, "module.", "checkpoint " + dir);
  }
}

int run_worker(const Options& opts, const WorkerEnv& env) {
  int code = 1;
  std::unique_ptr<Dist> dist;
  std::string message;
  bool echo = false;  // the error only follows from another process's failure
  try {
    const Placement placement = plan_placement(opts);
    configure_worker_process(env.local_world_size);
    Settings settings = shared_settings(opts);
    int64_t parameters = 0;
    for (const auto& p : Net()->parameters()) parameters += p.numel();
    settings.emplace_back("model", "Net with " + std::to_string(parameters) + " parameters");
    dist = std::make_unique<Dist>(connect(env, placement, opts.timeout, settings));
    if (dist->rank == 0) prepare_output_dir(opts.path, /*announce=*/false);
    init_logging(opts.path, dist->rank);
    Trainer(opts, *dist).run();
    return 0;
  } catch (const UsageError& e) {
    message = e.what();
    code = 2;
  } catch (const PeerLost& e) {
    message = e.what();
    echo = true;
  } catch (const std::exception& e) {
    message = error_line(e);
    // A collective that failed (LibTorch's or Gloo's error): name who went silent.
    const bool collective = dynamic_cast<const c10::Error*>(&e) || dynamic_cast<const gloo::Exception*>(&e);
    if (collective && dist && dist->world_size > 1) {
      const std::vector<int> silent = dist->silent_ranks();
      std::string who;
      for (int r : silent) who += (who.empty() ? "" : ", ") + std::to_string(r);
      echo = !silent.empty();
      if (echo)
        message = "lost rank" + std::string(silent.size() > 1 ? "s " : " ") + who +
                  (silent == std::vector<int>{0} ? " (the store's host)" : "") + ": " + message;
    }
  }
  show_progress("");
  log_error_to_file(message);
  report_worker_error(env, dist ? dist->rank : env.rank, message, echo);
  // Leave without destructors: a process group or the DDP thread could wait
  // for peers that are gone.
  std::cout.flush();
  std::cerr.flush();
  _exit(code);
}

}  // namespace mnist_ddp
