#include "app/train/report.hpp"

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "comm/group.hpp"


namespace mnist_ddp {

// ---- metrics.csv ----

MetricsFile::MetricsFile(const files::Directory& dir, int64_t resumed_step) {
  std::string text = std::string(kHeader) + "\n";
  if (resumed_step >= 0 && dir.has(kFile)) {
    const std::vector<char> bytes = dir.read(kFile);
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      const size_t comma = line.find(',');
      if (comma != std::string::npos && std::atoll(line.c_str() + comma + 1) <= resumed_step) text += line + "\n";
    }
  }
  dir.write_atomically(kFile, std::vector<char>(text.begin(), text.end()));
  out_ = dir.append(kFile);
}

void MetricsFile::restart_rows() {
  row_start_ = std::chrono::steady_clock::now();
  row_images_ = row_steps_ = row_bytes_ = 0;
}

void MetricsFile::count_step(int64_t images, int64_t wire_bytes) {
  row_images_ += images;
  row_bytes_ += wire_bytes;
  ++row_steps_;
}

void MetricsFile::train(int64_t epoch, int64_t step, double loss, double top1, double top5, double lr) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - row_start_).count();
  out_.write(fmt::format("{},{},train,{:.6f},{:.4f},{:.4f},{:.6g},{:.1f},{:.0f}\n", epoch, step, loss, top1, top5, lr,
                         static_cast<double>(row_images_) / seconds,
                         static_cast<double>(row_bytes_) / static_cast<double>(std::max<int64_t>(1, row_steps_))));
  restart_rows();
}

void MetricsFile::test(int64_t epoch, int64_t step, double loss, double top1, double top5, double lr) {
  out_.write(fmt::format("{},{},test,{:.6f},{:.4f},{:.4f},{:.6g},,\n", epoch, step, loss, top1, top5, lr));
}

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

// ---- summary.json ----

void StepStats::add_step(double forward_s, double backward_s, double optimizer_s, double waiting_s, int64_t sent,
                         bool compressed) {
  ++steps;
  forward += forward_s;
  backward += backward_s;
  optimizer += optimizer_s;
  waiting += waiting_s;
  wire_bytes += sent;
  if (compressed) {
    ++compressed_steps;
    compressed_bytes += sent;
  }
}

double StepStats::bytes_per_step() const {
  if (compressed_steps > 0) return static_cast<double>(compressed_bytes) / static_cast<double>(compressed_steps);
  return static_cast<double>(wire_bytes) / static_cast<double>(std::max<int64_t>(1, steps));
}

void log_training(const StepStats& s, int64_t uncompressed_bytes_per_step, const std::string& hook,
                  int64_t start_powersgd_iter) {
  if (s.steps == 0) return;
  const double ms = 1000.0 / static_cast<double>(s.steps);
  spdlog::info("Training: {} steps in {:.1f} s, {:.0f} images/s, {:.1f} ms/step (forward {:.1f}, backward {:.1f} "
               "of which {:.1f} waiting on communication, optimizer {:.1f})",
               s.steps, s.seconds, s.images / s.seconds, s.seconds * ms, s.forward * ms, s.backward * ms,
               s.waiting * ms, s.optimizer * ms);
  if (s.compressed_steps == 0)
    spdlog::warn("PowerSGD never started: --start-powersgd-iter {} is beyond the {} steps run; the next line is "
                 "the plain allreduce's",
                 start_powersgd_iter, s.steps);
  spdlog::info("Compression: {} {:.0f} bytes/step on the wire, {:.2f}x less than none", hook, s.bytes_per_step(),
               static_cast<double>(uncompressed_bytes_per_step) / s.bytes_per_step());
}

Json summary_head(const Arguments& arguments, const Runtime& r, const ProcessGroup& group, int nnodes,
                  const std::optional<ResumedFrom>& resumed) {
  Json head = Json::object();
  head["format"] = "mnist_ddp summary 1";
  Json args = Json::object();
  for (const auto& [name, value] : arguments) args[name] = value;
  head["arguments"] = std::move(args);
  head["runtime"] = {{"libtorch", r.libtorch},
                     {"cuda", r.cuda.empty() ? Json() : Json(r.cuda)},
                     {"nccl", r.nccl.empty() ? Json() : Json(r.nccl)},
                     {"store", r.store}};
  head["world"] = {{"ranks", group.world_size()},
                   {"backend", group.backend()},
                   {"sums", bulk_stream(group)->shares_memory() ? "shared memory" : group.backend()},
                   {"device_of_rank_0", r.device},
                   {"intra_op_threads_of_rank_0", at::get_num_threads()},
                   {"nodes", nnodes},
                   // 0, or how many times a launcher (ours, torchrun) restarted the workers
                   {"restart", group.restart()}};
  head["resumed_from"] = resumed ? Json{{"dir", resumed->dir},
                                        {"epoch", resumed->epoch},
                                        {"batch", resumed->batch},
                                        {"step", resumed->step}}
                                 : Json();
  return head;
}

RunSummary::RunSummary(const files::Directory& dir, Json head, int64_t resumed_epoch)
    : dir_(dir), root_(std::move(head)) {
  root_["finished"] = false;
  Json epochs = Json::array();
  if (resumed_epoch >= 0 && dir.has(kFile)) {
    // An unreadable summary of an earlier run: this run's epochs only.
    std::vector<char> bytes;
    try {
      bytes = dir.read(kFile);
    } catch (const std::exception&) {
    }
    const Json earlier = Json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
    if (earlier.is_object() && earlier.contains("epochs") && earlier["epochs"].is_array())
      for (const Json& e : earlier["epochs"])
        if (e.is_object() && e.value("epoch", resumed_epoch) < resumed_epoch) epochs.push_back(e);
  }
  root_["epochs"] = std::move(epochs);
}

void RunSummary::add_epoch(const EpochReport& e, double best_test_top1) {
  Json entry = Json::object();
  entry["epoch"] = e.epoch;
  entry["steps"] = e.steps;
  entry["end_step"] = e.end_step;
  entry["seconds"] = e.seconds;
  entry["images_per_s"] = e.images_per_s;
  entry["lr"] = e.lr;
  entry["wire_bytes_per_step"] = e.wire_bytes_per_step;
  auto split = [](double loss, double top1, double top5) { return Json{{"loss", loss}, {"top1", top1}, {"top5", top5}}; };
  entry["train"] = split(e.train_loss, e.train_top1, e.train_top5);
  entry["test"] = split(e.test_loss, e.test_top1, e.test_top5);
  root_["epochs"].push_back(std::move(entry));
  root_["best_test_top1"] = best_test_top1;
}

void RunSummary::finish(const StepStats& s, int64_t uncompressed_bytes_per_step, const std::string& hook,
                        int world_size, int replica_checks) {
  const double per_step = 1000.0 / static_cast<double>(std::max<int64_t>(1, s.steps));
  Json t = Json::object();
  t["steps"] = s.steps;
  t["seconds"] = s.seconds;
  t["images_per_s"] = s.seconds > 0 ? static_cast<double>(s.images) / s.seconds : 0.0;
  t["ms_per_step"] = s.seconds * per_step;
  t["forward_ms"] = s.forward * per_step;
  t["backward_ms"] = s.backward * per_step;
  t["waiting_ms"] = s.waiting * per_step;
  t["optimizer_ms"] = s.optimizer * per_step;
  root_["training"] = std::move(t);

  const bool started = s.compressed_steps > 0;
  const double bytes = s.bytes_per_step();
  Json c = Json::object();
  c["hook"] = hook;
  c["started_at_step"] = started ? Json(s.compression_started_at) : Json();
  c["bytes_per_step"] = bytes;
  c["uncompressed_bytes_per_step"] = uncompressed_bytes_per_step;
  c["ratio_to_none"] = bytes > 0 ? static_cast<double>(uncompressed_bytes_per_step) / bytes : 0.0;
  root_["compression"] = std::move(c);

  Json r = Json::object();
  r["ranks"] = world_size;
  r["checks"] = replica_checks;
  r["identical"] = true;  // a check that finds a difference ends the run with an error
  root_["replicas"] = std::move(r);
  root_["finished"] = true;
}

void RunSummary::write() const {
  // Full precision, and null for what JSON cannot hold (NaN, infinity).
  const std::string text = root_.dump(2) + "\n";
  dir_.write_atomically(kFile, std::vector<char>(text.begin(), text.end()));
}

}  // namespace mnist_ddp
