#include "mnist_ddp/report.hpp"

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "mnist_ddp/checkpoint.hpp"
#include "mnist_ddp/files.hpp"

namespace mnist_ddp {

// ---- Json ----

void Json::expect(Kind kind, const char* what) const {
  if (kind_ != kind) throw std::runtime_error(std::string("JSON: not ") + what);
}

double Json::number() const {
  expect(Kind::kNumber, "a number");
  return number_;
}

const std::string& Json::string() const {
  expect(Kind::kString, "a string");
  return text_;
}

bool Json::boolean() const {
  expect(Kind::kBool, "true or false");
  return number_ != 0;
}

Json& Json::operator[](const std::string& key) {
  expect(Kind::kObject, "an object");
  for (auto& [k, v] : members_)
    if (k == key) return v;
  members_.emplace_back(key, Json());
  return members_.back().second;
}

const Json& Json::at(const std::string& key) const {
  expect(Kind::kObject, "an object");
  for (const auto& [k, v] : members_)
    if (k == key) return v;
  throw std::out_of_range("JSON: no member \"" + key + "\"");
}

bool Json::contains(const std::string& key) const {
  for (const auto& [k, v] : members_)
    if (k == key) return true;
  return false;
}

const Json& Json::at(size_t i) const {
  expect(Kind::kArray, "an array");
  if (i >= items_.size()) throw std::out_of_range("JSON: no element " + std::to_string(i));
  return items_[i];
}

size_t Json::size() const { return kind_ == Kind::kArray ? items_.size() : members_.size(); }

void Json::push_back(Json value) {
  expect(Kind::kArray, "an array");
  items_.push_back(std::move(value));
}

const std::vector<std::pair<std::string, Json>>& Json::members() const {
  expect(Kind::kObject, "an object");
  return members_;
}

namespace {

void write_string(std::string& out, const std::string& s) {
  out += '"';
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  out += '"';
}

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Json document() {
    Json v = value();
    space();
    if (i_ != s_.size()) fail("text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(i_));
  }
  void space() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool take(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  bool word(const char* w) {
    const std::string_view v(w);
    if (s_.compare(i_, v.size(), v) != 0) return false;
    i_ += v.size();
    return true;
  }

  std::string text() {
    if (!take('"')) fail("expected a string");
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\') {
        if (i_ >= s_.size()) break;
        c = s_[i_++];
        if (c == 'n') c = '\n';
        else if (c == 't') c = '\t';
        else if (c == 'u') {
          if (i_ + 4 > s_.size()) fail("a short \\u escape");
          c = static_cast<char>(std::stoi(s_.substr(i_, 4), nullptr, 16));  // only what write_string emits
          i_ += 4;
        }
      }
      out += c;
    }
    if (!take('"')) fail("an unterminated string");
    return out;
  }

  Json value() {
    space();
    if (i_ >= s_.size()) fail("expected a value");
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      Json o = Json::object();
      if (take('}')) return o;
      do {
        const std::string key = text();
        if (!take(':')) fail("expected ':'");
        o[key] = value();
      } while (take(','));
      if (!take('}')) fail("expected ',' or '}'");
      return o;
    }
    if (c == '[') {
      ++i_;
      Json a = Json::array();
      if (take(']')) return a;
      do a.push_back(value());
      while (take(','));
      if (!take(']')) fail("expected ',' or ']'");
      return a;
    }
    if (c == '"') return Json(text());
    if (word("true")) return Json(true);
    if (word("false")) return Json(false);
    if (word("null")) return Json();
    size_t used = 0;
    double x = 0;
    try {
      x = std::stod(s_.substr(i_, 40), &used);
    } catch (const std::exception&) {
      fail("expected a value");
    }
    i_ += used;
    return Json(x);
  }

  const std::string& s_;
  size_t i_ = 0;
};

}  // namespace

Json Json::parse(const std::string& text) { return Parser(text).document(); }

void Json::write(std::string& out, int indent) const {
  const std::string pad(indent + 2, ' '), end(indent, ' ');
  switch (kind_) {
    case Kind::kNull: out += "null"; break;
    case Kind::kBool: out += number_ ? "true" : "false"; break;
    case Kind::kNumber:
      if (!std::isfinite(number_)) {
        out += "null";  // JSON has no NaN or infinity
      } else {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.17g", number_);
        out += buf;
      }
      break;
    case Kind::kString: write_string(out, text_); break;
    case Kind::kArray:
    case Kind::kObject: {
      // One element a line, indented; "[]" or "{}" when empty.
      const bool array = kind_ == Kind::kArray;
      const size_t n = array ? items_.size() : members_.size();
      out += array ? "[" : "{";
      for (size_t i = 0; i < n; ++i) {
        out += (i ? ",\n" : "\n") + pad;
        if (!array) {
          write_string(out, members_[i].first);
          out += ": ";
        }
        (array ? items_[i] : members_[i].second).write(out, indent + 2);
      }
      out += (n ? "\n" + end : "") + (array ? "]" : "}");
      break;
    }
  }
}

std::string Json::dump() const {
  std::string out;
  write(out, 0);
  return out + "\n";
}

// ---- metrics.csv ----

MetricsFile::MetricsFile(const std::string& file, int64_t resumed_step) {
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
  out_ << fmt::format("{},{},train,{:.6f},{:.4f},{:.4f},{:.6g},{:.1f},{:.0f}\n", epoch, step, loss, top1, top5, lr,
                      static_cast<double>(row_images_) / seconds,
                      static_cast<double>(row_bytes_) / static_cast<double>(std::max<int64_t>(1, row_steps_)));
  out_.flush();
  restart_rows();
}

void MetricsFile::test(int64_t epoch, int64_t step, double loss, double top1, double top5, double lr) {
  out_ << fmt::format("{},{},test,{:.6f},{:.4f},{:.4f},{:.6g},,\n", epoch, step, loss, top1, top5, lr);
  out_.flush();
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

RunSummary::RunSummary(const std::string& path, Json head, int64_t resumed_epoch)
    : file_(files::join(path, "summary.json")), root_(std::move(head)) {
  root_["finished"] = false;
  Json epochs = Json::array();
  if (resumed_epoch >= 0 && files::exists(file_)) {
    try {
      std::ifstream in(file_);
      const Json earlier = Json::parse(std::string(std::istreambuf_iterator<char>(in), {}));
      for (size_t i = 0; i < earlier.at("epochs").size(); ++i)
        if (earlier.at("epochs").at(i).at("epoch").number() < static_cast<double>(resumed_epoch))
          epochs.push_back(earlier.at("epochs").at(i));
    } catch (const std::exception&) {
      // An unreadable summary of an earlier run: this run's epochs only.
    }
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
  auto split = [](double loss, double top1, double top5) {
    Json j = Json::object();
    j["loss"] = loss;
    j["top1"] = top1;
    j["top5"] = top5;
    return j;
  };
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
  const std::string text = root_.dump();
  write_file_atomically(file_, std::vector<char>(text.begin(), text.end()));
}

}  // namespace mnist_ddp
